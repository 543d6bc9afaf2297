"""``iss`` execution of a spinn program: every layer's tiles run as generated machine code on
their PEs in the instruction-set simulator (:mod:`.iss`).

Per layer, the role's image runs on each PE the mapper placed a tile on. The host stands in for
the DMA: it places a tile's operands in the PE's SRAM (after the image, :data:`ARENA`), runs the
tile's jobs (element-wise tiles in SRAM-sized pieces; GEMM tiles one reduction chunk per job, the
accumulator staying in SRAM between them) and reads the results back. Data layout (the
im2col gather of a convolution, broadcasting) is the DMA's and is done on the host; every
arithmetic operation is executed code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import view
from .cycles import executed_cycles
from .errors import PeCodegenError
from .images import build_images
from .iss import PeMachine
from .kernels import I8_BIAS_FLAG
from .memory_map import ARENA_END, DMA_DESC_WORDS, DMA_SCATTER
from ..program.ops.gemm.geometry import M4F_BLOCK

__all__ = ["TileRun", "gemm_f32_panels", "gemm_i8_tile", "run_int8_tile", "run_program_iss"]

_F32 = np.float32


@dataclass
class TileRun:
    """One tile as executed: layer, tile index, PE, executed instructions per class and their
    cycles (:mod:`.cycles`, the waits on peripherals included), the timing model's cycles for
    the tile, and the cycles of ``cycles`` the M4F waited on the MAC array or the exp/log unit
    (recorded for tiles run in one piece; 0 where not)."""

    layer: int
    tile: int
    pe: int
    modelled: float
    cycles: int = 0
    classes: dict = field(default_factory=dict)
    waited: float = 0.0


def _align(n: int, a: int = 64) -> int:
    return -(-n // a) * a


class _Arena:
    """Bump allocation of tile buffers in a PE's SRAM between the image and the job block."""

    def __init__(self, machine: PeMachine, program, index: int):
        self.m, self.base, self.p, self.i = machine, machine.arena, program, index

    def take(self, *sizes: int) -> list[int]:
        out, pos = [], self.base
        for size in sizes:
            out.append(pos)
            pos += _align(max(int(size), 4))
        if pos > ARENA_END:
            need = f"a tile needs {pos - self.base} bytes of SRAM, the PE has {ARENA_END - self.base} after its image"
            if self.p is None:
                raise ValueError(need)
            raise PeCodegenError(view.layer_name(self.p, self.i), view.layer_kind(self.p, self.i), need)
        return out


class _Run:
    def __init__(self, program, images, record):
        self.p, self.images, self.record = program, images, record
        self.machines: dict = {}
        self.acc_bits = view.arch_of(program).acc_bits

    def machine(self, index: int, pe: int) -> PeMachine:
        """The machine of layer ``index``'s role, booted as PE ``pe`` (one emulator per role,
        reloaded for each tile: the PEs of a role run the same image on their own data)."""
        name = self.images.layers[index]
        if name not in self.machines:
            self.machines[name] = PeMachine(self.images.images[name].elf, name, pe, self.acc_bits,
                                            view.arch_of(self.p))
        m = self.machines[name]
        m.load(pe)
        m.clear_counters()
        return m

    def done(self, index: int, t: int, table, m: PeMachine) -> None:
        if self.record is not None:
            cycles, classes = executed_cycles(m)
            self.record.append(TileRun(index, t, int(table.pe[t]), float(table.cycles[t]), cycles, classes, m.stall))


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


def _gemm_operands(p, index: int, env, out, fill):
    """The GEMM operands as the DMA lays them out (``a`` [.., m, k], ``b`` [.., k, n] and the
    per-batch operand indices), the simulator's layout (conv2d: im2col)."""
    from ..program.ops.gemm.reference import _batched_operands
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
    from ..program.ops.gemm.geometry import int8_block_columns
    tm, tn = at.shape[0], bt.shape[1]
    cb = int8_block_columns(tm, tn, machine.arch)
    if cb >= 1 << 12:  # the job's flags hold it in 12 bits
        raise ValueError(f"int8 GEMM tile {tm}x{tn}: column blocks of {cb} exceed the kernel's 4095")
    nb = -(-tn // cb)
    chunks = [(c0, min(c0 + kc, k1)) for c0 in range(k0, k1, kc)]
    # two alternating scratch blocks, wherever a chunk's sums are not the accumulator's first
    scratch = 2 * 4 * tm * cb if k0 > 0 or len(chunks) > 1 else 0
    pa0, pa1, pb0, pb1, pp, pacc, prs, pcs, pq, py = arena.take(
        tm * kc, tm * kc, kc * tn, kc * tn, scratch, 4 * tm * tn, 4 * tm, 4 * tn, 4 * (len(consts) + 5), out_bytes * tm * tn)
    machine.write(pq, np.asarray(consts, dtype=np.int64).astype(np.int32).tobytes())
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
    from ..program.ops.gemm.reference import _batched_operands, _int8_operands
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
    from ..program.ops.movement import dma_descriptors, scatter_range, scatter_targets, strided_source
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
    from ..program.quant import QUANT_RANGES
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


def _tally(entry: list, m) -> None:
    """Add the machine's executed cycles and instruction classes to a tile's ``[cycles, classes]``."""
    cycles, classes = executed_cycles(m)
    entry[0] += cycles
    for key, v in classes.items():
        entry[1][key] = entry[1].get(key, 0) + v


def _record_runs(run, index: int, table, runs: list) -> None:
    """One :class:`TileRun` per tile of layer ``index`` where the run records them."""
    if run.record is not None:
        for t in range(len(table)):
            run.record.append(TileRun(index, t, int(table.pe[t]), float(table.cycles[t]), runs[t][0],
                                      dict(sorted(runs[t][1].items()))))


def _run_softmax_tflite(run: _Run, index: int, env, table) -> np.ndarray:
    """TFLite's integer softmax: per group of rows, each phase over the rows' chunks in column
    order, the int32 statistics (max, sum) chained and sent back as :func:`_run_rows` does."""
    from ..program.quant import QUANT_RANGES
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
    from ..program.ops.base import working_budget
    from ..program.ops.loss import STREAM_CHUNK, _row_bytes
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


def _run_pool_grad(run: _Run, index: int, env, table) -> np.ndarray:
    """``max_pool2d_backward``: per tile (a run of the flattened input gradient), its jobs
    (:func:`~tvm_spinn.program.ops.pool.pool_grad_jobs`: per plane and SRAM-sized band of rows):
    the DMA brings the padded input rows under the band's windows (the lowest float32 in the
    padding) and those windows' output gradients; the PE finds each window's argmax and adds its
    gradient to the element it takes where that element is one of the job's."""
    from ..program.ops.base import working_budget
    from ..program.ops.pool import pool_grad_jobs
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


def _run_xent_grad(run: _Run, index: int, env, table) -> np.ndarray:
    """``cross_entropy_backward``: per tile (runs of whole rows of the gradient), groups of
    whole rows that fit the working SRAM (:func:`~tvm_spinn.program.ops.loss.resident_rows`)
    run the kernel's phases 0 (the max), 1 (the exps and their sum) and 2 (the output) as one
    job list. A row longer than that streams through its
    PE in chunks of :data:`~tvm_spinn.program.ops.loss.STREAM_CHUNK` logits, the chunks in the
    row's order, the statistics staying in the PE's SRAM: phase 0 over every chunk, phase 1
    over every chunk, then per chunk phase 3 (its exps again: the same bits) and phase 2. Every
    label is checked first, as the default simulator does."""
    from ..program.ops.loss import STREAM_CHUNK, resident_rows
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
