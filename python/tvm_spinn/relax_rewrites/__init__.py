"""Generic Relax graph rewrites, independent of the partitioner.

The front-ends, the quantizer and the partitioner all run them, so they live below all three:
this package imports only TVM, :mod:`tvm_spinn.program` and leaf modules.

- :mod:`.folds`: constant layout folds, BatchNorm folding, requantization rounding tags and
  quantized clips (``rewrite_call`` rewrites).
- :mod:`.hidden`: weights standing in as parameters while a rewrite runs, so that large models
  are not hashed after every change.
"""

from .folds import FoldBatchNorm, FoldLayoutConstants, FoldQuantizedClip, TagRequantRounding, fold_batch_norm
from .hidden import HiddenConstants

__all__ = ["fold_batch_norm", "FoldBatchNorm", "FoldLayoutConstants", "TagRequantRounding", "FoldQuantizedClip",
           "HiddenConstants"]
