"""The host side of the data-movement tiles: the DMA engine's descriptors of a strided view or
its scatter, run by the ``dma`` kernel per SRAM-sized piece."""

from __future__ import annotations

import numpy as np

from .. import view
from ..memory_map import ARENA_END, DMA_DESC_WORDS, DMA_SCATTER
from .base import _Arena, _Run


def _descriptor_words(descs, strided: int, contiguous: int, eb: int, scatter: bool) -> list[list[int]]:
    """The engine's words (:data:`~.memory_map.DMA_REGS` order) of descriptors ``(strided start,
    contiguous start, counts, strides)`` in elements
    (:func:`~tvm_spinn.program.ops.movement.dma_descriptors`), the strided side's elements from
    address ``strided``, the contiguous side's from ``contiguous``: the source and the
    destination, or with ``scatter`` (:data:`~.memory_map.DMA_SCATTER`) the other way round."""
    words = []
    for s, c, counts, st in descs:
        a, b = strided + eb * s, contiguous + eb * c
        words.append([b, a, eb | DMA_SCATTER, *counts, *(eb * x for x in st)] if scatter else
                     [a, b, eb, *counts, *(eb * x for x in st)])
    return words


def _run_dma(run: _Run, index: int, env, table) -> np.ndarray:
    """Data movement by the DMA engine: the inputs stay outside the PE (placed at
    :data:`~.memory_map.REMOTE_BASE`, one after another), and per SRAM-sized piece of a tile the
    PE runs the piece's descriptors, which bring its elements into SRAM in output order: a
    strided view's (:func:`~tvm_spinn.program.ops.movement.dma_descriptors` of
    :func:`~tvm_spinn.program.ops.movement.strided_source`), or for ``concat`` and ``pad`` the
    scatter descriptors (:data:`~.memory_map.DMA_SCATTER`) of each input's elements that land in
    the piece (:func:`~tvm_spinn.program.ops.movement.scatter_range` of
    :func:`~tvm_spinn.program.ops.movement.scatter_targets`), after a fill descriptor (the value
    read with strides 0) where a ``pad`` piece is not wholly its input's."""
    from ...program.ops.movement import dma_descriptors, scatter_range, scatter_targets, strided_source
    p = run.p
    layer = p.layers[index]
    out_id = view.layer_output(p, index)
    dtype = np.dtype(view.tensor_dtype(p, out_id))
    eb = dtype.itemsize
    out = np.empty(view.tensor_shape(p, out_id), dtype=dtype)
    flat = out.reshape(-1).view(np.uint8)
    inputs = [np.ascontiguousarray(env[t], dtype=dtype).tobytes() for t in view.layer_inputs(p, index)]
    starts = np.cumsum([0] + [len(x) // eb for x in inputs])  # each input's first element in the remote bytes
    strided = strided_source(p, layer)
    targets = scatter_targets(p, layer) if strided is None else None
    fill = (np.asarray(view.layer_attrs(p, index)["value"], dtype=dtype).tobytes()
            if view.layer_kind(p, index) == "pad" else None)
    for t in range(len(table)):
        e0, e1 = int(table.lo[t, 0]), int(table.hi[t, 0])
        m = run.machine(index, int(table.pe[t]))
        remote = m.place_remote(b"".join(inputs), key=("dma", index))  # the inputs where the DMA reads them
        piece = max(16, (ARENA_END - m.arena) // (2 * eb) // 16 * 16)
        for s0 in range(e0, e1, piece):
            s1 = min(s0 + piece, e1)
            parts, filled = [], False  # (descriptors, the far side's address, scatter)
            if strided is not None:
                parts.append((dma_descriptors(*strided, s0, s1), remote, False))
            else:
                moved = 0
                for j, (dims, strides, offset) in enumerate(targets):
                    q0, q1 = (int(scatter_range(dims, strides, offset, e)[0]) for e in (s0, s1))
                    parts.append((dma_descriptors(dims, strides, offset - s0, q0, q1),
                                  remote + eb * (int(starts[j]) + q0), True))
                    moved += q1 - q0
                filled = fill is not None and moved < s1 - s0
            count = sum(len(d) for d, _, _ in parts) + filled
            pdst, pdesc, pfill = _Arena(m, p, index).take(eb * (s1 - s0), 4 * DMA_DESC_WORDS * count, eb * filled)
            # the fill value read with strides 0 first; the strided side in SRAM for a scatter
            words = [[pfill, pdst, eb, s1 - s0, 1, 1, 1, 0, 0, 0, 0]] if filled else []
            for descs, far, scatter in parts:
                words += (_descriptor_words(descs, pdst, far, eb, True) if scatter else
                          _descriptor_words(descs, far, pdst, eb, False))
            if filled:
                m.write(pfill, fill)
            m.write(pdesc, (np.array(words, dtype=np.int64) & 0xFFFFFFFF).astype("<u4").tobytes())
            m.run([[pdesc, len(words)]])
            flat[eb * s0:eb * s1] = np.frombuffer(m.read(pdst, eb * (s1 - s0)), dtype=np.uint8)
        run.done(index, t, table, m)
    return out
