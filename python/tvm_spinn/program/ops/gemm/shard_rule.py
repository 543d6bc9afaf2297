"""How GEMMs shard over a mesh axis (the family's :class:`~tvm_spinn.program.ops.sharding.ShardingRule`)."""

from __future__ import annotations

from ..base import ACC_BYTES
from ..sharding import (PARTIAL, REPLICATE, ROW_ALWAYS, GatherInput, PointwiseRule, ShardDecision,
                        ShardingRule, part, shard)


# -- sharding ---------------------------------------------------------------------------------
class GemmSharding(ShardingRule):
    """How GEMMs split over a mesh axis.

    Tensor axis (``tp``): a dense layer or a convolution on an ``R`` input is *column-parallel*
    (weight split by output features, output ``S``); on an input split along its reduction axis
    it is *row-parallel* (weight split by input features, output ``P``) where the mesh allows it
    and the partial sums are no larger than the input; output features that ``tp`` does not
    divide are split unevenly. Grouped convolutions split their groups. A matmul of two
    activations keeps a batch axis (the heads) both operands share, the rows of ``A`` or the
    columns of ``B``, runs row-parallel on a reduction split of both, and otherwise gathers its
    operands and splits the heads or the rows (``R`` operands are sliced for free).

    Sequence axis (``sp``): rows are independent, so dense layers and matmuls keep (or start) a
    split of their rows; what a row block cannot take split (a reduction axis, the keys of
    attention) is gathered; convolutions are replicated.

    Data axis (``dp``): samples are independent, so a split of any axis but the reduction axis
    is kept (a convolution keeps the batch, axis 0; a matmul keeps a batch axis or the rows of
    ``A``, or the columns of ``B``, a replicated operand sliced for free); replicated operands
    stay replicated; anything else is gathered.
    """

    def propagate(self, ctx, layer, ins):
        if len(ctx.acts(layer)) != 2 and layer.kind == "matmul":
            return PointwiseRule().propagate(ctx, layer, ins)  # a constant operand: follows A
        if ctx.axis.name == "sp":
            return self._rows(ctx, layer, ins)
        if ctx.axis.name == "dp":
            return self._batch(ctx, layer, ins)
        return self._tensor(ctx, layer, ins)

    def expert_weight(self, program, layer):
        """A matmul's constant second operand stacked over a leading expert axis (rank 3 or more)."""
        t = program.tensors
        if layer.kind != "matmul" or len(layer.inputs) != 2:
            return None
        tid = layer.inputs[1]
        return tid if t[tid].role == "const" and len(t[tid].shape) >= 3 else None

    @staticmethod
    def _batch(ctx, layer, st):
        full, acts = ctx.full, ctx.acts(layer)
        rank = len(full[layer.output])
        if not any(s.split for s in st):
            return ShardDecision(REPLICATE, "rep")
        if layer.kind == "conv2d":
            keep = st[0] == shard(0)
        elif layer.kind == "dense":
            keep = st[0].split and st[0].axis != len(full[acts[0]]) - 1
        else:
            a, b = ([s.axis - len(full[tid]) if s.split else None for s, tid in zip(st, acts)])
            fa, fb = full[acts[0]], full[acts[1]]

            def sliced(shape, ax, extent):  # a replicated operand broadcast, or sliced for free
                return len(shape) < -ax or shape[ax] in (1, extent)

            if a is not None and a != -1 and ((a <= -3 and b == a) or (b is None and (a == -2 or sliced(fb, a, fa[a])))):
                return ShardDecision(shard(rank + a), "split")
            if a is None and b is not None and (b == -1 or (b <= -3 and sliced(fa, b, fb[b]))):
                return ShardDecision(shard(rank + b), "split")
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        if keep:
            return ShardDecision(shard(st[0].axis + rank - len(full[acts[0]])), "split")
        return ShardDecision(REPLICATE, "rep", gather_all=True)

    @staticmethod
    def _tensor(ctx, layer, st):
        full, acts, tp, row = ctx.full, ctx.acts(layer), ctx.size, ctx.axis.row
        out = layer.output
        rank = len(full[out])
        kind = layer.kind
        if kind == "dense" or (kind == "conv2d" and layer.attrs.get("groups", 1) == 1):
            ax = rank - 1 if kind == "dense" else 1
            k_axis = len(full[acts[0]]) - 1 if kind == "dense" else 1
            n_out = full[out][ax]
            if st[0].split and st[0].axis == k_axis and row and (row == ROW_ALWAYS or ctx.row_pays(layer, acts[0])):
                return ShardDecision(PARTIAL, "row", partial_elem=ACC_BYTES if layer.mode == "int8" else None,
                                     partial_exact=layer.mode == "int8")
            if n_out >= tp:  # uneven: the last chips get a column fewer
                return ShardDecision(shard(ax), "col", (GatherInput(0),))
            return ShardDecision(REPLICATE, "rep", (GatherInput(0),))
        if kind == "conv2d":  # grouped / depthwise: channels split with their groups
            if layer.attrs["groups"] % tp == 0 and (not st[0].split or st[0] == shard(1)):
                return ShardDecision(shard(1), "split")  # an R input is sliced for free
            return ShardDecision(REPLICATE, "rep", (GatherInput(0),))
        a = (st[0].kind, st[0].axis - len(full[acts[0]]))
        b = (st[1].kind, st[1].axis - len(full[acts[1]]))
        m_ext = full[out][-2] if rank >= 2 else 1
        if a[0] == "S" and b[0] == "S" and a[1] == b[1] and a[1] <= -3:
            return ShardDecision(shard(rank + a[1]), "split")
        if a[0] == "S" and a[1] <= -3 and b[0] == "R" and len(full[acts[1]]) >= -a[1] \
                and full[acts[1]][a[1]] == full[acts[0]][a[1]]:
            return ShardDecision(shard(rank + a[1]), "split")
        if b[0] == "S" and b[1] <= -3 and a[0] == "R" and len(full[acts[0]]) >= -b[1] \
                and full[acts[0]][b[1]] == full[acts[1]][b[1]]:
            return ShardDecision(shard(rank + b[1]), "split")
        if a[0] == "S" and a[1] == -2 and b[0] == "R":
            return ShardDecision(shard(rank - 2), "split")
        if a[0] == "R" and b[0] == "S" and b[1] == -1:
            return ShardDecision(shard(rank - 1), "split")
        if a[0] == "S" and a[1] == -1 and b[0] == "S" and b[1] == -2 and row \
                and (row == ROW_ALWAYS or ctx.row_pays(layer, acts[0])):
            return ShardDecision(PARTIAL, "row", partial_elem=ACC_BYTES if layer.mode == "int8" else None,
                                 partial_exact=layer.mode == "int8")
        # R operands are sliced for free: split the outermost batch axis both operands share
        # (the heads), else the rows
        lead = [j for j in range(rank - 2) if full[out][j] % tp == 0 and full[out][j] >= tp
                and all(len(full[tid]) >= rank - j and full[tid][j - rank] == full[out][j] for tid in acts)]
        if lead:
            return ShardDecision(shard(lead[0]), "split", gather_all=True)
        if m_ext % tp == 0 and m_ext >= tp:
            return ShardDecision(shard(rank - 2), "split", gather_all=True)
        return ShardDecision(REPLICATE, "rep", gather_all=True)

    @staticmethod
    def _rows(ctx, layer, st):
        full, acts, sp = ctx.full, ctx.acts(layer), ctx.size
        shape = full[layer.output]
        rank = len(shape)
        rows = rank - 2 if rank >= 2 and shape[rank - 2] >= sp else None  # R operands: sliced for free
        if layer.kind == "conv2d":
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        if layer.kind == "dense":
            if st[0].split and st[0].axis == len(full[acts[0]]) - 1:
                return _row_split(rows, (GatherInput(0),))  # split along the reduction axis
            return _row_split(st[0].axis if st[0].split else rows, ())
        a, b = acts
        before = []
        sa = st[0].axis - len(full[a]) if st[0].split else None
        sb = st[1].axis - len(full[b]) if st[1].split else None
        if sa == -1:
            before.append(GatherInput(0))
            sa = None
        if sb == -2:
            before.append(GatherInput(1))
            sb = None
        if sa is not None and sa <= -3 and (sb == sa or (sb is None and len(full[b]) >= -sa
                                                          and full[b][sa] == full[a][sa])):
            res = rank + sa  # a batch axis (heads) both operands share
        elif sa is None and sb == -1:
            res = rank - 1  # the columns of B
        else:
            if sa is not None and sa != -2:
                before.append(GatherInput(0))
            if sb is not None:
                before.append(GatherInput(1))  # the keys: every query row block needs all of them
            res = rank - 2 if shape[rank - 2] >= sp else None
        return _row_split(res, tuple(before))

    def reduction_reader(self, program, layer, tid):
        return layer.kind == "dense" and "weight" in layer.consts and layer.inputs[0] == tid \
            and tid not in layer.inputs[1:]

    def cache_operand(self, layer, pos):
        return layer.kind == "matmul" and pos == 1

    def shrinks_row_consts(self, layer):
        return False  # weights and per-feature constants are not on the rows

    def const_shape(self, layer, tid, split, parts, full):
        if tid != layer.consts.get("weight") or layer.kind == "matmul":
            return None
        shape = list(full[tid])
        if layer.kind == "dense":
            k = 1 if split == "col" else 0
        else:
            k = 0 if split in ("col", "split") else 1
        shape[k] = part(shape[k], parts)
        return shape

    def local_attrs(self, layer, split, parts):
        if layer.kind == "conv2d" and split == "split":  # grouped: each chip has its groups
            return dict(layer.attrs, groups=layer.attrs["groups"] // parts)
        return None


def _row_split(axis, before):
    """A row-split decision on ``axis`` (None: replicated)."""
    if axis is None:
        return ShardDecision(REPLICATE, "rep", before, gather_all=True)
    return ShardDecision(shard(axis), "split", before)
