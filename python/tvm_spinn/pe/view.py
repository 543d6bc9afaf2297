"""The one place this package reads a spinn program: small accessors over its layers, tensors,
constants and the mapper's placed tiles, so a change of the program's records touches only here."""

from __future__ import annotations

import numpy as np

__all__ = [
    "layer_count", "layer_name", "layer_kind", "layer_mode", "layer_attrs", "layer_inputs",
    "layer_output", "layer_const", "tensor_shape", "tensor_dtype", "program_inputs",
    "program_outputs", "program_symbol", "program_bytes", "layer_tile_shape", "constants", "arch_of", "placed_tiles", "gemm_view", "gemm_chunk",
]


def layer_count(program) -> int:
    return len(program.layers)


def layer_name(program, index: int) -> str:
    return program.layers[index].name


def layer_kind(program, index: int) -> str:
    return program.layers[index].kind


def layer_mode(program, index: int) -> str:
    return program.layers[index].mode


def layer_attrs(program, index: int) -> dict:
    return program.layers[index].attrs


def layer_inputs(program, index: int) -> list[int]:
    return list(program.layers[index].inputs)


def layer_output(program, index: int) -> int:
    return program.layers[index].output


def layer_const(program, index: int, role: str) -> "int | None":
    """The tensor id of the layer's constant ``role`` (``weight``, ``bias``...), or None."""
    return program.layers[index].consts.get(role)


def tensor_shape(program, tid: int) -> tuple[int, ...]:
    return tuple(int(d) for d in program.tensors[tid].shape)


def tensor_dtype(program, tid: int) -> str:
    return program.tensors[tid].dtype


def program_inputs(program) -> list[int]:
    return list(program.inputs)


def program_outputs(program) -> list[int]:
    return list(program.outputs)


def program_symbol(program) -> str:
    return program.symbol


def program_bytes(program) -> bytes:
    """The program serialized (:meth:`~tvm_spinn.program.format.Program.to_bytes`)."""
    return program.to_bytes()


def layer_tile_shape(program, index: int) -> list[int]:
    """The mapper's tile shape of the layer (see :mod:`tvm_spinn.program.tiles`)."""
    return [int(v) for v in program.mapping.layers[index].tile]


def constants(program) -> dict[int, np.ndarray]:
    return dict(program.constants)


def arch_of(program):
    """The program's :class:`~tvm_spinn.target.arch.SpinnArch`."""
    return program.arch


def placed_tiles(program) -> list:
    """Per layer, the mapper's placed tiles (a :class:`~tvm_spinn.program.tiles.TileTable`:
    regions ``lo``/``hi``, ``pe``, modelled ``cycles``)."""
    from ..mapping.schedule import derive_tables
    return derive_tables(program, arch_of(program))


def gemm_view(program, index: int):
    """The layer's GEMM view (``batch, m, n, k``)."""
    from ..program.ops.gemm.geometry import gemm_shape
    return gemm_shape(program, program.layers[index])


def gemm_chunk(program, index: int) -> int:
    """Products per reduction chunk of the layer's tiles (the mapper's tile depth)."""
    from ..program.ops.gemm.geometry import chunk_length
    return chunk_length(gemm_view(program, index).k, program.mapping.layers[index].tile[2])
