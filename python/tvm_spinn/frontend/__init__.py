"""Front-ends: import framework models into Relax IRModules with weights bound."""

from .onnx import OnnxImportError, from_onnx
from .pytorch import from_pytorch

__all__ = ["from_pytorch", "from_onnx", "OnnxImportError"]
