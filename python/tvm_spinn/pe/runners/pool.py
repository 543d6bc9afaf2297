"""The host side of the pooling tiles: the padded input rows under a tile's windows per
SRAM-sized band (forward), and the max pool's backward per band of gradient rows."""

from __future__ import annotations

import numpy as np

from .. import view
from ..memory_map import ARENA_END
from .base import _Arena, _F32, _Run


def _run_pool(run: _Run, index: int, env, table) -> np.ndarray:
    """Pools: per tile (and per SRAM-sized group of its planes), the DMA brings the band of
    input rows under the tile's output rows, padded (the lowest float32 for max, +0.0 for
    average), and the divisors of the average's windows."""
    p = run.p
    attrs = view.layer_attrs(p, index)
    x = env[view.layer_inputs(p, index)[0]]
    out = np.empty(view.tensor_shape(p, view.layer_output(p, index)), dtype=_F32)
    n, c, h, w = x.shape
    oh, ow = out.shape[2:]
    pt, pl, pb, pr = attrs["padding"]
    kh, kw = attrs["pool_size"]
    sh, sw = attrs["strides"]
    dh, dw = attrs["dilation"]
    is_max = view.layer_kind(p, index) == "max_pool2d"
    fill = np.finfo(_F32).min if is_max else _F32(0.0)
    planes = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill).reshape(n * c, h + pt + pb, w + pl + pr)
    wp = planes.shape[2]
    # the average's divisor per output pixel: the window size, or its non-padding elements
    valid = np.pad(np.ones((h, w), np.int64), ((pt, pb), (pl, pr)))
    count = np.zeros((oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            count += valid[i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
    div = np.full((oh, ow), kh * kw, np.int64) if attrs.get("count_include_pad") else count
    div = div.astype(_F32)
    out_planes = out.reshape(n * c, oh, ow)
    for t in range(len(table)):
        (p0, r0), (p1, r1) = table.lo[t, :2].tolist(), table.hi[t, :2].tolist()
        rows = r1 - r0
        bh = (rows - 1) * sh + (kh - 1) * dh + 1
        m = run.machine(index, int(table.pe[t]))
        per_plane = 4 * (bh * wp + rows * ow)
        group = max(1, (ARENA_END - m.arena - 4 * rows * ow - 4 * 64) // per_plane)
        for q0 in range(p0, p1, group):
            q1 = min(q0 + group, p1)
            band = np.ascontiguousarray(planes[q0:q1, r0 * sh: r0 * sh + bh])
            geom = np.array([q1 - q0, rows, ow, bh, wp, kh, kw, sh, sw, dh, dw], np.int32)
            psrc, pdiv, pdst, pgeom = _Arena(m, p, index).take(band.nbytes, 4 * rows * ow, 4 * (q1 - q0) * rows * ow, 44)
            m.write(psrc, band.tobytes())
            m.write(pdiv, np.ascontiguousarray(div[r0:r1]).tobytes())
            m.write(pgeom, geom.tobytes())
            m.run([[psrc, pdiv, pdst, pgeom]])
            out_planes[q0:q1, r0:r1] = np.frombuffer(m.read(pdst, 4 * (q1 - q0) * rows * ow), dtype=_F32).reshape(q1 - q0, rows, ow)
        run.done(index, t, table, m)
    return out


def _run_pool_grad(run: _Run, index: int, env, table) -> np.ndarray:
    """``max_pool2d_backward``: per tile (a run of the flattened input gradient), its jobs
    (:func:`~tvm_spinn.program.ops.pool.pool_grad_jobs`: per plane and SRAM-sized band of rows):
    the DMA brings the padded input rows under the band's windows (the lowest float32 in the
    padding) and those windows' output gradients; the PE finds each window's argmax and adds its
    gradient to the element it takes where that element is one of the job's."""
    from ...program.ops.base import working_budget
    from ...program.ops.pool import pool_grad_jobs
    p = run.p
    attrs = view.layer_attrs(p, index)
    dy, x = (np.asarray(env[t], dtype=_F32) for t in view.layer_inputs(p, index))
    n, c, h, w = x.shape
    oh, ow = dy.shape[2:]
    (kh, kw), (sh, sw), pad = attrs["pool_size"], attrs["strides"], attrs["padding"]
    pt, pl, pb, pr = pad
    planes = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=np.finfo(_F32).min)
    planes = planes.reshape(n * c, h + pt + pb, w + pl + pr)
    wp = planes.shape[2]
    gy = dy.reshape(n * c, oh, ow)
    out = np.empty(x.shape, dtype=_F32)
    flat = out.reshape(-1)
    for t in range(len(table)):
        e0, e1 = int(table.lo[t, 0]), int(table.hi[t, 0])
        m = run.machine(index, int(table.pe[t]))
        # the bands the timing model prices (the working SRAM), within what the PE has
        free = min(working_budget(view.arch_of(p)), ARENA_END - m.arena - 4 * 64)
        for job in pool_grad_jobs(e0, e1, h, w, oh, ow, (kh, kw), (sh, sw), pad, free):
            xb = np.ascontiguousarray(planes[job.plane, job.oy0 * sh: job.oy0 * sh + max(0, (job.nwy - 1) * sh + kh)])
            geom = np.array([job.nwy, job.nwx, ow, wp, kh, kw, sh, sw, job.oy0 * sh - pt - job.row0, w, job.lo, job.hi,
                             pl, job.ox0, 0], np.int32)
            px, pdy, pdx, pg = _Arena(m, p, index).take(xb.nbytes, 4 * job.nwy * ow, 4 * job.hi, 4 * len(geom))
            m.write(px, xb.tobytes())
            m.write(pdy, np.ascontiguousarray(gy[job.plane, job.oy0:job.oy0 + job.nwy]).tobytes())
            m.write(pg, geom.tobytes())
            m.run([[px, pdy, pdx, pg]])
            d0 = (job.plane * h + job.row0) * w
            flat[d0 + job.lo:d0 + job.hi] = np.frombuffer(m.read(pdx + 4 * job.lo, 4 * (job.hi - job.lo)), dtype=_F32)
        run.done(index, t, table, m)
    return out
