"""GEMM tile geometry and cost: the GEMM view of a layer, reduction chunks, MAC-array passes,
cycles of a tile and the tile chooser (see :mod:`tvm_spinn.program.ops.gemm`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
import numpy as np

from ...checks import PAD4, POS2, POSINT, ZERO, check_bool, check_str
from ...model import Layer
from ...noc import noc_port_cycles
from ..m4f import Mix, mix_cycles
from ..base import ACC_BYTES, MappingError, ceil_div, gemm_tile_bytes, itemsize, working_budget

if TYPE_CHECKING:
    from ....target.arch import SpinnArch


GEMM_KINDS = ("conv2d", "dense", "matmul")
_F32 = np.float32
_QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
_REQUANT = {"y_zero": ZERO, "y_min": ZERO, "y_max": ZERO}
_CONV = {"strides": POS2, "padding": PAD4, "dilation": POS2, "groups": POSINT}
_INT8 = {"x_zero": ZERO, "x_flip": check_bool, "relu": check_bool,
         "out": lambda v, f: check_str(v, f, ("float32", "int8", "uint8", "int32"))}


@dataclass(frozen=True)
class GemmShape:
    batch: int
    m: int
    n: int
    k: int


def gemm_shape(program, layer: Layer) -> GemmShape:
    """GEMM view of a conv2d / dense / matmul layer of ``program`` (see the module docstring)."""
    t = program.tensors
    out = t[layer.output].shape
    if layer.kind == "conv2d":
        w = t[layer.consts["weight"]].shape
        groups = layer.attrs["groups"]
        return GemmShape(batch=out[0] * groups, m=w[0] // groups, n=out[2] * out[3], k=w[1] * w[2] * w[3])
    if layer.kind == "dense":
        w = t[layer.consts["weight"]].shape
        return GemmShape(batch=1, m=int(np.prod(out[:-1], dtype=np.int64)), n=w[1], k=w[0])
    a, b = t[layer.inputs[0]].shape, t[layer.inputs[1]].shape
    batch = int(np.prod(out[:-2], dtype=np.int64)) if len(out) > 2 else 1
    # the rows computed are the output's: equal to ``a``'s in a program as written, fewer in a
    # chip's shard whose rows are split over a sequence-parallel group while ``a`` is read
    # whole (a replicated operand is sliced for free: the chip reads only its rows of it)
    m = out[-2] if len(out) >= 2 else a[-2]
    return GemmShape(batch=batch, m=m, n=b[-1], k=a[-1])


def safe_k_chunk(arch, operand_bits: int = 8) -> int:
    """Longest reduction a MAC-array accumulator can take without overflowing.

    Each product of two signed ``operand_bits`` values is at most ``2**(2*(bits-1))`` in
    magnitude (-128 * -128 for int8), so ``k`` products fit a signed ``acc_bits`` accumulator when
    ``k * 2**(2*(bits-1)) <= 2**(acc_bits-1) - 1``: 511 for int8 into the production chip's 24
    bits, 16383 into the test chip's 29. Longer reductions are split into chunks whose partial
    sums the M4F adds in 32-bit.

    ``arch`` is a :class:`tvm_spinn.target.arch.SpinnArch` (only ``acc_bits`` is read).
    """
    return max(1, (2 ** (arch.acc_bits - 1) - 1) // 2 ** (2 * (operand_bits - 1)))


def splits_of(k: int, tk: int) -> int:
    """Reduction chunks of a GEMM tile with reduction ``k`` and tile depth ``tk``."""
    return -(-k // min(int(tk), k)) if k else 1


def chunk_length(k: int, tk: int) -> int:
    """Products per chunk, ``ceil(k / splits)``: what one accumulator takes (same for every
    chunk but possibly the last)."""
    return -(-k // splits_of(k, tk)) if k else 1


# -- costs ----------------------------------------------------------------------------------------
def _weight_is_a(kind: str) -> bool:
    """conv2d keeps weights in the A operand (rows = output channels); dense in B."""
    return kind == "conv2d"


def _operand_elems(kind: str, mode: str, elem_bytes) -> tuple[int, int, int, int]:
    """``(a, b, activation, output)`` element bytes; ``elem_bytes`` is ``(activation, weight,
    output)`` (matmul: lhs, rhs, output) or None for the mode's default (fp32: 4, 4, 4; int8:
    1, 1, 4)."""
    if elem_bytes is None:
        elem_bytes = (1, 1, ACC_BYTES) if mode == "int8" else (4, 4, 4)
    x, w, out = (int(v) for v in elem_bytes)
    a, b = (w, x) if _weight_is_a(kind) else (x, w)
    return a, b, x, out


@dataclass(frozen=True)
class Int8Side:
    """The M4F's share of an int8 GEMM tile (run by the PE kernel after each of the MAC array's
    reduction chunks, :mod:`tvm_spinn.pe.kernels` ``gemm_i8``).

    ``fp32_out``: dequantizing epilogue (``fl(acc) * scale [+ bias]``) on the M4F, else the
    requantization to int8/uint8; ``int32_out``: the raw int32 sums are the output (no
    epilogue, no zero points); ``row_sums`` / ``col_sums``: ``sum_k`` of the A rows / B
    columns is needed at run time (that operand is an activation and the other operand has a
    nonzero zero point; a constant operand's sums are the compiler's); ``epilogue``: the tile
    finishes its outputs (False for a part of a reduction split over PEs, whose reducing part
    does); ``transposed``: the kernel's rows are the tile's columns (``conv2d``: the kernel runs
    pixels x output channels); ``relu``, ``bias``: the dequantizing epilogue's ReLU and bias
    (each a variant of its code, :data:`I8_DEQUANT_CODE`); ``tflite``: TFLite's requantization
    (:data:`I8_TFLITE_CODE`) instead of the one-rounding one (:data:`I8_REQUANT_CODE`);
    ``col_zero``: the kernel's columns have a zero point (the weight's; a matmul's right-hand
    side's), so the requantization subtracts its product with the row sums per output;
    ``narrow``: the requantization's clamp is narrower than the output type's 256 values (a ReLU
    at the zero point, a clip), one compare more per output (the requantizations' variants);
    ``gemv``: the layer's tiles have one row and run the requantization's one-row kernel
    (:func:`int8_gemv`, :data:`I8_REQUANT_GEMV`, :data:`I8_TFLITE_GEMV`).
    """

    fp32_out: bool = False
    int32_out: bool = False
    row_sums: bool = False
    col_sums: bool = False
    epilogue: bool = True
    transposed: bool = False
    relu: bool = False
    bias: bool = False
    tflite: bool = False
    col_zero: bool = False
    narrow: bool = False
    gemv: bool = False


def int8_side(program, layer: Layer) -> Int8Side:
    """What the M4F does for an int8 GEMM layer besides adding k-chunk partial sums."""
    dtype = program.tensors[layer.output].dtype
    fp32_out, int32_out = dtype == "float32", dtype == "int32"
    a = layer.attrs
    w_zero = "w_zero" in layer.consts
    requant = not fp32_out and not int32_out
    finish = dict(relu=fp32_out and bool(a.get("relu")), bias=fp32_out and "bias" in layer.consts,
                  tflite=requant and a.get("rounding") == "tflite",
                  col_zero=requant and (w_zero if layer.kind != "matmul" else a.get("b_zero", 0) != 0),
                  narrow=requant and a.get("y_max", 127) - a.get("y_min", -128) != 255)
    finish["gemv"] = int8_gemv(program, layer)
    if layer.kind == "conv2d":  # A = weight, B = im2col(x): x sums needed when zw != 0
        return Int8Side(fp32_out, int32_out, False, w_zero, transposed=True, **finish)
    if layer.kind == "dense":  # A = x, B = weight
        return Int8Side(fp32_out, int32_out, w_zero, False, **finish)
    return Int8Side(fp32_out, int32_out, a.get("b_zero", 0) != 0, a.get("x_zero", 0) != 0, **finish)


def int8_gemv(program, layer: Layer) -> bool:
    """Whether int8 GEMM ``layer`` runs a one-row kernel of its requantization (PE kernel
    ``("gemm_i8", "gemv")``, or ``("gemm_i8", "tflite_gemv")`` for TFLite's): an int8 or uint8
    output with either rounding and one row in every tile the kernel runs (the layer's rows, or
    a ``conv2d``'s output pixels, which its transposed tiles put on the kernel's rows, are one:
    a matrix-vector product)."""
    out = program.tensors[layer.output]
    rounding = layer.attrs.get("rounding", "half_up")
    if out.dtype not in _QRANGE or rounding not in ("half_up", "tflite"):
        return False
    shape = tuple(out.shape)  # the rows of :func:`gemm_shape` (a conv2d's pixels), from the output
    if layer.kind == "conv2d":
        return shape[2] * shape[3] == 1
    return (int(np.prod(shape[:-1], dtype=np.int64)) if layer.kind == "dense" else shape[-2]) == 1


def mac_passes(vm, vn, arch: "SpinnArch"):
    """Output blocks the MAC array computes for a ``vm x vn`` tile: the array's ``mac_rows x
    mac_cols`` (16 x 4) outputs hold either operand on either side, so the tile is cut the way
    that pads least (a batch-1 GEMV puts its one row on the 4-wide side: 1 of 4 array lanes
    used, where the 16-wide side would use 1 of 16). Timing only: the bits of an int8 GEMM do
    not depend on the order its sums are formed in. ``vm``, ``vn`` may be int64 arrays."""
    r, c = arch.mac_rows, arch.mac_cols
    return np.minimum(ceil_div(vm, r) * ceil_div(vn, c), ceil_div(vm, c) * ceil_div(vn, r))


#: The fp32 GEMM kernel's register block (:mod:`tvm_spinn.pe.kernels`): ``4 x 4`` accumulators
#: (16 of the M4F's 32 single-precision registers, 8 more for one k's operands).
M4F_BLOCK = (4, 4)

#: The fp32 GEMM kernel's work as the generated code executes it, one :class:`~..m4f.Mix` per
#: unit (instruction classes counted in the executed basic blocks of ``gemm_f32``, a first and
#: last chunk without bias, each unit the difference of two tile shapes run directly: one more
#: trip, block, row or output). A full block's reduction loop, per trip of 4 k steps
#: (:data:`F32_TRIP`): 32 operand loads (the 8 of a step issued as pairs and runs of four, whose
#: followers pipeline), 64 VMUL and 64 VADD (the unfused VMLA's two roundings at 2 cycles where
#: VMLA takes 3), the two panel pointers' increment, the trip count's decrement and the taken
#: branch; the remainder steps of a chunk whose length is not a multiple of 4, per step
#: (:data:`F32_REM`, over the longest remainder, 3 steps, the loop's entry included); per block
#: its accumulators started (zeros, or the partial sums loaded) and stored through the bias and
#: ReLU tests (:data:`F32_BLOCK`), per row of blocks (:data:`F32_ROW`) and once per job with
#: blocks (:data:`F32_NEST`). The ``4 x 1`` blocks right of them (their loop unrolled by 4 by
#: LLVM): per k step 4 + 1 loads, 4 VMUL + VADD (:data:`F32_EDGE_STEP`), per block, row of
#: blocks and job (:data:`F32_EDGE`, :data:`F32_EDGE_ROW`, :data:`F32_EDGE_NEST`). The rows
#: below the blocks: ``1 x 4`` blocks, per k step 1 + 4 loads, 4 VMUL + VADD
#: (:data:`F32_TAIL_STEP`) and per block (:data:`F32_TAIL`); the outputs right of those one at a
#: time, per k step (:data:`F32_ONE_STEP`) and per output (:data:`F32_ONE`); per row and job
#: (:data:`F32_ONE_ROW`, :data:`F32_ONE_NEST`). Per job the runtime's job loop, the kernel's
#: entry, its arguments and return (:data:`F32_JOB`: a job of no outputs).
F32_TRIP = Mix(loads=11.0, paired=21.0, fpu=128.0, alu=4.0, branches=1.0)
F32_REM = Mix(loads=13 / 3, paired=6.0, fpu=32.0, alu=13 / 3, branches=1 / 3)
F32_BLOCK = Mix(loads=12.0, paired=15.0, fpu=16.0, alu=17.0, branches=4.0)
F32_ROW = Mix(loads=10.0, paired=7.0, alu=23.0, mla=1.0)
F32_NEST = Mix(loads=5.0, paired=5.0, alu=10.0, branches=2.0)
F32_EDGE_STEP = Mix(loads=3.5, paired=1.5, fpu=8.0, alu=1.0, branches=0.25)
F32_EDGE = Mix(loads=7.0, paired=5.0, fpu=4.0, alu=16.0, branches=1.0)
F32_EDGE_ROW = Mix(loads=14.0, paired=10.0, alu=21.0, mla=1.0, branches=3.0)
F32_EDGE_NEST = Mix(loads=20.0, paired=8.0, alu=28.0, branches=2.0)
F32_TAIL_STEP = Mix(loads=3.5, paired=1.5, fpu=8.0, alu=1.0, branches=0.25)
F32_TAIL = Mix(loads=8.0, paired=3.0, fpu=4.0, alu=17.0, branches=4.0)
F32_ONE_STEP = Mix(loads=0.5, paired=1.5, fpu=2.0, alu=1.0, branches=0.25)
F32_ONE = Mix(loads=4.0, paired=3.0, fpu=1.0, alu=13.0, branches=2.0)
F32_ONE_ROW = Mix(loads=12.0, paired=14.0, alu=18.0, branches=1.0)
F32_ONE_NEST = Mix(loads=20.0, paired=6.0, alu=29.0, mla=1.0, branches=1.0)
F32_JOB = Mix(loads=21.0, paired=56.0, fpu=1.0, alu=25.0, branches=3.0)
#: k steps per trip of the full blocks' unrolled reduction loop (the kernel's ``_KU``)
F32_UNROLL = 4


def fp32_tile_cycles(vm, vn, k, k_splits, arch: "SpinnArch"):
    """M4F cycles of a ``vm x vn`` fp32 GEMM tile with reduction ``k`` in ``k_splits`` jobs (chunks
    of ``ceil(k / k_splits)``, the last one shorter), as the PE kernel runs it: its full
    :data:`M4F_BLOCK` blocks, the ``4 x 1`` blocks right of them, the ``1 x 4`` blocks below them
    and the outputs right of those one at a time, each priced by the instructions the generated code executes (the ``F32_*``
    mixes). ``vm``, ``vn`` may be int64 arrays."""
    mr, nr = M4F_BLOCK
    bm, bn = vm // mr, vn // nr
    wn, wm = vn - bn * nr, vm - bm * mr
    full, edge, tail, alone = bm * bn, bm * wn, wm * bn, wm * wn

    def c(mix):
        return mix_cycles(mix, arch)

    def job(kc):
        steps = (kc // F32_UNROLL) * c(F32_TRIP) + (kc % F32_UNROLL) * c(F32_REM)
        return (c(F32_JOB)
                + (full > 0) * (c(F32_NEST) + bm * c(F32_ROW)) + full * (c(F32_BLOCK) + steps)
                + (edge > 0) * (c(F32_EDGE_NEST) + bm * c(F32_EDGE_ROW)) + edge * (c(F32_EDGE) + kc * c(F32_EDGE_STEP))
                + (wm * vn > 0) * (c(F32_ONE_NEST) + wm * c(F32_ONE_ROW)) + tail * (c(F32_TAIL) + kc * c(F32_TAIL_STEP))
                + alone * (c(F32_ONE) + kc * c(F32_ONE_STEP)))

    chunk = -(-k // k_splits)
    return (k_splits - 1) * job(chunk) + job(k - (k_splits - 1) * chunk)


#: The int8 GEMM kernel's M4F work as the generated code executes it, one :class:`~..m4f.Mix`
#: per unit (instruction classes counted in the executed basic blocks of ``gemm_i8``, tile shapes
#: run directly; the split of loads and stores into pipelined and not is the one that gives the
#: measured cycles): an operand's sums, per element (LDRSB + ADD, unrolled by 4 with one SUBS,
#: CMP and BNE per 4 elements) and per row (the running sum loaded or started at 0, stored, the
#: loop set-up); the 32-bit add of a chunk's array sums (:func:`int8_acc_cycles`); the epilogues (the requantizations
#: and the dequantizing epilogue: :class:`Int8Epilogue`). The software pipeline's own work: per job the
#: kernel's entry (its 12 arguments, the flags' tests, the block count), the first block's
#: start (where the job before did not start it; the driver's 9 register writes), the last
#: block's wait (after a chunk's last block, the next chunk's first start from the addresses
#: that follow the column constants) and the exit (:data:`I8_JOB`: the counted mix of a
#: one-block job less one :data:`I8_BLOCK` and ``m4f_job_cycles``' share in proportion); per
#: column block (the job's one block included: :data:`I8_JOB` leaves it out) the block loop's
#: control and the next block's start, one driver call that waits for the array and then
#: writes the four registers that change from block to block (:data:`I8_BLOCK`, counted as the
#: difference of a two-block and a one-block job, less :data:`I8_RESTART`: the driver's writes
#: after the wait, the only instructions the array idles for).
I8_SUM = Mix(loads=1.0, alu=1.5, branches=0.25)
I8_SUM_ROW = Mix(loads=2.0, paired=1.0, alu=8.0, branches=1.5)
#: The chunk add (the runtime's ``pe_i32_add_rows``, hand-written: the counts are its listing's),
#: per output of a row's steps of 4: two LDM and one STM of four words (1 + 4 cycles each, TRM
#: table 3-1, one load and three pipelined), four ADDs, the step's SUBS and BNE
I8_ACC = Mix(loads=0.75, paired=2.25, alu=1.25, branches=0.25)
#: per row of a column block: the step count set, the next row's address, the row loop's SUBS
#: and BNE, less the last step's BNE not taken (one cycle instead of two)
I8_ACC_ROW = Mix(alu=2.0, branches=1.0)
#: per row of a block whose width is not a multiple of 4: the width's split and the remainder's
#: entry (LSRS, BEQ, AND) in place of the step count's MOV, less the last word's BNE not taken;
#: per remaining word (:data:`I8_ACC_WORD`) two loads (the second pipelined), ADD, a store, SUBS
#: and BNE
I8_ACC_REM_ROW = Mix(alu=1.0)
I8_ACC_WORD = Mix(loads=2.0, paired=1.0, alu=2.0, branches=1.0)
#: per row of a block of fewer than 4 columns: no step runs, so the BEQ to the remainder is
#: taken (a branch in place of the one cycle :data:`I8_ACC_REM_ROW` counts) and the credit
#: :data:`I8_ACC_ROW` takes for a last step's BNE not taken does not apply: 2 cycles
I8_ACC_NARROW_ROW = Mix(branches=1.0)
#: per column block, the kernel's call site: the scratch half's address from the block's parity,
#: the accumulator's column address, the fifth argument stored, BL
I8_ACC_SITE = Mix(loads=4.0, paired=3.0, alu=8.0, branches=1.0)
#: per call, the routine's entry and exit: the fifth argument's load, PUSH and POP (with PC) of
#: nine registers, the row skip's SUB and LSL, the width's ANDS and its branch, the return
#: value's MOVS, the last row's BNE not taken
I8_ACC_ENTRY = Mix(loads=3.0, paired=16.0, alu=5.0, branches=1.0)
#: per column block: the call site and the routine's entry and exit
I8_ACC_CALL = Mix(**{f: getattr(I8_ACC_SITE, f) + getattr(I8_ACC_ENTRY, f) for f in vars(I8_ACC_SITE)})


def int8_acc_cycles(rows, w, arch: "SpinnArch"):
    """M4F cycles of one column block's chunk add (``rows x w`` outputs: the MAC array's sums of
    a later chunk added in 32-bit to the accumulator's columns) as the runtime's
    ``pe_i32_add_rows`` executes it: :data:`I8_ACC_CALL`, and per row :data:`I8_ACC_ROW`, the
    steps of 4 outputs (:data:`I8_ACC` each output) and, for a width not a multiple of 4,
    :data:`I8_ACC_REM_ROW` and the remaining words (:data:`I8_ACC_WORD`), and for a width under
    4, :data:`I8_ACC_NARROW_ROW`. ``rows``, ``w`` (``w >= 1``) may be int64 arrays."""
    rest = w % 4
    row = (mix_cycles(I8_ACC_ROW, arch) + (w - rest) * mix_cycles(I8_ACC, arch)
           + (rest > 0) * mix_cycles(I8_ACC_REM_ROW, arch) + rest * mix_cycles(I8_ACC_WORD, arch)
           + (w < 4) * mix_cycles(I8_ACC_NARROW_ROW, arch))
    return mix_cycles(I8_ACC_CALL, arch) + rows * row


#: Calibrated, not counted: the one-block job's mix less one :data:`I8_BLOCK`, its cycles
#: (:data:`I8_ENTRY_CYCLES`, 272 with ``m4f_job_cycles``) the executed cycles of a one-block,
#: one-chunk ``gemm_i8`` job run directly on the ISS (no operand sums, no epilogue: the
#: calibration tile 16x4x64/64 of ``bench/iss.py``'s kernel table, 346 cycles) less the
#: block's 74: 69 integer operations (the SDIV of the block count among them) and 11 branches as
#: counted in the executed blocks, the 57 single and 70 pipelined loads and stores counted there
#: scaled by 181/184, the factor that prices the mix at the measured 272. The first block's start
#: and the last block's wait among them are the runtime's hand-written ``pe_mac_start`` (24
#: cycles: 4 single and 9 pipelined stores and loads, the LDM of the four stacked arguments among
#: them, 4 integer operations and the return (3 cycles: a branch and one integer operation in the
#: mix)) and ``pe_mac_wait`` (9 cycles: the poll's load (2), compare and branch not taken, the
#: address's two moves, the return (3: a branch and one integer operation in the mix)).
_I8_ENTRY = Mix(loads=57.0 * 181 / 184, paired=70.0 * 181 / 184, alu=69.0, branches=11.0)
#: :data:`_I8_ENTRY`'s cycles, the calibration's measured figure
I8_ENTRY_CYCLES = 272


def _share(mix: Mix, f: float) -> Mix:
    """``mix`` with every class count times ``f``."""
    return Mix(**{k: v * f for k, v in vars(mix).items()})


#: :data:`_I8_ENTRY` less the runtime's job loop and call as the element-wise kernels'
#: calibration prices them (``SpinnArch.m4f_job_cycles``, 93), in its proportions:
#: ``m4f_job_cycles + mix_cycles(I8_JOB)`` is :data:`I8_ENTRY_CYCLES`
#: (``tests/pe/test_int8_kernel_fixed_costs.py`` checks the tie to the arch field)
I8_JOB = _share(_I8_ENTRY, (I8_ENTRY_CYCLES - 93) / I8_ENTRY_CYCLES)
#: counted as the difference of a two-block and a one-block job less :data:`I8_RESTART` (74
#: cycles: 21 loads and stores, 30 integer operations, one MLS, 6 branches)
I8_BLOCK = Mix(loads=13.0, paired=4.0, alu=30.0, mla=1.0, branches=6.0)
#: The next block's start after the wait (the driver ``pe_mac_wait_next``'s poll leaving its loop,
#: a taken branch whose refill follows the wait, then the four register writes and CTRL's and
#: the return): serial, the array idle, per column block but a chunk's last
I8_RESTART = Mix(loads=3.0, paired=4.0, alu=3.0, branches=1.0)
#: Of a job's fixed work (``m4f_job_cycles`` and :data:`I8_JOB`), what the M4F runs between the
#: first block's start and its wait (the driver's return, the kernel's tests of its flags, the
#: block loop's set-up with its spills): the share that overlaps the array's first block.
#: Calibrated, not counted: the one-block job's M4F cycles less what they add to the array's
#: run when the run is the longer (a one-block, one-chunk job run directly on the ISS, the
#: 16x4x256/256 tile without an epilogue: 448 executed cycles, the entry's 272 and the block's
#: 74 beside the array's 272): 170 of the entry's 272 cycles, in the entry's proportions.
I8_LEAD = _share(_I8_ENTRY, 170 / I8_ENTRY_CYCLES)


@dataclass(frozen=True)
class Int8Epilogue:
    """One epilogue variant of the int8 GEMM kernel as its generated code executes it, column by
    column (the kernel's columns outer, its rows inner, LLVM's row loop unrolled by 4): ``out``
    per output of the unrolled body; ``one`` per output of the ``rows % 4`` remainder (the
    mean over its three positions, whose code differs by a cycle or two); ``col`` per column of
    a tile of 4 rows or more (the column's constants, the zero-point terms that do not depend
    on the row, the unrolled loop's entry and exit, the remainder's entry); ``col_short`` per
    column of a tile of fewer than 4 rows (the branch around the unrolled body taken instead);
    ``block`` per column block (the epilogue's flag test and its live values reloaded)."""

    out: Mix
    one: Mix
    col: Mix
    col_short: Mix
    block: Mix


#: The dequantizing epilogue of a float32 output (``("gemm_i8", "f32", relu)``), per variant
#: ``(relu, bias)``: the ReLU is a separate image, the bias a run-time flag that LLVM unswitches
#: out of the row loop (two copies of it). Calibrated units, each solved from measured cycles on
#: the calibration shapes below; their instruction classes counted in the executed basic
#: blocks of each variant's image, each unit the difference of the epilogue's cycles (a job with
#: the epilogue's flag against the same job without it) between two tile shapes run directly
#: (``k = 16``, one chunk): ``out`` from ``8 x 4`` against ``4 x 4`` (/ 16 outputs), ``one``
#: from ``7 x 4`` against ``4 x 4`` (/ 12), ``col_short`` from ``1 x 12`` against ``1 x 4``
#: (/ 8, less ``one``), ``col`` from ``4 x 8`` against ``4 x 4`` (/ 4, less 4 ``out``), ``block``
#: what remains of ``4 x 4``. Per output, as the listing has it: the row sum and the
#: accumulator loaded (LDR, LDR), the row's zero-point term by MLA (``acc - zw * rowsum``: run
#: whatever ``zw`` is, the code does not branch on it) and the ADD of the column's term, VMOV
#: to the FPU, VCVT.F32.S32, VMUL by the scale, VADD of the bias (the bias variants), VCMP with
#: 0 + VMRS (the FPSCR's flags to the core) + IT + VMOVLS of +0 (the ReLU variants), VSTR; the
#: output's address reloaded from the stack every output and the unrolled loop's ADD, CMP and
#: BNE per 4 outputs (the 0.25 branch). Each unit's cycles are its counted difference exactly;
#: the share of the loads and stores among its classes is the stack reloads' (what LLVM's
#: register allocation moves between images and builds: the other classes are the listing's).
I8_DEQUANT_CODE = {
    (False, False): Int8Epilogue(
        out=Mix(loads=11 / 4, paired=3 / 4, fpu=3, alu=11 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=8 / 3, paired=4 / 3, fpu=3, alu=7, mla=2),
        col=Mix(loads=12, paired=11, alu=17, mla=1),
        col_short=Mix(loads=28 / 3, paired=14 / 3, alu=12, branches=3, mla=1),
        block=Mix(loads=13 / 2, paired=3, alu=7, branches=1)),
    (False, True): Int8Epilogue(
        out=Mix(loads=11 / 4, paired=1, fpu=4, alu=11 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=19 / 6, paired=4 / 3, fpu=4, alu=6, mla=2),
        col=Mix(loads=25 / 2, paired=13, alu=17, branches=1, mla=1),
        col_short=Mix(loads=41 / 6, paired=20 / 3, alu=10, branches=4, mla=1),
        block=Mix(loads=7, paired=3, alu=7, branches=1)),
    (True, False): Int8Epilogue(
        out=Mix(loads=5 / 2, paired=1, fpu=4, compares=1, alu=15 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=13 / 3, paired=1, fpu=4, compares=1, alu=6, mla=2),
        col=Mix(loads=23 / 2, paired=11, alu=17, mla=1),
        col_short=Mix(loads=20 / 3, paired=10, alu=12, branches=3, mla=1),
        block=Mix(loads=13 / 2, paired=3, alu=6, branches=1)),
    (True, True): Int8Epilogue(
        out=Mix(loads=5 / 2, paired=5 / 4, fpu=5, compares=1, alu=15 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=4, paired=1, fpu=5, compares=1, alu=17 / 3, mla=2),
        col=Mix(loads=14, paired=12, alu=15, branches=1, mla=1),
        col_short=Mix(loads=4, paired=11, alu=34 / 3, branches=4, mla=1),
        block=Mix(loads=7, paired=3, alu=6, branches=1)),
}
#: The requantizations on the DSP instructions, calibrated as :data:`I8_DEQUANT_CODE` is (the same
#: shapes and differences, the requantizing constants of the DSP path: a multiplier of 2**30
#: and a shift of 40), per variant ``(narrow, col_zero)``: the clamp's two forms (USAT #8 alone
#: on an int8 or uint8 output's 256 values; then a compare with the narrower range's top, whose
#: bounds the loop also reloads) and the row loops with and without a weight zero point (its MLS
#: and the row sum's load), each a row loop of its own that the column's constants select. A
#: column outside the DSP path's range (the exact 64-bit path: a multiplier of 1/4 or more or
#: below 2**-22, or a quantized bias above
#: :data:`~tvm_spinn.pe.kernels.i8_epilogues.I8_DSP_MAX_BIAS`; TFLite's, a multiplier of 1/2 or
#: more or below 2**-21) is charged as the DSP path (assumption). Per output of the one-rounding
#: requantization (``("gemm_i8",)``, :data:`I8_REQUANT_CODE`): the accumulator (and the row
#: sum) loaded, ADD of the column's term (MLS of the row's zero-point term), QADD of the bias,
#: SMMLA onto the rounding and zero-point term, ASR, USAT (CMP + IT + MOV of the top), ADD of
#: ``y_min``, STRB; the unrolled loop's rows' addresses reloaded from the stack (about two
#: memory operations an output: LLVM keeps a base address per unrolled row of the accumulator
#: and of the output, more than the core's registers hold beside the column's constants).
#: TFLite's (``("gemm_i8", "tflite")``, :data:`I8_TFLITE_CODE`): the same with SMMLAR
#: (``x + SMMULR(x, 2 M0)``, SaturatingRoundingDoublingHighMul) and an ADD of its sign (ASR #31)
#: instead of the bias's QADD and the SMMLA, QADD of the rounding and zero-point term before the
#: ASR. Per column: the column's entry of the host's table
#: (:func:`~tvm_spinn.pe.kernels.i8_epilogues.i8_dsp_table`: the zero-point term that does not
#: depend on the data, the multiplier, the rounding and zero-point term, the shift, whose zero
#: marks the exact path), the weight zero point and the bias, the MLS of the activation's zero
#: point by the column sum, the row loop's selection, entry and exit. The units were counted as
#: instruction classes in the executed basic blocks (a load or store priced 1 cycle when it
#: directly follows another, else 2; LDM, PUSH and POP as one such load and the rest pipelined).
I8_REQUANT_CODE = {
    (False, False): Int8Epilogue(
        out=Mix(loads=11 / 4, paired=1, alu=27 / 4, branches=1 / 4),
        one=Mix(loads=14 / 3, paired=7 / 3, alu=26 / 3, mla=1),
        col=Mix(loads=33 / 2, paired=9, alu=23, branches=1, mla=1),
        col_short=Mix(loads=83 / 6, paired=20 / 3, alu=52 / 3, branches=4, mla=1),
        block=Mix(loads=3, paired=3, alu=4, branches=1)),
    (False, True): Int8Epilogue(
        out=Mix(loads=13 / 4, paired=9 / 4, alu=27 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=11 / 2, paired=11 / 3, alu=29 / 3, branches=1 / 3, mla=2),
        col=Mix(loads=14, paired=10, alu=26, mla=1),
        col_short=Mix(loads=14, paired=16 / 3, alu=58 / 3, branches=8 / 3, mla=1),
        block=Mix(loads=3, paired=3, alu=4, branches=1)),
    (True, False): Int8Epilogue(
        out=Mix(loads=9 / 4, paired=2, alu=39 / 4, branches=1 / 4),
        one=Mix(loads=37 / 6, paired=7 / 3, alu=35 / 3, mla=1),
        col=Mix(loads=14, paired=10, alu=24, branches=2, mla=1),
        col_short=Mix(loads=43 / 3, paired=20 / 3, alu=49 / 3, branches=5, mla=1),
        block=Mix(loads=3, paired=3, alu=4, branches=1)),
    (True, True): Int8Epilogue(
        out=Mix(loads=4, paired=11 / 4, alu=45 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=13 / 2, paired=13 / 3, alu=38 / 3, mla=2),
        col=Mix(loads=15, paired=12, alu=22, branches=1, mla=1),
        col_short=Mix(loads=14, paired=17 / 3, alu=55 / 3, branches=4, mla=1),
        block=Mix(loads=3, paired=3, alu=4, branches=1)),
}
#: The one-row kernel's requantization (``("gemm_i8", "gemv")``, :func:`int8_gemv`) per column of
#: a one-row tile, its output included, whatever the clamp's form and the column's zero point (one
#: straight-line form for all): the column's constants and its entry of the host's table loaded,
#: the MLS of the activation's zero point by the column sum and of the column's zero point by
#: the row sum, the accumulator loaded, QADD, SMMLA, ASR, USAT, the compare with the clamp's top,
#: ADD of ``y_min``, STRB, and the column loop's ADD, CMP and branch. Calibrated as
#: :data:`I8_REQUANT_CODE` is: the executed instruction classes of ``1 x 12`` against ``1 x 4``
#: (``k = 16``, one chunk), / 8 (46 cycles a column on all four variants).
I8_REQUANT_GEMV = Mix(loads=17 / 2, paired=7, alu=16, branches=1, mla=2)
#: The one-row kernel's requantization per column block: the epilogue's flag test and its live
#: values reloaded (what remains of the ``1 x 4`` tile's epilogue, one block, after its columns)
I8_REQUANT_GEMV_BLOCK = Mix(loads=2, paired=1, alu=6, branches=1)
#: TFLite's in the one-row kernel (``("gemm_i8", "tflite_gemv")``), calibrated the same way: per column
#: 62 cycles (SMMLAR's SMMULR and ADD, the ADD of its sign, QADD, ASR in place of QADD, SMMLA, ASR),
#: per column block 14
I8_TFLITE_GEMV = Mix(loads=23 / 2, paired=13, alu=20, branches=1, mla=2)
I8_TFLITE_GEMV_BLOCK = Mix(loads=3, paired=2, alu=4, branches=1)
I8_TFLITE_CODE = {
    (False, False): Int8Epilogue(
        out=Mix(loads=23 / 8, paired=1 / 2, alu=31 / 4, branches=1 / 4),
        one=Mix(loads=14 / 3, paired=7 / 3, alu=28 / 3, mla=1),
        col=Mix(loads=17, paired=9, alu=23, branches=1, mla=1),
        col_short=Mix(loads=34 / 3, paired=23 / 3, alu=53 / 3, branches=4, mla=1),
        block=Mix(loads=4, paired=3, alu=4, branches=1)),
    (False, True): Int8Epilogue(
        out=Mix(loads=15 / 4, paired=7 / 4, alu=31 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=35 / 6, paired=14 / 3, alu=28 / 3, branches=1 / 3, mla=2),
        col=Mix(loads=13, paired=12, alu=26, mla=1),
        col_short=Mix(loads=61 / 6, paired=25 / 3, alu=56 / 3, branches=8 / 3, mla=1),
        block=Mix(loads=4, paired=3, alu=4, branches=1)),
    (True, False): Int8Epilogue(
        out=Mix(loads=5 / 2, paired=7 / 4, alu=43 / 4, branches=1 / 4),
        one=Mix(loads=6, paired=2, alu=37 / 3, mla=1),
        col=Mix(loads=16, paired=11, alu=21, branches=2, mla=1),
        col_short=Mix(loads=11, paired=8, alu=50 / 3, branches=5, mla=1),
        block=Mix(loads=4, paired=3, alu=4, branches=1)),
    (True, True): Int8Epilogue(
        out=Mix(loads=15 / 4, paired=5 / 2, alu=45 / 4, branches=1 / 4, mla=1),
        one=Mix(loads=41 / 6, paired=14 / 3, alu=37 / 3, mla=2),
        col=Mix(loads=37 / 2, paired=12, alu=22, branches=1, mla=1),
        col_short=Mix(loads=67 / 6, paired=25 / 3, alu=53 / 3, branches=4, mla=1),
        block=Mix(loads=4, paired=3, alu=4, branches=1)),
}

#: MAC-array runs per reduction chunk the int8 kernel's software pipeline aims at
#: (:func:`int8_block_columns`): enough that the M4F's work on one block hides the array's next.
I8_PIPELINE_BLOCKS = 4


def int8_block_columns(rows, cols, arch: "SpinnArch"):
    """Columns of one MAC-array run of the int8 PE kernel's software pipeline on a tile of
    ``rows x cols`` (the kernel's: a ``conv2d`` tile transposed): a multiple of the side the
    tile's better orientation (:func:`mac_passes`) puts its columns on (``mac_cols`` when the
    rows go on the ``mac_rows`` side, else ``mac_rows``), so that the blocks take the tile's own
    passes, and about :data:`I8_PIPELINE_BLOCKS` blocks. ``rows``, ``cols`` may be int64 arrays."""
    r, c = arch.mac_rows, arch.mac_cols
    side = np.where(ceil_div(rows, r) * ceil_div(cols, c) <= ceil_div(rows, c) * ceil_div(cols, r), c, r)
    out = side * ceil_div(ceil_div(cols, side), I8_PIPELINE_BLOCKS)
    return out if isinstance(out, np.ndarray) and out.ndim else int(out)


def _finish_cycles(rows, cols, blocks, arch: "SpinnArch", side: Int8Side):
    """M4F cycles of the last chunk's epilogue on ``rows x cols`` outputs (the kernel's) in
    ``blocks`` column blocks: the dequantizing epilogue's variant (:data:`I8_DEQUANT_CODE`),
    TFLite's requantization's (:data:`I8_TFLITE_CODE`) or the one-rounding one's
    (:data:`I8_REQUANT_CODE`; on a one-row tile of a one-row kernel :data:`I8_REQUANT_GEMV` or
    :data:`I8_TFLITE_GEMV`);
    none for an int32 output or a part of a split reduction. ``rows``, ``cols`` may be int64 arrays."""
    if not side.epilogue or side.int32_out:
        return 0.0

    def c(mix):
        return mix_cycles(mix, arch)

    rest = rows % 4
    if side.fp32_out:
        e = I8_DEQUANT_CODE[side.relu, side.bias]
    else:
        e = (I8_TFLITE_CODE if side.tflite else I8_REQUANT_CODE)[side.narrow, side.col_zero]
    col = np.where(rows >= 4, c(e.col), c(e.col_short))
    rowwise = (rows - rest) * cols * c(e.out) + rest * cols * c(e.one) + cols * col + blocks * c(e.block)
    if side.gemv and not side.fp32_out:  # the one-row kernel's column loop
        col1, block1 = (I8_TFLITE_GEMV, I8_TFLITE_GEMV_BLOCK) if side.tflite else (I8_REQUANT_GEMV,
                                                                                  I8_REQUANT_GEMV_BLOCK)
        return np.where(rows == 1, cols * c(col1) + blocks * c(block1), rowwise)
    return rowwise


def int8_m4f_cycles(vm, vn, k, k_splits, arch: "SpinnArch", side: Int8Side | None = None):
    """M4F cycles of a ``vm x vn`` int8 GEMM tile with reduction ``k`` in ``k_splits`` chunks, as
    the PE kernel runs it, summed as if nothing overlapped (the M4F's share alone; the MAC array
    runs beside it, :func:`int8_pipelined_cycles`): per chunk (job) ``m4f_job_cycles`` and
    :data:`I8_JOB`; per column block (:func:`int8_block_columns`) :data:`I8_BLOCK`, and
    :data:`I8_RESTART` for each but a chunk's last (the next block's start); the 32-bit
    add of the array's sums into the accumulator on every chunk but the first (whose sums the
    array writes into the accumulator itself); the activation's sums over all of ``k`` where the
    other operand's zero point needs them; after the last chunk the epilogue. ``vm``, ``vn``
    may be int64 arrays."""
    side = side or Int8Side()
    rows, cols = (vn, vm) if side.transposed else (vm, vn)  # the kernel's

    def c(mix):
        return mix_cycles(mix, arch)

    cb = int8_block_columns(rows, cols, arch)
    blocks = ceil_div(cols, cb)
    per_job = arch.m4f_job_cycles + c(I8_JOB) + blocks * c(I8_BLOCK) + (blocks - 1) * c(I8_RESTART)
    wl = cols - (blocks - 1) * cb  # the last block's width
    adds = (k_splits - 1) * ((blocks - 1) * int8_acc_cycles(rows, cb, arch) + int8_acc_cycles(rows, wl, arch))
    summed = vm * side.row_sums + vn * side.col_sums  # rows of a sum each
    sums = summed * (k * c(I8_SUM) + k_splits * c(I8_SUM_ROW))
    return k_splits * per_job + adds + sums + _finish_cycles(rows, cols, blocks, arch, side)


def int8_pipelined_cycles(vm, vn, k, tk: int, arch: "SpinnArch", side: Int8Side | None = None, starts=True):
    """Cycles of a ``vm x vn`` int8 GEMM tile with reduction ``k`` in chunks of ``tk`` as the PE
    kernel's software pipeline runs it, the MAC array concurrent with the M4F. Per chunk (one
    job) the array computes the sums one block of :func:`int8_block_columns` columns at a time,
    ``mac_passes(rows, block) * (chunk + mac_readout_cycles)`` cycles each (the array's time of
    :func:`gemm_tile_cycles`), while the M4F adds and requantizes block ``j`` (the mixes of
    :func:`int8_m4f_cycles`) while the array computes block ``j + 1``; a chunk's last block
    overlaps the next chunk's first, beside which the next job's entry and operand sums run too.
    Each wait ends at the later of the array's run and the M4F's work before it, and within a
    chunk the next block starts after the wait (the driver's writes, :data:`I8_RESTART`, in
    series: the array idles for them); the tile's last block's M4F work follows the array. ``starts``: the
    tile's first chunk is the reduction's first (its sums go straight into the accumulator; a
    later part of a reduction split over PEs adds every chunk).

    In closed form, elementwise over arrays: ``vm``, ``vn``, ``k`` and ``starts`` may be int64
    (bool) arrays of one entry per tile (the result is then a float64 array), ``tk`` (the
    products per chunk, the last chunk of ``k`` possibly shorter) is shared. A tile has at most
    two column-block widths (``cb`` and the last block's) and two chunk lengths (``tk`` and the
    last), so the sum over chunks and blocks is a few terms with counts: the first job's entry
    up to its first start; per chunk but the last, its blocks each beside the array's next block
    and its last block beside the next chunk's first with the next job's entry; the last
    chunk's blocks beside the array's next, its last block in series."""
    side = side or Int8Side()
    vector = any(isinstance(x, np.ndarray) and x.ndim for x in (vm, vn, k, starts))
    mx = np.maximum if vector else max
    rows, cols = (vn, vm) if side.transposed else (vm, vn)  # the kernel's

    def c(mix):
        return mix_cycles(mix, arch)

    def pick(cond, a, b):
        return np.where(cond, a, b) if vector else (a if cond else b)

    job, block = arch.m4f_job_cycles + c(I8_JOB), c(I8_BLOCK)
    lead, summ, sum_row, readout = c(I8_LEAD), c(I8_SUM), c(I8_SUM_ROW), arch.mac_readout_cycles
    restart = c(I8_RESTART)
    cb = int8_block_columns(rows, cols, arch)
    nb = ceil_div(cols, cb)
    wl = cols - (nb - 1) * cb  # the last block's width
    w0 = np.minimum(cb, cols) if vector else min(cb, cols)  # the first block's width
    s = mx(ceil_div(k, tk), 1)  # the chunks (jobs)
    kl = k - (s - 1) * tk  # the last chunk's products
    kf = pick(s > 1, tk, kl)  # the first chunk's
    summed = vm * side.row_sums + vn * side.col_sums
    a0 = (1 - np.asarray(starts, dtype=np.int64)) if vector else int(not starts)
    fin_cb, fin_wl = _finish_cycles(rows, cb, 1, arch, side), _finish_cycles(rows, wl, 1, arch, side)

    def entry(kc):  # a job's fixed work and its operand sums
        return job + summed * (kc * summ + sum_row)

    def array(kc, w):
        return mac_passes(rows, w, arch) * (kc + readout)

    def work(w, adds, fin):  # a block's M4F work after its wait: its own, its sums' add, its epilogue
        return block + adds * int8_acc_cycles(rows, w, arch) + fin

    def inner(kc, adds, fin):  # a chunk's blocks but its last, each beside the array's next block
        w = work(cb, adds, fin)  # (each after the next block's start, the array idle for its writes)
        return pick(nb >= 2, mx(nb - 2, 0) * mx(w, array(kc, cb)) + mx(w, array(kc, wl)) + (nb - 1) * restart,
                    0.0)

    def handover(adds, kn):  # a non-last chunk's last block beside the next chunk's first
        return mx(work(wl, adds, 0.0) + entry(kn), array(kn, w0))

    t = entry(kf) - lead + mx(lead, array(kf, w0))
    middle = mx(s - 3, 0) * (inner(tk, 1, 0.0) + handover(1, tk))
    before_last = pick(s >= 3, inner(tk, 1, 0.0) + handover(1, kl), 0.0)
    t = t + pick(s >= 2, inner(tk, a0, 0.0) + handover(a0, pick(s > 2, tk, kl)) + middle + before_last, 0.0)
    a_last = pick(s >= 2, 1, a0)
    t = t + inner(kl, a_last, fin_cb) + work(wl, a_last, fin_wl)
    return np.asarray(t, dtype=np.float64) if vector else float(t)


def gemm_tile_cycles(vm: int, vn: int, k: int, k_splits: int, arch: "SpinnArch", mode: str = "fp32",
                     side: Int8Side | None = None) -> float:
    """Compute cycles of a ``vm x vn`` GEMM tile with reduction ``k`` in ``k_splits`` chunks
    (see the module docstring); a float, callers round up. ``vm`` and ``vn`` may be int64
    arrays (one entry per tile): the result is then a float64 array. int8: the longer of the
    MAC array's passes and the M4F's adds of the chunks' sums, of the dequantizing epilogue and
    of the activation's sums at ``m4f_elementwise_cycles`` each: the M4F's work overlaps the
    array's, as the chip's published int8 rates require (``bench/fidelity.py``: the batch-1
    fully-connected layer's 16-19% MAC utilisation leaves the M4F about a quarter of the
    array's time). The generated PE kernel overlaps them too, but its requantization is dearer
    than this charges: :func:`int8_pipelined_cycles` prices what it executes, and
    ``bench/iss.py`` prints that kernel against executed code."""
    if mode != "int8":
        return fp32_tile_cycles(vm, vn, k, k_splits, arch)
    side = side or Int8Side()
    passes = mac_passes(vm, vn, arch)
    array = passes * (k + k_splits * arch.mac_readout_cycles)
    sums = side.row_sums or side.col_sums
    per_out = (k_splits - 1) + int(side.fp32_out) + int(sums)
    m4f = per_out * vm * vn * arch.m4f_elementwise_cycles + k * (vm * side.row_sums + vn * side.col_sums)
    longer = np.maximum(array, m4f)
    return longer.astype(np.float64) if isinstance(longer, np.ndarray) else float(longer)


def k_part_bounds(k: int, tk: int, parts: int) -> np.ndarray:
    """``[parts + 1]`` k bounds of a tile's reduction cut into ``parts`` contiguous runs of its
    :func:`splits_of` chunks (part ``j`` takes chunks ``j * S // parts`` up to ``(j + 1) * S //
    parts``): chunk boundaries, so every part streams the very chunks the whole tile would."""
    ks, c = splits_of(k, tk), chunk_length(k, tk)
    return np.minimum(np.arange(parts + 1, dtype=np.int64) * ks // parts * c, k)


def k_part_tail_cycles(vm, vn, parts: int, arch: "SpinnArch", side: Int8Side | None = None) -> float:
    """Cycles the reducing part of a split int8 tile spends after its own chunks: per other part
    a NoC DMA of its ``vm*vn`` int32 partial sums (``dma_setup_cycles`` + bytes /
    ``dma_bw_bytes_per_cycle``) and ``vm*vn`` 32-bit adds on the M4F (plus the zero-point sums'
    ``vm`` / ``vn`` adds), then the dequantizing epilogue (``fp32_out``). Serial: the partials
    are ready only when the other parts finish (taken to finish with it)."""
    side = side or Int8Side()
    others = parts - 1
    dma = others * (arch.dma_setup_cycles + ACC_BYTES * vm * vn / arch.dma_bw_bytes_per_cycle)
    adds = (others * (vm * vn + vm * side.row_sums + vn * side.col_sums) + int(side.fp32_out) * vm * vn)
    return dma + adds * arch.m4f_elementwise_cycles


def _part_side(side: Int8Side | None) -> Int8Side:
    """What one part of a split int8 reduction computes besides its MAC-array sums: its zero-point
    sums, not the epilogue (the reducing part runs that, :func:`k_part_tail_cycles`)."""
    side = side or Int8Side()
    return Int8Side(int32_out=side.int32_out, row_sums=side.row_sums, col_sums=side.col_sums, epilogue=False,
                    transposed=side.transposed)


def _round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def _fp32_row_tiles(g: GemmShape, mac_rows: int) -> set:
    """fp32 row tiles below the MAC array's ``mac_rows`` for a GEMM whose rows, over its batch,
    are fewer than the array's (none otherwise: a batch of such GEMMs has its batch's tiles to
    spread; nor for rows within one register block): multiples of the M4F kernel's register block
    rows (:data:`M4F_BLOCK`), the rows whole, halved, quartered, ... down to one register block.
    The M4F runs whole ``4 x 4`` blocks on every row tile, so register-block-high tiles keep the
    ``4 x 4`` blocks (four
    outputs a reduction step for each operand pair loaded, against one for the ``4 x 1`` blocks
    of a narrow column tile) while the tiles still spread over the PEs. Each output's reduction
    is the same whatever the row tile (ascending k on one PE), so no bit moves."""
    mr, out = M4F_BLOCK[0], set()
    # (rows within one register block: the MAC-high tile computes the same rows)
    tm = _round_up(g.m, mr) if mr < g.m and g.m * g.batch < mac_rows else 0
    while tm >= mr:
        out.add(tm)
        tm = _round_up(tm // 2, mr) if tm > mr else 0
    return out


def has_row_tiles(program, arch: "SpinnArch", resident: bool = False) -> bool:
    """Whether the mapper may cut some fp32 GEMM of ``program`` into register-block-high row
    tiles under some shard plan: :func:`_fp32_row_tiles` for rows more than one register block
    and fewer than the MAC array's (a shard plan may split its batch down to one); with
    ``resident`` (the GEMMs' weight operands held in SRAM, ``MappingOptions(weights="resident")``)
    also the bands of :func:`_fp32_band_tiles`, for any rows more than one register block. A
    mapping with ``MappingOptions(row_tiles=False)`` differs from the default only where this
    holds, ``resident`` as the mapping holds the weights."""
    mr = M4F_BLOCK[0]
    for layer in program.layers:
        if layer.kind in GEMM_KINDS and layer.mode != "int8":
            m = gemm_shape(program, layer).m
            if mr < m and (resident or m < arch.mac_rows):
                return True
    return False


def _fp32_band_tiles(g: GemmShape, tms: set, pes: int, mac_rows: int) -> dict:
    """fp32 column tiles per row tile that fill about whole rounds of ``pes`` PEs, ``{tm: {tn}}``:
    the row tiles are bands one or two register blocks high (:data:`M4F_BLOCK`) below the rows
    (where the rows over the batch are at least the MAC array's ``mac_rows``; fewer rows, only
    the ones among ``tms``, which :func:`_fp32_row_tiles` supplies), each with the column
    tiles, multiples of the register block's columns, that cut the columns into the most tiles
    over the row tiles that are at most ``j * pes`` (``j`` = 1 .. 8; at least one column tile a
    row tile): about ``j`` rounds, fewer where the row tiles alone exceed ``j * pes`` or the
    register block's columns leave no count nearer. A short reduction (a
    weight gradient over a slot's few tokens) pays a job's entry, a row's set-up and a block's
    for a few steps each: one wide band of ``4 x 4`` blocks a PE pays them once where the
    MAC-high tiles the other candidates take run many small jobs, and about whole rounds leave
    few PEs idle in the last. Each output's reduction is the same whatever the tile (ascending k on one
    PE), so no bit moves."""
    mr, nr = M4F_BLOCK
    rows = {t for t in tms if t < g.m and t <= 2 * mr}
    if g.m * g.batch >= mac_rows:
        rows |= {t for t in (mr, 2 * mr) if t < g.m}
    out = {}
    for tm in sorted(rows):
        row_tiles = g.batch * ceil_div(g.m, tm)
        out[tm] = {min(_round_up(ceil_div(g.n, max(1, j * pes // row_tiles)), nr), _round_up(g.n, nr))
                   for j in range(1, 9)}
    return out


def choose_matmul_tile(g: GemmShape, arch: "SpinnArch", pes: int, resident: bool = False) -> tuple[int, ...]:
    """The mapper's ``(tm, tn, tk)`` for an fp32 ``matmul`` (both operands computed, none a
    weight constant) on ``pes`` PEs: the tile planners without a program to build (the training
    planner, through :func:`tvm_spinn.timing.gemm.gemm_seconds`) time a GEMM with; ``resident``:
    the right operand held in SRAM (no DRAM traffic charged for it, as for resident weights)."""
    return choose_gemm_tile(g, arch, pes=pes, kind="matmul", mode="fp32", resident=resident)


def choose_gemm_tile(g: GemmShape, arch: "SpinnArch", name: str = "gemm", pes: int | None = None,
                     kind: str = "dense", naive: bool = False,
                     input_bytes=None, mode: str = "fp32", elem_bytes=None,
                     int8: Int8Side | None = None, split_k: bool = False,
                     resident: bool = False, row_tiles: bool = True) -> tuple[int, ...]:
    """Pick ``(tm, tn, tk)`` for a GEMM with the lowest estimated layer time; with ``split_k``
    (what the mapper asks), ``(tm, tn, tk, p)`` for an int8 GEMM whose tiles' reductions split
    over ``p`` PEs each (tried when the tiles leave PEs idle, ``tiles * p <= pes``; kept only
    when strictly faster).

    Candidates are multiples of the MAC array shape that fit ``arch.tile_sram_bytes``. The
    estimate spreads the tiles over ``pes`` PEs and takes ``max(per-PE compute and DMA, DRAM
    traffic / bandwidth + the last tile's compute)``, where the weight operand of a tile group is
    fetched once per PE (weight-stationary) and the activation operand once per tile
    (``input_bytes(vn)`` when given, e.g. a conv's input rows); ``resident`` weights are in SRAM
    before the inference and move no bytes. The NoC is costed as the timing model costs it
    (:func:`tvm_spinn.program.noc.noc_port_cycles`, the tiles spread evenly over the PEs).
    Ties go to fewer tiles, then to the larger tile (deterministic). ``naive`` returns the
    smallest MAC-shaped tile.

    ``elem_bytes`` is ``(activation, weight, output)`` element bytes (matmul: lhs, rhs, output),
    by default the mode's (fp32: 4, 4, 4; int8: 1, 1, 4); compute time follows ``mode``
    (:func:`gemm_tile_cycles`: the M4F for fp32, the MAC array for int8, with the M4F's share
    ``int8``, by default a dequantizing epilogue when the output takes 4 bytes).
    ``row_tiles``: an fp32 GEMM of fewer rows than the MAC array also tries register-block-high
    row tiles (:func:`_fp32_row_tiles`), and a ``resident`` one of more rows than one register
    block the bands of :func:`_fp32_band_tiles` (each band row tile with the general column tiles
    and its own);
    ``False``: MAC-high row tiles only (:func:`has_row_tiles`).
    """
    budget = arch.tile_sram_bytes if naive else working_budget(arch)
    r, c = arch.mac_rows, arch.mac_cols
    pes = pes or arch.total_pes
    ae, be, _, oe = _operand_elems(kind, mode, elem_bytes)
    int8 = int8 or Int8Side(fp32_out=oe == 4)
    if naive:
        tk = min(g.k, max(r, (budget - ACC_BYTES * r * c) // (2 * (ae * r + be * c)) // r * r))
        if mode == "int8":
            tk = min(tk, safe_k_chunk(arch, 8))
        if gemm_tile_bytes(r, c, min(tk, g.k), ae, be) > budget:
            raise MappingError(f"layer {name}: a {r}x{c} tile does not fit {budget} bytes of SRAM")
        return r, c, tk
    m_cap, n_cap = _round_up(g.m, r), _round_up(g.n, c)
    # Powers of two, plus sizes that split the work into about k tiles per PE (load balance).
    tms = {min(r * 2**i, m_cap) for i in range(12)}
    tns = {min(c * 2**i, n_cap) for i in range(14)}
    for k in range(1, 9):
        tns.add(min(n_cap, _round_up(ceil_div(g.n * g.batch * ceil_div(g.m, m_cap), k * pes), c)))
        tms.add(min(m_cap, _round_up(ceil_div(g.m * g.batch, k * pes), r)))
    if mode != "int8":
        # fp32 runs on the M4F, which has no row or column granularity (the MAC array's shape
        # only matters to int8): tiles that split a few output columns (a decode step's
        # matrix-vector product) or a narrow shard's columns and rows exactly over the PEs
        # keep more PEs busy (each PE streams its own weight columns). Buffers stay MAC-shaped
        # (tile_costs pads them), so the SRAM check below pads too.
        if g.m * g.batch < r:
            tns.update({1, 2})
        tns.update(min(g.n, ceil_div(g.n * g.batch * ceil_div(g.m, m_cap), k * pes)) for k in range(1, 9))
        if row_tiles:
            tms.update(_fp32_row_tiles(g, r))
        # with the right operand on chip (resident): the layer is the PEs' compute, where the
        # bands' fewer jobs show; streamed from DRAM, the last tile computes after the
        # channel's last byte (the timing model's layer rule) and a band's long job waits there.
        # Bands are register-block-high row tiles: MappingOptions(row_tiles=False) keeps them out.
        bands = _fp32_band_tiles(g, tms, pes, r) if resident and row_tiles else {}
    else:
        bands = {}
    # the row and column tiles cross, the bands' row tiles included (a band row with a general
    # column tile is the cheapest tile of some resident GEMMs of a few rows); a band's own
    # column tiles go with its row tile
    tms.update(bands)
    pairs = {(tm, tn) for tm in tms for tn in tns}
    pairs.update((tm, tn) for tm, band_tns in bands.items() for tn in band_tns)
    chips = max(1, -(-pes // arch.pes_per_chip))
    dram_bytes_per_cycle = arch.dram_bw_bytes_s * chips / arch.clock_hz
    pe_ids = np.arange(pes, dtype=np.int64)
    chip_ids = pe_ids // arch.pes_per_chip
    weight_a = _weight_is_a(kind)
    best, best_key = None, None
    for tm, tn in sorted(pairs):
        pm, pn = _round_up(tm, r), _round_up(tn, c)  # the buffers tile_costs reserves
        fixed = ACC_BYTES * pm * pn
        per_k = 2 * (ae * pm + be * pn)
        if fixed + per_k > budget:
            continue
        tk_max = (budget - fixed) // per_k
        tk = g.k if tk_max >= g.k else max(r, (tk_max // r) * r)
        if tk > tk_max:
            continue
        if mode == "int8":  # the MAC array's acc_bits-bit accumulators must never wrap
            tk = min(tk, safe_k_chunk(arch, 8))
        mt, nt = ceil_div(g.m, tm), ceil_div(g.n, tn)
        tiles = g.batch * mt * nt
        groups = (g.batch * mt) if weight_a else nt
        per_pe = ceil_div(tiles, pes)
        vm, vn = min(tm, g.m), min(tn, g.n)
        a_bytes, b_bytes = ae * vm * g.k, be * g.k * vn
        w_bytes, x_bytes = (a_bytes, b_bytes) if weight_a else (b_bytes, a_bytes)
        if input_bytes is not None:
            x_bytes = input_bytes(vn)
        # A weight block stays in SRAM across its tiles only if it fits next to the buffers.
        ksplits = ceil_div(g.k, tk)
        # int8: the chunks of each output tile may be split over p PEs (module docstring)
        # when the tiles leave PEs idle; every part is a tile of its own.
        p_max = min(ksplits, pes // tiles) if mode == "int8" and split_k else 1
        if p_max > 1 and gemm_tile_bytes(pm, pn, min(tk, g.k), ae, be) + ACC_BYTES * pm * pn > budget:
            p_max = 1  # no room for the reducer's block of received partial sums
        for parts in range(1, max(1, p_max) + 1):
            tiles_p, groups_p = tiles * parts, groups * parts
            per_pe = ceil_div(tiles_p, pes)
            span = -(-ksplits // parts) * ceil_div(g.k, ksplits)  # the longest part's k
            frac = min(span, g.k) / g.k
            xb, wb = x_bytes * frac, (0.0 if resident else w_bytes * frac)
            stationary = wb + gemm_tile_bytes(tm, tn, min(tk, g.k), ae, be) <= budget
            w_loads = min(tiles_p, max(groups_p, pes)) if stationary else tiles_p
            if parts == 1:
                compute = gemm_tile_cycles(vm, vn, g.k, ksplits, arch, mode, int8)
            else:
                compute = (gemm_tile_cycles(vm, vn, min(span, g.k), -(-ksplits // parts), arch, mode, _part_side(int8))
                           + k_part_tail_cycles(vm, vn, parts, arch, int8))
            dma = (xb + oe * vm * vn + (wb * w_loads) / tiles_p) / arch.dma_bw_bytes_per_cycle
            pe_time = per_pe * (max(compute, dma) + arch.dma_setup_cycles * -(-ksplits // parts))
            # Weight blocks cross DRAM once per group (the NoC multicasts them); activations
            # are assumed on-chip (NoC). The last tile computes after its load: no overlap.
            dram_time = groups_p * wb / dram_bytes_per_cycle
            on_pe = tiles_p // pes + (pe_ids < tiles_p % pes)
            noc_time = noc_port_cycles(pe_ids, chip_ids, on_pe * (xb + wb * w_loads / tiles_p),
                                       on_pe * (oe * vm * vn), arch)
            key = (max(pe_time, max(dram_time, noc_time) + compute), tiles_p, -tm, -tn)
            if best_key is None or key < best_key:
                best, best_key = ((tm, tn, tk, parts) if parts > 1 else (tm, tn, tk)), key
    if best is None:
        need = gemm_tile_bytes(r, c, r, ae, be)
        raise MappingError(
            f"layer {name}: even a {r}x{c}x{r} tile needs {need} bytes of SRAM, the PE has {budget}; "
            f"the smallest system that fits has sram_bytes >= {need + arch.sram_reserved_bytes}"
        )
    return best


def smallest_gemm_tile_bytes(arch: "SpinnArch", k: int, a_bytes: int = 4, b_bytes: int = 4) -> int:
    """SRAM of the smallest GEMM tile: one ``mac_rows x mac_cols`` block of outputs with
    reduction chunks of ``min(k, mac_rows)``, operands double-buffered (element bytes of the A
    and B operands: conv2d A = weight, B = im2col(input); dense/matmul A = input)."""
    return gemm_tile_bytes(arch.mac_rows, arch.mac_cols, min(k, arch.mac_rows), a_bytes, b_bytes)


def _conv_input_bytes(program, layer: Layer, p0, p1):
    """Bytes of input a conv tile DMAs for output pixels [p0, p1) (ints or arrays): the input
    window under those output pixels (with the kernel halo) of one group's channels; im2col
    happens in SRAM."""
    _, _, h, w = program.tensors[layer.inputs[0]].shape
    _, cg, kh, kw = program.tensors[layer.consts["weight"]].shape
    ow = program.tensors[layer.output].shape[3]
    sh, sw = layer.attrs["strides"]
    dh, dw = layer.attrs["dilation"]
    khe, kwe = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    p0, p1 = np.asarray(p0, dtype=np.int64), np.asarray(p1, dtype=np.int64)
    pixels = p1 - p0
    # Part of one output row (two if it wraps): a strip of columns; else whole rows.
    strip_rows = khe * np.where(p0 // ow == (p1 - 1) // ow, 1, 2)
    strip_cols = np.minimum(w, (pixels - 1) * sw + kwe)
    band_rows = np.minimum(h, (-(-pixels // ow)) * sh + khe)
    rows = np.where(pixels < ow, strip_rows, band_rows)
    cols = np.where(pixels < ow, strip_cols, w)
    return itemsize(program, layer.inputs[0]) * cg * rows * cols


def _cost_operands(program, layer: Layer):
    """``(weight tid, (activation, weight, output) element bytes, Int8Side or None)``."""
    w_tid = layer.inputs[1] if layer.kind == "matmul" else layer.consts["weight"]
    elems = tuple(itemsize(program, tid) for tid in (layer.inputs[0], w_tid, layer.output))
    side = int8_side(program, layer) if layer.mode == "int8" else None
    return w_tid, elems, side
