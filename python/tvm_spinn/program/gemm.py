"""Former home of the GEMM view (compatibility): it lives in the GEMM operator family,
:mod:`tvm_spinn.program.ops.gemm`."""

from .ops.gemm import GemmShape, gemm_shape, safe_k_chunk

__all__ = ["GemmShape", "gemm_shape", "safe_k_chunk"]
