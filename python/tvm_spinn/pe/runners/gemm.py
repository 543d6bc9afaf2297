"""The host side of the GEMM tiles: fp32 on the M4F (the operands in the kernel's panels) and int8
on the MAC array (one reduction chunk per job, the accumulator kept in SRAM)."""

from __future__ import annotations

import numpy as np

from ...program.ops.gemm.geometry import M4F_BLOCK
from .. import view
from ..iss import PeMachine
from ..kernels import I8_BIAS_FLAG
from ..kernels.i8_epilogues import i8_dsp_table
from .base import _Arena, _F32, _Run


def _gemm_operands(p, index: int, env, out, fill):
    """The GEMM operands as the DMA lays them out (``a`` [.., m, k], ``b`` [.., k, n] and the
    per-batch operand indices), the simulator's layout (conv2d: im2col)."""
    from ...program.ops.gemm.reference import _batched_operands
    layer = p.layers[index]
    wid = view.layer_const(p, index, "weight")
    rhs = env[wid] if wid is not None else env[view.layer_inputs(p, index)[1]]
    return _batched_operands(p, layer, out, env[view.layer_inputs(p, index)[0]], rhs, fill)


def gemm_f32_panels(a: np.ndarray, b: np.ndarray) -> tuple[bytes, bytes]:
    """The ``gemm_f32`` kernel's operands of one chunk ``a @ b`` (fp32 ``[m, k]`` by ``[k, n]``)
    as the host's DMA places them: ``a`` transposed and both cut into panels of the register
    block's rows (``a``) and columns (``b``), each full panel ``[k, width]`` row-major, so that a
    block's operands of one k step are contiguous and the next step's lie a fixed distance on;
    a narrower last panel (the rows below the blocks, the columns right of them) stored
    transposed, each of its rows or columns contiguous in k, as the kernel walks them one at a
    time (strided DMA descriptors, one per panel); panel ``p`` starts at element ``p * 4 * k``
    in both layouts."""
    mr, nr = M4F_BLOCK

    def panel(x, p, r):
        part = x[:, p:p + r]
        return np.ascontiguousarray(part if part.shape[1] == r else part.T, dtype=_F32).tobytes()

    def panels(x, r):
        return b"".join(panel(x, p, r) for p in range(0, x.shape[1], r))

    return panels(np.asarray(a).T, mr), panels(np.asarray(b), nr)


def _run_gemm_f32(run: _Run, index: int, env, table) -> np.ndarray:
    p = run.p
    kind = view.layer_kind(p, index)
    out = np.empty(view.tensor_shape(p, view.layer_output(p, index)), dtype=_F32)
    g, a, b, a_index, b_index = _gemm_operands(p, index, env, out, 0)
    c = out.reshape(g.batch, g.m, g.n)
    bid = view.layer_const(p, index, "bias")
    bias = env[bid].reshape(-1).astype(_F32, copy=False) if bid is not None else None
    kc = view.gemm_chunk(p, index)
    for t in range(len(table)):
        (b0, m0, n0), (_, m1, n1) = table.lo[t, :3].tolist(), table.hi[t, :3].tolist()
        tm, tn = m1 - m0, n1 - n0
        m = run.machine(index, int(table.pe[t]))
        pa, pb, pc, pbias = _Arena(m, p, index).take(4 * tm * kc, 4 * kc * tn, 4 * tm * tn, 4 * max(tm, tn))
        flags_bias = 0
        if bias is not None:
            if kind == "conv2d":
                oc0 = (b0 % p.layers[index].attrs["groups"]) * g.m
                m.write(pbias, bias[oc0 + m0: oc0 + m1].tobytes())
                flags_bias = 4 | 8
            else:
                m.write(pbias, bias[n0:n1].tobytes())
                flags_bias = 4
        at, bt = a[int(a_index[b0]), m0:m1], b[int(b_index[b0]), :, n0:n1]
        for k0 in range(0, g.k, kc):
            k1 = min(k0 + kc, g.k)
            pan_a, pan_b = gemm_f32_panels(at[:, k0:k1], bt[k0:k1])
            m.write(pa, pan_a)
            m.write(pb, pan_b)
            flags = (1 if k0 == 0 else 0) | ((2 | flags_bias) if k1 == g.k else 0)
            m.run([[pa, pb, pc, pbias, tm, tn, k1 - k0, flags]])
        c[b0, m0:m1, n0:n1] = np.frombuffer(m.read(pc, 4 * tm * tn), dtype=_F32).reshape(tm, tn)
        run.done(index, t, table, m)
    return out


def run_int8_tile(machine: PeMachine, a: np.ndarray, b: np.ndarray, chunk: int, q: np.ndarray,
                  flags: int) -> np.ndarray:
    """Run the ``gemm_i8`` kernel on one tile ``a @ b`` (int8 ``[rows, k]`` by ``[k, cols]``,
    the reduction in chunks of ``chunk``) from a freshly loaded PE with cleared counters, as the
    ``iss`` mode does (:func:`gemm_i8_tile`, its buffers from the PE's free SRAM); returns the
    int32 accumulator ``[rows, cols]``. The machine keeps the run's counters for the caller."""
    rows, k = a.shape
    cols = b.shape[1]
    machine.load(0)
    machine.clear_counters()
    pacc, *_ = gemm_i8_tile(machine, _Arena(machine, None, None), a, b, chunk, 0, k, q, flags)
    return np.frombuffer(machine.read(pacc, 4 * rows * cols), np.int32).reshape(rows, cols)


def gemm_i8_tile(machine: PeMachine, arena, at: np.ndarray, bt: np.ndarray, kc: int, k0: int, k1: int,
                 consts: np.ndarray, flags: int, acc=None, rowsum=None, colsum=None,
                 out_bytes: int = 1) -> tuple[int, int, int, int]:
    """Run the ``gemm_i8`` kernel on one tile as its PE does: ``at`` ``[rows, K]`` and ``bt`` ``[K,
    cols]`` (int8 or uint8, the kernel's operands), reduction ``[k0, k1)`` in jobs of ``kc``
    (``k0 == 0``: the reduction's first chunk), ``consts`` the requantization constants
    (``[zx, K, y_zero, y_min, y_max]`` then 4 per column), ``flags`` bits 1 (requantize after the
    last chunk), 2 and 3 (the operand sums the kernel forms) and 20 (a dequantizing epilogue's
    bias). ``out_bytes``: the bytes of an output element (4: a float32 output). ``acc``, ``rowsum``, ``colsum``: the
    sums a previous part of the reduction handed on (bytes), else zeros. The DMA's part is the
    host's: the operands of chunk ``c + 1`` go into the other half of the double-buffered A and
    B before job ``c`` runs (the job starts that chunk's first MAC-array block when it ends).
    ``arena`` allocates the buffers (:class:`_Arena`, or anything with its ``take``). Returns
    the addresses of the accumulator, the row and column sums, and the int8 output."""
    from ...program.ops.gemm.geometry import int8_block_columns
    tm, tn = at.shape[0], bt.shape[1]
    if tm < 1 or tn < 1:  # the chunk add's loops (pe_i32_add_rows) count down before they test
        raise ValueError(f"int8 GEMM tile {tm}x{tn}: the kernel needs at least one row and one column")
    cb = int8_block_columns(tm, tn, machine.arch)
    if cb >= 1 << 12:  # the job's flags hold it in 12 bits
        raise ValueError(f"int8 GEMM tile {tm}x{tn}: column blocks of {cb} exceed the kernel's 4095")
    nb = -(-tn // cb)
    chunks = [(c0, min(c0 + kc, k1)) for c0 in range(k0, k1, kc)]
    # two alternating scratch blocks, wherever a chunk's sums are not the accumulator's first
    scratch = 2 * 4 * tm * cb if k0 > 0 or len(chunks) > 1 else 0
    table = i8_dsp_table(consts)  # after the consts' five trailing words (the chunks' operand halves)
    pa0, pa1, pb0, pb1, pp, pacc, prs, pcs, pq, py = arena.take(
        tm * kc, tm * kc, kc * tn, kc * tn, scratch, 4 * tm * tn, 4 * tm, 4 * tn, 4 * (len(consts) + 5 + len(table)),
        out_bytes * tm * tn)
    machine.write(pq, np.asarray(consts, dtype=np.int64).astype(np.int32).tobytes())
    machine.write(pq + 4 * (len(consts) + 5), table.astype(np.int32).tobytes())
    machine.write(pacc, acc if acc is not None else bytes(4 * tm * tn))
    machine.write(prs, rowsum if rowsum is not None else bytes(4 * tm))
    machine.write(pcs, colsum if colsum is not None else bytes(4 * tn))
    halves = ((pa0, pb0), (pa1, pb1))

    def place(ci):
        c0, c1 = chunks[ci]
        pa, pb = halves[ci & 1]
        machine.write(pa, np.ascontiguousarray(at[:, c0:c1]).view(np.int8).tobytes())
        machine.write(pb, np.ascontiguousarray(bt[c0:c1]).view(np.int8).tobytes())

    place(0)
    for ci, (c0, c1) in enumerate(chunks):
        more = ci + 1 < len(chunks)
        if more:
            place(ci + 1)
        machine.write(pq + 4 * len(consts), np.array(
            [pa0, pa1, pb0, pb1, chunks[ci + 1][1] - chunks[ci + 1][0] if more else 0], dtype=np.int64
        ).astype(np.uint32).tobytes())
        job_flags = ((1 if c0 == 0 else 0) | (flags & (12 | I8_BIAS_FLAG)) | (flags & 2 if c1 == k1 else 0)
                     | (16 if ci else 0) | (32 if more else 0) | ((ci * nb) & 1) << 6 | (ci & 1) << 7 | cb << 8)
        pa, pb = halves[ci & 1]
        machine.run([[pa, pb, pp, pacc, prs, pcs, pq, py, tm, tn, c1 - c0, job_flags]], mac_in_flight=more)
    return pacc, prs, pcs, py


def _run_gemm_i8(run: _Run, index: int, env, table) -> np.ndarray:
    """int8 ``dense``, ``matmul`` and ``conv2d`` on the MAC array, requantized (half up or
    TFLite's rule) or dequantized (a float32 output: the scale's and the bias's float32 bits as
    the column constants, ``flags`` bit 20 where there is a bias) on the M4F (an ``int32``
    output: the accumulator's sums, no last-chunk epilogue). The
    kernel's operand ``a`` is the activation (zero point ``x_zero``) and ``b`` the operand
    whose zero point and requantization constants go per output column: a ``conv2d`` tile (the
    mapper's ``[oc, pixels]``) runs transposed, ``a`` = its im2col columns ``[pixels, k]`` and
    ``b`` = its weights ``[k, oc]`` (the DMA's layout), and its result is transposed back. The
    sums are integers, each k-chunk's accumulated on the array at the program's chunk length,
    so the bits are the simulator's."""
    from ...program.ops.gemm.reference import _batched_operands, _int8_operands
    p = run.p
    layer = p.layers[index]
    kind = view.layer_kind(p, index)
    attrs = view.layer_attrs(p, index)
    spec = p.tensors[view.layer_output(p, index)]
    out = np.empty(view.tensor_shape(p, view.layer_output(p, index)), dtype=spec.dtype)
    x, rhs, _ = _int8_operands(layer, env)
    fill = np.asarray(attrs["x_zero"]).astype(x.dtype)  # padding holds the zero point
    g, a, b, a_index, b_index = _batched_operands(p, layer, out, x, rhs, fill)
    c = out.reshape(g.batch, g.m, g.n)
    conv = kind == "conv2d"
    channels = attrs["groups"] * g.m if conv else g.n

    def column(role, default=0):
        tid = view.layer_const(p, index, role)
        if tid is None and role == "w_zero" and kind == "matmul":
            return np.broadcast_to(np.int64(attrs.get("b_zero", 0)), (channels,))
        v = env[tid].astype(np.int64).reshape(-1) if tid is not None else np.int64(default)
        return np.broadcast_to(v, (channels,))

    requant = attrs["out"] != "int32"
    bias_flag = 0
    if attrs["out"] == "float32":  # the dequantizing epilogue: the bias's and the scale's float32 bits
        def bits(role):
            tid = view.layer_const(p, index, role)
            v = env[tid] if tid is not None else np.zeros(1, _F32)
            return np.broadcast_to(np.ascontiguousarray(v, dtype=_F32).reshape(-1).view(np.int32).astype(np.int64),
                                   (channels,))
        bias_flag = I8_BIAS_FLAG if view.layer_const(p, index, "bias") is not None else 0
        cols = np.stack([column("w_zero"), bits("bias"), bits("scale"), np.zeros(channels, np.int64)], axis=1)
    else:
        cols = np.stack([column("w_zero"), column("bias_q"), column("multiplier"), column("shift", 1)], axis=1)
    # the zero-point terms need a's row sums where b's zero points are not all 0, and b's column
    # sums where x_zero is not 0: a constant b's (the weights of dense and conv2d) are the
    # compiler's, written with the requantization constants; an activation's the PE's
    row_sums, col_sums = bool(np.any(cols[:, 0] != 0)), int(attrs["x_zero"]) != 0
    const_b = kind != "matmul"
    sum_flags = (4 if row_sums else 0) | (8 if col_sums and not const_b else 0)
    kc = view.gemm_chunk(p, index)
    carry: dict = {}  # region -> the int32 sums a reduction part hands to the next (over the NoC)
    for t in range(len(table)):
        (b0, m0, n0), (_, m1, n1) = table.lo[t, :3].tolist(), table.hi[t, :3].tolist()
        # a region's reduction may be split over PEs (parts innermost, ascending k): each part
        # continues the int32 sums of the one before; the last one finishes
        k0, k1 = (int(table.lo[t, 3]), int(table.hi[t, 3])) if table.lo.shape[1] > 3 else (0, g.k)
        if conv:  # transposed: the kernel's rows are the tile's pixels, its columns the channels
            oc0 = (b0 % attrs["groups"]) * g.m
            at, bt = b[int(b_index[b0]), :, n0:n1].T, a[int(a_index[b0]), m0:m1].T
            ch = slice(oc0 + m0, oc0 + m1)
        else:
            at, bt = a[int(a_index[b0]), m0:m1], b[int(b_index[b0]), :, n0:n1]
            ch = slice(n0, n1)
        tm, tn = at.shape[0], bt.shape[1]
        head = np.array([attrs["x_zero"], g.k, attrs.get("y_zero", 0), attrs.get("y_min", 0), attrs.get("y_max", 0)],
                        dtype=np.int64)
        m = run.machine(index, int(table.pe[t]))
        key = (b0, m0, m1, n0, n1)
        if k0 > 0:
            acc0, rs, cs = carry.pop(key)
        else:  # sums the kernel does not form are zero, or the constant operand's
            acc0, rs = None, bytes(4 * tm)
            cs = (bt.astype(np.int64).sum(axis=0) if col_sums and const_b else np.zeros(tn, np.int64))
            cs = cs.astype(np.int32).tobytes()
        pacc, prs, pcs, py = gemm_i8_tile(
            m, _Arena(m, p, index), at, bt, kc, k0, k1, np.concatenate([head, cols[ch].reshape(-1)]),
            flags=(2 if k1 == g.k and requant else 0) | sum_flags | bias_flag, acc=acc0, rowsum=rs, colsum=cs,
            out_bytes=out.itemsize if requant else 1)  # an int32 output is the accumulator
        if k1 < g.k:
            carry[key] = (m.read(pacc, 4 * tm * tn), m.read(prs, 4 * tm), m.read(pcs, 4 * tn))
        else:  # an int32 output is the accumulator itself (no zero points: the checks')
            y = (np.frombuffer(m.read(py, out.itemsize * tm * tn), dtype=out.dtype) if requant
                 else np.frombuffer(m.read(pacc, 4 * tm * tn), dtype=np.int32)).reshape(tm, tn)
            c[b0, m0:m1, n0:n1] = y.T if conv else y
        run.done(index, t, table, m)
    return out


def gemm_f32_job_cycles(shapes, arch) -> dict:
    """``(m, n, k) -> executed cycles`` of one job of the fp32 GEMM kernel (its first and last
    chunk) on each tile shape of ``shapes``, run in the ARM emulator (the ``iss`` mode's machine)
    on seeded random panels: the counted reference the fp32 tile costs are checked against."""
    from ..cycles import executed_cycles
    from ..images import role_image

    image = role_image(("gemm_f32", False))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rng, out = np.random.default_rng(0), {}
    for m, n, k in shapes:
        a, b = rng.standard_normal(m * k).astype(np.float32), rng.standard_normal(k * n).astype(np.float32)
        pa = machine.arena
        pb, pc = pa + a.nbytes, pa + a.nbytes + b.nbytes
        pan_a, pan_b = gemm_f32_panels(a.reshape(m, k), b.reshape(k, n))
        machine.write(pa, pan_a)
        machine.write(pb, pan_b)
        machine.clear_counters()
        machine.run([[pa, pb, pc, pc + 4 * m * n, m, n, k, 3]])
        out[(m, n, k)] = executed_cycles(machine)[0]
    return out


def int8_seeded_operands(rows: int, cols: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random int8 operands of one tile, ``a`` ``[rows, k]`` and ``b`` ``[k, cols]`` (uniform over
    -128..127, drawn from ``rng`` in that order): what the kernel's direct runs multiply."""
    a = rng.integers(-128, 128, (rows, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, cols)).astype(np.int8)
    return a, b


def int8_dsp_consts(k: int, cols: int, col_zero: bool = True) -> np.ndarray:
    """The ``gemm_i8`` kernel's constants for a direct run: an activation zero point of 3, ``k``,
    the output's zero point 0 and range -128..127, then per column the DSP path's one-rounding
    constants (weight zero point 1 where ``col_zero``, else 0; bias 100; multiplier 2**30;
    shift 40). The weight zero point selects the epilogue's row loop (with or without its MLS
    and the row sum's load), so it follows the case's :class:`Int8Side`."""
    return np.concatenate([[3, k, 0, -128, 127], np.tile([int(bool(col_zero)), 100, 1 << 30, 40], cols)])


def int8_array_cycles(rows: int, cols: int, k: int, chunk: int, arch) -> int:
    """The MAC array's busy cycles on one ``rows x cols`` tile of reduction ``k`` in chunks of
    ``chunk``: per column block (:func:`~tvm_spinn.program.ops.gemm.geometry.int8_block_columns`)
    its passes, each ``k`` products plus a readout per chunk."""
    from ...program.ops.gemm.geometry import int8_block_columns, mac_passes, splits_of
    cb = int(int8_block_columns(rows, cols, arch))
    passes = sum(int(mac_passes(rows, min(cb, cols - j), arch)) for j in range(0, cols, cb))
    return passes * (k + int(splits_of(k, chunk)) * int(arch.mac_readout_cycles))


#: the phases :func:`int8_tile_phases` splits a tile's executed cycles into
INT8_PHASES = ("job loop", "MAC driver", "kernel fixed", "operand sums", "chunk adds", "epilogue", "waits")

#: the image's routines by the phase their executed blocks count in (``pe_kernel``'s blocks are
#: split between "kernel fixed" and "chunk adds" by a one-chunk run)
INT8_PHASE_OWNERS = {"_start": "job loop", "pe_halt": "job loop", "pe_mac_start": "MAC driver",
                     "pe_mac_wait": "MAC driver", "pe_mac_wait_next": "MAC driver",
                     "pe_i32_add_rows": "chunk adds", "memset": "kernel fixed", "pe_kernel": None}


def int8_tile_phases(spec: tuple, rows: int, cols: int, k: int, chunk: int, arch, side=None,
                     seed: int = 0) -> dict:
    """Where the executed cycles of one int8 GEMM tile go: the ``gemm_i8`` kernel of image
    ``spec`` run on a ``rows x cols`` tile with reduction ``k`` in chunks of ``chunk`` (seeded
    random operands, :func:`int8_seeded_operands`; the constants of a DSP-path column,
    :func:`int8_dsp_consts`, with a weight zero point where ``side.col_zero``), ``side`` the
    case's :class:`~tvm_spinn.program.ops.gemm.geometry.Int8Side` (default: a requantized int8
    output without zero points; ``row_sums``, ``col_sums``: the kernel forms the operands' sums;
    ``int32_out``: no epilogue, the int32 accumulator is the output; float32 outputs, TFLite's
    rounding and narrow ranges are not run here), its executed basic blocks priced by the TRM's
    cycle table (:func:`~tvm_spinn.pe.cycles.block_price`). The tile runs four times, each
    run leaving one more part out, and each part is the difference of the M4F's cycles (the
    waits on the array not counted) between two runs: the ``epilogue`` (the run with it less
    the same run without it), the ``operand sums`` (likewise), and in the run with neither,
    each executed block by its routine (:data:`INT8_PHASE_OWNERS`): the runtime's ``job loop``
    (``_start``, ``pe_halt``), the ``MAC driver`` (``pe_mac_start``, ``pe_mac_wait``,
    ``pe_mac_wait_next``), the ``chunk adds`` (the runtime's ``pe_i32_add_rows`` and the
    kernel's blocks that a one-chunk run of the same tile does not execute: the 32-bit adds of
    the chunks' sums and the next chunk's start) and the ``kernel fixed`` rest (each job's entry
    and exit, the column-block loop); a block of any other routine raises ValueError. ``waits``:
    the cycles the M4F stalls on the array in the full run. Returns ``{phase: cycles}``
    (:data:`INT8_PHASES`) plus ``executed`` (their sum: the full run's executed cycles),
    ``array`` (the array's busy cycles, :func:`int8_array_cycles`) and ``mac_runs``."""
    from ...program.ops.gemm.geometry import Int8Side
    from ..cycles import block_price
    from ..images import role_image
    from ..iss import image_symbols

    side = side if side is not None else Int8Side(gemv=spec[-1] == "gemv")
    if side.fp32_out or side.tflite or side.narrow:
        raise ValueError(f"int8_tile_phases: {side} (float32 outputs, TFLite's rounding and narrow ranges "
                         f"are not run here)")
    image = role_image(spec)
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    starts = sorted((addr & ~1, name) for name, addr in image_symbols(image.elf).items())
    a, b = int8_seeded_operands(rows, cols, k, np.random.default_rng(seed))
    q = int8_dsp_consts(k, cols, side.col_zero)

    def owner(address):
        name = None
        for start, sym in starts:
            if start > address:
                break
            name = sym
        if name not in INT8_PHASE_OWNERS:
            raise ValueError(f"int8_tile_phases: an executed block at {address:#x} in {name!r}, "
                             f"a routine no phase owns (INT8_PHASE_OWNERS)")
        return name

    def run(flags, kk=k):
        """``({block: cycles}, stall, MAC runs)`` of the tile (the first ``kk`` products)."""
        machine.load(0)
        machine.clear_counters()
        machine.mac_calls = 0
        gemm_i8_tile(machine, _Arena(machine, None, None), a[:, :kk], b[:kk], chunk, 0, kk,
                     np.concatenate([q[:1], [kk], q[2:]]), flags)
        priced = {}
        for key, count in machine.blocks.items():
            cycles, extra = block_price(machine, *key)
            priced[key] = cycles * count + extra * machine.taken.get(key, 0)
        return priced, machine.stall, machine.mac_calls

    sums = (4 if side.row_sums else 0) | (8 if side.col_sums else 0)
    full, stall, runs = run(sums | (0 if side.int32_out else 2))
    no_epilogue = run(sums)[0]
    bare = run(0)[0]
    one_chunk = set(run(0, min(k, chunk))[0])
    out = dict.fromkeys(INT8_PHASES, 0)
    out["epilogue"] = sum(full.values()) - sum(no_epilogue.values())
    out["operand sums"] = sum(no_epilogue.values()) - sum(bare.values())
    for key, cycles in bare.items():
        phase = INT8_PHASE_OWNERS[owner(key[0])]
        if phase is None:  # the kernel's own blocks
            phase = "kernel fixed" if key in one_chunk else "chunk adds"
        out[phase] += cycles
    out["waits"] = int(-(-stall // 1))
    out["executed"] = sum(out[p] for p in INT8_PHASES)
    out["array"] = int8_array_cycles(rows, cols, k, chunk, arch)
    out["mac_runs"] = runs
    return out
