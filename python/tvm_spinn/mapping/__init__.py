"""The mapping compiler: tiling, placement, memory planning, static schedule."""

from .memory import MemoryPlan, check_plan, plan_memory
from .options import MappingOptions, current_options
from .schedule import derive_tables, map_program
from .tiling import MappingError, choose_gemm_tile, gemm_shape, tile_layer

__all__ = [
    "map_program", "derive_tables", "MappingError", "MappingOptions", "current_options", "MemoryPlan", "check_plan",
    "plan_memory", "choose_gemm_tile", "gemm_shape", "tile_layer",
]
