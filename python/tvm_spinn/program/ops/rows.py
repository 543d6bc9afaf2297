"""Row operators: ``softmax``, ``layer_norm`` and ``rms_norm`` over the last axis, ``mean`` over
trailing axes.

- Arithmetic (Cortex-M4F, fp32): the sums of ``softmax`` and ``mean`` are sequential fp32 sums
  of one row, left to right from 0 (``mean``'s is llvm's order too: training's batch statistics
  match llvm bit for bit); ``layer_norm``'s two sums are *blocked*: the row in blocks of
  :data:`LAYER_NORM_BLOCK` elements from its start, each block summed left to right from 0 and
  the block sums added left to right from 0 -- an order fixed by the row alone (so every
  mapping gives the same bits) in which a row split over PEs sums its blocks in parallel and
  only the block sums travel along the chain (a model-width row of a decode step: 32 chained
  adds instead of 1,024). C++ kernels ``tvm_spinn.sim.row_sum_f32``, ``softmax_f32``,
  ``layer_norm_f32``; ``softmax``
  is ``e / sum(e)`` with ``e = exp(x - max(x))`` from the exp/log unit's model (the max: the
  row's first NaN if it has one);
  ``layer_norm`` is ``(x - mean) / sqrt(var + eps) * gamma + beta`` with ``mean = sum(x) / d``,
  ``var = sum((x - mean)^2) / d``; ``mean`` is ``sum / d``.
- ``rms_norm`` (Llama's ``RMSNorm``, C++ ``rms_norm_f32``), fused from the graph transformers'
  ``LlamaRMSNorm`` imports as -- ``power(x, 2)``, ``mean(axis=-1, keepdims)``, ``add(eps)``,
  ``rsqrt``, ``multiply(x, .)``, ``multiply(weight, .)`` -- or from ``relax.nn.rms_norm``: per
  row ``q = sum(x * x)`` in layer_norm's blocked order (:data:`LAYER_NORM_BLOCK`), then the
  graph's operations in its order, each one fp32 rounding: ``m = q / d``, ``v = m + eps``,
  ``r = 1 / sqrt(v)`` (VSQRT then VDIV, the ``rsqrt`` of :mod:`.elementwise`), ``h = x * r``,
  ``y = weight * h`` (without a weight, ``y = h``). So the fused layer differs from the
  decomposed layers only in the order of the sum of squares (the ``mean`` kind's is sequential,
  and stays so for training's statistics), and a split row chains ``d / 32`` block sums, not
  ``d`` elements. (Which NaN a product of two NaNs returns is not fixed here, unlike the
  element-wise ``multiply``'s first-operand rule.)
- TFLite's integer softmax and mean (``attrs["rounding"] == "tflite"``: int8/uint8 in and out,
  the composites ``spinn.qsoftmax_tflite`` / ``spinn.qmean_tflite``, i.e. ``quantize(op(dequantize
  (x)))`` of a full-integer TFLite model, see :mod:`tvm_spinn.frontend.tflite`) run on the M4F
  with the integer arithmetic of TFLite's reference kernels (``tensorflow/lite/kernels/
  internal/reference/softmax.h`` and ``reduce.h``), bit for bit:

  * ``softmax`` (``Softmax<int8/uint8>``): per row ``d = x - max(x)``; where ``d >= diff_min``,
    ``e = exp_on_negative_values(SRDHM(d * 2**left_shift, multiplier))`` (Q5.26 in, Q0.31 out:
    gemmlowp's fixed-point exp); ``S = sum(RoundingDivideByPOT(e, 12))`` (Q12.19, 32-bit
    wrapping adds); ``1/S`` by ``GetReciprocal`` (``one_over_one_plus_x`` of the normalized sum,
    ``k = 12 - clz(S)`` bits above one); ``y = RoundingDivideByPOT(SRDHM(1/S, e), k + 23) +
    type_min`` clamped; elements below ``diff_min`` give ``type_min``. ``multiplier``,
    ``left_shift`` and ``diff_min`` are ``PreprocessSoftmaxScaling(beta=1, input_scale, 5)`` and
    ``-CalculateInputRadius(5, left_shift)``; the output is fixed at scale 1/256, zero point
    ``type_min`` (TFLite requires it).
  * ``mean`` (``QuantizedMeanOrSum``, what both the reference and the optimized kernels run for
    ``keep_dims=False``): ``S = sum(x) - x_zero * n`` (int32), ``y = clamp(y_zero +
    MultiplyByQuantizedMultiplier(S, multiplier, 31 - shift))`` where ``(multiplier, shift)`` is
    TFLite's ``QuantizeMultiplier(s_x / s_y)`` with ``1 / n`` folded in: ``M0 * 2**k // n`` and
    the exponent lowered by ``k = min(floor(log2 n), 32, 31 + exponent)``.

  The fixed-point primitives live in :mod:`tvm_spinn.program.quant`.
- Tiles: ``[rows, cols]``, regions ``[[r0, r1], [c0, c1]]`` over the rows (everything but the
  normalized or reduced axes) and the elements of a row (rows outer). ``cols`` below the row
  length splits each row into ``k = ceil(row / cols)`` chunks on ``k`` PEs, which keeps the
  bits: the row's sums stay in their fixed order, because the PEs holding consecutive chunks
  pass the running partial sum along a chain (PE ``i`` adds its chunk's terms, in order, to the
  partial it receives: a softmax's or mean's elements, a layer_norm's block sums, which each PE
  first computes for its blocks in parallel); the element-wise work (the max, exact in any
  order; subtract, square, exp, divide, scale, shift) runs in parallel, and the row's
  statistic (max, mean, variance, sum of exps) is broadcast back to the chunks (at most
  ``m4f_chain_registers`` terms of a chunk wait in FPU registers, so the chain costs
  ``m4f_chain_cycles`` per term; more are loaded as they are added); the
  functional simulator computes a split tile's rows whole with the same kernel and writes only
  its chunk (a mean's output is written by the tile holding the row's last chunk), so every
  tiling gives the same bits. The cost (:meth:`Rows.tile_costs`): the parallel element-wise
  work of the chunk, plus the chain (the serial terms of the whole row, one NoC hop per chunk
  boundary) and the statistic's broadcast (one multicast packet the NoC's routers copy to every
  chunk's PE: the hops to the farthest), per statistic; the tiler splits a row only when
  rows are fewer than the PEs and the split lowers the layer's modelled time
  (:meth:`Rows.choose_tile`), and an ``rms_norm`` row too long for a PE's SRAM (Llama-2-70B's
  8,192) always, into the fewest chunks of whole blocks that fit (so its smallest tile is one
  block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from ... import _lib
from ..checks import POSINT, ZERO, check_bool, check_int, check_num, check_str, fail
from ..model import Layer
from ..quant import (QUANT_RANGES, count_leading_zeros32, exp_on_negative_values, one_over_one_plus_x,
                     requantize_tflite, rounding_divide_by_pot, srdhm, tflite_quantize_multiplier, wrap32)
from . import native
from .base import OpFamily, ceil_div, itemsize, register, starts, working_budget
from .m4f import Mix, mix_cycles, pass_cycles
from .sharding import REPLICATE, GatherInput, RowAllReduce, ShardDecision, ShardingRule

if TYPE_CHECKING:
    from ...target.arch import SpinnArch

__all__ = ["Rows", "RowLoop", "RowPhase", "stepped_cycles", "blocked_cycles", "ROW_CODE", "ROW_RUN", "ROW_COLUMN_UNROLL", "row_tile_cycles", "LAYER_NORM_BLOCK", "BLOCKED", "smallest_row_tile_bytes", "split_norm_sums", "softmax_tflite", "mean_tflite", "softmax_tflite_params",
           "TFLITE_MEAN_CODE", "TFLITE_MEAN_ELEMENT", "tflite_mean_tile_cycles",
           "TfliteSoftmaxPhase", "TFLITE_SOFTMAX_CODE", "softmax_tflite_expected", "tflite_softmax_tile_cycles",
           "mean_tflite_params"]

_F32 = np.float32
_I64 = np.int64
#: Elements per block of ``layer_norm``'s row sums (the C++ kernel's ``kLayerNormBlock``; see
#: the module docstring). 32: a 1,024-wide row's chain is 32 block sums, and a PE holding a
#: 32-element chunk keeps its one block sum per statistic in a register.
LAYER_NORM_BLOCK = 32
#: kinds whose row sums are blocked (:data:`LAYER_NORM_BLOCK`): only block sums are chained
BLOCKED = ("layer_norm", "rms_norm")

#: The ``mean_tflite`` PE kernel (:mod:`tvm_spinn.pe.kernels`) as it executes, by instruction
#: class, counted on its executed blocks (int8, a tile of 1 row of 1 column, 9 rows of 1
#: column, 1 row of 65 columns: per row and per element the differences over 8 and 64) and
#: priced by :func:`~.m4f.mix_cycles`: ``(job, row)`` for a tile holding its rows' ends (the
#: requantization: a 64-bit multiply, TFLite's rounding shifts and the clamp, per row) and for
#: one passing its partial sums on; per element the 32-bit sum's load, add and loop step.
TFLITE_MEAN_CODE = {
    True: (Mix(loads=28.0, paired=50.0, alu=45.4375, branches=1.75),
           Mix(loads=15.0, paired=3.0, alu=67.0, branches=5.0)),
    False: (Mix(loads=17.25, paired=41.875, alu=21.6875, branches=2.5),
            Mix(loads=3.75, paired=0.125, alu=11.75, branches=3.25)),
}
TFLITE_MEAN_ELEMENT = Mix(loads=1.015625, alu=1.5625, branches=0.234375)


def tflite_mean_tile_cycles(rows, cols, last, arch: "SpinnArch") -> np.ndarray:
    """M4F cycles of ``mean_tflite`` tiles of ``rows`` rows of ``cols`` columns (int arrays),
    ``last`` where a tile holds its rows' ends: the kernel's job, its rows
    (:data:`TFLITE_MEAN_CODE`) and elements (:data:`TFLITE_MEAN_ELEMENT`)."""
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    (jf, rf), (jp, rp) = TFLITE_MEAN_CODE[True], TFLITE_MEAN_CODE[False]
    per_tile = np.where(last, mix_cycles(jf, arch) + rows * mix_cycles(rf, arch),
                        mix_cycles(jp, arch) + rows * mix_cycles(rp, arch))
    return np.asarray(per_tile + rows * cols * mix_cycles(TFLITE_MEAN_ELEMENT, arch), dtype=np.float64)
#: integer bits of the softmax exponent's input (Q5.26) and of the sum of exps (Q12.19), TFLite's
_SCALED_DIFF_BITS, _ACCUM_BITS = 5, 12
#: attributes of TFLite's integer softmax and mean layers
_TFLITE_ATTRS = {"softmax": ("multiplier", "left_shift", "diff_min"),
                 "mean": ("x_zero", "y_zero", "multiplier", "shift")}


def smallest_row_tile_bytes(row: int, in_bytes: int = 4, out_bytes: int = 4, reduce: bool = False) -> int:
    """SRAM of one row of a softmax / layer_norm (``reduce=False``) or mean (``reduce=True``:
    one output per row), input and output double-buffered."""
    return 2 * (in_bytes * row + out_bytes * (1 if reduce else row))


def _weight(layer: Layer):
    """An rms_norm's weight tensor id, or None."""
    return layer.consts.get("weight")


def _row(program, layer: Layer) -> int:
    """Elements per row: the reduced trailing axes of a mean, else the last axis."""
    return layer.attrs["row"] if layer.kind == "mean" else program.tensors[layer.output].shape[-1]


def _rows(program, layer: Layer) -> int:
    n_out = int(np.prod(program.tensors[layer.output].shape, dtype=np.int64))
    return n_out if layer.kind == "mean" else n_out // _row(program, layer)


def _chain_terms(layer: Layer, row: int, chunk: int) -> tuple[int, int]:
    """``(terms, most per chunk)`` of a split row's chain per statistic: the fp32 terms added one
    after another along the chunks -- a softmax's or mean's elements, a layer_norm's block sums
    (one more per chunk boundary inside a block: the block's partial sum travels on) -- and the
    most of them one chunk adds (what must wait in registers for the fast rate). TFLite's
    integer partials are counted by :meth:`Rows.tile_costs` itself."""
    if layer.kind not in BLOCKED:
        return row, chunk
    blocks = ceil_div(row, LAYER_NORM_BLOCK)
    chunks = ceil_div(row, chunk)
    straddle = 0 if chunk % LAYER_NORM_BLOCK == 0 else chunks - 1
    return blocks + straddle, ceil_div(chunk, LAYER_NORM_BLOCK) + (1 if straddle else 0)


def _multicast_hops(chunks: int, arch: "SpinnArch") -> int:
    """NoC hops of a statistic multicast from the PE holding a split row's last chunk to the
    PEs of its other ``chunks - 1`` chunks: the routers copy the one packet onto every branch
    of the route tree at once, so the farthest PE waits for the hops to it, bounded by twice
    the radius of the chip's mesh of quad-PE routers (:meth:`SpinnArch.noc_hops` of the chip's
    PEs, from its middle), which no route between two of its routers exceeds, and never more
    than the chain's ``chunks - 1`` hops back."""
    return int(min(chunks - 1, 2 * arch.noc_hops(arch.pes_per_chip)))


def _statistics(layer: Layer) -> tuple[int, int]:
    """``(gathers, broadcasts)`` of a split row: statistics combined along the chain of its
    chunks, and those sent back to every chunk (layer_norm: mean then variance, both sent
    back; softmax: the max and the sum of exps, both sent back; mean: its sum, written by the
    last chunk's PE; rms_norm: the sum of squares, its ``1 / sqrt`` sent back)."""
    return {"mean": (1, 0), "rms_norm": (1, 1)}.get(layer.kind, (2, 2))


def _per_elem(layer: Layer, arch: "SpinnArch") -> float:
    """M4F operations per element (softmax: max, subtract, exp, sum, divide; TFLite's integer
    softmax: its kernel's expected cycles per element, :data:`TFLITE_SOFTMAX_CODE`, over
    ``m4f_elementwise_cycles / 2`` per operation; rms_norm: square, add, ``x * r`` and the
    weight's multiply)."""
    if layer.kind == "softmax" and _tflite(layer):
        return float(tflite_softmax_tile_cycles(1, 1, True, 1, _expected(layer), arch)
                     - tflite_softmax_tile_cycles(1, 0, True, 1, _expected(layer), arch)) / (arch.m4f_elementwise_cycles / 2)
    if layer.kind == "rms_norm":
        return 4.0 if _weight(layer) is not None else 3.0
    return {"softmax": 3.0 + arch.exp_unit_cycles, "layer_norm": 6.0, "mean": 1.0}[layer.kind]


#: Columns per iteration of a row kernel's loops over a row: LLVM unrolls them by 4, then runs the
#: row's ``cols mod 4`` remaining columns one by one.
ROW_COLUMN_UNROLL = 4


@dataclass(frozen=True)
class RowLoop:
    """One step of a kernel's loop over rows of columns, as the generated code executes it: a row
    kernel's loop over a tile's rows (:class:`RowPhase`) or the pool kernel's loop over a
    window's rows (:class:`~.pool.PoolCode`). A step is one row, or a pair of rows where LLVM
    unrolls the loop by 2; its columns run in :data:`ROW_COLUMN_UNROLL`-wide iterations, then
    one by one.

    Each piece is the difference of the executed instruction counts between two tiles or
    windows (1 to 4 rows of 1 to 8 columns), by class as :func:`~.m4f.mix_cycles` prices them,
    so a piece can hold a negative count where it turns another piece's taken branch into a
    fall-through (a not-taken branch is counted as ``alu``).

    Attributes
    ----------
    overhead : Mix
        Once per step: its loops' set-up and exits and the step's loop branch (a row kernel's
        statistic loaded, stored or finished, the divides of a mean, variance or reciprocal;
        the pool kernel's row addresses).
    group : Mix
        Per full iteration of the unrolled column loops: 4 columns of each of the step's rows
        and loops (loads, arithmetic, stores, a blocked sum's block-end tests), the index
        increments, the compares and the branches back.
    remainder : tuple of Mix
        Per remaining column ``i + 1`` of the ``cols mod 4``, ``remainder[i]``.
    short : Mix
        Added when the row is narrower than 4 columns: the branches around the unrolled loops
        taken, their entry and exit tests not run.
    """

    overhead: Mix
    group: Mix
    remainder: tuple
    short: Mix

    def cycles(self, cols, arch) -> np.ndarray:
        """Cycles of one step over rows of ``cols`` columns.

        Parameters
        ----------
        cols : numpy.ndarray or int
            Columns of the rows (int64, >= 1).
        arch : SpinnArch
            The TRM's prices (:func:`~.m4f.mix_cycles`).

        Returns
        -------
        numpy.ndarray
            M4F cycles (float64).
        """
        full, rest = np.divmod(np.asarray(cols, dtype=np.int64), ROW_COLUMN_UNROLL)
        rem = np.cumsum([0.0] + [mix_cycles(m, arch) for m in self.remainder])
        return (mix_cycles(self.overhead, arch) + full * mix_cycles(self.group, arch) + rem[rest]
                + np.where(full == 0, mix_cycles(self.short, arch), 0.0))


def stepped_cycles(code, base, rows, cols, arch) -> np.ndarray:
    """``base`` cycles plus those of ``rows`` rows of ``cols`` columns run by ``code``'s loop over
    rows.

    Parameters
    ----------
    code : RowPhase or PoolCode
        The loop: ``code.step_rows`` rows a step (``code.step``, a :class:`RowLoop`), the
        ``rows mod step_rows`` row left over (``code.tail``, None when ``step_rows`` is 1) and
        the unrolled loop's set-up ``code.entry`` once where there is a full step.
    base : float
        What the code runs besides the loop (a job's or an output's fixed cycles).
    rows, cols : numpy.ndarray or int
        Rows, and columns of each row (int64).
    arch : SpinnArch
        The TRM's prices, as :meth:`RowLoop.cycles` takes them.

    Returns
    -------
    numpy.ndarray
        ``base`` plus the loop's M4F cycles (float64).
    """
    steps, left = np.divmod(np.asarray(rows, dtype=np.int64), code.step_rows)
    cycles = base + steps * code.step.cycles(cols, arch) + np.where(steps > 0, mix_cycles(code.entry, arch), 0.0)
    return cycles if code.tail is None else cycles + left * code.tail.cycles(cols, arch)


@dataclass(frozen=True)
class RowPhase:
    """One phase (one job) of an fp32 row kernel (:mod:`tvm_spinn.pe.kernels` ``softmax``,
    ``layer_norm``, ``rms_norm``, ``mean``) as the generated code executes it.

    Attributes
    ----------
    job : Mix
        Once per job: the job loop's step, the kernel's prologue, epilogue and set-up, the row
        loop's entry and exit (the run's start-up, :data:`ROW_RUN`, apart).
    step : RowLoop
        One step of :attr:`step_rows` rows.
    step_rows : int
        Rows per step of the row loop (2 where LLVM unrolls it by 2).
    tail : RowLoop or None
        The ``rows mod step_rows`` row left over (None when ``step_rows`` is 1).
    entry : Mix
        Once per job with at least one full step: the unrolled row loop's set-up.
    finish : Mix
        Per row, what only the chunk holding the row's end runs (its statistic finished: the
        divides and VSQRT), counted in :attr:`step` and :attr:`tail`; a split row's other
        chunks skip it.
    block : RowLoop or None
        Where the phase runs a row's columns a block at a time (:data:`LAYER_NORM_BLOCK`
        columns, blocks aligned at the row's start; the tile's first block from its first
        column to the next block start): one step of this loop per block, its overhead the
        block's set-up and its end (the block's partial joining the sum); :attr:`step` is then
        the row's part only. None: the columns run in one loop (:attr:`step`).
    chain : Mix
        Per row, what a split row's later chunk (its first column past the row's start) runs
        more than the row's first chunk: its running sums loaded from the statistics, not
        started at zero.
    """

    job: Mix
    step: RowLoop
    step_rows: int = 1
    tail: "RowLoop | None" = None
    entry: Mix = Mix()
    finish: Mix = Mix()
    block: "RowLoop | None" = None
    chain: Mix = Mix()

    def cycles(self, rows, cols, arch, last=True, first=0) -> np.ndarray:
        """Cycles of one job over ``rows`` rows of ``cols`` columns (int64 arrays).

        Parameters
        ----------
        rows, cols : numpy.ndarray
            Rows of the tile and columns of each row.
        arch : SpinnArch
            The TRM's prices (:func:`~.m4f.mix_cycles`).
        last : bool or numpy.ndarray
            Whether the tile holds its rows' ends (else :attr:`finish` is skipped).
        first : int or numpy.ndarray
            The tile's first column in its rows (where its blocks start, :attr:`block`).

        Returns
        -------
        numpy.ndarray
            M4F cycles (float64).
        """
        cycles = stepped_cycles(self, mix_cycles(self.job, arch), rows, cols, arch)
        if self.block is not None:
            cycles = cycles + np.asarray(rows, dtype=np.int64) * blocked_cycles(self.block, cols, first, arch)
        cycles = cycles + np.where(np.asarray(first) > 0, rows * mix_cycles(self.chain, arch), 0.0)
        return cycles - np.where(last, 0.0, rows * mix_cycles(self.finish, arch))


def blocked_cycles(loop: RowLoop, cols, first, arch) -> np.ndarray:
    """Cycles of one row's ``cols`` columns run a block at a time by ``loop`` (one step per
    block, :attr:`RowPhase.block`), the row's columns starting at column ``first`` of the row:
    the first block up to the next multiple of :data:`LAYER_NORM_BLOCK`, then whole blocks,
    then what is left.

    Parameters
    ----------
    loop : RowLoop
        One block's loop (its overhead once per block).
    cols, first : numpy.ndarray or int
        Columns (>= 1) and the first column (int64).
    arch : SpinnArch
        The TRM's prices, as :meth:`RowLoop.cycles` takes them.

    Returns
    -------
    numpy.ndarray
        M4F cycles (float64).
    """
    cols = np.asarray(cols, dtype=np.int64)
    head = np.minimum(cols, LAYER_NORM_BLOCK - np.asarray(first, dtype=np.int64) % LAYER_NORM_BLOCK)
    whole, left = np.divmod(cols - head, LAYER_NORM_BLOCK)
    return (loop.cycles(np.maximum(head, 1), arch) + whole * loop.cycles(LAYER_NORM_BLOCK, arch)
            + np.where(left > 0, loop.cycles(np.maximum(left, 1), arch), 0.0))


#: Once per run of a PE's job list: the runtime's start-up and its return to the halt (a
#: whole-row tile runs its phases as one job list; a split row's chunk one job per run, as the
#: chain's statistics arrive).
ROW_RUN = Mix(loads=3.0, paired=7.0, fpu=1.0, alu=9.0, branches=-1.0)
#: The fp32 row kernels as the generated code executes them, one :class:`RowPhase` per phase:
#: the instruction classes of the executed blocks, counted at tiles of 1 to 4 rows of 1 to 8
#: columns (layer_norm with gamma and beta, rms_norm with its weight; the norms' block overhead
#: at rows of 32 and 36 columns, one block and two; their chained sums' loads,
#: :attr:`RowPhase.chain`, at a chunk past the row's start) and priced by
#: :func:`~.m4f.mix_cycles`. softmax: 0, the max (per element a load and the first NaN's
#: compares and selects, eight FPU instructions); 1, ``x - max`` stored, then after the exp/log
#: unit's stream the sequential sum (both row loops unrolled by 2); 2, ``e / sum`` (a VDIV per
#: element, rows in pairs). layer_norm and rms_norm: the blocked sums a block at a time
#: (:attr:`RowPhase.block`: per element a load and VADD, with ``x - mean`` stored and its VMUL
#: in layer_norm's variance, a VMUL in rms_norm's sum of squares; per block its bounds and the
#: partial's select into the sum), then the scaling pass. mean: the sequential sum, rows in
#: pairs, a VDIV per row.
ROW_CODE = {
    "softmax": (
        RowPhase(job=Mix(loads=15.0, paired=36.0, alu=25.0, branches=5.0),
                 step=RowLoop(overhead=Mix(loads=2.0, fpu=1.0, alu=14.0),
                         group=Mix(loads=4.0, fpu=32.0, alu=15.0, branches=1.0),
                         remainder=(Mix(loads=2.0, fpu=8.0, alu=8.0), Mix(loads=1.0, fpu=8.0, alu=5.0),
                                    Mix(loads=1.0, fpu=8.0, alu=4.0)),
                         short=Mix(alu=-6.0, branches=2.0))),
        RowPhase(job=Mix(loads=20.0, paired=42.0, alu=34.0, branches=8.0),
                 entry=Mix(loads=5.0, paired=1.0, alu=24.0, branches=2.0), step_rows=2,
                 step=RowLoop(overhead=Mix(loads=8.0, paired=3.0, fpu=2.0, alu=52.0),
                         group=Mix(loads=9.0, paired=15.0, fpu=16.0, alu=15.0, branches=4.0),
                         remainder=(Mix(loads=10.0, fpu=4.0, alu=22.0), Mix(loads=8.0, fpu=6.0, alu=16.0, branches=-1.0),
                                    Mix(loads=4.0, fpu=2.0, alu=8.0, branches=-1.0)),
                         short=Mix(alu=-23.0, branches=9.0)),
                 tail=RowLoop(overhead=Mix(loads=6.0, paired=2.0, alu=32.0),
                         group=Mix(loads=6.0, paired=6.0, fpu=8.0, alu=13.0, branches=2.0),
                         remainder=(Mix(loads=3.0, fpu=2.0, alu=8.0), Mix(loads=4.0, fpu=3.0, alu=8.0, branches=-1.0),
                                    Mix(loads=2.0, fpu=1.0, alu=4.0)),
                         short=Mix(alu=-19.0, branches=6.0))),
        RowPhase(job=Mix(loads=13.0, paired=36.0, alu=18.0, branches=7.0),
                 entry=Mix(alu=11.0), step_rows=2,
                 step=RowLoop(overhead=Mix(loads=2.0, alu=22.0),
                         group=Mix(loads=4.0, paired=12.0, divides=8.0, alu=6.0, branches=2.0),
                         remainder=(Mix(loads=6.0, divides=2.0, alu=10.0), Mix(loads=4.0, divides=2.0, alu=4.0),
                                    Mix(loads=4.0, divides=2.0, alu=3.0, branches=-1.0)),
                         short=Mix(alu=-12.0, branches=4.0)),
                 tail=RowLoop(overhead=Mix(loads=2.0, alu=13.0, branches=-1.0),
                         group=Mix(loads=2.0, paired=6.0, divides=4.0, alu=3.0, branches=1.0),
                         remainder=(Mix(loads=2.0, divides=1.0, alu=3.0), Mix(loads=2.0, divides=1.0, alu=2.0),
                                    Mix(loads=1.0, paired=1.0, divides=1.0, alu=1.0, branches=-1.0)),
                         short=Mix(alu=-7.0, branches=3.0))),
    ),
    "layer_norm": (
        RowPhase(finish=Mix(loads=1.0, paired=1.0, fpu=2.0, divides=2.0, alu=4.0, branches=-1.0),
                 job=Mix(loads=21.0, paired=37.0, fpu=3.0, alu=36.0, branches=3.0),
                 step=RowLoop(overhead=Mix(loads=10.0, paired=9.0, fpu=4.0, divides=2.0, alu=18.0, branches=5.0),
                         group=Mix(), remainder=(Mix(), Mix(), Mix()), short=Mix()),
                 chain=Mix(loads=1.0, paired=2.0, alu=2.0, branches=-1.0),
                 block=RowLoop(overhead=Mix(loads=4.0, paired=1.0, fpu=3.0, alu=40.0),
                         group=Mix(loads=2.0, paired=2.0, fpu=4.0, alu=3.0, branches=1.0),
                         remainder=(Mix(loads=1.0, fpu=1.0, alu=4.0), Mix(loads=2.0, fpu=2.0, alu=3.0), Mix()),
                         short=Mix(loads=-1.0, alu=-9.0, branches=3.0))),
        RowPhase(finish=Mix(loads=1.0, paired=1.0, fpu=2.0, divides=2.0, alu=4.0, branches=-1.0),
                 job=Mix(loads=21.0, paired=37.0, fpu=3.0, alu=36.0, branches=3.0),
                 step=RowLoop(overhead=Mix(loads=10.0, paired=10.0, fpu=4.0, divides=2.0, alu=19.0, branches=4.0),
                         group=Mix(), remainder=(Mix(), Mix(), Mix()), short=Mix()),
                 chain=Mix(loads=1.0, paired=2.0, alu=2.0, branches=-1.0),
                 block=RowLoop(overhead=Mix(loads=8.0, paired=1.0, fpu=3.0, alu=39.0),
                         group=Mix(loads=4.0, paired=4.0, fpu=12.0, alu=6.0, branches=1.0),
                         remainder=(Mix(loads=3.0, paired=1.0, fpu=3.0, alu=6.0), Mix(loads=2.0, fpu=3.0, alu=5.0),
                                    Mix(loads=2.0, fpu=3.0, alu=4.0)),
                         short=Mix(loads=-3.0, alu=-9.0, branches=3.0))),
        RowPhase(job=Mix(loads=14.0, paired=33.0, alu=31.0, branches=6.0),
                 step=RowLoop(overhead=Mix(loads=3.0, alu=11.0),
                         group=Mix(loads=5.0, paired=11.0, fpu=8.0, divides=4.0, alu=6.0, branches=1.0),
                         remainder=(Mix(loads=4.0, fpu=2.0, divides=1.0, alu=7.0), Mix(loads=4.0, paired=1.0, fpu=2.0, divides=1.0, alu=6.0),
                                    Mix(loads=4.0, fpu=2.0, divides=1.0, alu=5.0)),
                         short=Mix(alu=-5.0, branches=2.0))),
    ),
    "rms_norm": (
        RowPhase(finish=Mix(paired=1.0, fpu=1.0, divides=3.0, alu=1.0, branches=-1.0),
                 job=Mix(loads=15.0, paired=35.0, fpu=4.0, alu=29.0, branches=4.0),
                 step=RowLoop(overhead=Mix(loads=8.0, paired=6.0, fpu=3.0, divides=3.0, alu=9.0, branches=4.0),
                         group=Mix(), remainder=(Mix(), Mix(), Mix()), short=Mix()),
                 chain=Mix(paired=2.0, alu=1.0, branches=-1.0),
                 block=RowLoop(overhead=Mix(loads=1.0, paired=1.0, fpu=3.0, alu=37.0),
                         group=Mix(loads=2.0, paired=2.0, fpu=8.0, alu=3.0, branches=1.0),
                         remainder=(Mix(loads=1.0, paired=1.0, fpu=2.0, alu=4.0), Mix(loads=1.0, fpu=2.0, alu=2.0),
                                    Mix(loads=1.0, fpu=2.0, alu=1.0)),
                         short=Mix(alu=-9.0, branches=3.0))),
        RowPhase(job=Mix(loads=14.0, paired=33.0, alu=28.0, branches=5.0),
                 step=RowLoop(overhead=Mix(loads=3.0, paired=1.0, alu=12.0),
                         group=Mix(loads=3.0, paired=9.0, fpu=8.0, alu=6.0, branches=1.0),
                         remainder=(Mix(loads=5.0, fpu=2.0, alu=7.0), Mix(loads=4.0, fpu=2.0, alu=7.0),
                                    Mix(loads=4.0, fpu=2.0, alu=6.0)),
                         short=Mix(alu=-5.0, branches=3.0))),
    ),
    "mean": (
        RowPhase(finish=Mix(divides=1.0),
                 job=Mix(loads=11.0, paired=34.0, fpu=2.0, alu=16.0, branches=7.0),
                 entry=Mix(loads=2.0, alu=9.0), step_rows=2,
                 step=RowLoop(overhead=Mix(loads=2.0, fpu=2.0, divides=2.0, alu=21.0),
                         group=Mix(loads=4.0, paired=4.0, fpu=8.0, alu=6.0, branches=2.0),
                         remainder=(Mix(loads=2.0, fpu=2.0, alu=10.0), Mix(loads=4.0, fpu=4.0, alu=6.0, branches=-1.0),
                                    Mix()),
                         short=Mix(alu=-11.0, branches=6.0)),
                 tail=RowLoop(overhead=Mix(loads=2.0, divides=1.0, alu=13.0, branches=-1.0),
                         group=Mix(loads=3.0, paired=1.0, fpu=4.0, alu=3.0, branches=1.0),
                         remainder=(Mix(loads=1.0, fpu=1.0, alu=3.0), Mix(loads=2.0, fpu=2.0, alu=3.0, branches=-1.0),
                                    Mix()),
                         short=Mix(alu=-7.0, branches=3.0))),
    ),
}
#: Per element, the sequential fp32 sum's share of a split row's chunk (softmax's sum of exps,
#: mean's sum): a load and a VADD with its loop step. A split row's chunk is charged the chain
#: of the whole row instead (:meth:`Rows.tile_costs`).
_SERIAL = Mix(loads=1.0, fpu=1.0)
#: a term of a split row's chain that does not wait in an FPU register: loaded and added in a loop
_CHAIN_STEP = Mix(loads=1.0, fpu=1.0)


def split_norm_sums(layer: Layer, row: int, cols: int, arch: "SpinnArch") -> tuple[float, float, float]:
    """The sum-of-squares half of an ``rms_norm`` row split over PEs in chunks of ``cols``
    columns (one row, fp32), as :meth:`Rows.tile_costs` prices it: ``(first pass, chain, hop)``
    in cycles -- a middle chunk's run and first phase (:data:`ROW_RUN`, the blocked sums of
    ``x * x``, :data:`ROW_CODE`), the chain of the row's block sums along every chunk (its
    terms at the chain's rate and one NoC hop per chunk boundary), and one hop's cycles.

    Raises
    ------
    ValueError
        ``layer`` not an ``rms_norm``, or ``cols`` not in ``1 .. row - 1`` (a row not split).
    """
    if layer.kind != "rms_norm":
        raise ValueError(f"split_norm_sums: layer {layer.name!r} is a {layer.kind}, not an rms_norm")
    if not 1 <= cols < row:
        raise ValueError(f"split_norm_sums: {cols} columns a chunk do not split a row of {row}")
    first = mix_cycles(ROW_RUN, arch) + float(np.asarray(
        ROW_CODE["rms_norm"][0].cycles(np.array([1]), np.array([cols]), arch, False, np.array([cols]))).reshape(-1)[0])
    terms, held = _chain_terms(layer, row, cols)
    step = arch.m4f_chain_cycles if held <= arch.m4f_chain_registers else pass_cycles((_CHAIN_STEP,), arch)
    chunks = ceil_div(row, cols)
    return first, terms * step + (chunks - 1) * arch.noc_hop_cycles, float(arch.noc_hop_cycles)


def row_tile_cycles(kind: str, rows, cols, arch: "SpinnArch", runs: int = 1, last=True, first=0) -> np.ndarray:
    """M4F cycles of an fp32 row kernel's tile of ``rows`` rows of ``cols`` columns (int64
    arrays, one entry per tile): ``runs`` start-ups (:data:`ROW_RUN`), every phase's job and rows
    (:data:`ROW_CODE`), and softmax's stream through the exp/log unit
    (``exp_unit_latency_cycles`` to its first result, then ``exp_unit_cycles`` per element).

    Parameters
    ----------
    kind : str
        ``softmax``, ``layer_norm``, ``rms_norm`` or ``mean``.
    rows, cols : numpy.ndarray
        Rows of the tile and columns of each row.
    arch : SpinnArch
        The TRM's prices and the exp/log unit's rate.
    runs : int
        Runs of the PE's job list for the tile (1 for a whole-row tile; one per phase for a
        split row's chunk).
    last : bool or numpy.ndarray
        Whether each tile holds its rows' ends (a split row's other chunks skip the row's
        finish, :attr:`RowPhase.finish`).
    first : int or numpy.ndarray
        Each tile's first column in its rows (where a phase run a block at a time starts its
        blocks, :attr:`RowPhase.block`; 0 for a whole-row tile).

    Returns
    -------
    numpy.ndarray
        M4F cycles (float64), the waits on the exp/log unit included.
    """
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    cycles = runs * mix_cycles(ROW_RUN, arch) + sum(p.cycles(rows, cols, arch, last, first) for p in ROW_CODE[kind])
    if kind == "softmax":
        cycles = cycles + arch.exp_unit_latency_cycles + rows * cols * arch.exp_unit_cycles
    return np.asarray(cycles, dtype=np.float64)


#: The ``softmax_tflite`` PE kernel (:mod:`tvm_spinn.pe.kernels`) as it executes, one
#: :class:`TfliteSoftmaxPhase` per phase (0, the max; 1, the exps' sum; 2, the reciprocal and the
#: outputs), by instruction class: least-squares coefficients regressed on the executed counts of
#: single-job runs of 66 tiles (1 to 4 rows of 1 to 120 columns, first chunk or not, three input
#: scales, full-range and near-maximum inputs), priced by :func:`~.m4f.mix_cycles`. They are
#: regression coefficients, not counted instructions: a class's coefficient in one component may
#: be fractional or negative (the fit shares a count between components that move together);
#: each component's price is non-negative. Phases 1 and 2 each run the
#: fixed-point exp per element, whose barrel shifter multiplies once per set bit of the
#: remainder (:attr:`TfliteSoftmaxPhase.bit`), and phase 1 adds only the exps inside
#: ``diff_min``; the model charges them at their expected counts (:func:`softmax_tflite_expected`).
#: A job's mix includes one run's start-up (:data:`ROW_RUN`).
@dataclass(frozen=True)
class TfliteSoftmaxPhase:
    """One phase (one job) of TFLite's integer softmax kernel as the generated code executes it.

    Attributes
    ----------
    job : Mix
        Once per job run alone: the runtime's start-up and return, the kernel's prologue and
        epilogue, the row loop's entry and exit.
    row : Mix
        Per row (phase 2: the reciprocal of the row's sum, three Newton-Raphson steps).
    first : Mix
        Per row where the tile holds the row's first element (its statistic started afresh,
        not read from the chain).
    elem : Mix
        Per element, with no barrel-shifter multiply, outside ``diff_min`` and ``d != 0``.
    bit : Mix
        Per set bit of an element's exp remainder (one barrel-shifter multiply).
    inside : Mix
        Per element with ``d >= diff_min`` (phase 1: its exp rescaled and added).
    zero : Mix
        Per element whose scaled difference is 0 (the row's maximum, or outside ``diff_min``:
        exp's result replaced by one).
    """

    job: Mix
    row: Mix
    first: Mix
    elem: Mix
    bit: Mix = Mix()
    inside: Mix = Mix()
    zero: Mix = Mix()


TFLITE_SOFTMAX_CODE = (
    TfliteSoftmaxPhase(Mix(loads=16.31, paired=42.31, fpu=1.00, alu=17.87, branches=5.43, mla=-0.51),
                       Mix(loads=4.80, paired=1.16, alu=17.59, branches=0.14, mla=1.35),
                       Mix(loads=-0.28, paired=-0.21, alu=0.67, branches=0.49),
                       Mix(loads=0.99, paired=-0.01, alu=3.78, branches=0.24, mla=-0.01)),
    TfliteSoftmaxPhase(Mix(loads=18.00, paired=44.00, fpu=1.00, alu=27.47, branches=-0.95),
                       Mix(loads=8.00, paired=9.00, alu=-10.77, branches=2.84),
                       Mix(alu=2.39, branches=0.17),
                       Mix(loads=7.00, paired=1.00, alu=126.82, branches=16.33, mla=5.00),
                       bit=Mix(alu=15.48, branches=-0.34, mla=1.00),
                       inside=Mix(loads=2.00, paired=1.00, alu=36.18, branches=-3.19),
                       zero=Mix(alu=20.83, branches=-1.92)),
    TfliteSoftmaxPhase(Mix(loads=14.00, paired=42.00, fpu=1.00, alu=21.11, branches=5.25),
                       Mix(loads=20.00, paired=12.00, alu=194.37, branches=9.50, mla=10.00),
                       Mix(alu=4.78, branches=0.19),
                       Mix(loads=15.00, paired=7.00, alu=206.21, branches=9.35, mla=7.00),
                       bit=Mix(alu=15.08, branches=0.11, mla=1.00),
                       inside=Mix(alu=11.30, branches=1.99),
                       zero=Mix(alu=11.10, branches=1.78)),
)


def softmax_tflite_expected(multiplier: int, left_shift: int, diff_min: int) -> tuple[float, float, float]:
    """``(bits, inside, zero)`` per element of TFLite's integer softmax, expected where a row's
    differences ``d = x - max`` spread uniformly over an 8-bit type's span ``[-255, 0]`` (the
    model's assumption; the data is not known when a layer is timed): the set bits of the
    fixed-point exp's remainder (bits 24 to 30 of ``(s mod 2**24) - 2**24 - s``, one barrel
    multiply each), the share inside ``diff_min`` and the share whose scaled difference ``s``
    is 0 (exp's result replaced by one)."""
    d = np.arange(-255, 1, dtype=_I64)
    inside = d >= diff_min
    s = srdhm(wrap32(np.where(inside, d, 0) << left_shift), multiplier)
    rem = wrap32(wrap32((s & ((1 << 24) - 1)) - (1 << 24)) - s)
    bits = sum((rem >> k) & 1 for k in range(24, 31))
    return float(bits.mean()), float(inside.mean()), float((s == 0).mean())


def tflite_softmax_tile_cycles(rows, cols, first, runs, expected, arch: "SpinnArch") -> np.ndarray:
    """M4F cycles of ``softmax_tflite`` tiles of ``rows`` rows of ``cols`` columns (int arrays),
    ``first`` where a tile holds its rows' first elements, ``runs`` runs of the PE's job list
    (1 for a whole-row tile, its three phases in one list; 3 for a split row's chunk), with
    ``expected`` = :func:`softmax_tflite_expected`'s ``(bits, inside, zero)`` per element."""
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    bits, inside, zero = expected
    total = (runs - len(TFLITE_SOFTMAX_CODE)) * mix_cycles(ROW_RUN, arch)
    for ph in TFLITE_SOFTMAX_CODE:
        elem = (mix_cycles(ph.elem, arch) + bits * mix_cycles(ph.bit, arch) + inside * mix_cycles(ph.inside, arch)
                + zero * mix_cycles(ph.zero, arch))
        total = total + mix_cycles(ph.job, arch) + rows * (mix_cycles(ph.row, arch)
                                                           + np.where(first, mix_cycles(ph.first, arch), 0.0))
        total = total + rows * cols * elem
    return np.asarray(total, dtype=np.float64)


def _expected(layer: Layer) -> tuple[float, float, float]:
    """:func:`softmax_tflite_expected` of a TFLite integer softmax layer's attributes."""
    return softmax_tflite_expected(int(layer.attrs["multiplier"]), int(layer.attrs["left_shift"]),
                                   int(layer.attrs["diff_min"]))


def _tflite(layer: Layer) -> bool:
    """A layer with TFLite's integer arithmetic (int8/uint8 in and out)."""
    return layer.attrs.get("rounding") == "tflite"


# -- TFLite's integer softmax and mean (see the module docstring) ------------------------------
def softmax_tflite_params(input_scale: float, beta: float = 1.0) -> tuple[int, int, int]:
    """``(multiplier, left_shift, diff_min)`` of TFLite's int8/uint8 softmax for an input scale:
    ``PreprocessSoftmaxScaling(beta, input_scale, 5)`` and ``-CalculateInputRadius(5, left_shift)``.
    Raises ``ValueError`` where TFLite's own check fails (``beta * scale * 2**26 <= 1``)."""
    real = min(float(beta) * float(input_scale) * (1 << (31 - _SCALED_DIFF_BITS)), (1 << 31) - 1.0)
    if not real > 1.0:
        raise ValueError(f"softmax input scale {input_scale} is too small for TFLite's integer softmax "
                         "(beta * scale * 2**26 must exceed 1)")
    multiplier, left_shift = tflite_quantize_multiplier(real)
    radius = math.floor(((1 << _SCALED_DIFF_BITS) - 1) * (1 << (31 - _SCALED_DIFF_BITS)) / (1 << left_shift))
    return multiplier, left_shift, -radius


def mean_tflite_params(input_scale: float, output_scale: float, n: int) -> tuple[int, int]:
    """``(multiplier, shift)`` of TFLite's integer mean of ``n`` elements: ``QuantizeMultiplier(
    s_x / s_y)`` (float32 scales read as doubles) with ``1 / n`` folded in as
    ``QuantizedMeanOrSum`` does; ``shift`` in :func:`~tvm_spinn.program.quant.requantize_tflite`'s
    convention (``31 - exponent``)."""
    m0, exponent = tflite_quantize_multiplier(float(_F32(input_scale)) / float(_F32(output_scale)))
    k = min(int(n).bit_length() - 1, 32, 31 + exponent)
    return (m0 << k) // int(n), 31 - (exponent - k)


def softmax_tflite(x: np.ndarray, multiplier: int, left_shift: int, diff_min: int, out_dtype) -> np.ndarray:
    """TFLite's integer softmax of the rows ``x`` [rows, n] (int8 or uint8), see the module
    docstring; returns ``out_dtype`` (int8: zero point -128, uint8: 0; scale 1/256)."""
    lo, hi = QUANT_RANGES[np.dtype(out_dtype).name]
    x = np.asarray(x, dtype=_I64)
    diff = x - x.max(axis=-1, keepdims=True)
    inside = diff >= diff_min
    scaled = srdhm(wrap32(np.where(inside, diff, 0) << left_shift), multiplier)
    exps = exp_on_negative_values(scaled, _SCALED_DIFF_BITS)
    # Rescale<12> of a Q0.31 value to Q12.19: a rounding division by 2**12
    total = wrap32(np.where(inside, rounding_divide_by_pot(exps, _ACCUM_BITS), 0).sum(axis=-1, keepdims=True))
    headroom = count_leading_zeros32(total)
    bits_over_unit = _ACCUM_BITS - headroom
    reciprocal = one_over_one_plus_x(wrap32(((total & 0xFFFFFFFF) << headroom) - (1 << 31)))
    out = rounding_divide_by_pot(srdhm(reciprocal, exps), bits_over_unit + 31 - 8) + lo  # 8-bit output
    return np.where(inside, np.clip(out, lo, hi), lo).astype(out_dtype)


def mean_tflite(x: np.ndarray, x_zero: int, multiplier: int, shift: int, y_zero: int, out_dtype) -> np.ndarray:
    """TFLite's integer mean of the rows ``x`` [rows, n] (int8 or uint8): one value per row."""
    lo, hi = QUANT_RANGES[np.dtype(out_dtype).name]
    total = wrap32(np.asarray(x, dtype=_I64).sum(axis=-1) - x_zero * x.shape[-1])
    return requantize_tflite(total, multiplier, shift, y_zero, lo, hi).astype(out_dtype)


def _nonneg_num(v, field: str) -> float:
    if check_num(v, field) < 0:
        fail(field, f"{v} must be >= 0")
    return float(v)


def _row_sum(x: np.ndarray) -> np.ndarray:
    """Sequential fp32 sum of each row of ``x`` [rows, row]."""
    out = np.empty(x.shape[0], dtype=_F32)
    x = np.ascontiguousarray(x, dtype=_F32)
    _lib._func("tvm_spinn.sim.row_sum_f32")(_lib._input(x), out)
    return out


def _ffi_in(x: np.ndarray) -> np.ndarray:
    """``x`` as a contiguous float32 kernel input (read-only constants as writable-flagged views)."""
    return _lib._input(np.ascontiguousarray(x, dtype=_F32))


_NONE = np.zeros(0, dtype=_F32)


def _softmax(x: np.ndarray) -> np.ndarray:
    """Rows ``x`` [rows, row]: ``e / sum(e)``, ``e = exp(x - max)`` (C++ ``softmax_f32``)."""
    out = np.empty(x.shape, dtype=_F32)
    _lib._func("tvm_spinn.sim.softmax_f32")(_ffi_in(x), out, 0)
    return out


def _rms_norm(x: np.ndarray, eps, weight) -> np.ndarray:
    """Rows ``x`` [rows, row] RMS-normalized, then scaled (C++ ``rms_norm_f32``)."""
    out = np.empty(x.shape, dtype=_F32)
    _lib._func("tvm_spinn.sim.rms_norm_f32")(_ffi_in(x), _NONE if weight is None else _ffi_in(weight), float(eps), out, 0)
    return out


def _layer_norm(x: np.ndarray, eps, gamma, beta) -> np.ndarray:
    """Rows ``x`` [rows, row] normalized, then scaled and shifted (C++ ``layer_norm_f32``)."""
    out = np.empty(x.shape, dtype=_F32)
    _lib._func("tvm_spinn.sim.layer_norm_f32")(
        _ffi_in(x), _NONE if gamma is None else _ffi_in(gamma), _NONE if beta is None else _ffi_in(beta),
        float(eps), out, 0)
    return out


class Rows(OpFamily):
    """softmax, layer_norm, rms_norm and mean: whole rows per PE, or a long row split into chunks on
    several PEs chained by their partial sums (see the module docstring)."""

    tile_arity = 2

    def sums_squares_first(self, layer: Layer) -> bool:
        return layer.kind == "rms_norm"

    kinds = ("softmax", "layer_norm", "rms_norm", "mean")
    #: ``qsoftmax_tflite`` / ``qmean_tflite``: TFLite's integer softmax and mean (the partitioner
    #: offers these patterns only to modules marked ``spinn_quant_rounding="tflite"``)
    #: ``rms_norm`` / ``rms_norm_bare``: Llama's decomposed RMSNorm with / without its weight,
    #: ``rms_norm_nn``: ``relax.nn.rms_norm``
    composites = ("softmax", "layer_norm", "rms_norm", "rms_norm_bare", "rms_norm_nn", "mean", "qsoftmax_tflite",
                  "qmean_tflite")
    # before the quantize/dequantize family (20): the TFLite patterns contain its operators
    priority = 15

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        from tvm.relax.dpl import is_const, is_op, wildcard

        gamma, beta, x = is_const(), is_const(), wildcard()
        layer_norm = is_op("relax.nn.layer_norm")(x, gamma, beta)
        return [
            self._tflite_entry(kit, "spinn.qsoftmax_tflite", "relax.nn.softmax"),
            self._tflite_entry(kit, "spinn.qmean_tflite", "relax.mean"),
            kit.entry("spinn.layer_norm", layer_norm, {"input": x, "gamma": gamma, "beta": beta, "root": layer_norm},
                      self._check_pattern),
            *self._rms_norm_entries(kit),
            kit.unary("spinn.softmax", "relax.nn.softmax", self._check_pattern),
            kit.unary("spinn.mean", "relax.mean", self._check_pattern),
        ]

    def _rms_norm_entries(self, kit) -> list[tuple]:
        """Llama's RMSNorm as transformers' ``LlamaRMSNorm`` is imported (``x * rsqrt(mean(x ** 2,
        -1, keepdim) + eps)``, then ``weight * .``), with and without the weight (before
        ``spinn.mean``, which would take its mean), and ``relax.nn.rms_norm``."""
        from tvm.relax.dpl import is_const, is_op, wildcard

        def commuted(op, a, b):
            return is_op(op)(a, b) | is_op(op)(b, a)

        x, exponent, eps, weight = wildcard(), is_const(), is_const(), is_const()
        power = is_op("relax.power")(x, exponent)
        mean = is_op("relax.mean")(power)
        var = is_op("relax.add")(mean, eps)
        rsqrt = is_op("relax.rsqrt")(var)
        norm = commuted("relax.multiply", x, rsqrt)
        scaled = commuted("relax.multiply", weight, norm)
        parts = {"input": x, "exponent": exponent, "power": power, "mean": mean, "eps": eps, "norm": norm}
        nx, nweight = wildcard(), is_const()
        nn = is_op("relax.nn.rms_norm")(nx, nweight)
        return [
            kit.entry("spinn.rms_norm", scaled, dict(parts, weight=weight, root=scaled), self._check_rms_norm),
            kit.entry("spinn.rms_norm_bare", norm, dict(parts, root=norm), self._check_rms_norm),
            kit.entry("spinn.rms_norm_nn", nn, {"input": nx, "weight": nweight, "root": nn}, self._check_rms_norm),
        ]

    @staticmethod
    def _check_rms_norm(kit, op: str, ctx) -> bool:
        ann = ctx.annotated_expr
        root, x = ann["root"], ann["input"]
        if not kit.check_tensors(op, ctx, ("input", "weight"), ("float32",)):
            return False
        shape = kit.static_shape(root)
        if kit.static_shape(x) != shape:
            return kit.refuse(op, root, f"input {kit.static_shape(x)} broadcast to {shape}")
        rank, row = len(shape), shape[-1]
        if "weight" in ann and kit.static_shape(ann["weight"]) != (row,):
            return kit.refuse(op, root, f"weight of shape {kit.static_shape(ann['weight'])} (need ({row},))")

        def scalar(name):
            value = ann[name].value.numpy()
            return float(value.reshape(-1)[0]) if value.size == 1 and value.dtype == np.float32 else None

        if op == "spinn.rms_norm_nn":
            axes = [int(a) % rank for a in root.attrs.axes]
            if axes != [rank - 1]:
                return kit.refuse(op, root, f"rms_norm over axes {axes} (only the last axis)")
            eps = float(root.attrs.epsilon)
        else:
            if scalar("exponent") != 2.0:
                return kit.refuse(op, root, "power of x is not a float32 scalar 2 (not an RMSNorm)")
            mean = ann["mean"]
            axes = sorted(int(a) % rank for a in mean.attrs.axis) if mean.attrs.axis is not None else None
            if axes != [rank - 1] or not bool(mean.attrs.keepdims):
                return kit.refuse(op, root, f"mean of x**2 over axes {axes} (RMSNorm: the last, kept)")
            eps = scalar("eps")
            if eps is None:
                return kit.refuse(op, root, "epsilon is not a float32 scalar")
        if not (math.isfinite(eps) and eps >= 0):
            return kit.refuse(op, root, f"epsilon {eps} (need a finite value >= 0)")
        # a row too long for a PE is split into chunks of whole blocks (Rows.choose_tile)
        block = min(row, LAYER_NORM_BLOCK)
        return kit.check_fits(op, root, smallest_row_tile_bytes(block), f"a block of {block} elements")

    def _tflite_entry(self, kit, name: str, op: str) -> tuple:
        """``quantize(op(dequantize(x)))`` with per-tensor parameters: TFLite's integer op."""
        from tvm.relax.dpl import is_const, is_op, wildcard

        x, x_scale, x_zero, y_scale, y_zero = wildcard(), is_const(), is_const(), is_const(), is_const()
        dq = is_op("relax.dequantize")(x, x_scale, x_zero)
        inner = is_op(op)(dq)
        root = is_op("relax.quantize")(inner, y_scale, y_zero)
        return kit.entry(name, root, {"input": x, "x_scale": x_scale, "x_zero": x_zero, "dq": dq, "op": inner,
                                      "y_scale": y_scale, "y_zero": y_zero, "root": root}, self._check_tflite)

    def _check_tflite(self, kit, op: str, ctx) -> bool:
        ann = ctx.annotated_expr
        root, x, inner = ann["root"], ann["input"], ann["op"]
        if not kit.check_quantized(op, root, x, "input"):
            return False
        if kit.dtype(root) != kit.dtype(x):
            return kit.refuse(op, root, f"{kit.dtype(x)} input quantized to {kit.dtype(root)}")
        if not (kit.check_qparams(op, root, ctx, "x_scale", "x_zero", None, "input")
                and kit.check_qparams(op, root, ctx, "y_scale", "y_zero", None, "output")):
            return False
        dq = ann["dq"]
        if str(dq.attrs.out_dtype) != "float32":
            return kit.refuse(op, root, f"dequantize to {dq.attrs.out_dtype}")
        if op == "spinn.qsoftmax_tflite":
            lo = QUANT_RANGES[kit.dtype(x)][0]
            y_scale, y_zero = (float(ann[k].value.numpy().reshape(-1)[0]) for k in ("y_scale", "y_zero"))
            if y_scale != 1.0 / 256 or y_zero != lo:
                return kit.refuse(op, root, f"softmax output scale {y_scale} / zero point {y_zero:g} "
                                            f"(TFLite's integer softmax: 1/256, {lo})")
            try:
                softmax_tflite_params(float(ann["x_scale"].value.numpy().reshape(-1)[0]))
            except ValueError as err:
                return kit.refuse(op, root, str(err))
        # the float op's own checks (axes, SRAM of a row) on the op between the Q/DQ pair
        plain = SimpleNamespace(annotated_expr={"input": dq, "root": inner})
        return self._check_pattern(kit, "spinn.softmax" if op == "spinn.qsoftmax_tflite" else "spinn.mean", plain)

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        if not kit.check_tensors(op, ctx, ("input", "gamma", "beta")):
            return False
        root = ctx.annotated_expr["root"]
        shape = kit.static_shape(root)
        attrs = root.attrs
        if op == "spinn.mean":
            in_shape = kit.static_shape(ctx.annotated_expr["input"])
            rank = len(in_shape)
            axes = sorted(int(a) % rank for a in attrs.axis) if attrs.axis is not None else list(range(rank))
            if axes != list(range(rank - len(axes), rank)):
                return kit.refuse(op, root, f"mean over axes {axes} (only trailing axes)")
            row = int(np.prod(in_shape[rank - len(axes):], dtype=np.int64))
            return kit.check_fits(op, root, smallest_row_tile_bytes(row, reduce=True), f"a row of {row} elements")
        if op == "spinn.softmax":
            axis = int(attrs.axis)
            if axis not in (-1, len(shape) - 1):
                return kit.refuse(op, root, f"softmax over axis {axis} (only the last axis)")
        else:
            axes = [int(a) % len(shape) for a in attrs.axes]
            if axes != [len(shape) - 1]:
                return kit.refuse(op, root, f"layer_norm over axes {axes} (only the last axis)")
        # One whole row (in, out, double buffered) must fit a PE.
        return kit.check_fits(op, root, smallest_row_tile_bytes(shape[-1]), f"a row of {shape[-1]} elements")

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        if kind.endswith("_tflite"):
            self._lower_tflite(lowerer, kind, calls, env, layer)
            return
        if kind.startswith("rms_norm"):
            self._lower_rms_norm(lowerer, kind, calls, env, layer)
            return
        call = calls[0][1]
        layer.inputs = [lowerer.operand(call.args[0], env)]
        if kind == "layer_norm":
            layer.consts["gamma"] = lowerer.operand(call.args[1], env)
            layer.consts["beta"] = lowerer.operand(call.args[2], env)
            layer.attrs["epsilon"] = float(call.attrs.epsilon)
            layer.attrs["center"] = bool(call.attrs.center)
            layer.attrs["scale"] = bool(call.attrs.scale)
        elif kind == "mean":
            in_shape = lowerer.tensors[layer.inputs[0]].shape
            axes = call.attrs.axis
            n_axes = len(axes) if axes is not None else len(in_shape)
            layer.attrs["row"] = int(np.prod(in_shape[len(in_shape) - n_axes:], dtype=np.int64))

    def _lower_rms_norm(self, lowerer, kind: str, calls: list, env: dict, layer: Layer) -> None:
        """One ``rms_norm`` layer: the input, the weight (if any) and epsilon as a float32 value."""
        from tvm.ir.expr import Constant

        layer.kind = "rms_norm"
        by_op: dict[str, list] = {}
        for _, call in calls:
            by_op.setdefault(str(call.op.name), []).append(call)
        if kind == "rms_norm_nn":
            call = by_op["relax.nn.rms_norm"][0]
            layer.inputs = [lowerer.operand(call.args[0], env)]
            layer.consts["weight"] = lowerer.operand(call.args[1], env)
            layer.attrs["epsilon"] = float(_F32(float(call.attrs.epsilon)))
            return
        layer.inputs = [lowerer.operand(by_op["relax.power"][0].args[0], env)]
        layer.attrs["epsilon"] = float(by_op["relax.add"][0].args[1].value.numpy().astype(_F32).reshape(-1)[0])
        if kind == "rms_norm":  # the multiply with a constant operand is the weight's
            for call in by_op["relax.multiply"]:
                weights = [a for a in call.args if isinstance(a, Constant)]
                if weights:
                    layer.consts["weight"] = lowerer.operand(weights[0], env)

    def _lower_tflite(self, lowerer, kind: str, calls: list, env: dict, layer: Layer) -> None:
        """``quantize(op(dequantize(x)))`` as one integer layer with TFLite's arithmetic."""
        by_op = {str(call.op.name): call for _, call in calls}
        dq, q = by_op["relax.dequantize"], by_op["relax.quantize"]

        def scalar(expr, dtype):
            return expr.value.numpy().astype(dtype).reshape(-1)[0]

        layer.kind = "softmax" if kind == "qsoftmax_tflite" else "mean"
        layer.inputs = [lowerer.operand(dq.args[0], env)]
        layer.attrs["rounding"] = "tflite"
        x_scale = float(scalar(dq.args[1], np.float32))
        if layer.kind == "softmax":
            m, left_shift, diff_min = softmax_tflite_params(x_scale)
            layer.attrs.update(multiplier=m, left_shift=left_shift, diff_min=diff_min)
            return
        mean = by_op["relax.mean"]
        in_shape = lowerer.tensors[layer.inputs[0]].shape
        n_axes = len(mean.attrs.axis) if mean.attrs.axis is not None else len(in_shape)
        row = int(np.prod(in_shape[len(in_shape) - n_axes:], dtype=np.int64))
        m, shift = mean_tflite_params(x_scale, float(scalar(q.args[1], np.float32)), row)
        layer.attrs.update(row=row, x_zero=int(scalar(dq.args[2], np.int64)), y_zero=int(scalar(q.args[2], np.int64)),
                           multiplier=m, shift=shift)

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        tflite = {"rounding": lambda v, f: check_str(v, f, ("tflite",))}
        if kind == "layer_norm":
            return {"epsilon": _nonneg_num}, {"center": check_bool, "scale": check_bool}
        if kind == "rms_norm":
            return {"epsilon": _nonneg_num}, {}
        if kind == "mean":
            return {"row": POSINT}, dict(tflite, x_zero=ZERO, y_zero=ZERO, shift=lambda v, f: check_int(v, f, 0, 62),
                                         multiplier=lambda v, f: check_int(v, f, 0, (1 << 31) - 1))
        return {}, dict(tflite, multiplier=lambda v, f: check_int(v, f, 1 << 30, (1 << 31) - 1),
                        left_shift=lambda v, f: check_int(v, f, 0, 31), diff_min=lambda v, f: check_int(v, f, None, 0))

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        v.need(f"{f}.inputs", kind, ins, 1)
        ishape, oshape = v.shapes[ins[0]], v.shapes[out]
        integer = kind in _TFLITE_ATTRS and "rounding" in attrs
        given = sorted(k for k in _TFLITE_ATTRS.get(kind, ()) if k in attrs)
        if not integer and given:
            fail(f"{f}.attrs", f"{given} belong to TFLite's integer {kind} (rounding='tflite')")
        if integer:
            missing = sorted(set(_TFLITE_ATTRS[kind]) - attrs.keys())
            if missing:
                fail(f"{f}.attrs", f"missing key(s) {missing} of TFLite's integer {kind}")
            dtype = v.dtype(f"{f}.inputs[0]", ins[0], ("int8", "uint8"))
            v.dtype(fo, out, (dtype,))
        else:
            v.dtype(f"{f}.inputs[0]", ins[0], ("float32",))
            v.dtype(fo, out, ("float32",))
        numel = math.prod(oshape)
        if kind == "mean":
            v.consts(f, consts, set())
            row = attrs["row"]
            tails = {math.prod(ishape[len(ishape) - n:]) for n in range(len(ishape) + 1)}
            if row not in tails or math.prod(ishape) != numel * row:
                fail(f"{f}.attrs.row", f"{row} is not the size of trailing axes of {ishape} "
                                       f"reducing to {oshape}")
            return (numel, row), None
        if kind == "rms_norm":
            v.consts(f, consts, set(), {"weight"})
        else:
            v.consts(f, consts, {"gamma", "beta"} if kind == "layer_norm" else set())
        v.shape(fo, out, ishape)
        if kind in BLOCKED:
            for role in consts:  # layer_norm's gamma and beta, rms_norm's weight
                v.dtype(f"{f}.consts.{role}", consts[role], ("float32",))
                v.shape(f"{f}.consts.{role}", consts[role], ishape[-1:])
        # tiles hold rows of the last axis and chunks of a row
        return (numel // oshape[-1] if oshape else 1, oshape[-1] if oshape else 1), None

    # -- tiles as data ------------------------------------------------------------------------
    def region_extent(self, program, layer):
        return (_rows(program, layer), _row(program, layer))

    def expand_regions(self, program, layer, tile):
        rows, row = self.region_extent(program, layer)
        r0, r1 = starts(rows, int(tile[0]))
        c0, c1 = starts(row, int(tile[1]))
        ri = np.repeat(np.arange(len(r0)), len(c0))
        ci = np.tile(np.arange(len(c0)), len(r0))
        lo = np.stack([r0[ri], c0[ci]], axis=1)
        hi = np.stack([r1[ri], c1[ci]], axis=1)
        return lo, hi, np.full(len(ri), -1, dtype=np.int64)

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        return int(_rows(program, layer) * _row(program, layer) * _per_elem(layer, arch)), None

    def smallest_tile_bytes(self, program, layer, arch):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        row = _row(program, layer)
        if layer.kind == "rms_norm":  # one block of a row split over PEs (:meth:`choose_tile`)
            row = min(row, LAYER_NORM_BLOCK)
        return smallest_row_tile_bytes(row, ie, oe, reduce=layer.kind == "mean")

    def choose_tile(self, program, layer, arch, pes, naive):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        rows, row = _rows(program, layer), _row(program, layer)
        unit = 2 * (ie + oe)  # SRAM bytes per element of a tile (in and out, double-buffered)
        width, least = row, 1
        if layer.kind == "rms_norm" and unit * row > arch.tile_sram_bytes:
            # A row too long for a PE (Llama-2-70B's 8,192) is split into the fewest chunks of
            # whole blocks that fit the working budget, chained as a split row always is.
            most_blocks = max(1, working_budget(arch) // unit // LAYER_NORM_BLOCK)
            least = ceil_div(row, most_blocks * LAYER_NORM_BLOCK)
            width = ceil_div(ceil_div(row, least), LAYER_NORM_BLOCK) * LAYER_NORM_BLOCK
            least = ceil_div(row, width)
        cap = max(1, working_budget(arch) // (unit * width))
        whole = [max(1, min(cap, ceil_div(rows, max(1, pes // least)))), width]
        if naive or whole[0] > 1 or pes // rows <= least:
            return whole
        # Fewer rows than PEs: split each row over up to pes // rows PEs where that lowers the
        # layer's modelled time (every PE then holds one tile: the slowest tile's compute and
        # DMA). The chain keeps the serial terms whole (a layer_norm's: one per block), so a
        # split pays through the element-wise work and the DMA it parallelizes (a plain mean:
        # its DMA only).
        best, best_time = whole, self._tile_time(program, layer, arch, whole)
        most = min(pes // rows, row)
        # powers of two, and the fewest chunks whose terms fit the FPU registers (the chain's
        # fast rate with the fewest hops; layer_norm: one block per chunk)
        fit = ceil_div(row, LAYER_NORM_BLOCK) if layer.kind in BLOCKED else ceil_div(row, arch.m4f_chain_registers)
        counts = sorted({2 ** i for i in range(1, most.bit_length())} | {fit})
        for k in (k for k in counts if max(2, least + 1) <= k <= most):
            tile = [1, ceil_div(row, k)]
            t = self._tile_time(program, layer, arch, tile)
            if t < best_time:
                best, best_time = tile, t
        return best

    def _tile_time(self, program, layer, arch, tile) -> float:
        """Cycles of the slowest tile of ``tile`` with one tile per PE: its DMA in and out
        (per-transfer setup plus bytes at the PE's DMA rate) and its compute."""
        lo, hi, _ = self.expand_regions(program, layer, tile)
        _, in_b, w_b, out_b, cycles = (np.broadcast_to(np.asarray(v, dtype=np.float64), (len(lo),))
                                       for v in self.tile_costs(program, layer, arch, tile, lo, hi))
        moves = (in_b > 0).astype(np.float64) + (w_b > 0) + (out_b > 0)
        dma = moves * arch.dma_setup_cycles + (in_b + w_b + out_b) / arch.dma_bw_bytes_per_cycle
        return float((dma + cycles).max())

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        row = _row(program, layer)
        r = (hi - lo)[:, 0]
        c = (hi - lo)[:, 1]
        n = r * c
        # a mean's output row is written by the tile holding the row's last chunk
        n_res = np.where(hi[:, 1] == row, r, 0) if layer.kind == "mean" else n
        w_b = c * sum(itemsize(program, tid) for tid in layer.consts.values())
        code, wait = self._code_and_wait(layer, arch, row, tile, lo, hi)
        cycles = np.ceil(code + wait)
        return 2 * (ie * n + oe * n_res), ie * n, w_b, oe * n_res, cycles

    def chain_wait(self, program, layer, arch, tile, lo, hi) -> np.ndarray:
        """Cycles of each tile that :meth:`tile_costs` charges beyond the PE code the tile
        executes: a split row's chain (the other chunks' serial terms and the NoC hops, the
        statistics broadcast back), less the chunk's own sequential sum where the chain takes
        its place. Zero for whole-row tiles.

        Parameters
        ----------
        program : Program
            The program holding ``layer``.
        layer : Layer
            A row layer.
        arch : SpinnArch
            The target's rates.
        tile : sequence of int
            ``[rows, columns]`` of the tiling.
        lo, hi : numpy.ndarray
            The tiles' regions (:meth:`expand_regions`).

        Returns
        -------
        numpy.ndarray
            Cycles per tile (float64; negative where a chunk's terms wait in FPU registers and
            the chain adds them faster than the chunk's loop would).
        """
        return np.broadcast_to(self._code_and_wait(layer, arch, _row(program, layer), tile, lo, hi)[1], (len(lo),))

    def _code_and_wait(self, layer, arch, row, tile, lo, hi):
        """``(code, wait)`` per tile: the M4F cycles of the PE code the tile executes, and
        :meth:`chain_wait`'s."""
        r = (hi - lo)[:, 0]
        c = (hi - lo)[:, 1]
        n = r * c
        integer = _tflite(layer)
        chunks = ceil_div(row, int(tile[1]))
        op = arch.m4f_elementwise_cycles / 2  # cycles per integer operation of TFLite's kernels
        if integer and layer.kind == "mean":  # the generated kernel's counted job, rows and elements
            code = tflite_mean_tile_cycles(r, c, hi[:, 1] == row, arch)
        elif integer:  # TFLite's integer softmax: the kernel's counted phases
            code = tflite_softmax_tile_cycles(r, c, lo[:, 1] == 0, 1 if chunks == 1 else len(TFLITE_SOFTMAX_CODE),
                                              _expected(layer), arch)
        else:  # the generated code's phases over the tile's rows of c columns
            code = row_tile_cycles(layer.kind, r, c, arch, 1 if chunks == 1 else len(ROW_CODE[layer.kind]),
                                   hi[:, 1] == row, lo[:, 1])
        if chunks == 1:
            return code, np.zeros(len(lo))
        gathers, broadcasts = _statistics(layer)
        if layer.kind == "mean" and not integer:
            # Nothing is sent back: a chunk waits only for the partial of the chunks before it,
            # each summing its own columns of the tile's rows at the generated loop's rate (its
            # unrolled group of 4 columns per row), one NoC hop per chunk before it.
            phase = ROW_CODE["mean"][0]
            rate = (phase.cycles(r, 2 * ROW_COLUMN_UNROLL, arch) - phase.cycles(r, ROW_COLUMN_UNROLL, arch)) / (
                ROW_COLUMN_UNROLL * np.maximum(r, 1))
            before = lo[:, 1] // int(tile[1])
            return code, r * (lo[:, 1] * rate + before * arch.noc_hop_cycles)
        # the chain: per row the serial sums over the whole row (every chunk waits for the
        # statistic sent back) with one NoC hop per chunk boundary per statistic gathered; the
        # chunk's own sequential sum is part of the chain. A statistic goes back to the chunks
        # as one multicast packet from the chain's last PE, which the routers copy on towards
        # every chunk's PE (as a barrier's wake-up packet): the hops to the farthest
        # (:func:`_multicast_hops`), not one hop per chunk boundary
        serial = pass_cycles((_SERIAL,), arch) if layer.kind == "softmax" and not integer else 0.0
        hops = (gathers * (chunks - 1) + broadcasts * _multicast_hops(chunks, arch)) * arch.noc_hop_cycles
        chain_adds = gathers * (chunks - 1) if integer else 0.0  # integer partials added
        terms, held = _chain_terms(layer, row, int(tile[1]))
        # a chunk whose terms fit the FPU registers computes them (loads, squares, block sums)
        # while the running sum travels: the chain then costs one dependent add per term, not a
        # load and an add
        step = (arch.m4f_chain_cycles if held <= arch.m4f_chain_registers
                else pass_cycles((_CHAIN_STEP,), arch))
        chained = 0.0 if integer else terms * (1 if serial else gathers) * step
        return code, r * (chained + chain_adds * op + hops) - n * serial

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        x = runner.env[runner.layer.inputs[0]]
        row = runner.layer.attrs["row"] if runner.layer.kind == "mean" else x.shape[-1]
        runner.rows_in = np.ascontiguousarray(x).reshape(-1, row)

    def run_tile(self, runner, tile) -> None:
        # A tile holding chunks [c0, c1) of its rows computes the rows whole with the same
        # kernel (the chained partial sums give the whole row's sums in their order) and writes
        # only its chunk: every tiling has the bits of the whole-row kernel.
        (r0, r1), (c0, c1) = tile.region
        layer = runner.layer
        x = runner.rows_in[r0:r1]
        row = x.shape[-1]
        if layer.kind == "mean":
            if c1 != row:  # the row's last chunk writes its mean
                return
            out = _integer(layer, x, runner.out.dtype) if _tflite(layer) else _row_sum(x) / _F32(row)
            runner.out.reshape(-1)[r0:r1] = out
            return
        if _tflite(layer):
            out = _integer(layer, x, runner.out.dtype)
        elif layer.kind == "softmax":
            out = _softmax(x)
        elif layer.kind == "rms_norm":
            weight = _weight(layer)
            out = _rms_norm(x, _F32(layer.attrs["epsilon"]), None if weight is None else runner.env[weight])
        else:
            gamma = runner.env[layer.consts["gamma"]] if layer.attrs.get("scale", True) else None
            beta = runner.env[layer.consts["beta"]] if layer.attrs.get("center", True) else None
            out = _layer_norm(x, _F32(layer.attrs["epsilon"]), gamma, beta)
        runner.out.reshape(-1, row)[r0:r1, c0:c1] = out[:, c0:c1]

    def whole_region(self, layer, out):
        if layer.kind == "mean":
            return ((0, out.size), (0, int(layer.attrs["row"])))
        row = out.shape[-1] if out.ndim else 1
        return ((0, out.size // max(row, 1)), (0, row))

    def step(self, program, layer):
        """The whole output at once: the same rows and operations as :meth:`run_tile`."""
        tensors = program.tensors
        shape = tuple(tensors[layer.output].shape)
        x_tid = layer.inputs[0]
        rows_shape = (-1, int(layer.attrs["row"]) if layer.kind == "mean" else int(tensors[x_tid].shape[-1]))
        if _tflite(layer):
            dtype = np.dtype(tensors[layer.output].dtype)
            return lambda program, env: _integer(layer, np.reshape(env[x_tid], rows_shape), dtype).reshape(shape)
        if np.dtype(tensors[layer.output].dtype) != _F32:
            return None
        if layer.kind == "mean":
            d = _F32(rows_shape[1])
            return lambda program, env: (_row_sum(np.ascontiguousarray(env[x_tid]).reshape(rows_shape)) / d).reshape(shape)
        if layer.kind == "softmax":
            return lambda program, env: _softmax(np.reshape(env[x_tid], rows_shape)).reshape(shape)
        eps = _F32(layer.attrs["epsilon"])
        if layer.kind == "rms_norm":
            weight = _weight(layer)
            weight = None if weight is None else _ffi_in(program.constants[weight])
            return lambda program, env: _rms_norm(np.reshape(env[x_tid], rows_shape), eps, weight).reshape(shape)
        # prepared once: contiguous float32 views the FFI accepts (constants are read-only)
        gamma = _ffi_in(program.constants[layer.consts["gamma"]]) if layer.attrs.get("scale", True) else None
        beta = _ffi_in(program.constants[layer.consts["beta"]]) if layer.attrs.get("center", True) else None
        return lambda program, env: _layer_norm(np.reshape(env[x_tid], rows_shape), eps, gamma, beta).reshape(shape)

    def native(self, program, layer, nb, clip=None):
        """The rows of :meth:`step` as one instruction: the same C++ row kernels."""
        tensors = program.tensors
        x_tid = layer.inputs[0]
        if _tflite(layer) or tensors[layer.output].dtype != "float32" or tensors[x_tid].dtype != "float32":
            return False
        total = native.numel(tensors[x_tid].shape)
        cols = int(layer.attrs["row"]) if layer.kind == "mean" else int(tensors[x_tid].shape[-1])
        rows = total // cols
        if layer.kind == "layer_norm":
            none = native.codes()["none"]
            gamma = nb.read(layer.consts["gamma"]) if layer.attrs.get("scale", True) else none
            beta = nb.read(layer.consts["beta"]) if layer.attrs.get("center", True) else none
            nb.emit("layer_norm", nb.read(x_tid), gamma, beta, native.f32_bits(layer.attrs["epsilon"]),
                    nb.write(layer.output), rows, cols)
            return True
        if layer.kind == "rms_norm":
            weight = _weight(layer)
            nb.emit("rms_norm", nb.read(x_tid), native.codes()["none"] if weight is None else nb.read(weight),
                    native.f32_bits(layer.attrs["epsilon"]), nb.write(layer.output), rows, cols)
            return True
        nb.emit(layer.kind, nb.read(x_tid), nb.write(layer.output), rows, cols)
        return True


def _integer(layer: Layer, rows: np.ndarray, dtype) -> np.ndarray:
    """TFLite's integer softmax (rows of the output) or mean (one value per row) of ``rows``."""
    a = layer.attrs
    if layer.kind == "softmax":
        return softmax_tflite(rows, a["multiplier"], a["left_shift"], a["diff_min"], dtype)
    return mean_tflite(rows, a["x_zero"], a["multiplier"], a["shift"], a["y_zero"], dtype)


class RowsSharding(ShardingRule):
    """Row operators keep a split that is not on their reduced axes (leading axes keep their
    index). On the tensor axis a softmax whose rows are split along the reduced axis (attention
    over KV-cache slots spread over the chips) keeps its slice: the row maxima are all-reduced
    (exact in any order), then the sums of ``exp(x - max)`` by the chain that continues one
    accumulator from chip to chip in slot order, the one-chip kernel's sequential left-to-right
    sum, the same bits. Any other split is gathered (on the sequence and data axes every
    input is gathered for a replicated output)."""

    def propagate(self, ctx, layer, ins):
        full = ctx.full
        x = ctx.acts(layer)[0]
        src = full[x]
        rows = int(np.prod(full[layer.output], dtype=np.int64))
        width = int(np.prod(src, dtype=np.int64)) // max(1, rows) if layer.kind == "mean" else src[-1]
        reduced, acc = len(src), 1
        while reduced > 0 and acc < width:
            reduced -= 1
            acc *= src[reduced]
        s = ins[0]
        if s.split and s.axis < reduced:
            return ShardDecision(s, "split")
        if ctx.axis.name in ("sp", "dp"):
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        if s.split and layer.kind == "softmax" and s.axis == len(src) - 1 and src[-1] >= ctx.size:
            n_rows = rows // max(1, src[-1])
            return ShardDecision(s, "split", (RowAllReduce(0, n_rows * 4, True), RowAllReduce(0, n_rows * 4, False)))
        if s.split:
            return ShardDecision(REPLICATE, "rep", (GatherInput(0),))
        return ShardDecision(REPLICATE, "rep")

    def shrinks_row_consts(self, layer):
        return False  # per-feature constants (gamma, beta) are not on the rows


Rows.sharding = RowsSharding()
register(Rows())
