"""``iss`` execution of a spinn program: every layer's tiles run as generated machine code on
their PEs in the instruction-set simulator (:mod:`.iss`).

Per layer, the role's image runs on each PE the mapper placed a tile on. The host stands in for
the DMA: it places a tile's operands in the PE's SRAM (after the image, :data:`ARENA`), runs the
tile's jobs (element-wise tiles in SRAM-sized pieces; GEMM tiles one reduction chunk per job, the
accumulator staying in SRAM between them) and reads the results back. Data layout (the
im2col gather of a convolution, broadcasting) is the DMA's and is done on the host; every
arithmetic operation is executed code. Each kernel family's host side is a module of
:mod:`.runners`; this module runs the layers in order and keeps the embedding lookup's.
"""

from __future__ import annotations

import numpy as np

from . import view
from .images import build_images
from .memory_map import ARENA_END, DMA_DESC_WORDS
from .runners.base import TileRun, _Arena, _Run
from .runners.elementwise import _run_elementwise, _run_qdq, _run_rope
from .runners.gemm import _run_gemm_f32, _run_gemm_i8, gemm_f32_panels, gemm_i8_tile, run_int8_tile
from .runners.movement import _run_dma
from .runners.pool import _run_pool, _run_pool_grad
from .runners.rows import (_run_cross_entropy, _run_mean, _run_mean_tflite, _run_rows, _run_softmax_tflite,
                           _run_xent_grad, cross_entropy_chunks)  # noqa: F401 (cross_entropy_chunks: its importers' name)

__all__ = ["TileRun", "gemm_f32_panels", "gemm_i8_tile", "run_int8_tile", "run_program_iss"]


def take_segments(e0: int, e1: int, inner: int, count: int, extent: int) -> tuple[np.ndarray, ...]:
    """The segments of output elements ``[e0, e1)`` of a ``take`` whose table rows hold ``inner``
    elements, with ``count`` indices and ``extent`` rows on the gathered axis: per run of one
    gathered row's elements, ``(slot, position, start, stop)``: its index's position among
    the indices used (``np.unique`` order), the element of row 0 it starts at in the table, and
    its output range. The indices used are ``positions`` (the second result)."""
    slots = np.arange(e0 // inner, (e1 - 1) // inner + 1, dtype=np.int64)  # (outer, index) pairs
    pos, outer = slots % count, slots // count
    used = np.unique(pos)
    start, stop = np.maximum(slots * inner, e0), np.minimum((slots + 1) * inner, e1)
    return np.searchsorted(used, pos), used, outer * extent * inner + start - slots * inner, start, stop


def _read_status(m, address: int, nbytes: int) -> bytes:
    """A kernel's status words (a refused input: a nonzero first word, then the value at fault),
    which the host checks rather than passes on: the job tables' recorder (``read_status``)
    records the check as a step of its own."""
    status = getattr(m, "read_status", None)
    return status(address, nbytes) if status is not None else m.read(address, nbytes)


def _run_take(run: _Run, index: int, env, table) -> np.ndarray:
    """``take`` (an embedding lookup): per SRAM-sized piece of a tile, the PE resolves the
    indices its elements use into table rows (the layer's index mode; ``fast`` reports an index
    out of range), then drives the DMA engine over the piece's segments (a run of one row's
    elements each: :func:`take_segments`), adding each one's row offset to its descriptor's
    source; the engine copies the elements from the table, outside the PE's SRAM."""
    from ..program.ops.gather import MODES
    p = run.p
    layer = p.layers[index]
    attrs = view.layer_attrs(p, index)
    tid = view.layer_const(p, index, "table")
    tab = env[tid if tid is not None else view.layer_inputs(p, index)[0]]
    idx = np.ascontiguousarray(env[view.layer_inputs(p, index)[-1]], dtype=np.int32).reshape(-1)
    axis, mode = int(attrs["axis"]), MODES.index(attrs.get("mode", "fast"))
    extent = tab.shape[axis]
    inner = int(np.prod(tab.shape[axis + 1:], dtype=np.int64))
    eb = tab.dtype.itemsize
    data = np.ascontiguousarray(tab).tobytes()
    out = np.empty(view.tensor_shape(p, view.layer_output(p, index)), dtype=tab.dtype)
    flat = out.reshape(-1).view(np.uint8)
    words = DMA_DESC_WORDS + 1  # a segment: its index's position, then its descriptor
    for t in range(len(table)):
        e0, e1 = int(table.lo[t, 0]), int(table.hi[t, 0])
        m = run.machine(index, int(table.pe[t]))
        remote = m.place_remote(data, key=("take", index))  # the table where the DMA reads it
        free = ARENA_END - m.arena - 5 * 64 - 2 * (8 + 4 * words)  # two partial rows' records
        piece = max(16, int(free / (eb + (8 + 4 * words) / inner)) // 16 * 16)
        for s0 in range(e0, e1, piece):
            s1 = min(s0 + piece, e1)
            slot, used, first, start, stop = take_segments(s0, s1, inner, max(idx.size, 1), extent)
            pi, pr, pe, pseg, pdst = _Arena(m, p, index).take(4 * len(used), 4 * len(used), 8, 4 * words * len(slot),
                                                              eb * (s1 - s0))
            segs = np.zeros((len(slot), words), dtype=np.int64)
            segs[:, 0], segs[:, 1], segs[:, 2] = slot, remote + eb * first, pdst + eb * (start - s0)
            segs[:, 3], segs[:, 4], segs[:, 5:8], segs[:, 8] = eb, stop - start, 1, eb
            m.write(pi, idx[used].tobytes())
            m.write(pseg, (segs & 0xFFFFFFFF).astype("<u4").tobytes())
            m.run([[pi, pr, pe, len(used), extent, mode, pseg, len(slot), eb * inner]])
            bad, value = np.frombuffer(_read_status(m, pe, 8), dtype=np.int32)
            if bad:
                raise IndexError(f"{layer.name}: take index {int(value)} is out of range for axis {axis} "
                                 f"of extent {extent}")
            flat[eb * s0:eb * s1] = np.frombuffer(m.read(pdst, eb * (s1 - s0)), dtype=np.uint8)
        run.done(index, t, table, m)
    return out


_RUNNERS = {"take": _run_take, "unary": _run_elementwise, "softmax": _run_rows, "layer_norm": _run_rows, "rms_norm": _run_rows, "mean": _run_mean, "mean_tflite": _run_mean_tflite, "softmax_tflite": _run_softmax_tflite, "pool": _run_pool, "quantize": _run_qdq, "dequantize": _run_qdq, "dma": _run_dma, "binary": _run_elementwise, "relu": _run_elementwise, "clip": _run_elementwise, "where_less": _run_elementwise, "rope": _run_rope, "gemm_f32": _run_gemm_f32,
            "gemm_i8": _run_gemm_i8}
_RUNNERS.update(pool_grad=_run_pool_grad, xent_grad=_run_xent_grad)

_RUNNERS["cross_entropy"] = _run_cross_entropy


def run_program_iss(program, inputs: list[np.ndarray], record: "list | None" = None) -> list[np.ndarray]:
    """Execute ``program`` on ``inputs`` (in the program's input order) as generated Cortex-M4F
    code in the instruction-set simulator; returns its outputs.

    Parameters
    ----------
    program : tvm_spinn.program.Program
        A mapped spinn program.
    inputs : list of numpy.ndarray
        One array per program input.
    record : list, optional
        Receives a :class:`TileRun` per executed tile (executed cycles beside the timing
        model's).

    Raises
    ------
    PeCodegenError
        Before anything runs, for the first layer the generator cannot lower.
    IssFault
        For an image that faults (PE, image and program counter in the message).
    """
    images = build_images(program)
    tables = view.placed_tiles(program)
    env: dict = dict(view.constants(program))
    for tid, value in zip(view.program_inputs(program), inputs):
        env[tid] = np.asarray(value)
    run = _Run(program, images, record)
    for index in range(view.layer_count(program)):
        kind = program_role_kind(images, index)
        env[view.layer_output(program, index)] = _RUNNERS[kind](run, index, env, tables[index])
    return [env[tid] for tid in view.program_outputs(program)]


def program_role_kind(images, index: int) -> str:
    """The kernel kind (``binary``, ``gemm_f32``...) of layer ``index``'s role."""
    return images.images[images.layers[index]].spec[0]
