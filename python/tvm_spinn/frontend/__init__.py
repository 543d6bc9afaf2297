"""Front-ends: import framework models into Relax IRModules with weights bound."""

from .onnx import OnnxImportError, from_onnx
from .pytorch import from_pytorch
from .tflite import TFLiteImportError, from_keras, from_tflite

__all__ = ["from_pytorch", "from_onnx", "from_keras", "from_tflite", "OnnxImportError", "TFLiteImportError"]
