"""Optimizer-state sharding over data-parallel replicas (ZeRO stages 1 and 2).

The parameters, laid out as one flat float32 vector (every parameter flattened, in parameter
order: the layout of the gradient buffer the replicas reduce), are cut into ``R`` consecutive
shards (:func:`shard_bounds`). Replica ``r`` keeps the optimizer state of shard ``r`` only and
updates shard ``r`` of the parameters with shard ``r`` of the reduced gradient; the updated
shards are then gathered, so every replica holds all parameters again for the next step
(stage 1). Stage 2 also keeps only shard ``r`` of the reduced gradient on replica ``r`` (the
reduction's result is scattered instead of broadcast).

Why the bits are the one-chip run's: every optimizer in :mod:`tvm_spinn.training` updates a
parameter element from that element's gradient and state alone (the per-element float32 ops of
``torch.optim``'s single-tensor update), with the same 0-d step arithmetic (step count, bias
corrections) for every element. A shard's update is the same per-element ops on a slice, so
each element gets the same roundings whatever the shard it falls in; the gather is a copy.

The canonical state (what :meth:`~tvm_spinn.training.Trainer.optimizer_state` returns and a
checkpoint holds) is the unsharded one, so a run may resume under another replica count or
without sharding, with the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ..frontend.fixups import FixupImported
from .graph import make_optimizer

__all__ = ["ShardLayout", "shard_bounds", "shard_update_module"]


def shard_bounds(total: int, shards: int) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` of each of ``shards`` consecutive shards of ``total`` elements, as even
    as possible (the first ``total % shards`` one element longer)."""
    sizes = [total // shards + (r < total % shards) for r in range(shards)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return tuple((int(starts[r]), int(starts[r + 1])) for r in range(shards))


def shard_update_module(optimizer, size: int, granules: int) -> tuple[tvm.IRModule, tuple]:
    """``main(param_shard, grad_sum_shard, optim_state_shard) -> (param_shard, optim_state_shard)``
    for a shard of ``size`` elements: the gradient sum divided by the granule count, then the
    optimizer's update. Returns the module and the optimizer's initial state of a shard."""
    shard = relax.Var("param_shard", relax.TensorType((size,), "float32"))
    opt = make_optimizer(optimizer).init([shard])
    update = opt.get_function().without_attr("global_symbol")
    bb = relax.BlockBuilder()
    g_update = bb.add_func(update, "update")
    param = relax.Var("param_shard", relax.TensorType((size,), "float32"))
    gsum = relax.Var("grad_sum_shard", relax.TensorType((size,), "float32"))
    state = relax.Var("optim_states", update.params[2].ty)
    with bb.function("main", [param, gsum, state]):
        with bb.dataflow():
            # the canonical update's division (parallel.update_module): exact IEEE division
            grad = bb.emit(relax.op.divide(gsum, relax.const(float(granules), "float32")))
            upd = bb.emit(relax.Call(g_update, [relax.Tuple([param]), relax.Tuple([grad]), state]))
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(relax.TupleGetItem(upd, 0), 0),
                                              relax.TupleGetItem(upd, 1)]))
        bb.emit_func_output(out)
    mod = relax.transform.InlinePrivateFunctions()(bb.get())
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    mod = relax.transform.CanonicalizeBindings()(mod)
    return FixupImported(mod), tuple(np.array(s.numpy()) for s in opt.state)


@dataclass(frozen=True)
class ShardLayout:
    """How the canonical optimizer state maps onto shard states.

    The canonical state is ``scalars`` 0-d entries (the step count, an optimizer's running
    products), then ``groups`` buffers per parameter (momentum; first and second moments),
    group by group, each group in parameter order. A shard's state is the same scalars, then
    one flat buffer per group.

    Attributes
    ----------
    param_shapes : tuple of tuple of int
    bounds : tuple of (int, int)
        Each shard's ``[start, stop)`` in the flat parameter vector.
    scalars, groups : int
    """

    param_shapes: tuple
    bounds: tuple
    scalars: int
    groups: int

    @staticmethod
    def of(param_shapes, shards: int, shard_state) -> "ShardLayout":
        """The layout of ``shards`` shards, from a shard's initial state (its scalars are 0-d,
        its buffers 1-d: a shard is a flat vector)."""
        scalars = sum(1 for s in shard_state if np.ndim(s) == 0)
        total = sum(int(np.prod(s)) for s in param_shapes)
        return ShardLayout(tuple(tuple(s) for s in param_shapes), shard_bounds(total, shards),
                           scalars, len(shard_state) - scalars)

    def split_params(self, flat: np.ndarray) -> list[np.ndarray]:
        return [np.ascontiguousarray(flat[a:b]) for a, b in self.bounds]

    def flatten(self, arrays) -> np.ndarray:
        return np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])

    def unflatten(self, flat: np.ndarray) -> list[np.ndarray]:
        cuts = np.cumsum([int(np.prod(s)) for s in self.param_shapes])[:-1]
        return [np.array(p.reshape(s), order="C") for p, s in zip(np.split(flat, cuts), self.param_shapes)]

    def scatter_state(self, canonical) -> list[list[np.ndarray]]:
        """Shard states of a canonical state."""
        n = len(self.param_shapes)
        scalars = [np.array(s) for s in canonical[:self.scalars]]
        groups = [self.flatten(canonical[self.scalars + j * n:self.scalars + (j + 1) * n])
                  for j in range(self.groups)]
        return [scalars + [np.ascontiguousarray(g[a:b]) for g in groups] for a, b in self.bounds]

    def gather_state(self, shards) -> list[np.ndarray]:
        """The canonical state of shard states (the scalars are every shard's: the first's)."""
        out = [np.array(s) for s in shards[0][:self.scalars]]
        for j in range(self.groups):
            out += self.unflatten(np.concatenate([s[self.scalars + j] for s in shards]))
        return out

