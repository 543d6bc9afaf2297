"""Tensor parallelism of a granule's gradient program (Megatron's split), bits independent of ``tp``.

Megatron-LM splits each transformer block over ``tp`` ranks (chips): the QKV and MLP-up
projections are *column-parallel* (rank ``r`` owns the output features of its heads, of its
block of the MLP's hidden features) and the attention-output and MLP-down projections are
*row-parallel* (rank ``r`` owns the input features it receives from its column-parallel
partner, and produces a partial sum of the full output). Attention runs head by head on the
rank owning the head.

Which additions does the split move? A column-parallel GEMM's outputs are independent sums over
the whole k range, computed on one rank each exactly as on one chip; so is every weight
gradient (``dW = X^T dY`` reduces over the batch rows, which every rank holds whole). Two GEMMs
per split layer reduce over the *sharded* axis: the forward of a row-parallel layer (k = its
input features) and the input gradient of a column-parallel layer (``dX = dY W^T``: k = its
output features). Megatron all-reduces their partial sums, in an order that depends on ``tp``.
Here they are a **chain**: the sharded axis, in ascending order, is cut into runs of consecutive
indices owned by one rank (one run per rank for a plain block split; a fused QKV weight gives
each rank one run in each of Q, K and V), and the run on ``[k1, k2)`` continues the accumulator
the run on ``[k0, k1)`` finished (:mod:`tvm_spinn.program.ops.gemm_chain`), passed from rank to
rank. A PE's fp32 GEMM adds the k terms of an output in ascending k into one accumulator, so the
chain makes the same additions of the same values in the same order as the one-chip GEMM: the
gradients, and the parameters after any number of steps, are bitwise those of ``tp = 1`` (and
so of every data- and pipeline-parallel plan, :mod:`.parallel`, :mod:`.pipeline`).

:func:`split_gemms` rewrites the gradient program accordingly: each chain GEMM becomes its first
run (a GEMM on the PEs, from zero) followed by one continuation per further run (the simulator's
GEMM kernel continuing the accumulator, run by the host's VM through ``call_dps_packed``); the
column-parallel GEMMs, weight gradients and attention keep one op each (each rank's share of
them is a slice of its outputs, with the same bits). :func:`tp_compute` prices one rank's share
of a granule (:meth:`~tvm_spinn.training.parallel.DataParallelTrainer.simulated_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ..program.ops.gemm_chain import PACKED, register_packed
from .errors import TrainingError
from .tp_chain import chain_blocks, chain_makespan, chain_seconds

__all__ = ["TPShard", "ChainGemm", "TPSplit", "tp_layout", "split_gemms", "tp_compute", "chain_makespan"]

#: module (leaf) names of the column-parallel projections (GPT-2 ``Conv1D``, Llama ``Linear``)
COLUMN = ("c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
#: module names of the row-parallel projections (GPT-2's ``attn.c_proj`` and ``mlp.c_proj``)
ROW = ("c_proj", "o_proj", "down_proj")
#: projections whose output is the three fused Q, K, V blocks (each split by heads)
FUSED_QKV = ("c_attn",)


@dataclass(frozen=True)
class TPShard:
    """How a weight is split: ``kind`` ``"column"`` or ``"row"``; ``axis``: the weight's axis
    the ranks split; ``owner``: the rank owning each index of that axis."""

    name: str
    kind: str
    axis: int
    owner: tuple

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """``(rank, k0, k1)``: maximal runs of consecutive indices with one owner, ascending."""
        out, start = [], 0
        for k in range(1, len(self.owner) + 1):
            if k == len(self.owner) or self.owner[k] != self.owner[start]:
                out.append((int(self.owner[start]), start, k))
                start = k
        return tuple(out)


@dataclass(frozen=True)
class ChainGemm:
    """A GEMM of the gradient program reducing over a sharded axis: ``[m, k] @ [k, n]`` as a
    chain over ``runs`` (``(rank, k0, k1)``) of weight ``name``."""

    name: str
    m: int
    k: int
    n: int
    runs: tuple


@dataclass(frozen=True)
class TPSplit:
    """A gradient program split over ``tp`` ranks.

    Attributes
    ----------
    mod : tvm.IRModule
        ``main(inputs, params, targets) -> (loss, grads)`` with the chains.
    chains : tuple of ChainGemm
        The GEMMs computed as chains (row-parallel forwards, column-parallel input gradients).
    parallel : tuple of (str, int, int, int, int)
        ``(name, m, k, n, split)`` per GEMM a rank does a ``1 / tp`` share of, ``split`` the
        index of the shared extent (0: m, 2: n): column-parallel forwards and row-parallel input
        gradients (n), every split weight's gradient (its weight's sharded axis; the GEMM
        reduces over the batch rows).
    sharded_bytes, replicated_bytes : int
        Parameter bytes split over the ranks and held by every rank.
    """

    mod: tvm.IRModule
    tp: int
    chains: tuple
    parallel: tuple
    sharded_bytes: int
    replicated_bytes: int


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check(tp: int, extent: int, axis: str) -> None:
    if extent % tp:
        raise TrainingError(f"parallel: tp={tp} does not divide {axis} ({extent}); tp may be {_divisors(extent)}")


def tp_layout(model, param_names, param_shapes, tp: int) -> tuple:
    """Each parameter's :class:`TPShard` (None: replicated) under ``tp`` ranks.

    Raises
    ------
    TrainingError
        When ``tp`` does not divide a split axis (heads, key-value heads, MLP features), naming
        the axis and the values that would work; when the model has no projection to split.
    """
    modules = dict(model.named_modules())
    for sub in modules.values():  # grouped-query attention: tp splits the key-value heads too
        kv = getattr(getattr(sub, "config", None), "num_key_value_heads", None)
        if isinstance(kv, int) and not isinstance(kv, bool):
            _check(tp, kv, "the key-value heads")
            break
    out = []
    for name, shape in zip(param_names, param_shapes):
        owner_name, _, leaf = name.rpartition(".")
        mod_leaf = owner_name.rpartition(".")[2]
        if leaf != "weight" or mod_leaf not in COLUMN + ROW or len(shape) != 2:
            out.append(None)
            continue
        module = modules.get(owner_name)
        # transformers' Conv1D stores (in, out); torch's Linear (out, in)
        out_axis = 1 if type(module).__name__ == "Conv1D" else 0
        kind = "column" if mod_leaf in COLUMN else "row"
        axis = out_axis if kind == "column" else 1 - out_axis
        extent = int(shape[axis])
        if mod_leaf in FUSED_QKV:
            _check(3, extent, f"the fused QKV features of {owner_name}")
            _check(tp, extent // 3, f"the attention heads' features of {owner_name} ({extent // 3} per Q, K, V)")
            part = extent // 3
            owner = tuple(np.tile(np.repeat(np.arange(tp), part // tp), 3).tolist())
        else:
            _check(tp, extent, f"the {'output' if kind == 'column' else 'input'} features of {owner_name}")
            owner = tuple(np.repeat(np.arange(tp), extent // tp).tolist())
        out.append(TPShard(name, kind, axis, owner))
    if not any(out):
        raise TrainingError("parallel: tp > 1 splits the attention and MLP projections (GPT-2 c_attn/c_proj/c_fc, "
                            "Llama q/k/v/o/gate/up/down_proj); the model has none")
    return tuple(out)


def _shape(expr) -> tuple:
    return tuple(int(d) for d in expr.ty.shape)


def split_gemms(grad_mod: tvm.IRModule, n_inputs: int, layout, tp: int) -> TPSplit:
    """Rewrite ``main(inputs, params, targets) -> (loss, grads)`` so that every GEMM reducing
    over a split weight's sharded axis is a chain over the ranks' runs (module docstring)."""
    register_packed()
    func = grad_mod["main"]
    fparams = list(func.params)
    param_vars = fparams[n_inputs:n_inputs + len(layout)]
    shard_of = {v: s for v, s in zip(param_vars, layout) if s is not None}
    bindings = [b for block in func.body.blocks for b in block.bindings]
    # a weight or its transpose (permute_dims with the default axes of a matrix)
    view: dict = {v: (s, False) for v, s in shard_of.items()}
    for b in bindings:
        v = b.value
        if (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.permute_dims"
                and v.args[0] in shard_of and (v.attrs.axes is None or [int(a) for a in v.attrs.axes] == [1, 0])):
            view[b.var] = (shard_of[v.args[0]], True)
    mapping: dict = {}

    @relax.expr_functor.mutator
    class Remap(relax.PyExprMutator):
        def visit_var_(self, op):
            return mapping.get(op, op)

        def visit_dataflow_var_(self, op):
            return mapping.get(op, op)

    remap = Remap()
    chains, parallel, funcs = [], [], {}
    bb = relax.BlockBuilder()
    with bb.function("main", fparams):
        with bb.dataflow():
            for b in bindings:
                v = b.value
                is_mm = isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.matmul"
                if is_mm and v.args[1] in view and len(_shape(v.args[0])) >= 2:
                    shard, transposed = view[v.args[1]]
                    a, w = remap.visit_expr(v.args[0]), remap.visit_expr(v.args[1])
                    a_shape, (k, n) = _shape(v.args[0]), _shape(v.args[1])
                    m = int(np.prod(a_shape[:-1]))
                    if (shard.axis == 1) == transposed:  # the contraction axis is the sharded one
                        chains.append(ChainGemm(shard.name, m, k, n, shard.runs()))
                        mapping[b.var] = _chain(bb, a, w, a_shape, k, n, shard.runs(), b.var.name, funcs)
                        continue
                    parallel.append((shard.name, m, k, n, 2))
                mapping[b.var] = bb.emit(remap.visit_expr(v), name_hint=b.var.name)
            out = bb.emit_output(remap.visit_expr(func.body.body))
        bb.emit_func_output(out)
    mod = relax.transform.DeadCodeElimination(["main"])(bb.get())
    from ..frontend.fixups import FixupImported

    # every split weight's gradient: [in, out] over the rows its forward GEMM reduces
    rows = {c.name: c.m for c in chains}
    rows.update({p[0]: p[1] for p in parallel})
    for s, var in zip(layout, param_vars):
        if s is not None and s.name in rows:
            k, n = _shape(var)
            parallel.append((s.name, k, rows[s.name], n, 2 if s.axis == 1 else 0))
    sizes = [int(np.prod(_shape(v))) * 4 for v in param_vars]
    sharded = sum(b for b, s in zip(sizes, layout) if s is not None)
    return TPSplit(FixupImported(mod), tp, tuple(chains), tuple(parallel), sharded, sum(sizes) - sharded)


def _continue_func(m: int, k: int, n: int) -> relax.Function:
    """``(partial [m, n], a [m, k], w [k, n]) -> partial + a @ w`` continued from ``partial``:
    a private function around the ``call_dps_packed`` (the partitioner's graph partitioner
    cannot visit an external function inside the function it partitions)."""
    inner = relax.BlockBuilder()
    args = [relax.Var("partial", relax.TensorType((m, n), "float32")),
            relax.Var("a", relax.TensorType((m, k), "float32")),
            relax.Var("w", relax.TensorType((k, n), "float32"))]
    with inner.function("gemm_continue", args, private=True):
        out = inner.emit(relax.call_dps_packed(PACKED, relax.Tuple(args), relax.TensorType((m, n), "float32")))
        inner.emit_func_output(out)
    return inner.get()["gemm_continue"]


def _chain(bb, a, w, a_shape, k: int, n: int, runs, name: str, funcs: dict):
    """``a @ w`` as the chain over ``runs`` of the k axis: the first run from zero (a GEMM on
    the PEs), each further one continuing its accumulator."""
    m = int(np.prod(a_shape[:-1]))
    a2 = a if len(a_shape) == 2 else bb.emit(relax.op.reshape(a, (m, k)))
    acc = None
    for _, k0, k1 in runs:
        ak = bb.emit(relax.op.strided_slice(a2, axes=[1], begin=[k0], end=[k1]))
        wk = bb.emit(relax.op.strided_slice(w, axes=[0], begin=[k0], end=[k1]))
        if acc is None:
            acc = bb.emit(relax.op.matmul(ak, wk))
        else:
            key = (m, k1 - k0, n)
            if key not in funcs:
                funcs[key] = bb.add_func(_continue_func(*key), f"gemm_continue_{m}x{k1 - k0}x{n}")
            acc = bb.emit(relax.Call(funcs[key], [acc, ak, wk]))
    if len(a_shape) != 2:
        acc = bb.emit(relax.op.reshape(acc, (*a_shape[:-1], n)), name_hint=name)
    return acc


def _gemm_module(shapes) -> tvm.IRModule:
    """``main(a_0, b_0, ...) -> (a_0 @ b_0, ...)``: the GEMMs of ``shapes`` ``[(m, k, n)]``."""
    bb = relax.BlockBuilder()
    args = []
    for i, (m, k, n) in enumerate(shapes):
        args += [relax.Var(f"a{i}", relax.TensorType((m, k), "float32")),
                 relax.Var(f"b{i}", relax.TensorType((k, n), "float32"))]
    with bb.function("main", args):
        with bb.dataflow():
            outs = [bb.emit(relax.op.matmul(args[2 * i], args[2 * i + 1])) for i in range(len(shapes))]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def tp_compute(split: TPSplit, one_chip_s: float, target, topo) -> dict:
    """Simulated seconds of one rank's share of a granule's gradient program.

    ``one_chip_s`` is the unsplit gradient program's PE time on one chip. A rank does ``1 / tp``
    of the parallel GEMMs (column-parallel forwards, row-parallel input gradients, the split
    weights' gradients: ``parallel_s`` for all of them, ``rank_parallel_s`` for one rank's
    share); a chain's runs follow one another (rank ``r`` continues rank ``r - 1``'s
    accumulator): unpipelined, a chain GEMM (``chain_s`` whole) would cost the sum of its runs
    (``runs_s``: the first from zero, the continuations, ``continue_s``, priced as the PE GEMMs
    they are) plus one point-to-point hop of the ``m x n`` partial sum per further run
    (``chain_hops``, ``chain_hops_s``, between neighbouring chips); its rows cut into ``tp``
    blocks, the ranks overlap on different blocks (:func:`~tvm_spinn.training.tp_chain.chain_seconds`, each run
    of a block priced as its own GEMM, the hops a block's partial sum): ``chains_s``, what a rank is
    charged. Each set of GEMMs is priced as one program of those GEMMs on a chip. The rest
    (norms, attention, element-wise, the embeddings and head) is counted on every rank:
    Megatron's split of attention by heads and of the vocabulary is not modelled.

    For comparison, ``megatron_rank_s`` is the usual, non-reproducible split: every rank computes
    its ``k / tp`` share of each chain GEMM at once (``chain_s`` whole, ``rank_chain_s`` a
    share) and the partial sums are all-reduced (``all_reduce_s``: the cheaper of a ring and a
    tree over the ``tp`` chips; its bits depend on ``tp``); ``reproducible_cost`` is
    ``rank_s / megatron_rank_s``.
    """
    from ..timing.collectives import all_reduce, point_to_point
    from .timing import executable_latency

    tp = split.tp

    def latency(shapes) -> float:
        if not shapes:
            return 0.0
        return executable_latency(relax.build(_gemm_module(shapes), target=target))

    continues = [(c.m, k1 - k0, c.n) for c in split.chains for _, k0, k1 in c.runs[1:]]
    runs_s = latency([(c.m, k1 - k0, c.n) for c in split.chains for _, k0, k1 in c.runs])
    full = [(m, k, n) for _, m, k, n, _ in split.parallel]
    share = [(m // tp, k, n) if axis == 0 else (m, k, n // tp) for _, m, k, n, axis in split.parallel]
    continue_s = latency(continues)
    parallel_s, rank_parallel_s = latency(full), latency(share)
    chain_s = latency([(c.m, c.k, c.n) for c in split.chains])
    rank_chain_s = latency([(c.m, c.k // tp, c.n) for c in split.chains])
    reduce_s = sum(all_reduce(topo, list(range(tp)), 4 * c.m * c.n).seconds for c in split.chains) \
        if topo is not None else 0.0
    hops = sum(len(c.runs) - 1 for c in split.chains)
    hop_s = sum((len(c.runs) - 1) * point_to_point(topo, [0], [1], 4 * c.m * c.n).seconds
                for c in split.chains) if topo is not None and hops else 0.0
    # the chain model the planner prices too (:mod:`.tp_chain`): each block's run a simulated
    # GEMM, each hop a point-to-point transfer between neighbouring chips
    blocks = {c: chain_blocks(c.m, tp) for c in split.chains}
    block_s = {shape: latency([shape]) for shape in sorted({(c.m // blocks[c], k1 - k0, c.n)
                                                             for c in split.chains for _, k0, k1 in c.runs})}

    def hop(nbytes: int) -> float:
        return point_to_point(topo, [0], [1], nbytes).seconds if topo is not None else 0.0

    chains_s = sum(chain_seconds(c.runs, c.m, c.n, tp, lambda *shape: block_s[shape], hop) for c in split.chains)
    one_chip = one_chip_s
    rank = one_chip - parallel_s + rank_parallel_s - chain_s + chains_s
    megatron = one_chip - parallel_s + rank_parallel_s - chain_s + rank_chain_s + reduce_s
    return {"one_chip_s": one_chip, "continue_s": continue_s, "runs_s": runs_s, "parallel_s": parallel_s,
            "rank_parallel_s": rank_parallel_s, "chain_hops": hops, "chain_hops_s": hop_s, "chains_s": chains_s,
            "rank_s": rank,
            "chain_s": chain_s, "rank_chain_s": rank_chain_s, "all_reduce_s": reduce_s, "megatron_rank_s": megatron,
            "reproducible_cost": rank / megatron}
