"""The host side of the row kernels' tiles (mean, softmax, layer_norm, rms_norm, their TFLite
integer forms, cross_entropy and its backward): each phase over a row's chunks in column
order, the statistics chained from chunk to chunk as the chain over the NoC passes them."""

from __future__ import annotations

import numpy as np

from .. import view
from ..errors import PeCodegenError
from ..memory_map import ARENA_END
from .base import _Arena, _F32, _record_runs, _Run, _tally


def _run_mean(run: _Run, index: int, env, table) -> np.ndarray:
    """fp32 mean over trailing axes: a tile's chunk of its rows; a row split over PEs passes its
    running sum along the chain (over the NoC), the last chunk divides."""
    p = run.p
    row = int(view.layer_attrs(p, index)["row"])
    x = np.ascontiguousarray(env[view.layer_inputs(p, index)[0]], dtype=_F32).reshape(-1, row)
    out = np.empty(view.tensor_shape(p, view.layer_output(p, index)), dtype=_F32)
    flat = out.reshape(-1)
    partial = np.zeros(x.shape[0], dtype=_F32)  # per row, the running sum a chunk passes on
    order = sorted(range(len(table)), key=lambda t: (int(table.lo[t, 0]), int(table.lo[t, 1])))
    for t in order:
        (r0, c0), (r1, c1) = table.lo[t, :2].tolist(), table.hi[t, :2].tolist()
        m = run.machine(index, int(table.pe[t]))
        per_row = 4 * (c1 - c0) + 8
        group = max(1, (ARENA_END - m.arena - 3 * 64) // per_row)
        for q0 in range(r0, r1, group):
            q1 = min(q0 + group, r1)
            n = q1 - q0
            px, pp, py = _Arena(m, p, index).take(4 * n * (c1 - c0), 4 * n, 4 * n)
            m.write(px, np.ascontiguousarray(x[q0:q1, c0:c1]).tobytes())
            if c0 > 0:
                m.write(pp, partial[q0:q1].tobytes())
            flags = (1 if c0 == 0 else 0) | (2 if c1 == row else 0)
            m.run([[px, pp, py, n, c1 - c0, flags, row]])
            if c1 == row:
                flat[q0:q1] = np.frombuffer(m.read(py, 4 * n), dtype=_F32)
            else:
                partial[q0:q1] = np.frombuffer(m.read(pp, 4 * n), dtype=_F32)
        run.done(index, t, table, m)
    return out


def _run_mean_tflite(run: _Run, index: int, env, table) -> np.ndarray:
    """TFLite's integer mean: as :func:`_run_mean`, the chain passing each row's int32 sum."""
    p = run.p
    attrs = view.layer_attrs(p, index)
    row = int(attrs["row"])
    x = np.ascontiguousarray(env[view.layer_inputs(p, index)[0]]).reshape(-1, row)
    out_id = view.layer_output(p, index)
    out = np.empty(view.tensor_shape(p, out_id), dtype=view.tensor_dtype(p, out_id))
    flat = out.reshape(-1)
    from ...program.quant import QUANT_RANGES
    lo, hi = QUANT_RANGES[out.dtype.name]
    consts = np.array([attrs["x_zero"], row, attrs["multiplier"], attrs["shift"], attrs["y_zero"], lo, hi],
                      dtype=np.int64).astype(np.int32)
    partial = np.zeros(x.shape[0], dtype=np.int32)
    order = sorted(range(len(table)), key=lambda t: (int(table.lo[t, 0]), int(table.lo[t, 1])))
    for t in order:
        (r0, c0), (r1, c1) = table.lo[t, :2].tolist(), table.hi[t, :2].tolist()
        m = run.machine(index, int(table.pe[t]))
        per_row = (c1 - c0) * x.itemsize + 8
        group = max(1, (ARENA_END - m.arena - 4 * 64) // per_row)
        for q0 in range(r0, r1, group):
            q1 = min(q0 + group, r1)
            n = q1 - q0
            px, pp, py, pq = _Arena(m, p, index).take(n * (c1 - c0) * x.itemsize, 4 * n, n * out.itemsize, 28)
            m.write(px, np.ascontiguousarray(x[q0:q1, c0:c1]).tobytes())
            m.write(pq, consts.tobytes())
            if c0 > 0:
                m.write(pp, partial[q0:q1].tobytes())
            flags = (1 if c0 == 0 else 0) | (2 if c1 == row else 0)
            m.run([[px, pp, py, n, c1 - c0, flags, pq]])
            if c1 == row:
                flat[q0:q1] = np.frombuffer(m.read(py, n * out.itemsize), dtype=out.dtype)
            else:
                partial[q0:q1] = np.frombuffer(m.read(pp, 4 * n), dtype=np.int32)
        run.done(index, t, table, m)
    return out


def _run_softmax_tflite(run: _Run, index: int, env, table) -> np.ndarray:
    """TFLite's integer softmax: per group of rows, each phase over the rows' chunks in column
    order, the int32 statistics (max, sum) chained and sent back as :func:`_run_rows` does."""
    from ...program.quant import QUANT_RANGES
    p = run.p
    attrs = view.layer_attrs(p, index)
    x = np.ascontiguousarray(env[view.layer_inputs(p, index)[0]])
    row = x.shape[-1]
    x = x.reshape(-1, row)
    out_id = view.layer_output(p, index)
    out = np.empty(view.tensor_shape(p, out_id), dtype=view.tensor_dtype(p, out_id))
    y_all = out.reshape(-1, row)
    lo_q, hi_q = QUANT_RANGES[out.dtype.name]
    consts = np.array([attrs["multiplier"], attrs["left_shift"], attrs["diff_min"], lo_q, hi_q],
                      dtype=np.int64).astype(np.int32)
    lo, hi = table.lo[:, :2], table.hi[:, :2]
    groups: dict = {}
    for t in range(len(table)):
        groups.setdefault((int(lo[t, 0]), int(hi[t, 0])), []).append(t)
    runs = {t: [0, {}] for t in range(len(table))}
    for (r0, r1), tiles in sorted(groups.items()):
        tiles.sort(key=lambda t: int(lo[t, 1]))
        width = max(int(hi[t, 1] - lo[t, 1]) for t in tiles)
        m0 = run.machine(index, int(table.pe[tiles[0]]))
        group = max(1, (ARENA_END - m0.arena - 5 * 64) // (2 * width + 8))
        for q0 in range(r0, r1, group):
            q1 = min(q0 + group, r1)
            n = q1 - q0
            st = np.zeros(2 * n, dtype=np.int32)
            for ph in range(3):
                for i, t in enumerate(tiles):
                    c0, c1 = int(lo[t, 1]), int(hi[t, 1])
                    m = run.machine(index, int(table.pe[t]))
                    px, py, pst, pq = _Arena(m, p, index).take(n * (c1 - c0), n * (c1 - c0), 8 * n, 20)
                    m.write(px, np.ascontiguousarray(x[q0:q1, c0:c1]).tobytes())
                    m.write(pq, consts.tobytes())

                    def job(f, first, last):
                        return [px, py, pst, n, c1 - c0, f, (1 if first else 0) | (2 if last else 0), pq]
                    if len(tiles) == 1:
                        m.run([job(f, True, True) for f in range(3)])
                    else:
                        m.write(pst, st.tobytes())
                        m.run([job(ph, i == 0, i == len(tiles) - 1)])
                        st[:] = np.frombuffer(m.read(pst, 8 * n), dtype=np.int32)
                    if len(tiles) == 1 or ph == 2:
                        y_all[q0:q1, c0:c1] = np.frombuffer(m.read(py, n * (c1 - c0)), dtype=out.dtype).reshape(n, c1 - c0)
                    _tally(runs[t], m)
                if len(tiles) == 1:
                    break
    _record_runs(run, index, table, runs)
    return out


#: phases of each row kernel (:mod:`.kernels`)
_ROW_PHASES = {"softmax": 3, "layer_norm": 3, "rms_norm": 2}


def _run_rows(run: _Run, index: int, env, table) -> np.ndarray:
    """softmax, layer_norm, rms_norm: per group of rows (as many as fit a PE's SRAM), each
    phase of the row kernel runs over the chunks of the rows in ascending column order; the
    statistics a phase leaves (partial sums, max, mean, divisor) pass from chunk to chunk and
    back to every chunk (the chain over the NoC, here the host). A whole-row tile runs its
    phases as one job list, its data staying in the PE's SRAM."""
    p = run.p
    kind = view.layer_kind(p, index)
    attrs = view.layer_attrs(p, index)
    x = np.ascontiguousarray(env[view.layer_inputs(p, index)[0]], dtype=_F32)
    row = x.shape[-1] if x.ndim else 1
    x = x.reshape(-1, row)
    # zeros, not uninitialized memory: a split row's output buffer is placed before its first
    # phase, so the placement is the same bytes in every run (a firmware's job table records it)
    out = np.zeros(view.tensor_shape(p, view.layer_output(p, index)), dtype=_F32)
    y_all = out.reshape(-1, row)
    phases = _ROW_PHASES[kind]
    # per-column constants (layer_norm's gamma and beta, rms_norm's weight) and flag bits
    consts, bits = [], 0
    if kind == "layer_norm":
        for role, key, bit in (("gamma", "scale", 4), ("beta", "center", 8)):
            tid = view.layer_const(p, index, role)
            use = attrs.get(key, True) and tid is not None
            consts.append(env[tid].reshape(-1).astype(_F32, copy=False) if use else None)
            bits |= bit if use else 0
    elif kind == "rms_norm":
        tid = view.layer_const(p, index, "weight")
        consts.append(env[tid].reshape(-1).astype(_F32, copy=False) if tid is not None else None)
        bits |= 4 if tid is not None else 0
    eps = int(np.asarray(attrs.get("epsilon", 0.0), dtype=_F32).view(np.uint32))
    lo, hi = table.lo[:, :2], table.hi[:, :2]
    groups: dict = {}
    for t in range(len(table)):
        groups.setdefault((int(lo[t, 0]), int(hi[t, 0])), []).append(t)
    runs = {t: [0, {}] for t in range(len(table))}  # executed cycles and classes per tile

    def job(t, ph, bufs, n, first, last):
        c0, c1 = int(lo[t, 1]), int(hi[t, 1])
        flags = (1 if first else 0) | (2 if last else 0) | bits
        px, py, pst, *pc = bufs
        if kind == "softmax":
            return [px, py, pst, n, c1 - c0, ph, flags]
        return [px, py, pst, *pc, n, c1 - c0, ph, flags, c0, row, eps]

    for (r0, r1), tiles in sorted(groups.items()):
        tiles.sort(key=lambda t: int(lo[t, 1]))
        width = max(int(hi[t, 1] - lo[t, 1]) for t in tiles)
        m0 = run.machine(index, int(table.pe[tiles[0]]))
        per_row = 8 * width + 16
        group = max(1, (ARENA_END - m0.arena - 4 * width * len(consts) - 8 * 64) // per_row)
        for q0 in range(r0, r1, group):
            q1 = min(q0 + group, r1)
            n = q1 - q0
            st = np.zeros(4 * n, dtype=_F32)  # the chained and broadcast statistics of the rows
            for ph in range(phases):
                for i, t in enumerate(tiles):
                    c0, c1 = int(lo[t, 1]), int(hi[t, 1])
                    m = run.machine(index, int(table.pe[t]))
                    bufs = _Arena(m, p, index).take(4 * n * (c1 - c0), 4 * n * (c1 - c0), 16 * n,
                                                    *([4 * (c1 - c0)] * len(consts)))
                    m.write(bufs[0], np.ascontiguousarray(x[q0:q1, c0:c1]).tobytes())
                    for buf, c in zip(bufs[3:], consts):
                        if c is not None:
                            m.write(buf, c[c0:c1].tobytes())
                    if len(tiles) == 1:  # whole rows: every phase in one run
                        m.run([job(t, f, bufs, n, True, True) for f in range(phases)])
                    else:
                        m.write(bufs[1], np.ascontiguousarray(y_all[q0:q1, c0:c1]).tobytes())
                        m.write(bufs[2], st.tobytes())
                        m.run([job(t, ph, bufs, n, i == 0, i == len(tiles) - 1)])
                        st[:] = np.frombuffer(m.read(bufs[2], 16 * n), dtype=_F32)
                    y_all[q0:q1, c0:c1] = np.frombuffer(m.read(bufs[1], 4 * n * (c1 - c0)), dtype=_F32).reshape(n, c1 - c0)
                    _tally(runs[t], m)
                if len(tiles) == 1:
                    break
    _record_runs(run, index, table, runs)
    return out


def cross_entropy_chunks(classes: int, arch) -> list[tuple[int, int]]:
    """The column chunks ``[c0, c1)`` a ``cross_entropy`` row runs in on its PE: the whole row
    where it fits the working SRAM (the timing model's resident rows), else chunks of
    :data:`~tvm_spinn.program.ops.loss.STREAM_CHUNK` logits streamed through the PE in the
    row's order (the timing model's streamed rows)."""
    from ...program.ops.base import working_budget
    from ...program.ops.loss import STREAM_CHUNK, _row_bytes
    width = classes if _row_bytes(classes) <= working_budget(arch) else STREAM_CHUNK
    return [(c0, min(c0 + width, classes)) for c0 in range(0, classes, width)]


def _run_cross_entropy(run: _Run, index: int, env, table) -> np.ndarray:
    """``cross_entropy``: each tile's rows (as many at a time as fit the PE's SRAM) through the
    kernel's phases. A row that fits runs its three phases as one job list; a longer row streams
    through the same PE in chunks (:func:`cross_entropy_chunks`), once for the max (phase 0),
    once for the exps' sum and the label's logit (phases 1 and 2 per chunk, the last chunk
    finishing the loss), the row's statistics passing from chunk to chunk in its order. A label
    outside ``[0, classes)`` that is not the ignore index is a ValueError naming it and its row
    (as the simulator's kernel reports it)."""
    p = run.p
    layer = p.layers[index]
    zid, tid = view.layer_inputs(p, index)
    z = np.ascontiguousarray(env[zid], dtype=_F32)
    labels = np.ascontiguousarray(env[tid], dtype=np.int32).reshape(-1)
    rows, classes = z.shape
    ignore = int(view.layer_attrs(p, index)["ignore_index"])
    bad = np.flatnonzero((labels != ignore) & ((labels < 0) | (labels >= classes)))
    if bad.size:
        raise ValueError(f"{layer.name}: label {int(labels[bad[0]])} of row {int(bad[0])} is out of range for "
                         f"{classes} classes")
    out = np.empty(view.tensor_shape(p, view.layer_output(p, index)), dtype=_F32)
    flat = out.reshape(-1)
    chunks = cross_entropy_chunks(classes, view.arch_of(p))
    width = max(c1 - c0 for c0, c1 in chunks)
    runs = {t: [0, {}] for t in range(len(table))}
    for t in range(len(table)):
        r0, r1, pe = int(table.lo[t, 0]), int(table.hi[t, 0]), int(table.pe[t])
        m = run.machine(index, pe)
        group = max(1, (ARENA_END - m.arena - 6 * 64) // (8 * width + 24))
        for q0 in range(r0, r1, group):
            q1 = min(q0 + group, r1)
            n = q1 - q0
            st = np.zeros(4 * n, dtype=_F32)  # the rows' chained statistics

            def job(bufs, ph, i, c0, c1):
                flags = (1 if i == 0 else 0) | (2 if i == len(chunks) - 1 else 0)
                return [*bufs, n, c1 - c0, ph, flags, c0, ignore]

            # whole rows: one run of the three phases; streamed rows: phase 0 over the chunks,
            # then phases 1 and 2 over them
            passes = [(0, 1, 2)] if len(chunks) == 1 else [(0,), (1, 2)]
            for phases in passes:
                for i, (c0, c1) in enumerate(chunks):
                    m = run.machine(index, pe)
                    bufs = _Arena(m, p, index).take(4 * n * (c1 - c0), 4 * n * (c1 - c0), 16 * n, 4 * n, 4 * n)
                    m.write(bufs[0], np.ascontiguousarray(z[q0:q1, c0:c1]).tobytes())
                    m.write(bufs[2], st.tobytes())
                    m.write(bufs[3], labels[q0:q1].tobytes())
                    m.run([job(bufs, ph, i, c0, c1) for ph in phases])
                    st[:] = np.frombuffer(m.read(bufs[2], 16 * n), dtype=_F32)
                    if 2 in phases and i == len(chunks) - 1:
                        flat[q0:q1] = np.frombuffer(m.read(bufs[4], 4 * n), dtype=_F32)
                    _tally(runs[t], m)
    _record_runs(run, index, table, runs)
    return out


def _run_xent_grad(run: _Run, index: int, env, table) -> np.ndarray:
    """``cross_entropy_backward``: per tile (runs of whole rows of the gradient), groups of
    whole rows that fit the working SRAM (:func:`~tvm_spinn.program.ops.loss.resident_rows`)
    run the kernel's phases 0 (the max), 1 (the exps and their sum) and 2 (the output) as one
    job list. A row longer than that streams through its
    PE in chunks of :data:`~tvm_spinn.program.ops.loss.STREAM_CHUNK` logits, the chunks in the
    row's order, the statistics staying in the PE's SRAM: phase 0 over every chunk, phase 1
    over every chunk, then per chunk phase 3 (its exps again: the same bits) and phase 2. Every
    label is checked first, as the default simulator does."""
    from ...program.ops.loss import STREAM_CHUNK, resident_rows
    p = run.p
    z, labels = (env[t] for t in view.layer_inputs(p, index))
    z = np.ascontiguousarray(z, dtype=_F32)
    labels = np.ascontiguousarray(labels, dtype=np.int32).reshape(-1)
    rows, cols = z.shape
    bad = np.flatnonzero((labels < 0) | (labels >= cols))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"tvm_spinn.sim.cross_entropy_grad: label {int(labels[r])} of row {r} is out of range "
                         f"for {cols} classes")
    div = int(np.asarray(view.layer_attrs(p, index)["divisor"], dtype=_F32).view(np.uint32))
    out = np.empty((rows, cols), dtype=_F32)
    for t in range(len(table)):
        e0, e1 = int(table.lo[t, 0]), int(table.hi[t, 0])
        if e0 % cols or e1 % cols:
            raise PeCodegenError(view.layer_name(p, index), view.layer_kind(p, index),
                                 f"a tile of elements [{e0}, {e1}) cuts a row of {cols} classes")
        r0, r1 = e0 // cols, e1 // cols
        m = run.machine(index, int(table.pe[t]))
        # the groups the timing model prices (the working SRAM), within what the PE has
        group = min(resident_rows(cols, view.arch_of(p)), (ARENA_END - m.arena - 4 * 64) // (8 * cols + 12))
        if group >= 1:  # whole rows resident: the three phases in one run
            for q0 in range(r0, r1, group):
                q1 = min(q0 + group, r1)
                n = q1 - q0
                px, py, pst, pl = _Arena(m, p, index).take(4 * n * cols, 4 * n * cols, 8 * n, 4 * n)
                m.write(px, z[q0:q1].tobytes())
                m.write(pl, labels[q0:q1].tobytes())
                m.run([[px, py, pst, pl, n, cols, ph, 3, 0, div] for ph in range(3)])
                out[q0:q1] = np.frombuffer(m.read(py, 4 * n * cols), dtype=_F32).reshape(n, cols)
        else:  # a row streamed in chunks through the PE
            px, py, pst, pl = _Arena(m, p, index).take(4 * STREAM_CHUNK, 4 * STREAM_CHUNK, 8, 4)
            for r in range(r0, r1):
                m.write(pl, labels[r:r + 1].tobytes())
                chunks = [(c0, min(c0 + STREAM_CHUNK, cols)) for c0 in range(0, cols, STREAM_CHUNK)]
                for ph in (0, 1):
                    for c0, c1 in chunks:
                        m.write(px, z[r, c0:c1].tobytes())
                        m.run([[px, py, pst, pl, 1, c1 - c0, ph, (1 if c0 == 0 else 0) | (2 if c1 == cols else 0), c0,
                                div]])
                for c0, c1 in chunks:
                    m.write(px, z[r, c0:c1].tobytes())
                    m.run([[px, py, pst, pl, 1, c1 - c0, ph, 0, c0, div] for ph in (3, 2)])
                    out[r, c0:c1] = np.frombuffer(m.read(py, 4 * (c1 - c0)), dtype=_F32)
        run.done(index, t, table, m)
    return out
