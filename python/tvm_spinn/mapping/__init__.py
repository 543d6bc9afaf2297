"""The mapping compiler: tiling, placement, static schedule."""

from .schedule import map_program
from .tiling import MappingError, choose_gemm_tile, gemm_shape, tile_layer

__all__ = ["map_program", "MappingError", "choose_gemm_tile", "gemm_shape", "tile_layer"]
