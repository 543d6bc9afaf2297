"""Training losses on the PEs: ``cross_entropy`` (log-softmax and NLL of each row) and its
gradient ``cross_entropy_backward``.

A training step's mean cross-entropy is reduced on the PEs in two layers (the graph form
:mod:`tvm_spinn.training.graph` gives it, see :func:`~tvm_spinn.training.graph.loss_on_pes`):

- ``cross_entropy`` (composite ``spinn.cross_entropy``: ``nll_loss(log_softmax(z), t,
  reduction="none")``): logits ``z`` [rows, classes] float32 and int32 labels ``t`` [rows] ->
  the per-row loss [rows]: ``m`` = the row's max (its first NaN if it has one), ``s`` = the
  sequential fp32 sum of ``exp(z - m)`` left to right from 0 (the ``softmax`` kind's
  statistics), ``loss = log(s) - (z[t] - m)`` (the negated log-softmax at the label; exp and
  log from the exp/log unit's models, C++ ``cross_entropy_f32``); a row whose label is
  ``ignore_index`` gives +0. The batch mean that follows is the rows family's ``mean`` over the
  per-row losses: a sequential fp32 sum in ascending row order, then one divide.
- ``cross_entropy_backward`` (composite ``spinn.cross_entropy_backward``: ``divide(subtract(
  softmax(z), one_hot(t)), n)``): ``(p - onehot) / n`` per element with ``p`` the softmax's
  bits, ``n`` a float32 constant (the mean's divisor; C++ ``cross_entropy_grad_f32``).

Every reduction is inside one row (in a fixed order) or the mean's ascending chain, so the
bits do not depend on the mapping: the layers are computed whole by the kernel and each tile
copies its run of the result (:class:`~.base.ComputedFlat`), and a split over chips keeps rows
whole (:class:`LossSharding`). Labels must lie in ``[0, classes)`` (or equal ``ignore_index``
in the forward): anything else is a ValueError naming the label and the row.

The cost: the forward is its PE kernel as executed (:func:`cross_entropy_tile_cycles`: the
softmax kernel's max and exp-sum passes, the exps and the rows' logs streamed through the exp/log
unit, the label's logit and the loss per row, counted instructions priced by the Cortex-M4 TRM);
the backward's M4F cycles are its PE kernel's too (``xent_grad``, :func:`xent_grad_tile_cycles`:
the executed pieces of each phase, :data:`XENT_GRAD_CODE`). A row is whole on one PE: rows that
fit the working SRAM stay resident (the row of logits in, and out for the backward,
double-buffered: up to 3,583 classes at the 56 KiB working share of a PE's SRAM), each read
once; a longer row (a language model's vocabulary: GPT-2's 50,257 logits are 201 KB) is streamed
through the PE in chunks of :data:`STREAM_CHUNK` logits, once for the max and once for the sum
(and once more for the backward's output, whose exps the PE computes again), so its DRAM reads
are two (three) passes over the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import _lib
from ..checks import check_int, check_num, fail
from ..model import Layer
from . import native
from .base import ComputedFlat, ceil_div, register, working_budget
from .m4f import Mix
from .sharding import REPLICATE, ShardDecision, ShardingRule, shard

__all__ = ["CrossEntropy", "cross_entropy_rows", "cross_entropy_grad", "cross_entropy_tile_cycles", "CE_CODE",
           "LossSharding", "GradPhase", "XENT_GRAD_CODE", "XENT_GRAD_RUN", "resident_rows", "xent_grad_tile_cycles"]

_F32 = np.float32
#: M4F operations per logit of the forward (subtract, exp model ~12 operations, compare, add)
#: and of the backward (the same, then the subtract and the exp model again for the output, a
#: divide, a subtract and a divide): an assumption counted from the kernel's operations
#: (Cephes expf: a reduction, a degree-6 polynomial and a scale). The forward's are its work
#: measure (:meth:`CrossEntropy.work`); its cycles are :func:`cross_entropy_tile_cycles`.
_FORWARD_OPS, _BACKWARD_OPS = 15.0, 31.0
#: M4F operations of the log model (a frexp, a degree-8 polynomial, the ln 2 terms), per row.
_LOG_OPS = 25.0
#: Logits per DMA chunk of a row streamed through a PE (a row too long for the working SRAM):
#: 4 KB of fp32, double-buffered in and out (an assumption: the DMA's block size, the same
#: order as the GEMM tiles' k chunks).
STREAM_CHUNK = 1024


@dataclass(frozen=True)
class GradPhase:
    """One phase (one job) of the ``xent_grad`` PE kernel (:mod:`tvm_spinn.pe.kernels`) as the
    generated code executes it, in M4F cycles at the Cortex-M4 TRM's prices
    (:mod:`tvm_spinn.pe.cycles`): each piece the difference of the executed cycles of single
    jobs (read from the ISS at jobs of 1 to 8 rows of 256 and 512 classes), the exp/log unit's
    stream apart (``exp_unit_latency_cycles`` once, ``exp_unit_cycles`` per element).

    Attributes
    ----------
    job : float
        The job loop's step, the kernel's prologue, set-up and epilogue.
    row : float
        Per row (per pair of rows' worth where LLVM unrolls the row loop by 2).
    element : float
        Per logit of a row in a pair of rows (every row where the loop is not unrolled).
    tail : float
        Per logit of the odd row left over after the pairs.
    exp : bool
        Whether the phase streams its logits through the exp/log unit.
    """

    job: float
    row: float
    element: float
    tail: float
    exp: bool = False

    def cycles(self, rows: int, cols: int, arch) -> float:
        """Cycles of one job over ``rows`` rows of ``cols`` logits."""
        paired, odd = (rows // 2) * 2, rows % 2
        c = self.job + rows * self.row + cols * (paired * self.element + odd * self.tail)
        if self.exp:
            c += arch.exp_unit_latency_cycles + rows * cols * arch.exp_unit_cycles
        return c


#: The ``xent_grad`` kernel's phases: 0, the max; 1, ``x - max``, the exps, their sum (row
#: loops unrolled by 2); 2, the output (two VDIV per logit); 3, phase 1 without the sum (a
#: streamed row's exps again).
XENT_GRAD_CODE = {
    0: GradPhase(job=94.0, row=22.0, element=14.25, tail=14.25),
    1: GradPhase(job=169.0, row=37.5, element=9.0, tail=10.75, exp=True),
    2: GradPhase(job=97.0, row=24.0, element=37.0, tail=37.0),
    3: GradPhase(job=142.0, row=17.0, element=5.125, tail=7.0, exp=True),
}
#: The runtime's start-up and return per run of a PE's job list.
XENT_GRAD_RUN = 22.0


def resident_rows(classes: int, arch) -> int:
    """Rows of ``classes`` logits a PE holds at once (their logits in and out, their statistics
    and labels, within the working SRAM), or 0 where a row streams through the PE in chunks of
    :data:`STREAM_CHUNK` (a row whose double-buffered logits exceed the working SRAM).

    Parameters
    ----------
    classes : int
        Logits per row.
    arch : SpinnArch
        The chip (its working SRAM, :func:`~.base.working_budget`).

    Returns
    -------
    int
        Rows per group, 0 for a streamed row.
    """
    if _row_bytes(classes) > working_budget(arch):
        return 0
    return max(1, working_budget(arch) // (8 * classes + 12))


def xent_grad_tile_cycles(rows: int, classes: int, arch) -> float:
    """M4F cycles of a ``cross_entropy_backward`` tile of ``rows`` whole rows as the PE kernel
    runs them: resident rows in groups (:func:`resident_rows`), one run of phases 0, 1, 2 per
    group; a streamed row per chunk one run of phase 0, one of phase 1, then one of phases 3
    and 2 (:data:`XENT_GRAD_CODE`).

    Parameters
    ----------
    rows, classes : int
        The tile's rows and their logits.
    arch : SpinnArch
        The exp/log unit's rate and latency, the working SRAM.

    Returns
    -------
    float
        M4F cycles, the waits on the exp/log unit included.
    """
    code = XENT_GRAD_CODE
    group = resident_rows(classes, arch)
    if group:
        def run(n):
            return XENT_GRAD_RUN + sum(code[ph].cycles(n, classes, arch) for ph in (0, 1, 2))
        full, left = divmod(int(rows), group)
        return full * run(group) + (run(left) if left else 0.0)
    per_row = 0.0
    for c0 in range(0, classes, STREAM_CHUNK):
        c = min(STREAM_CHUNK, classes - c0)
        per_row += (3 * XENT_GRAD_RUN + code[0].cycles(1, c, arch) + code[1].cycles(1, c, arch)
                    + code[3].cycles(1, c, arch) + code[2].cycles(1, c, arch))
    return int(rows) * per_row


def _labels(labels: np.ndarray) -> np.ndarray:
    return _lib._input(np.ascontiguousarray(labels, dtype=np.int32))


def cross_entropy_rows(z: np.ndarray, labels: np.ndarray, ignore_index: int = -100) -> np.ndarray:
    """Per-row cross-entropy of logits ``z`` [rows, classes] (C++ ``cross_entropy_f32``)."""
    out = np.empty(z.shape[0], dtype=_F32)
    _lib._func("tvm_spinn.sim.cross_entropy_f32")(_lib._input(np.ascontiguousarray(z, dtype=_F32)),
                                                   _labels(labels), int(ignore_index), out, 0)
    return out


def cross_entropy_grad(z: np.ndarray, labels: np.ndarray, divisor: float) -> np.ndarray:
    """``(softmax(z) - one_hot(labels)) / divisor`` (C++ ``cross_entropy_grad_f32``)."""
    out = np.empty(z.shape, dtype=_F32)
    _lib._func("tvm_spinn.sim.cross_entropy_grad_f32")(_lib._input(np.ascontiguousarray(z, dtype=_F32)),
                                                        _labels(labels), float(divisor), out, 0)
    return out


#: The ``cross_entropy`` PE kernel (:mod:`tvm_spinn.pe.kernels`) as it executes beyond the
#: ``softmax`` kernel's phases 0 and 1 (the max; ``x - max``, the exps' stream and their sum:
#: the same TIR, priced by :data:`~.rows.ROW_CODE`), by instruction class, priced by
#: :func:`~.m4f.mix_cycles`. Counted on its executed blocks: per row, the difference of the
#: counts of one-job runs of 9 rows and of 1 row over 8 (the row loops are unrolled, so a
#: component may hold a fraction or a negative count); per job, the 1-row run less its row and
#: the run's start-up (:data:`~.rows.ROW_RUN`). ``args``: per job of phase 0 or 1, what the
#: kernel's four more arguments cost over softmax's (their loads from the stack). Phase 2:
#: ``label_job`` and ``label_row`` (the label's logit ``z[t] - max`` picked in the chunk that
#: holds it), ``other_row`` (a chunk without the label: the range test only), ``finish_job``
#: and ``finish_row`` (the row's last chunk: the pick, the sums copied into one stream through
#: the exp/log unit's log, the loss written).
CE_CODE = {
    "args": Mix(loads=4.0, paired=6.0, alu=-2.5, branches=1.5),
    "label_job": Mix(loads=24.5, paired=38.875, alu=20.0, branches=8.125),
    "label_row": Mix(loads=3.5, paired=2.125, fpu=1.0, alu=11.0, branches=-0.125),
    "other_row": Mix(loads=2.5, paired=0.125, alu=8.25, branches=0.875),
    "finish_job": Mix(loads=34.125, paired=45.125, fpu=-1.0, alu=36.75, branches=13.75),
    "finish_row": Mix(loads=6.875, paired=4.875, fpu=3.0, alu=18.25, branches=0.25),
}


def cross_entropy_tile_cycles(rows, classes: int, arch) -> np.ndarray:
    """M4F cycles of ``cross_entropy`` tiles of ``rows`` whole rows of ``classes`` logits (an int
    array, one entry per tile), as the PE kernel runs them: a row that fits the working SRAM
    in one run of the three phases; a longer row streamed through the PE in chunks of
    :data:`STREAM_CHUNK` logits, one run per chunk for the max and one for the exps' sum and the
    label (the label charged in the last chunk, the others testing it only). The waits on the
    exp/log unit are included (``exp_unit_latency_cycles`` to a stream's first result, then
    ``exp_unit_cycles`` per element: the chunk's exps, then the rows' logs).

    Parameters
    ----------
    rows : numpy.ndarray
        Rows of each tile (int64).
    classes : int
        Logits per row.
    arch : SpinnArch
        The TRM's prices and the exp/log unit's rate.

    Returns
    -------
    numpy.ndarray
        M4F cycles (float64).
    """
    from .m4f import mix_cycles
    from .rows import ROW_CODE, ROW_RUN
    rows = np.asarray(rows, dtype=np.int64)
    max_pass, exp_pass = ROW_CODE["softmax"][:2]
    price = {k: mix_cycles(v, arch) for k, v in CE_CODE.items()}
    run = mix_cycles(ROW_RUN, arch)

    def stream(n):
        return arch.exp_unit_latency_cycles + n * arch.exp_unit_cycles

    def chunk(width, last):
        stats = (max_pass.cycles(rows, width, arch) + exp_pass.cycles(rows, width, arch) + 2 * price["args"]
                 + stream(rows * width))
        if last:
            return stats + price["finish_job"] + rows * price["finish_row"] + stream(rows)
        return stats + price["label_job"] + rows * price["other_row"]

    if _row_bytes(classes) <= working_budget(arch):
        return np.asarray(run + chunk(classes, True), dtype=np.float64)
    full, rest = divmod(classes, STREAM_CHUNK)
    widths = [STREAM_CHUNK] * full + ([rest] if rest else [])
    cycles = 2 * len(widths) * run + (len(widths) - 1) * chunk(STREAM_CHUNK, False) + chunk(widths[-1], True)
    return np.asarray(cycles, dtype=np.float64)


class CrossEntropy(ComputedFlat):
    """``cross_entropy`` and ``cross_entropy_backward`` (see the module docstring)."""

    kinds = ("cross_entropy", "cross_entropy_backward")
    # before the rows family (15): the patterns contain its softmax and mean operators
    priority = 12

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        from tvm.relax.dpl import is_const, is_op, wildcard

        z, t = wildcard(), wildcard()
        lsm = is_op("relax.nn.log_softmax")(z)
        fwd = is_op("relax.nn.nll_loss")(lsm, t)
        z2, t2, n = wildcard(), wildcard(), is_const()
        sm = is_op("relax.nn.softmax")(z2)
        hot = is_op("relax.one_hot")(t2, wildcard(), wildcard())
        diff = is_op("relax.subtract")(sm, hot)
        bwd = is_op("relax.divide")(diff, n)
        return [
            kit.entry("spinn.cross_entropy", fwd, {"z": z, "t": t, "lsm": lsm, "root": fwd}, self._check_forward),
            kit.entry("spinn.cross_entropy_backward", bwd,
                      {"z": z2, "t": t2, "sm": sm, "hot": hot, "n": n, "root": bwd}, self._check_backward),
        ]

    @staticmethod
    def _check_operands(kit, op: str, ctx, softmax_call) -> bool:
        from tvm import relax

        root = ctx.annotated_expr["root"]
        if not kit.check_tensors(op, ctx, ("z",)):
            return False
        labels = ctx.annotated_expr["t"]
        if not isinstance(labels.ty, relax.TensorType) or kit.static_shape(labels) is None \
                or kit.dtype(labels) != "int32":
            return kit.refuse(op, root, "labels are not int32 with a static shape")
        z, t = (kit.static_shape(ctx.annotated_expr[k]) for k in ("z", "t"))
        if len(z) != 2 or t != (z[0],):
            return kit.refuse(op, root, f"logits {z} and labels {t} (need [rows, classes] and [rows])")
        if int(softmax_call.attrs.axis) not in (-1, 1):
            return kit.refuse(op, root, f"softmax over axis {int(softmax_call.attrs.axis)} (need the classes)")
        return kit.check_fits(op, root, _row_bytes(min(z[1], STREAM_CHUNK)), f"a chunk of a row of {z[1]} classes")

    def _check_forward(self, kit, op: str, ctx) -> bool:
        root = ctx.annotated_expr["root"]
        if root.attrs.reduction != "none" or len(root.args) != 2:
            return kit.refuse(op, root, f"nll_loss with reduction {root.attrs.reduction!r} or class weights "
                                        "(the per-row losses are the layer; the mean is a rows layer)")
        return self._check_operands(kit, op, ctx, ctx.annotated_expr["lsm"])

    def _check_backward(self, kit, op: str, ctx) -> bool:
        root, hot, n = (ctx.annotated_expr[k] for k in ("root", "hot", "n"))
        a = hot.attrs
        if int(a.axis) not in (-1, 1) or _prim(hot.args[1]) != 1.0 or _prim(hot.args[2]) != 0.0:
            return kit.refuse(op, root, "one_hot other than on 1, off 0 along the classes")
        value = n.value.numpy()
        if value.dtype != np.float32 or value.size != 1 or not np.isfinite(value).all():
            return kit.refuse(op, root, "divisor is not one finite float32 constant")
        if not self._check_operands(kit, op, ctx, ctx.annotated_expr["sm"]):
            return False
        if int(a.depth) != kit.static_shape(ctx.annotated_expr["z"])[1]:
            return kit.refuse(op, root, f"one_hot depth {int(a.depth)} is not the number of classes")
        return True

    def lower(self, lowerer, name, kind, calls, env, layer) -> None:
        by_op = {call.op.name: call for _, call in calls}
        if kind == "cross_entropy":
            nll = by_op["relax.nn.nll_loss"]
            layer.inputs = [lowerer.operand(by_op["relax.nn.log_softmax"].args[0], env),
                            lowerer.operand(nll.args[1], env)]
            layer.attrs["ignore_index"] = int(nll.attrs.ignore_index)
        else:
            layer.inputs = [lowerer.operand(by_op["relax.nn.softmax"].args[0], env),
                            lowerer.operand(by_op["relax.one_hot"].args[0], env)]
            layer.attrs["divisor"] = float(by_op["relax.divide"].args[1].value.numpy().reshape(-1)[0])

    # -- program validation -----------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        if kind == "cross_entropy":
            return {"ignore_index": lambda v, f: check_int(v, f)}, {}
        return {"divisor": _divisor}, {}

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        v.need(f"{f}.inputs", kind, ins, 2)
        v.consts(f, consts, set())
        v.dtype(f"{f}.inputs[0]", ins[0], ("float32",))
        v.dtype(f"{f}.inputs[1]", ins[1], ("int32",))
        v.dtype(f"{f}.output", out, ("float32",))
        rows, classes = v.rank(f"{f}.inputs[0]", ins[0], 2, 2)
        v.shape(f"{f}.inputs[1]", ins[1], [rows])
        v.shape(f"{f}.output", out, [rows] if kind == "cross_entropy" else [rows, classes])
        return (math.prod(v.shapes[out]),), None

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        rows, classes = (int(d) for d in program.tensors[layer.inputs[0]].shape)
        ops = _FORWARD_OPS if layer.kind == "cross_entropy" else _BACKWARD_OPS
        return int(rows * classes * ops + (rows * _LOG_OPS if layer.kind == "cross_entropy" else 0)), None

    def _classes(self, program, layer) -> int:
        return int(program.tensors[layer.inputs[0]].shape[1])

    def smallest_tile_bytes(self, program, layer, arch):
        return _row_bytes(min(self._classes(program, layer), STREAM_CHUNK))

    def choose_tile(self, program, layer, arch, pes, naive):
        """Whole rows per tile (the forward's output elements are rows; the backward's tiles
        are runs of whole rows of its output), spread over the PEs within the working SRAM (one
        streamed row per tile where a row does not fit it)."""
        classes = self._classes(program, layer)
        rows = int(program.tensors[layer.inputs[0]].shape[0])
        cap = max(1, working_budget(arch) // _row_bytes(classes))
        per = max(1, min(cap, ceil_div(rows, pes)))
        return [per if layer.kind == "cross_entropy" else per * classes]

    @staticmethod
    def _passes(layer, classes: int, arch) -> tuple[int, int]:
        """(reads of each logit, SRAM bytes per row): 1 and the row where it fits the working
        SRAM, else the streamed passes and one chunk."""
        if _row_bytes(classes) <= working_budget(arch):
            return 1, _row_bytes(classes)
        return (2 if layer.kind == "cross_entropy" else 3), 0

    def cycles_per_element(self, layer, arch):
        raise NotImplementedError  # tile_costs below prices whole rows

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        classes = self._classes(program, layer)
        e = (hi - lo)[:, 0]
        rows = e if layer.kind == "cross_entropy" else np.ceil(e / classes)
        logits = rows * classes
        if layer.kind == "cross_entropy":
            cycles = np.ceil(cross_entropy_tile_cycles(rows, classes, arch))
            out_bytes = 4 * rows
        else:  # the PE kernel's phases as it runs them (:func:`xent_grad_tile_cycles`)
            per = {int(r): xent_grad_tile_cycles(int(r), classes, arch) for r in np.unique(rows)}
            cycles = np.ceil(np.array([per[int(r)] for r in np.ravel(rows)]).reshape(np.shape(rows)))
            out_bytes = 4 * logits
        passes, row_sram = self._passes(layer, classes, arch)
        in_bytes = passes * 4 * logits + 4 * rows
        sram = row_sram * rows if row_sram else np.full(np.shape(rows), _row_bytes(STREAM_CHUNK))
        return sram, in_bytes, 0, out_bytes, cycles

    # -- functional simulator -----------------------------------------------------------------
    def native(self, program, layer, nb, clip=None):
        """One ``cross_entropy`` / ``cross_entropy_grad`` instruction: the kernels of
        :meth:`values` (labels range-checked when the plan runs)."""
        z, t = layer.inputs
        rows, classes = (int(d) for d in program.tensors[z].shape)
        if layer.kind == "cross_entropy":
            nb.emit("cross_entropy", nb.read(z), nb.read(t), nb.write(layer.output), rows, classes,
                    int(layer.attrs["ignore_index"]))
        else:
            nb.emit("cross_entropy_grad", nb.read(z), nb.read(t), nb.write(layer.output), rows, classes,
                    native.f32_bits(_F32(layer.attrs["divisor"])))
        return True

    def values(self, layer: Layer, env) -> np.ndarray:
        z, t = (env[tid] for tid in layer.inputs)
        if layer.kind == "cross_entropy":
            return cross_entropy_rows(z, t, layer.attrs["ignore_index"])
        return cross_entropy_grad(z, t, layer.attrs["divisor"])


def _prim(expr) -> float | None:
    """The number a one_hot's on/off value (a ``FloatImm``/``IntImm``, or a ``PrimValue`` of
    one) holds, or None."""
    for _ in range(2):
        expr = getattr(expr, "value", None)
        if isinstance(expr, int | float):
            return float(expr)
    return None


def _row_bytes(classes: int) -> int:
    """SRAM of one row: its logits in (and out, for the backward) double-buffered, the label."""
    return 2 * (4 * classes + 4 * classes + 4)


def _divisor(v, f) -> float:
    value = check_num(v, f)
    if not math.isfinite(value) or value == 0:
        fail(f, f"{v} must be a finite non-zero number")
    return float(value)


class LossSharding(ShardingRule):
    """Rows are independent (each reads its logits and its label): a split of the rows (axis 0)
    that the split operands share is kept, on any mesh axis; a split of the classes would cut
    a row's max and sum, so it is gathered first (a vocabulary-parallel loss would all-reduce
    them instead, which this rule does not do)."""

    def propagate(self, ctx, layer, ins):
        axes = {s.axis for s in ins if s.split}
        if axes == {0}:
            return ShardDecision(shard(0), "split")
        if axes:
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        return ShardDecision(REPLICATE, "rep")


CrossEntropy.sharding = LossSharding()
register(CrossEntropy())
