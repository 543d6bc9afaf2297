"""Tensor parallelism of a granule's gradient program (Megatron's split), bits independent of ``tp``.

Megatron-LM splits each transformer block over ``tp`` ranks (chips): the QKV and MLP-up
projections are *column-parallel* (rank ``r`` owns the output features of its heads, of its
block of the MLP's hidden features) and the attention-output and MLP-down projections are
*row-parallel* (rank ``r`` owns the input features it receives from its column-parallel
partner, and produces a partial sum of the full output). Attention runs head by head on the
rank owning the head. With grouped-query attention and more ranks than key/value heads, each
key/value head is computed whole on the ``tp / kv_heads`` ranks whose query heads read it (its
*replicas*); the gradient of its keys and values, a sum over those query heads, runs along the
replicas in rank order (:func:`~tvm_spinn.training.tp_chain.group_sum`, the one-chip additions)
and returns to each. The widths a model admits are
:func:`~tvm_spinn.training.tp_chain.admissible_tp`'s, the planner's too.

Which additions does the split move? A column-parallel GEMM's outputs are independent sums over
the whole k range, computed on one rank each exactly as on one chip; so is every weight
gradient (``dW = X^T dY`` reduces over the batch rows, which every rank holds whole). Two GEMMs
per split layer reduce over the *sharded* axis: the forward of a row-parallel layer (k = its
input features) and the input gradient of a column-parallel layer (``dX = dY W^T``: k = its
output features). Megatron all-reduces their partial sums, in an order that depends on ``tp``.
Here they run in the **canonical order** of :mod:`.tp_chain` on every plan, one chip included:
the sharded axis cut into a fixed number of leaves that every admissible ``tp`` divides (a fused
QKV weight: leaf ``l`` is the ``l``-th slice of each of Q, K and V), each leaf a GEMM from zero,
the leaves added in ascending order. The additions do not depend on ``tp``, so the gradients,
and the parameters after any number of steps, are bitwise the same for every tensor-, data- and
pipeline-parallel plan (:mod:`.parallel`, :mod:`.pipeline`). Each rank computes its own leaves
(the ``1 / tp`` share of the GEMM, in parallel) and the ordered sum is a reduction over the ranks
in rank order (:func:`~tvm_spinn.training.tp_chain.split_reduce` executes it rank by rank).

:func:`split_gemms` rewrites the gradient program accordingly: each such GEMM becomes its leaves'
GEMMs (on the PEs) and the additions in leaf order, and input gradients the program only adds
together (Llama's ``q/k/v_proj``, its ``gate/up_proj``) become one such reduction of their sum
(:func:`canonical_sum`: leaf ``l`` one GEMM over the ``l``-th leaf of each, two reductions a
block's backward as in Megatron's split); the column-parallel GEMMs, weight gradients
and attention keep one op each (each rank's share of them is a slice of its outputs, with the
same bits). :func:`tp_compute` prices one rank's share of a granule
(:meth:`~tvm_spinn.training.parallel.DataParallelTrainer.simulated_step`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import tvm
from tvm import relax

from .errors import TrainingError
from .tp_chain import admissible_tp, canonical_leaves, kv_replicas, leaf_slices

__all__ = ["TPShard", "CanonicalGemm", "TPSplit", "tp_layout", "split_gemms", "canonical_sum", "tp_compute"]

#: module (leaf) names of the column-parallel projections (GPT-2 ``Conv1D``, Llama ``Linear``)
COLUMN = ("c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
#: module names of the row-parallel projections (GPT-2's ``attn.c_proj`` and ``mlp.c_proj``)
ROW = ("c_proj", "o_proj", "down_proj")
#: projections whose output is the three fused Q, K, V blocks (each split by heads)
FUSED_QKV = ("c_attn",)
#: column-parallel projections into the MLP's hidden features, and onto the key-value heads
MLP_COLUMN = ("c_fc", "gate_proj", "up_proj")
KV_COLUMN = ("k_proj", "v_proj")
#: separate column-parallel projections of the attention's input (their leaves coincide)
ATTN_COLUMN = ("q_proj",) + KV_COLUMN


@dataclass(frozen=True)
class TPShard:
    """How a weight is split: ``kind`` ``"column"`` or ``"row"``; ``axis``: the weight's axis
    the ranks split, ``extent`` its length; ``leaves`` and ``parts``: the canonical order of a
    reduction over that axis (:mod:`.tp_chain`: ``parts`` equal parts, each cut into ``leaves``
    leaves; rank ``r`` of ``tp`` owns leaves ``r * leaves / tp`` onwards); ``replicas``: the
    ranks computing each output feature (a key/value projection's head, replicated on
    ``tp / kv_heads`` ranks when ``tp`` exceeds the key/value heads; 1 otherwise)."""

    name: str
    kind: str
    axis: int
    extent: int
    leaves: int = 1
    parts: int = 1
    replicas: int = 1
    #: the LM head's weight split by the vocabulary
    #: (:class:`~tvm_spinn.training.vocab_parallel.VocabShard`): its classes are the loss'
    vocabulary: ClassVar[bool] = False

    def leaf_ranges(self) -> tuple:
        """Each leaf's ``k`` ranges (one a part) in the canonical order."""
        return leaf_slices(self.extent, self.leaves, self.parts)

    def rank_leaf_ranges(self, rank: int, tp: int) -> tuple:
        """The :meth:`leaf_ranges` rank ``rank`` of ``tp`` owns (its ``leaves / tp`` leaves)."""
        return self.leaf_ranges()[rank * self.leaves // tp:(rank + 1) * self.leaves // tp]


@dataclass(frozen=True)
class CanonicalGemm:
    """A GEMM of the gradient program reducing over a sharded axis: ``[m, k] @ [k, n]`` of
    weight ``name`` in the canonical order (``leaves`` leaves of each of ``parts`` parts); a sum
    of such GEMMs (:func:`canonical_sum`) names its weights joined by ``+``, ``k`` their total.

    ``ranges`` are the leaves' ``k`` ranges as the compiled step adds them (per leaf, one range
    per part, in the sum's concatenated ``k``; ``leaves`` is their count, a ceil-width vocabulary's
    empty leaves left out); ``rank_ranges`` are those of the rank with the most rows of ``k``."""

    name: str
    m: int
    k: int
    n: int
    leaves: int
    parts: int
    ranges: tuple
    rank_ranges: tuple


@dataclass(frozen=True)
class TPSplit:
    """A gradient program split over ``tp`` ranks.

    Attributes
    ----------
    mod : tvm.IRModule
        ``main(inputs, params, targets) -> (loss, grads)`` with the canonical reductions (the
        same program for every ``tp``).
    reductions : tuple of CanonicalGemm
        The GEMMs that reduce over a sharded axis (row-parallel forwards, column-parallel input
        gradients), in the canonical order.
    parallel : tuple of (str, int, int, int, int, int)
        ``(name, m, k, n, split, ways)`` per GEMM a rank does a ``1 / ways`` share of (``ways``:
        ``tp``, or the key/value heads for a key/value projection replicated over ranks),
        ``split`` the index of the shared extent (0: m, 2: n): column-parallel forwards and
        row-parallel input gradients (n), every split weight's gradient (its weight's sharded
        axis; the GEMM reduces over the batch rows).
    groups : tuple of (str, int, int, int)
        ``(name, m, features, replicas)`` per key/value projection whose heads are replicated
        over ``replicas`` ranks: the gradient of its output (``m`` rows, ``features`` of one
        head) is the sum of the replicas' query heads' terms, added along the replicas in rank
        order (:func:`~tvm_spinn.training.tp_chain.group_sum`, the one-chip additions) and
        returned to every replica.
    sharded_bytes, replicated_bytes : int
        Parameter bytes split over the ranks and held by every rank.
    rank_bytes : int
        Parameter bytes one rank holds (its shares, its key/value heads, the replicated rest).
    losses : tuple of (int, int, int)
        ``(rows, classes, rank classes)`` per cross-entropy over the vocabulary-parallel head's
        logits (:mod:`.vocab_parallel`): each rank computes the exponentials and the softmax's
        gradient of its own classes only (``rank classes``: the busiest rank's, its vocabulary
        leaves), and the rows' running sums of exponentials pass the ranks in rank order.
    """

    mod: tvm.IRModule
    tp: int
    reductions: tuple
    parallel: tuple
    sharded_bytes: int
    replicated_bytes: int
    groups: tuple
    rank_bytes: int
    losses: tuple = ()


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check(tp: int, extent: int, axis: str) -> None:
    if extent % tp:
        raise TrainingError(f"parallel: tp={tp} does not divide {axis} ({extent}); tp may be {_divisors(extent)}")


def tp_layout(model, param_names, param_shapes, tp: int) -> "tuple | None":
    """Each parameter's :class:`TPShard` (None: replicated) under ``tp`` ranks, or None when
    the model has no transformer block to split (no projection among :data:`COLUMN` and
    :data:`ROW`, or no config naming its attention heads).

    Raises
    ------
    TrainingError
        When ``tp`` is not a width the model admits
        (:func:`~tvm_spinn.training.tp_chain.admissible_tp`) or does not divide a split axis,
        naming the axis and the values that would work.
    """
    modules = dict(model.named_modules())
    heads = kv_heads = None
    for sub in modules.values():  # grouped-query attention: tp splits or replicates the key-value heads
        config = getattr(sub, "config", None)
        kv = getattr(config, "num_key_value_heads", None)
        if heads is None and isinstance(getattr(config, "num_attention_heads", None), int):
            heads = config.num_attention_heads
            kv_heads = kv if isinstance(kv, int) and not isinstance(kv, bool) else heads
        if isinstance(kv, int) and not isinstance(kv, bool):
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
        else:
            _check(tp, extent, f"the {'output' if kind == 'column' else 'input'} features of {owner_name}")
        replicas = kv_replicas(kv_heads, tp) if kv_heads is not None and mod_leaf in KV_COLUMN else 1
        out.append(TPShard(name, kind, axis, extent, parts=3 if mod_leaf in FUSED_QKV else 1, replicas=replicas))
    if not any(out) or heads is None:
        return None  # no block to split: the program as it is
    # the canonical order's leaves (:func:`.tp_chain.canonical_leaves`): the MLP's hidden features
    # are the column-parallel MLP weights' split extent; the head size, the query features' per head
    mlp = [s.extent for s in out if s is not None and s.kind == "column" and _module(s) in MLP_COLUMN]
    query = [s.extent // s.parts for s in out if s is not None and _module(s) in FUSED_QKV + ("q_proj",)]
    intermediate = math.gcd(*mlp) if mlp else heads
    head_dim = math.gcd(*query) // heads if query and math.gcd(*query) % heads == 0 else 1
    ok = admissible_tp(heads, kv_heads, intermediate, head_dim)
    if tp not in ok:
        raise TrainingError(f"parallel: tp={tp} is not a split of the attention heads ({heads}), the key-value heads "
                            f"({kv_heads}: tp must divide them or be a multiple of them) and the MLP's "
                            f"{intermediate} hidden features (the canonical order's leaves); tp may be "
                            f"{', '.join(map(str, ok))}")
    g, g_qkv = canonical_leaves(heads, kv_heads, intermediate, head_dim)
    # the query, key and value projections' input gradients are summed into one reduction
    # (:func:`split_gemms`), leaf by leaf: their leaves coincide (g_qkv, which every admissible
    # tp divides)
    return tuple(None if s is None else dataclasses.replace(s, leaves=g_qkv if _module(s) in ATTN_COLUMN else g)
                 for s in out)


def _module(shard: TPShard) -> str:
    """The projection's module name (``q_proj``, ``c_attn``, ...) of a split weight."""
    return shard.name.rpartition(".")[0].rpartition(".")[2]


def _shape(expr) -> tuple:
    return tuple(int(d) for d in expr.ty.shape)


def _vocab_losses(bindings, layout, tp: int) -> tuple:
    """``(rows, classes, rank classes)`` of each ``nll_loss(log_softmax(z))`` over logits whose
    classes are a vocabulary shard's vocabulary (:attr:`TPShard.vocabulary`: the head split by
    the vocabulary, each rank holding its leaves' classes)."""
    heads = {s.extent: s for s in layout if s is not None and s.vocabulary}
    values = {b.var: b.value for b in bindings}
    out = []
    for b in bindings:
        v = b.value
        if not (_is_op(v, "relax.nn.nll_loss") and _is_op(values.get(v.args[0]), "relax.nn.log_softmax")):
            continue
        shape = _shape(values[v.args[0]].args[0])
        if len(shape) != 2 or shape[1] not in heads:
            continue
        shard = heads[shape[1]]
        mine = max(sum(hi - lo for ((lo, hi),) in shard.rank_leaf_ranges(r, tp)) for r in range(tp))
        out.append((int(shape[0]), int(shape[1]), int(mine)))
    return tuple(out)


def split_gemms(grad_mod: tvm.IRModule, n_inputs: int, layout, tp: int) -> TPSplit:
    """Rewrite ``main(inputs, params, targets) -> (loss, grads)`` so that every GEMM reducing
    over a split weight's sharded axis runs in the canonical order (module docstring): the same
    program for every ``tp``; ``tp`` sets the shares :func:`tp_compute` prices."""
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
    canon = {}  # a GEMM reducing over a sharded axis: its binding's var -> (shard, a, w, m, k, n)
    for b in bindings:
        v = b.value
        if (_is_op(v, "relax.matmul") and v.args[1] in view and len(_shape(v.args[0])) >= 2
                and (view[v.args[1]][0].axis == 1) == view[v.args[1]][1]):  # contracts the sharded axis
            a_shape, (k, n) = _shape(v.args[0]), _shape(v.args[1])
            canon[b.var] = (view[v.args[1]][0], v.args[0], v.args[1], int(np.prod(a_shape[:-1])), k, n)
    fused, skipped = _summed_reductions(bindings, canon, func.body.body)
    reductions, parallel = [], []
    bb = relax.BlockBuilder()
    with bb.function("main", fparams):
        with bb.dataflow():
            for b in bindings:
                v = b.value
                if b.var in skipped:  # a term of a summed reduction: its sum is emitted whole
                    continue
                if b.var in fused or b.var in canon:
                    members = [canon[c] for c in fused.get(b.var, [b.var])]
                    shard, _, _, m, _, n = members[0]
                    ranges = _joined_ranges([(c[0].leaf_ranges(), c[4]) for c in members])
                    shares = [_joined_ranges([(c[0].rank_leaf_ranges(r, tp), c[4]) for c in members])
                              for r in range(tp)]
                    mine = max(shares, key=lambda leaves: sum(b - a for leaf in leaves for a, b in leaf))
                    reductions.append(CanonicalGemm("+".join(c[0].name for c in members), m,
                                                    sum(c[4] for c in members), n, len(ranges),
                                                    sum(c[0].parts for c in members), ranges, mine))
                    out = canonical_sum(bb, [(remap.visit_expr(a), remap.visit_expr(w), _shape(a), s.leaf_ranges())
                                             for s, a, w, _, _, _ in members])
                    if _shape(b.var) != (m, n):
                        out = bb.emit(relax.op.reshape(out, _shape(b.var)), name_hint=b.var.name)
                    mapping[b.var] = out
                    continue
                if _is_op(v, "relax.matmul") and v.args[1] in view and len(_shape(v.args[0])) >= 2:
                    a_shape, (k, n) = _shape(v.args[0]), _shape(v.args[1])
                    shard = view[v.args[1]][0]
                    parallel.append((shard.name, int(np.prod(a_shape[:-1])), k, n, 2, tp // shard.replicas))
                mapping[b.var] = bb.emit(remap.visit_expr(v), name_hint=b.var.name)
            out = bb.emit_output(remap.visit_expr(func.body.body))
        bb.emit_func_output(out)
    mod = relax.transform.DeadCodeElimination(["main"])(bb.get())
    from ..frontend.fixups import FixupImported

    # every split weight's gradient: [in, out] over the rows its forward GEMM reduces
    rows = {shard.name: m for shard, _, _, m, _, _ in canon.values()}
    rows.update({p[0]: p[1] for p in parallel})
    for s, var in zip(layout, param_vars):
        if s is not None and s.name in rows:
            k, n = _shape(var)
            parallel.append((s.name, k, rows[s.name], n, 2 if s.axis == 1 else 0, tp // s.replicas))
    # a replicated key/value head's output gradient: summed over its replicas (one head's features)
    groups = tuple((s.name, rows[s.name], s.extent * s.replicas // tp, s.replicas) for s in layout
                   if s is not None and s.replicas > 1 and s.name in rows)
    sizes = [int(np.prod(_shape(v))) * 4 for v in param_vars]
    sharded = sum(b for b, s in zip(sizes, layout) if s is not None)
    # one rank's bytes: a replicated key/value head's weights are held by each of its replicas
    rank = sum(b if s is None else b * s.replicas // tp for b, s in zip(sizes, layout))
    return TPSplit(FixupImported(mod), tp, tuple(reductions), tuple(parallel), sharded, sum(sizes) - sharded,
                   groups, rank, _vocab_losses(bindings, layout, tp))


def _joined_ranges(terms) -> tuple:
    """The leaf ranges of a sum of GEMMs over the concatenated ``k`` of its terms
    ``[(leaf ranges, k)]``: leaf ``l`` is the ``l``-th leaf of every term, in term order."""
    counts = {len(leaves) for leaves, _ in terms}
    if len(counts) != 1:
        raise TrainingError(f"canonical order: the summed reductions have different leaf counts {sorted(counts)}")
    offsets = np.concatenate([[0], np.cumsum([k for _, k in terms])[:-1]]).astype(int).tolist()
    return tuple(tuple((o + a, o + b) for (leaves, _), o in zip(terms, offsets) for a, b in leaves[l])
                 for l in range(counts.pop()))


def _packed(ranges) -> tuple[int, tuple]:
    """``(k, ranges)`` of the operands holding only ``ranges`` (per leaf, ranges of a wider
    ``k``), packed in order from row 0, each leaf one range: a rank's share of a reduction as its
    own GEMM (a rank holds its shard's rows contiguously, its parts' ranges of a leaf side by
    side, so it gathers nothing)."""
    packed, k = [], 0
    for leaf in ranges:
        width = sum(b - a for a, b in leaf)
        packed.append(((k, k + width),))
        k += width
    return k, tuple(packed)


def _is_op(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name


def _summed_reductions(bindings, canon: dict, output) -> tuple[dict, set]:
    """The canonical reductions whose results the program only adds together (Llama's query,
    key and value input gradients into the attention's input gradient, the gate's and up's into
    the MLP's): ``({root add var: [reduction vars, in the program's order]}, {the vars the
    summed reduction replaces})``. The terms may be reshaped on the way (each used once); they
    must have the same rows, columns and leaves, so that leaf ``l`` of the sum is leaf ``l`` of
    every term (one GEMM from zero over all their slices)."""
    uses: dict = {}
    for b in bindings:
        for var in {*relax.analysis.free_vars(b.value)}:
            uses[var] = uses.get(var, 0) + 1
    for var in {*relax.analysis.free_vars(output)}:
        uses[var] = uses.get(var, 0) + 2  # a program output stays
    source = {b.var: b.value.args[0] for b in bindings if _is_op(b.value, "relax.reshape")}
    groups: dict = {}  # add var -> (member reduction vars, vars it replaces)

    def term(var):
        chain = []
        while var in source and var not in canon and var not in groups and uses.get(var, 0) == 1:
            chain.append(var)
            var = source[var]
        if uses.get(var, 0) != 1:
            return None
        if var in canon:
            return [var], {var, *chain}
        if var in groups:
            members, inner = groups[var]
            return members, {var, *inner, *chain}
        return None

    for b in bindings:
        v = b.value
        if not _is_op(v, "relax.add") or not _shape(v.args[0]) == _shape(v.args[1]) == _shape(b.var):
            continue
        x, y = term(v.args[0]), term(v.args[1])
        if x is None or y is None:
            continue
        members = x[0] + y[0]
        if len({(canon[c][0].leaves, canon[c][3], canon[c][5]) for c in members}) == 1:
            groups[b.var] = (members, x[1] | y[1])
    skipped = set().union(*(inner for _, inner in groups.values())) if groups else set()
    return {var: members for var, (members, _) in groups.items() if var not in skipped}, skipped


def canonical_sum(bb: relax.BlockBuilder, operands):
    """Emit ``sum(a_i @ w_i)`` in the canonical order: leaf ``l`` is one GEMM from zero on the
    PEs over the ``l``-th leaf of every term (each term's ``k`` ranges of that leaf, from
    :meth:`TPShard.leaf_ranges`, in term order), the leaves added in order. ``operands`` is
    ``[(a, w, a_shape, leaf ranges)]``, ``a`` ``[..., k]``, ``w`` ``[k, n]``; returns ``[m, n]``."""
    flat = []
    for a, w, a_shape, leaves in operands:
        m, k = int(np.prod(a_shape[:-1])), int(a_shape[-1])
        flat.append((a if len(a_shape) == 2 else bb.emit(relax.op.reshape(a, (m, k))), w, leaves))
    acc = None
    for l in range(len(flat[0][2])):
        ak = [bb.emit(relax.op.strided_slice(a2, axes=[1], begin=[k0], end=[k1]))
              for a2, _, leaves in flat for k0, k1 in leaves[l]]
        wk = [bb.emit(relax.op.strided_slice(w, axes=[0], begin=[k0], end=[k1]))
              for _, w, leaves in flat for k0, k1 in leaves[l]]
        if len(ak) > 1:
            ak = [bb.emit(relax.op.concat(ak, axis=1))]
            wk = [bb.emit(relax.op.concat(wk, axis=0))]
        leaf = bb.emit(relax.op.matmul(ak[0], wk[0]))
        acc = leaf if acc is None else bb.emit(relax.op.add(acc, leaf))
    return acc


def canonical_gemm(bb: relax.BlockBuilder, a, w, a_shape, leaves, name: str = "canonical"):
    """Emit ``a @ w`` in the canonical order (:func:`canonical_sum` of one term), shaped
    ``[..., n]`` like ``a``."""
    acc = canonical_sum(bb, [(a, w, tuple(a_shape), leaves)])
    if len(a_shape) != 2:
        acc = bb.emit(relax.op.reshape(acc, (*a_shape[:-1], _shape(w)[1])), name_hint=name)
    return acc


def _gemm_module(shapes, leaves=1) -> tvm.IRModule:
    """``main(a_0, b_0, ...) -> (...)``: the GEMMs of ``shapes`` ``[(m, k, n)]``, each in ``leaves``
    equal leaves added in order (1: a plain GEMM), or in the leaves of ``leaves[i]`` (per GEMM,
    its leaf ranges as :func:`canonical_gemm` takes them)."""
    bb = relax.BlockBuilder()
    args = []
    for i, (m, k, n) in enumerate(shapes):
        args += [relax.Var(f"a{i}", relax.TensorType((m, k), "float32")),
                 relax.Var(f"b{i}", relax.TensorType((k, n), "float32"))]
    with bb.function("main", args):
        with bb.dataflow():
            outs = []
            for i, (m, k, n) in enumerate(shapes):
                ranges = leaves[i] if not isinstance(leaves, (int, np.integer)) else \
                    None if leaves == 1 else leaf_slices(k, leaves)
                if ranges is None or ranges == (((0, k),),):  # one leaf of the whole axis: the GEMM
                    outs.append(bb.emit(relax.op.matmul(args[2 * i], args[2 * i + 1])))
                else:
                    outs.append(canonical_gemm(bb, args[2 * i], args[2 * i + 1], (m, k), ranges))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _add_module(shapes) -> tvm.IRModule:
    """``main(x_0, y_0, ...) -> (x_0 + y_0, ...)`` for ``[m, n]`` float32 ``shapes``."""
    bb = relax.BlockBuilder()
    args = [relax.Var(f"{v}{i}", relax.TensorType(shape, "float32")) for i, shape in enumerate(shapes) for v in "xy"]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple([bb.emit(relax.op.add(args[2 * i], args[2 * i + 1]))
                                              for i in range(len(shapes))]))
        bb.emit_func_output(out)
    return bb.get()


def _loss_module(shapes) -> tvm.IRModule:
    """``main(z_0, t_0, ...) -> (row losses, gradient, ...)``: the cross-entropy and its gradient
    in the forms the PE kernels take (:func:`~tvm_spinn.training.graph.loss_on_pes`), for
    ``(rows, classes)`` logits ``shapes``."""
    from tvm.ir.prim.expr import FloatImm

    bb = relax.BlockBuilder()
    args = []
    for i, (rows, classes) in enumerate(shapes):
        args += [relax.Var(f"z{i}", relax.TensorType((rows, classes), "float32")),
                 relax.Var(f"t{i}", relax.TensorType((rows,), "int32"))]
    one, zero = (FloatImm("float32", v) for v in (1.0, 0.0))
    with bb.function("main", args):
        with bb.dataflow():
            outs = []
            for i, (rows, classes) in enumerate(shapes):
                z, t = args[2 * i], args[2 * i + 1]
                outs.append(bb.emit(relax.op.nn.nll_loss(relax.op.nn.log_softmax(z, -1), t, reduction="none")))
                hot = relax.op.one_hot(t, one, zero, classes, -1)
                outs.append(bb.emit(relax.op.divide(relax.op.subtract(relax.op.nn.softmax(z, -1), hot),
                                                    relax.const(np.float32(rows)))))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def tp_compute(split: TPSplit, one_chip_s: float, target, topo) -> dict:
    """Simulated seconds of one rank's share of a granule's gradient program.

    ``one_chip_s`` is the gradient program's PE time on one chip (the canonical reductions
    included). A rank does ``1 / tp`` of the parallel GEMMs (column-parallel forwards,
    row-parallel input gradients, the split weights' gradients: ``parallel_s`` for all of them,
    ``rank_parallel_s`` for one rank's share: a replicated key/value head is computed whole on
    each of its replicas) and of each canonical reduction's leaves
    (``canonical_s`` for all the leaves' GEMMs and additions, ``rank_canonical_s`` for one rank's
    leaves, its additions to the running sum included); the ordered sum over the ranks is the
    chain all-reduce of :func:`~tvm_spinn.timing.collectives.chain_all_reduce` (rank after rank
    in rank order, pipelined over segments, every rank receiving the result: the compiled step
    keeps each block's output whole on every rank), ``reduce_s``, each priced for one reduction's
    ``m x n`` sums over the ``tp`` neighbouring chips; with more ranks than key/value heads it
    includes ``group_s``, the chain all-reduces of each replicated head's output gradient over
    its replicas (:attr:`TPSplit.groups`). Each set of GEMMs is priced as one program
    of those GEMMs on a chip. The LM head's GEMMs are split over the vocabulary
    (:mod:`.vocab_parallel`) and priced among the parallel shares; so is the loss over them
    (:attr:`TPSplit.losses`): a rank's cross-entropy kernels run over its own classes
    (``loss_s`` for the whole vocabulary on one chip, ``rank_loss_s`` for the busiest rank's
    share), and the rows' sums of exponentials pass the ranks in rank order, a chain of each
    row's three scalars (max, running sum, target logit) over the ``tp`` chips (``loss_chain_s``,
    in ``reduce_s``). The rest (norms, attention, element-wise, the embeddings) is counted on
    every rank: Megatron's split of attention by heads is not modelled.

    For comparison, ``megatron_rank_s`` is the usual, non-reproducible split: every rank computes
    its ``k / tp`` share of each reduction as one GEMM (``rank_share_s``) and the partial sums are
    all-reduced (``all_reduce_s``: the cheaper of a ring and a tree over the ``tp`` chips; its bits
    depend on ``tp``); ``reproducible_cost`` is ``rank_s / megatron_rank_s``.
    """
    from ..timing.collectives import all_reduce, chain_all_reduce
    from .timing import executable_latency

    tp = split.tp

    def latency(shapes, leaves=1) -> float:
        if not shapes:
            return 0.0
        return executable_latency(relax.build(_gemm_module(shapes, leaves), target=target))

    full = [(m, k, n) for _, m, k, n, _, _ in split.parallel]
    share = [(m // ways, k, n) if axis == 0 else (m, k, n // ways) for _, m, k, n, axis, ways in split.parallel]
    parallel_s, rank_parallel_s = latency(full), latency(share)
    # the canonical reductions, grouped by leaf count: all the leaves on one chip (their ranges as
    # the compiled step adds them), a rank's leaves (the busiest rank's, packed into its own
    # operands, each added to the running sum)
    canonical_s = rank_canonical_s = 0.0
    for leaves in sorted({c.leaves for c in split.reductions}):
        group = [c for c in split.reductions if c.leaves == leaves]
        canonical_s += latency([(c.m, c.k, c.n) for c in group], [c.ranges for c in group])
        mine = [_packed(c.rank_ranges) for c in group]
        rank_canonical_s += latency([(c.m, k, c.n) for c, (k, _) in zip(group, mine)], [r for _, r in mine])
    # a rank's leaves form mine - 1 sums among themselves (in the module above); the running sum
    # arriving from the rank before adds one more a reduction
    rank_canonical_s += executable_latency(relax.build(_add_module([(c.m, c.n) for c in split.reductions]),
                                                       target=target)) if split.reductions and tp > 1 else 0.0
    rank_share_s = latency([(c.m, -(-c.k // tp), c.n) for c in split.reductions])  # k padded to tp
    ranks = list(range(tp))
    reduce_s = sum(chain_all_reduce(topo, ranks, 4 * c.m * c.n).seconds for c in split.reductions) \
        if topo is not None and tp > 1 else 0.0
    fast_s = sum(all_reduce(topo, ranks, 4 * c.m * c.n).seconds for c in split.reductions) \
        if topo is not None and tp > 1 else 0.0
    # replicated key/value heads: each head's output gradient summed over its replicas (the
    # first ``replicas`` neighbouring ranks stand for every group: they all run at once)
    group_s = sum(chain_all_reduce(topo, ranks[:r], 4 * m * f).seconds for _, m, f, r in split.groups) \
        if topo is not None else 0.0
    group_fast_s = sum(all_reduce(topo, ranks[:r], 4 * m * f).seconds for _, m, f, r in split.groups) \
        if topo is not None else 0.0
    reduce_s += group_s
    fast_s += group_fast_s
    # the loss over the vocabulary-parallel head: each rank's exponentials and softmax gradient
    # are its own classes'; the rows' max, running sum and target pass the ranks (a chain, the
    # one-chip kernel's class order; Megatron all-reduces the ranks' partial sums)
    loss_s = rank_loss_s = loss_chain_s = loss_fast_s = 0.0
    if split.losses and tp > 1:
        def loss_latency(shapes) -> float:
            return executable_latency(relax.build(_loss_module(shapes), target=target))

        loss_s = loss_latency([(rows, classes) for rows, classes, _ in split.losses])
        rank_loss_s = loss_latency([(rows, mine) for rows, _, mine in split.losses])
        if topo is not None:
            loss_chain_s = sum(chain_all_reduce(topo, ranks, 3 * 4 * rows).seconds for rows, _, _ in split.losses)
            loss_fast_s = sum(all_reduce(topo, ranks, 3 * 4 * rows).seconds for rows, _, _ in split.losses)
    reduce_s += loss_chain_s
    fast_s += loss_fast_s
    rest = one_chip_s - parallel_s + rank_parallel_s - canonical_s - loss_s + rank_loss_s
    rank = rest + rank_canonical_s + reduce_s
    megatron = rest + rank_share_s + fast_s
    return {"one_chip_s": one_chip_s, "parallel_s": parallel_s, "rank_parallel_s": rank_parallel_s,
            "canonical_s": canonical_s, "rank_canonical_s": rank_canonical_s, "reduce_s": reduce_s,
            "group_s": group_s, "loss_s": loss_s, "rank_loss_s": rank_loss_s, "loss_chain_s": loss_chain_s,
            "rank_s": rank, "rank_share_s": rank_share_s, "all_reduce_s": fast_s, "megatron_rank_s": megatron,
            "reproducible_cost": rank / megatron}
