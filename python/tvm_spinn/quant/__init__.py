"""Post-training quantization for the int8 MAC path: ``quantize(mod, calibration_data, scheme)``.

- :mod:`.scheme`: :class:`QuantScheme` (options, validated) and :class:`QuantizationError`.
- :mod:`.calibrate`: sample validation, the instrumented calibration module, range selection
  (min/max, percentile, KL entropy) and activation scale/zero-point math.
- :mod:`.insert`: preparation (batch-norm and layout folding), layer discovery and naming,
  weight quantization and the quantize/dequantize insertion.
"""

from .calibrate import activation_qparams, entropy_threshold, percentile_range
from .insert import ATTR, find_layers, prepare, quantizable_layers, quantize, quantize_weight
from .scheme import QuantizationError, QuantScheme

__all__ = [
    "quantize", "quantizable_layers", "QuantScheme", "QuantizationError", "prepare", "find_layers",
    "quantize_weight", "activation_qparams", "percentile_range", "entropy_threshold", "ATTR",
]
