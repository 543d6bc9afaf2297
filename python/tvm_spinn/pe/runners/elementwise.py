"""The host side of the element-wise tiles (binary, unary, relu, clip, where_less, rope,
quantize and dequantize): the operands in SRAM-sized pieces, each piece one job."""

from __future__ import annotations

import numpy as np

from .. import view
from ..memory_map import ARENA_END
from .base import _Arena, _F32, _Run


def _flat_operands(p, index: int, env) -> tuple[list[np.ndarray], np.ndarray]:
    out_shape = view.tensor_shape(p, view.layer_output(p, index))
    args = [np.ascontiguousarray(np.broadcast_to(env[t], out_shape), dtype=_F32).reshape(-1)
            for t in view.layer_inputs(p, index)]
    return args, np.empty(out_shape, dtype=_F32)


def _run_elementwise(run: _Run, index: int, env, table) -> np.ndarray:
    p = run.p
    args, out = _flat_operands(p, index, env)
    flat = out.reshape(-1)
    extra = []  # clip's bounds, as float32 bits
    if view.layer_kind(p, index) == "clip":
        attrs = view.layer_attrs(p, index)
        extra = [int(np.asarray(attrs[b], dtype=_F32).view(np.uint32)) for b in ("min", "max")]
    _run_flat_pieces(run, index, table, args, flat, lambda s0: extra)
    return out


def _run_flat_pieces(run: _Run, index: int, table, args: list, flat: np.ndarray, extra) -> None:
    """Each tile of a flat element-wise layer through its PE in SRAM-sized pieces (a tile larger
    than the SRAM streams through it: element-wise, the same bits): the pieces of ``args`` in,
    the kernel run with ``(*buffers, n, *extra(first element))``, the output piece into ``flat``."""
    p = run.p
    for t in range(len(table)):
        e0, e1 = int(table.lo[t, 0]), int(table.hi[t, 0])
        m = run.machine(index, int(table.pe[t]))
        piece = max(16, ((ARENA_END - m.arena) // (4 * (len(args) + 1)) - 64) // 16 * 16)
        for s0 in range(e0, e1, piece):
            s1 = min(s0 + piece, e1)
            n = s1 - s0
            bufs = _Arena(m, p, index).take(*([4 * n] * (len(args) + 1)))
            for buf, a in zip(bufs, args):
                m.write(buf, a[s0:s1].tobytes())
            m.run([[*bufs, n, *extra(s0)]])
            flat[s0:s1] = np.frombuffer(m.read(bufs[-1], 4 * n), dtype=_F32)
        run.done(index, t, table, m)


def _run_rope(run: _Run, index: int, env, table) -> np.ndarray:
    """``rope``: per tile (in SRAM-sized pieces) the DMA's runs of ``x``, its partners (the
    other half of each row, unsigned: the kernel flips the first half's), ``cos`` and ``sin``."""
    p = run.p
    out_shape = view.tensor_shape(p, view.layer_output(p, index))
    x, c, s = (np.ascontiguousarray(np.broadcast_to(env[t], out_shape), dtype=_F32)
               for t in view.layer_inputs(p, index))
    d = out_shape[-1]
    h = d // 2
    partner = np.concatenate([x[..., h:], x[..., :h]], axis=-1).reshape(-1)
    args = [x.reshape(-1), partner, c.reshape(-1), s.reshape(-1)]
    out = np.empty(out_shape, dtype=_F32)
    flat = out.reshape(-1)
    # each piece's first element's place in its row: the kernel flips the first half's partners
    _run_flat_pieces(run, index, table, args, flat, lambda s0: (s0 % d, h))
    return out


def _run_qdq(run: _Run, index: int, env, table) -> np.ndarray:
    """quantize / dequantize: per SRAM-sized piece, the value and the result; a quantize the
    layer's per-channel scales and zero points (one table of each, channel ``(i // inner) %
    channels`` of flat element ``i``), a dequantize each element's (the DMA broadcasts them)."""
    p = run.p
    x = env[view.layer_inputs(p, index)[0]]
    out_id = view.layer_output(p, index)
    out = np.empty(view.tensor_shape(p, out_id), dtype=view.tensor_dtype(p, out_id))
    scale = env[view.layer_const(p, index, "scale")].astype(_F32, copy=False).reshape(-1)
    zero = env[view.layer_const(p, index, "zero")].astype(np.int32, copy=False).reshape(-1)
    channels = scale.size
    axis = view.layer_attrs(p, index).get("axis", 0)
    inner = int(np.prod(out.shape[axis + 1:], dtype=np.int64)) if channels > 1 else 0
    quantize = view.layer_kind(p, index) == "quantize"
    xs = np.ascontiguousarray(x).reshape(-1)
    if not quantize:
        shape = [1] * x.ndim
        if channels > 1:
            shape[axis] = -1
        ss = np.ascontiguousarray(np.broadcast_to(scale.reshape(shape), out.shape), dtype=_F32).reshape(-1)
        zs = np.ascontiguousarray(np.broadcast_to(zero.reshape(shape), out.shape), dtype=np.int32).reshape(-1)
    flat = out.reshape(-1)
    per = xs.itemsize + flat.itemsize + (0 if quantize else 8)
    for t in range(len(table)):
        e0, e1 = int(table.lo[t, 0]), int(table.hi[t, 0])
        m = run.machine(index, int(table.pe[t]))
        tables = 8 * channels if quantize else 0
        piece = max(16, (ARENA_END - m.arena - 4 * 64 - tables) // per // 16 * 16)
        for s0 in range(e0, e1, piece):
            s1 = min(s0 + piece, e1)
            n = s1 - s0
            if quantize:
                px, ps, pz, py = _Arena(m, p, index).take(xs.itemsize * n, 4 * channels, 4 * channels, flat.itemsize * n)
                m.write(ps, scale.tobytes())
                m.write(pz, zero.tobytes())
                # per tensor: the piece is one run of its one channel
                geometry = [inner, channels, s0 % inner, s0 // inner % channels] if channels > 1 else [n, 1, 0, 0]
            else:
                px, ps, pz, py = _Arena(m, p, index).take(xs.itemsize * n, 4 * n, 4 * n, flat.itemsize * n)
                m.write(ps, ss[s0:s1].tobytes())
                m.write(pz, zs[s0:s1].tobytes())
                geometry = []
            m.write(px, xs[s0:s1].tobytes())
            m.run([[px, ps, pz, py, n, *geometry]])
            flat[s0:s1] = np.frombuffer(m.read(py, flat.itemsize * n), dtype=flat.dtype)
        run.done(index, t, table, m)
    return out
