"""Data-parallel training whose bits do not depend on the replica count.

Rule (docs/design/training.md): the batch is cut into a fixed number ``M`` of micro-batches
(a property of the training run, like the batch size), and the gradient of the step is the sum of
the ``M`` micro-batch gradients in ascending micro-batch order, ``((g0 + g1) + g2) + ...``,
divided by ``M``. ``R`` replicas (chips) own consecutive blocks of micro-batches
(:func:`replica_blocks`) and reduce by a *chain*: replica ``r`` receives the running sum of the
micro-batches before its block from replica ``r - 1``, adds its own micro-batches' gradients in
order and passes the sum on (the last replica's sum goes back to all). Every addition is
therefore the same pair of the same values for ``R = 1, 2, 4, ...`` and any split into blocks:
the final parameters are bitwise identical across replica counts (and across systems, by the
one-chip rule of the package docstring). The loss is carried in the same buffer (its first
element), so the reported loss is reduced the same way.

The chain is the scale-out mapping's bit-exact all-reduce
(:func:`~tvm_spinn.timing.collectives.chain_all_reduce`): the buffer is cut into segments that
flow down the chain while finished segments flow back, so its cost is a ring's bandwidth over
neighbouring chips (on a board's links it is cheaper than the ring for gradient-sized buffers,
``bench/training.py``). The additions of the reduction are done here in numpy float32:
IEEE-754 binary32 additions, rounded to nearest even, with subnormals kept, which is what the
simulated M4F's fp32 ``add`` computes (no flush-to-zero; ``tests/training/test_training_parallel.py``
checks a PE ``add`` against numpy). Their time is modelled: the additions as the PE add program
of the gradient buffer, the transfers as the collective on the system's link graph.

The non-reproducible mode (``reproducible=False``) is the usual one: each replica sums its
micro-batches, then the cheaper of a ring and a tree all-reduce adds the replicas' sums; a ring's
additions run chunk by chunk starting at a different rank per chunk, so its bits depend on
``R`` (also its functional result here: :func:`ring_sum`).
:meth:`DataParallelTrainer.simulated_step` prices both.

BatchNorm normalizes each micro-batch with its own statistics (as PyTorch's DDP without
SyncBatchNorm does).

Plans of ``parallel=`` (:func:`build_parallel`) take the chain's unit from the micro-batch down
to a *granule* of ``g`` samples (default one): the gradient program is compiled for a granule,
a micro-batch runs it once per granule, and the chain adds the granules' gradients in ascending
order, so the micro-batch count (any that cuts the batch into whole granules) joins the replica
count among the things the bits do not depend on. ZeRO-1/2 (:mod:`.zero`) shards the update.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import tvm
from tvm import relax

from ..frontend.fixups import FixupImported
from ..timing.collectives import all_gather, all_reduce, chain_all_reduce
from .trainer import Trainer, _resolve_target
from .errors import TrainingError
from .graph import TrainGraph

__all__ = ["DataParallelTrainer", "build_data_parallel"]


def _finish(bb: relax.BlockBuilder) -> tvm.IRModule:
    mod = relax.transform.InlinePrivateFunctions()(bb.get())
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    mod = relax.transform.CanonicalizeBindings()(mod)
    return FixupImported(mod)


def grad_module(graph: TrainGraph) -> tvm.IRModule:
    """``main(inputs, params, targets) -> (loss, grads)``: one micro-batch's loss and gradients
    (the adjoint function). The step lays them out as one float32 vector (the loss, then every
    gradient flattened, in parameter order) on the host: a copy, exact. (A ``concat`` of the
    flattened gradients in the graph trips TVM 0.27's FuseTIR on ResNet-18: "Parameter
    expression ... expected an integer argument".)"""
    adjoint = graph.phases["backbone_loss_adjoint"].without_attr("global_symbol")
    bb = relax.BlockBuilder()
    g_adjoint = bb.add_func(adjoint, "adjoint")
    args = [relax.Var(p.name, p.ty) for p in adjoint.params]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(g_adjoint, args))
        bb.emit_func_output(out)
    return _finish(bb)


def update_module(graph: TrainGraph, microbatches: int) -> tvm.IRModule:
    """``main(params, loss_sum, grad_sums, optim_states) -> (loss, params, optim_states)``: the
    sums divided by the micro-batch count (the batch mean, as the full-batch loss takes it) and
    the optimizer's update."""
    update = graph.phases["optimizer"].without_attr("global_symbol")
    bb = relax.BlockBuilder()
    g_update = bb.add_func(update, "update")
    params = [relax.Var(n.replace(".", "_"), relax.TensorType(s, "float32"))
              for n, s in zip(graph.param_names, graph.param_shapes)]
    sums = [relax.Var(f"grad_sum_{k}", relax.TensorType(s, "float32")) for k, s in enumerate(graph.param_shapes)]
    loss_sum = relax.Var("loss_sum", relax.TensorType((), "float32"))
    state = relax.Var("optim_states", update.params[2].ty)
    m = relax.const(float(microbatches), "float32")
    with bb.function("main", params + [loss_sum] + sums + [state]):
        with bb.dataflow():
            # a division, not a multiply by 1/M: exact IEEE division, as a mean over M values is
            grads = [bb.emit(relax.op.divide(g, m)) for g in sums]
            loss = bb.emit(relax.op.divide(loss_sum, m))
            upd = bb.emit(relax.Call(g_update, [relax.Tuple(params), relax.Tuple(grads), state]))
            out = bb.emit_output(relax.Tuple([loss, relax.TupleGetItem(upd, 0), relax.TupleGetItem(upd, 1)]))
        bb.emit_func_output(out)
    return _finish(bb)


def add_module(n: int) -> tvm.IRModule:
    """``main(a, b) -> a + b`` on the flat gradient buffer: one in-block addition (timing)."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((n,), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(a, b))
        bb.emit_func_output(out)
    return bb.get()


@contextlib.contextmanager
def _replica_target(target: tvm.target.Target):
    """``(replica target, system)``: one chip of a spinn system (every replica's programs are
    built for it), registered as ``<system>-replica`` for the ``with`` block only, or the
    target itself (one chip already, or a host target; system ``None`` for a host)."""
    from ..target.registry import arch_of, is_spinn_target, registered_system

    if not is_spinn_target(target):
        yield target, None
        return
    arch = arch_of(target)
    if arch.chips == 1:
        yield target, arch
        return
    chip = arch.replace(name=f"{arch.name}-replica", chips=1)
    with registered_system(chip, fallback=arch.host_fallback) as tag:
        yield _resolve_target(tag), arch


def replica_blocks(microbatches: int, replicas: int) -> tuple[tuple[int, int], ...]:
    """Consecutive blocks of micro-batches, one per replica, as even as possible (the first
    ``microbatches % replicas`` one longer)."""
    sizes = [microbatches // replicas + (r < microbatches % replicas) for r in range(replicas)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return tuple((int(starts[r]), int(starts[r + 1])) for r in range(replicas))


def chain_sum(partials: list[np.ndarray]) -> np.ndarray:
    """The reproducible reduction: ascending micro-batch order, ``((p0 + p1) + p2) + ...``
    (what the chain over replicas computes for any split into consecutive blocks)."""
    acc = partials[0]
    for p in partials[1:]:
        acc = acc + p
    return acc


def ring_sum(partials: list[np.ndarray], blocks) -> np.ndarray:
    """The non-reproducible reduction: each replica sums its block one after another, then a
    ring reduce-scatter adds the replicas' sums chunk by chunk, chunk ``j`` starting at replica
    ``j + 1`` (the order therefore depends on the replica count)."""
    local = []
    for start, stop in blocks:
        acc = partials[start]
        for m in range(start + 1, stop):
            acc = acc + partials[m]
        local.append(acc)
    c = len(local)
    out = np.empty_like(local[0])
    for j, idx in enumerate(np.array_split(np.arange(out.size), c)):
        acc = local[(j + 1) % c][idx]
        for k in range(2, c + 1):
            acc = acc + local[(j + k) % c][idx]
        out[idx] = acc
    return out


class DataParallelTrainer(Trainer):
    """A training step split over ``microbatches`` micro-batches on ``replicas`` chips.

    Built by :func:`tvm_spinn.training.compile` with ``data_parallel=`` or ``parallel=``.
    :meth:`step`, :meth:`parameters`, :meth:`save` and :meth:`load` behave as
    :class:`Trainer`'s (a checkpoint holds the same, unsharded state, so a run may resume with
    another replica count, micro-batch count or sharding).

    A micro-batch is a whole number of *granules* (``granule`` samples each; the gradient
    program is compiled for one granule): the step's gradient is the sum of the granule
    gradients in ascending granule order, which neither the micro-batch count nor the replica
    count changes. ``data_parallel=`` takes a granule of one micro-batch (bits depend on the
    micro-batch count), ``parallel=`` one sample (bits depend on neither). With ``tp > 1`` the
    gradient program is split over ``tp`` chips per stage (:mod:`.tensor_parallel`), with the
    same bits.
    """

    def __init__(self, graph, micro_graph, grad_ex, update_ex, target, system_arch, loss, optimizer,
                 model_name, microbatches: int, replicas: int, reproducible: bool, granules: int | None = None,
                 zero: int = 0, shared: dict | None = None, pp: int = 1, layers: int | None = None,
                 tp: int = 1, tp_split=None, head_stage: bool = False, head_lag: int = 0,
                 zero_bubble: bool = False):
        super().__init__(graph, update_ex, target, loss, optimizer, model_name)
        self._micro_graph = micro_graph
        self._grad_ex = grad_ex
        self._grad_vm = relax.VirtualMachine(grad_ex, tvm.cpu())
        self._system = system_arch
        self.microbatches = microbatches
        self.replicas = replicas
        self.reproducible = reproducible
        #: granules per step (the batch / the granule's samples); a micro-batch holds granules / microbatches
        self.granules = microbatches if granules is None else granules
        self._granule_is_microbatch = granules is None
        self.zero = zero
        #: pipeline stages (chips per replica); ``layers``: the model's layers (None: not a transformer)
        self.pp = pp
        self._layers = layers
        #: the last of the ``pp`` stages is the LM head's own (:func:`.pipeline.cut_stages`)
        self.head_stage = head_stage
        #: micro-batches the head stage's passes run behind the others (:func:`.pipeline.one_f_one_b`)
        self.head_lag = head_lag
        #: each stage's backward cut into input- and weight-gradient programs, scheduled ZB-H1
        #: (:func:`.pipeline.zb_h1`)
        self.zero_bubble = zero_bubble
        #: tensor-parallel ranks (chips per stage) and the split gradient program (:mod:`.tensor_parallel`)
        self.tp = tp
        self._tp_split = tp_split
        self._blocks = replica_blocks(microbatches, replicas)
        # compiled programs shared by every trainer derived with with_plan (shard updates by size,
        # stage programs by stage count)
        self._shared = ({"add": None, "host": None, "shard_update": {}, "pipeline": {}, "tp": None} if shared is None
                        else shared)
        self._stages = self._pipeline() if pp > 1 else None
        self._layout = None
        self._shard_vms: list = []
        if zero:
            self._setup_shards()
        #: ZeRO-0 pipeline in the chain's order: per stage, (parameter indices, their elements in the
        #: flat gradient vector, update VM), reduced and updated as the stage's last backward ends
        self._buckets = self._setup_buckets() if pp > 1 and not zero and reproducible else None

    @property
    def granule(self) -> int:
        """Samples per granule (the unit whose gradients the step sums in a fixed order)."""
        return self._graph.input_shapes[0][0][0] // self.granules

    def plan(self) -> dict:
        """This trainer's parallel plan: ``{"dp", "tp", "pp", "microbatches", "zero", "granule", "head_stage",
        "head_lag", "zero_bubble"}``."""
        return {"dp": self.replicas, "tp": self.tp, "pp": self.pp, "microbatches": self.microbatches, "zero": self.zero,
                "granule": self.granule, "head_stage": self.head_stage, "head_lag": self.head_lag,
                "zero_bubble": self.zero_bubble}

    def _grad_program(self) -> tvm.IRModule:
        """The granule's gradient program: for a transformer, the one whose GEMMs over a
        tensor-parallel split axis run in the canonical order (:func:`~.tensor_parallel.split_gemms`,
        the same program for every ``tp``)."""
        return self._tp_split.mod if self._tp_split is not None else grad_module(self._micro_graph)

    # -- pipeline stages ---------------------------------------------------------------------------
    def _pipeline(self):
        """``(cut, VMs of the forward programs, VMs of the backward programs, executables, VMs of
        the weight-gradient programs)`` of this trainer's stage count, compiled once per count and
        schedule (:mod:`.pipeline`; with ZB-H1 the backward programs are the input-gradient ones
        and a stage without a weight-gradient program has None)."""
        from .pipeline import cut_stages

        cache, key = self._shared["pipeline"], (self.pp, self.head_stage, self.zero_bubble)
        if key not in cache:
            micro = self._micro_graph
            cut = cut_stages(self._grad_program(), micro.param_names, len(micro.input_shapes), self._layers, self.pp,
                             self.head_stage, self.zero_bubble)
            with _replica_target(self._target) as (replica, _):
                exes = ([relax.build(p.mod, target=replica) for p in cut.forward],
                        [relax.build(p.mod, target=replica) for p in cut.backward],
                        [None if p is None else relax.build(p.mod, target=replica) for p in cut.weight])
            cache[key] = (cut, exes)
        cut, (fwd, bwd, wgt) = cache[key]
        return (cut, [relax.VirtualMachine(e, tvm.cpu()) for e in fwd],
                [relax.VirtualMachine(e, tvm.cpu()) for e in bwd], (fwd, bwd, wgt),
                [None if e is None else relax.VirtualMachine(e, tvm.cpu()) for e in wgt])

    def _pipelined_grads(self, granule_args: list[list]) -> list[np.ndarray]:
        """One replica's micro-batches through the stages in 1F1B order (:func:`.pipeline.one_f_one_b`),
        or with ZB-H1 the input- and weight-gradient passes in :func:`.pipeline.zb_h1`'s:
        ``granule_args[m]`` holds the (inputs, targets) of micro-batch ``m``'s granules. Returns each
        granule's flat (loss, gradients) vector in granule order. Every granule keeps its own values;
        the order of the events moves no bits (each event's programs read only its granule's values)."""
        from .pipeline import one_f_one_b, zb_h1

        cut, fwd, bwd, _, wgt = self._stages
        order = zb_h1 if self.zero_bubble else one_f_one_b
        values = []
        for mb in granule_args:
            for inputs, targets in mb:
                v = {f"input:{k}": x for k, x in enumerate(inputs)}
                v.update({f"param:{k}": p for k, p in enumerate(self._params)})
                v["targets"] = targets
                values.append(v)
        starts = np.cumsum([0] + [len(mb) for mb in granule_args])
        for kind, stage, m in order(self.pp, len(granule_args), self.head_lag):
            prog, vm = {"f": (cut.forward, fwd), "b": (cut.backward, bwd), "w": (cut.weight, wgt)}[kind]
            prog, vm = prog[stage], vm[stage]
            if prog is None:  # a stage with no weight-gradient binding
                continue
            for v in values[starts[m]:starts[m + 1]]:
                out = vm["main"](*[v[k] for k in prog.inputs])
                v.update(zip(prog.outputs, out))
        return [np.concatenate([v[cut.loss].numpy().reshape(1)] + [v[k].numpy().reshape(-1) for k in cut.grads])
                for v in values]

    # -- ZeRO: the optimizer state sharded over the replicas ------------------------------------
    def _setup_shards(self) -> None:
        from .zero import ShardLayout, shard_bounds, shard_update_module

        total = sum(int(np.prod(s)) for s in self._graph.param_shapes)
        cache = self._shared["shard_update"]
        vms, init = [], None
        with _replica_target(self._target) as (replica, _):
            for a, b in shard_bounds(total, self.replicas):
                if (b - a, self.granules) not in cache:
                    mod, state = shard_update_module(self._optimizer_spec, b - a, self.granules)
                    cache[(b - a, self.granules)] = (relax.build(mod, target=replica), state)
                ex, init = cache[(b - a, self.granules)]
                vms.append(relax.VirtualMachine(ex, tvm.cpu()))
        self._shard_vms = vms
        self._layout = ShardLayout.of(self._graph.param_shapes, self.replicas, init)

    # -- bucketed reduction: each stage's gradients reduced and updated on their own ----------------
    def _setup_buckets(self) -> list:
        """One bucket per stage that holds parameters (ZeRO-0 with pipeline stages): its
        parameters (the cut's ``param_stage``), their elements' positions in the flat (loss,
        gradients) vector and the update of a flat vector of its size
        (:func:`.zero.shard_update_module`: the canonical update's per-element ops on a slice, so
        the same bits). The loss (position 0) is in no bucket: ``_bucketed_update`` reduces
        it on its own, so a stage without parameters leaves it whole."""
        from .zero import ShardLayout, shard_update_module

        cut = self._stages[0]
        sizes = [int(np.prod(s)) for s in self._graph.param_shapes]
        starts = np.cumsum([1] + sizes)
        cache = self._shared["shard_update"]
        buckets, init = [], None
        with _replica_target(self._target) as (replica, _):
            for stage in range(self.pp):
                idx = [k for k, st in enumerate(cut.param_stage) if st == stage]
                if not idx:
                    continue
                pos = np.concatenate([np.arange(starts[k], starts[k] + sizes[k]) for k in idx])
                n = sum(sizes[k] for k in idx)
                if (n, self.granules) not in cache:
                    mod, state = shard_update_module(self._optimizer_spec, n, self.granules)
                    cache[(n, self.granules)] = (relax.build(mod, target=replica), state)
                ex, init = cache[(n, self.granules)]
                buckets.append((stage, tuple(idx), pos, relax.VirtualMachine(ex, tvm.cpu())))
        self._bucket_layout = ShardLayout.of(self._graph.param_shapes, 1, init)
        return buckets

    def _bucketed_update(self, flats: list) -> float:
        """Each stage's bucket: its elements of every granule's vector added in ascending granule
        order (the chain's order per element, whatever the buckets), then its parameters updated
        from that sum and their optimizer state. The canonical state is kept whole: a bucket's
        state is the scalars (the step count: every bucket's update advances it alike) and its
        parameters' entries of each group, flattened."""
        layout, n = self._bucket_layout, len(self._params)
        state = [s.numpy() for s in self._state]
        scalars = state[:layout.scalars]
        params = list(self._params)
        new_state = list(state)
        # the loss: every granule's added in the chain's order, whichever stages hold parameters
        loss = chain_sum([f[0] for f in flats])
        for _, idx, pos, vm in self._buckets:
            total = chain_sum([f[pos] for f in flats])
            flat = np.concatenate([params[k].numpy().reshape(-1) for k in idx])
            groups = [np.concatenate([state[layout.scalars + j * n + k].reshape(-1) for k in idx])
                      for j in range(layout.groups)]
            p, st = vm["main"](tvm.runtime.tensor(np.ascontiguousarray(flat)),
                               tvm.runtime.tensor(np.ascontiguousarray(total)),
                               [tvm.runtime.tensor(np.array(x)) for x in scalars] +
                               [tvm.runtime.tensor(g) for g in groups])
            st = [x.numpy() for x in st]
            cuts = np.cumsum([int(np.prod(self._graph.param_shapes[k])) for k in idx])[:-1]
            for k, part in zip(idx, np.split(p.numpy(), cuts)):
                params[k] = tvm.runtime.tensor(np.array(part.reshape(self._graph.param_shapes[k]), order="C"))
            for j in range(layout.groups):
                for k, part in zip(idx, np.split(st[layout.scalars + j], cuts)):
                    new_state[layout.scalars + j * n + k] = part.reshape(self._graph.param_shapes[k])
            new_state[:layout.scalars] = st[:layout.scalars]
        self._params = params
        self._state = [tvm.runtime.tensor(np.array(x, order="C")) for x in new_state]
        # the loss: the mean over the granules, one IEEE float32 division as the update's
        return float(np.float32(loss) / np.float32(self.granules))

    def _set_state(self, params, optim) -> None:
        if not self.zero:
            super()._set_state(params, optim)
            return
        self._params = [tvm.runtime.tensor(np.array(p, order="C")) for p in params]
        self._state = [[tvm.runtime.tensor(np.array(s, order="C")) for s in shard]
                       for shard in self._layout.scatter_state([np.asarray(s) for s in optim])]

    def optimizer_state(self) -> list[np.ndarray]:
        if not self.zero:
            return super().optimizer_state()
        return self._layout.gather_state([[s.numpy() for s in shard] for shard in self._state])

    def optimizer_state_shards(self) -> list[list[np.ndarray]]:
        """Each replica's optimizer state (ZeRO): the scalars, then one flat buffer per kind
        (momentum; first and second moments) of its shard of the parameters. Without
        sharding: one shard, the canonical state."""
        if not self.zero:
            return [self.optimizer_state()]
        return [[s.numpy() for s in shard] for shard in self._state]

    @property
    def steps(self) -> int:
        return int((self._state[0][0] if self.zero else self._state[0]).numpy())

    # -- plans sharing the compiled programs -------------------------------------------------------
    def with_plan(self, replicas: int | None = None, microbatches: int | None = None, zero: int | None = None,
                  reproducible: bool | None = None, pp: int | None = None,
                  tp: int | None = None, head_stage: bool | None = None,
                  head_lag: int | None = None, zero_bubble: bool | None = None) -> "DataParallelTrainer":
        """The same compiled gradient program under another plan (replica count, micro-batch
        count, optimizer-state sharding, mode, pipeline stages: a new stage count compiles its
        stage programs once), from this trainer's current parameters and optimizer state. A
        micro-batch count must split the step's granules evenly. The tensor-parallel degree
        ``tp`` is the compiled one (its gradient program is split for it). ``head_stage``: the
        last of the ``pp`` stages holds the LM head alone (the layers fill the others); ``head_lag``:
        its passes run that many micro-batches behind the other stages' (a schedule order: the
        same bits); ``zero_bubble``: each stage's backward cut into input- and weight-gradient
        programs and scheduled ZB-H1 (:func:`.pipeline.zb_h1`; the same bits)."""
        replicas = self.replicas if replicas is None else replicas
        microbatches = self.microbatches if microbatches is None else microbatches
        zero = self.zero if zero is None else zero
        pp = self.pp if pp is None else _positive("parallel: pp", pp)
        head_stage = self.head_stage if head_stage is None else head_stage
        if not isinstance(head_stage, bool):
            raise TrainingError(f"with_plan: head_stage must be True or False, got {head_stage!r}")
        if head_stage and pp < 2:
            raise TrainingError(f"with_plan: a head stage of its own needs pp >= 2 (the layers' stages and the "
                                f"head's), got pp={pp}")
        head_lag = _head_lag("with_plan", self.head_lag if head_lag is None else head_lag, head_stage)
        zero_bubble = _zero_bubble("with_plan", self.zero_bubble if zero_bubble is None else zero_bubble, pp)
        if tp is not None and tp != self.tp:
            raise TrainingError(f"with_plan: tp={tp}: this trainer's gradient program is split for tp={self.tp}; "
                                f"compile with parallel={{'tp': {tp}}} for another tensor-parallel degree")
        if pp > 1:
            if self._layers is None:
                raise TrainingError("with_plan: pp > 1 needs a transformer compiled with parallel= (its layers "
                                    "are what the stages cut)")
            if head_stage:
                _check_axis("pp - 1", pp - 1, "the layers", self._layers,
                            "a head stage of its own leaves pp - 1 stages to the layers")
            else:
                _check_axis("pp", pp, "the layers", self._layers)
        if microbatches != self.microbatches and self._granule_is_microbatch:
            raise TrainingError("with_plan: this trainer's granule is its micro-batch (data_parallel=), so its "
                                "micro-batch count is fixed; compile with parallel= to vary it")
        batch = self._graph.input_shapes[0][0][0]
        _check_axis("microbatches", microbatches, "the batch's granules", self.granules,
                    f"batch {batch} in granules of {self.granule} sample(s)")
        _check_replicas(replicas, microbatches, self._system, self._target,
                        "data_parallel: replicas" if self._granule_is_microbatch else "parallel: dp", pp, self.tp)
        _check_zero(zero)
        other = DataParallelTrainer(self._graph, self._micro_graph, self._grad_ex, self.executable, self._target,
                                    self._system, self._loss, self._optimizer_spec, self._model_name,
                                    microbatches, replicas,
                                    self.reproducible if reproducible is None else reproducible,
                                    None if self._granule_is_microbatch else self.granules, zero,
                                    self._shared, pp, self._layers, self.tp, self._tp_split, head_stage, head_lag,
                                    zero_bubble)
        other._set_state([p.numpy() for p in self._params], self.optimizer_state())
        return other

    def with_replicas(self, replicas: int, reproducible: bool | None = None) -> "DataParallelTrainer":
        """The same compiled programs on another replica count (and mode), from this trainer's
        current parameters and optimizer state."""
        return self.with_plan(replicas=replicas, reproducible=reproducible)

    def build_for(self, target) -> "Trainer":
        raise TrainingError("build_for is not available on a data-parallel trainer: compile with "
                            "data_parallel= for the other target (the replicas' programs are per system)")

    # -- one step ---------------------------------------------------------------------------------
    def step(self, inputs, labels) -> float:
        """One step: every replica's granule gradients, the reduction, the update; returns
        the batch's mean loss (reduced like the gradients)."""
        xs = self._check_inputs(inputs)
        y = self._check_labels(labels)
        n = self.granules
        xs = [np.split(x, n) for x in xs]
        ys = np.split(y, n)
        per = n // self.microbatches  # granules per micro-batch
        flats = []
        for start, stop in self._blocks:  # replica r runs its block of micro-batches
            if self._stages is not None:  # through its pipeline stages, micro-batch by micro-batch
                flats += self._pipelined_grads([[([tvm.runtime.tensor(np.ascontiguousarray(x[k])) for x in xs],
                                                  tvm.runtime.tensor(np.ascontiguousarray(ys[k])))
                                                 for k in range(m * per, (m + 1) * per)]
                                                for m in range(start, stop)])
                continue
            for k in range(start * per, stop * per):  # their granules, in order
                args = [tvm.runtime.tensor(np.ascontiguousarray(x[k])) for x in xs]
                args += self._params + [tvm.runtime.tensor(np.ascontiguousarray(ys[k]))]
                loss, grads = self._grad_vm["main"](*args)
                flats.append(np.concatenate([loss.numpy().reshape(1)] + [g.numpy().reshape(-1) for g in grads]))
        if self._buckets is not None:
            return self._bucketed_update(flats)
        blocks = tuple((a * per, b * per) for a, b in self._blocks)
        total = chain_sum(flats) if self.reproducible else ring_sum(flats, blocks)
        if self.zero:
            return self._sharded_update(total)
        parts = np.split(total, np.cumsum([1] + [int(np.prod(s)) for s in self._graph.param_shapes])[:-1])
        sums = [tvm.runtime.tensor(np.array(p.reshape(s), order="C"))  # not ascontiguousarray: 0-d -> 1-d
                for p, s in zip(parts, ((),) + tuple(self._graph.param_shapes))]
        loss, params, state = self._vm["main"](*self._params, *sums, self._state)
        self._params = list(params)
        self._state = list(state)
        return float(loss.numpy())

    def _sharded_update(self, total: np.ndarray) -> float:
        """Replica ``r`` updates shard ``r`` of the parameters with shard ``r`` of the gradient
        sum and its own optimizer state; the shards are gathered into the parameters."""
        layout = self._layout
        flat = layout.flatten([p.numpy() for p in self._params])
        new_shards, new_state = [], []
        for vm, (a, b), state in zip(self._shard_vms, layout.bounds, self._state):
            p, st = vm["main"](tvm.runtime.tensor(np.ascontiguousarray(flat[a:b])),
                               tvm.runtime.tensor(np.ascontiguousarray(total[1 + a:1 + b])), state)
            new_shards.append(p.numpy())
            new_state.append(list(st))
        self._params = [tvm.runtime.tensor(p) for p in layout.unflatten(np.concatenate(new_shards))]
        self._state = new_state
        # the loss: the mean over the granules, one IEEE float32 division as the update's
        return float(np.float32(total[0]) / np.float32(self.granules))

    def simulated_step(self) -> dict:
        """Simulated time of one step on the system, in seconds, by part.

        Returns
        -------
        dict
            ``microbatch_s`` (one micro-batch's forward + backward on a chip), ``compute_s``
            (the busiest replica's micro-batches), ``local_add_s`` (its in-block additions),
            ``all_reduce_s`` and ``all_reduce`` (algorithm), ``update_s`` (with ZeRO: the
            largest shard's), ``all_gather_s`` (ZeRO: the updated shards to every replica; else 0), ``host_s`` (the host
            ops left, the loss: the busiest replica's micro-batches and the update, by the
            host's roofline, :func:`~tvm_spinn.training.timing.host_time`; each replica's host
            ops are assumed to run on a host core of their own) and ``total_s``, for this
            trainer's mode.

            With pipeline stages (``pp > 1``; replica ``r``'s stage ``s`` on chip ``r * pp + s``):
            ``compute_s`` is the 1F1B schedule's makespan of the busiest replica's micro-batches
            (:func:`~tvm_spinn.training.pipeline.pipeline_makespan`) from each stage program's
            latency, plus ``stage_forward_s``, ``stage_backward_s`` (per stage, one micro-batch)
            and ``hand_over_s`` (a micro-batch's activations across one cut, point to point),
            ``stage_end_s`` (each stage's last pass ends) and with ZB-H1 ``stage_weight_s`` (the
            weight-gradient programs; the schedule :func:`~tvm_spinn.training.pipeline.zb_h1`);
            ``all_reduce_s`` is the slowest stage's chain over the replicas' chips of that stage
            (each reduces its own parameters' gradients). ZeRO-0 in the reproducible mode reduces
            by buckets: each stage's chain starts as its last pass ends and its update as the
            chain ends (``bucket_sync_end_s``, ``bucket_update_end_s``: one entry per stage, 0.0
            for a stage without parameters), and ``all_reduce_s`` and
            ``update_s`` are the parts past the pipeline. The in-block additions are costed as
            for the whole gradient buffer (the stages' shares would be smaller: not modelled).

            With tensor parallelism (``tp > 1``; the ranks of a stage on neighbouring chips,
            replica ``r``'s stage ``s`` rank ``t`` on chip ``(r * pp + s) * tp + t``): a granule
            costs one rank's share (:func:`~tvm_spinn.training.tensor_parallel.tp_compute`, its
            parts under ``"tp"``), the stage programs scale by the same ratio, and the reduction
            over the replicas, the update and the ZeRO gather move a rank's share of the
            parameters (the replicated ones and ``1 / tp`` of the split ones).
        """
        if self._system is None:
            raise TrainingError("simulated_step needs a spinn target (this trainer runs on the host)")
        from ..target.topology import topology_of
        from .timing import executable_latency

        shared = self._shared
        if shared["add"] is None:
            n = sum(int(np.prod(s)) for s in self._graph.param_shapes) + 1
            with _replica_target(self._target) as (replica, _):
                shared["add"] = relax.build(add_module(n), target=replica)
        gpm = self.granules // self.microbatches  # granules per micro-batch
        per = max(stop - start for start, stop in self._blocks) * gpm  # the busiest replica's granules
        granule = executable_latency(self._grad_ex)
        add = executable_latency(shared["add"])
        nbytes = 4 * (sum(int(np.prod(s)) for s in self._graph.param_shapes) + 1)
        chips = len(self._blocks)
        topo = topology_of(self._system)
        pipe, tp_cost, ratio, share = {}, None, 1.0, 1.0
        if self.tp > 1:
            from .tensor_parallel import tp_compute

            if shared["tp"] is None:
                with _replica_target(self._target) as (replica, _):
                    # the one-chip granule: the same program (its reductions in the canonical order)
                    shared["tp"] = tp_compute(self._tp_split, granule, replica, topo)
            tp_cost = shared["tp"]
            # a rank's share of a granule; a rank reduces (and updates) its share of the parameters
            ratio = tp_cost["rank_s"] / tp_cost["one_chip_s"]
            granule = tp_cost["rank_s"]
            split = self._tp_split
            share = split.rank_bytes / (split.replicated_bytes + split.sharded_bytes)
            nbytes = int(4 + (nbytes - 4) * share)
        stride = self.tp  # tensor-parallel ranks of a stage sit on neighbouring chips
        if self.pp > 1:
            from ..timing.collectives import point_to_point
            from .pipeline import one_f_one_b, schedule_times, zb_h1

            cut, _, _, (fwd_ex, bwd_ex, wgt_ex), _ = self._stages
            f_s = [gpm * ratio * executable_latency(e) for e in fwd_ex]
            b_s = [gpm * ratio * executable_latency(e) for e in bwd_ex]
            w_s = [0.0 if e is None else gpm * ratio * executable_latency(e) for e in wgt_ex] or None
            hand = max(cut.boundary_bytes) * gpm
            p2p = point_to_point(topo, [0], [1], hand).seconds if hand else 0.0
            busiest = max(stop - start for start, stop in self._blocks)
            events = (zb_h1 if self.zero_bubble else one_f_one_b)(self.pp, busiest, self.head_lag)
            _, stage_end = schedule_times(events, f_s, b_s, p2p, w_s)
            pipe = {"stage_forward_s": f_s, "stage_backward_s": b_s, "hand_over_s": p2p,
                    "compute_s": max(stage_end), "stage_end_s": list(stage_end)}
            if w_s is not None:
                pipe["stage_weight_s"] = w_s
            stage_bytes = [int(4 * share * sum(int(np.prod(shape)) for shape, st in zip(self._graph.param_shapes,
                                                                                       cut.param_stage) if st == s))
                           + (4 if s == self.pp - 1 else 0) for s in range(self.pp)]
            if chips > 1:
                colls = [(chain_all_reduce if self.reproducible else all_reduce)(
                    topo, [(r * self.pp + s) * stride for r in range(chips)], stage_bytes[s]) for s in range(self.pp)]
                coll = max(colls, key=lambda c: c.seconds)
            if self._buckets is not None:
                # each stage's bucket reduced over its replicas' chips as the stage's last pass ends,
                # then updated on the stage's chip: the tail past the pipeline is the latest stage's;
                # one entry per stage, 0.0 for a stage without parameters (no bucket)
                sync_end, upd_end = [0.0] * self.pp, [0.0] * self.pp
                for stage, _, pos, _ in self._buckets:
                    ready = stage_end[stage] + (colls[stage].seconds if chips > 1 else 0.0)
                    sync_end[stage] = ready
                    upd_end[stage] = ready + share * executable_latency(
                        self._shared["shard_update"][(len(pos), self.granules)][0])
                span = pipe["compute_s"]
                bucketed = (max(0.0, max(sync_end) - span), max(0.0, max(upd_end) - max(max(sync_end), span)))
                pipe["bucket_sync_end_s"], pipe["bucket_update_end_s"] = sync_end, upd_end
        if self.pp > 1 and chips > 1:
            adds = per if self.reproducible else per - 1
        elif self.pp > 1:
            adds = per - 1
        elif self.reproducible:
            coll = chain_all_reduce(topo, [r * stride for r in range(chips)], nbytes)
            # the chain adds every granule's gradient into the running sum: a replica does as
            # many additions as it has granules (the first one less)
            adds = per if chips > 1 else per - 1
        else:
            coll = all_reduce(topo, [r * stride for r in range(chips)], nbytes)
            adds = per - 1  # its own block's sum; the ring's additions are inside the collective
        algorithm, seconds = (coll.algorithm, coll.seconds) if chips > 1 else ("none", 0.0)
        if self._buckets is not None:
            seconds = bucketed[0]  # the exposed part of the stages' reductions
        if self.zero:
            # each replica updates its shard; the updated shards are gathered onto every replica
            update = max(executable_latency(self._shared["shard_update"][(b - a, self.granules)][0])
                         for a, b in self._layout.bounds)
            gather = all_gather(topo, [r * stride for r in range(chips)], nbytes - 4).seconds if chips > 1 else 0.0
        elif self._buckets is not None:
            update, gather = bucketed[1], 0.0  # the exposed part of the stages' updates
        else:
            update, gather = executable_latency(self.executable) * share, 0.0
        if shared["host"] is None:
            from .timing import host_time

            with _replica_target(self._target) as (replica, _):
                shared["host"] = (host_time(grad_module(self._micro_graph), replica)[0],
                                  host_time(update_module(self._micro_graph, self.granules), replica)[0])
        out = {"microbatch_s": gpm * granule, "compute_s": per * granule, "local_add_s": adds * add,
               "all_reduce_s": seconds if chips > 1 or self._buckets is not None else 0.0,
               "all_reduce": algorithm if chips > 1 else "none", "update_s": update, "all_gather_s": gather,
               "host_s": per * shared["host"][0] + shared["host"][1]}
        out.update(pipe)
        if tp_cost is not None:
            out["tp"] = dict(tp_cost)
        out["total_s"] = (out["compute_s"] + out["local_add_s"] + out["all_reduce_s"] + update + gather
                          + out["host_s"])
        return out


def _check_replicas(replicas, microbatches, system, target, name: str = "data_parallel: replicas",
                    pp: int = 1, tp: int = 1) -> None:
    option, key = name.split(": ")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise TrainingError(f"{name} must be a positive integer, got {replicas!r}")
    if replicas > microbatches:
        raise TrainingError(f"{option}: {key}={replicas} > microbatches={microbatches}: "
                            "every replica needs at least one micro-batch")
    if system is not None and replicas * pp * tp > system.chips:
        if tp > 1:
            raise TrainingError(f"{option}: {key}={replicas} x pp={pp} x tp={tp} needs {replicas * pp * tp} chips, "
                                f"target {target} has {system.chips} (one chip per tensor-parallel rank of each "
                                "stage of each replica)")
        if pp > 1:
            raise TrainingError(f"{option}: {key}={replicas} x pp={pp} needs {replicas * pp} chips, target "
                                f"{target} has {system.chips} (one chip per stage of each replica)")
        raise TrainingError(f"{option}: {key}={replicas} needs {replicas} chips, target "
                            f"{target} has {system.chips} (one replica per chip)")


def _positive(what: str, value) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise TrainingError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_axis(option: str, value: int, axis: str, size: int, context: str = "") -> None:
    """``value`` must divide ``size`` (the extent of ``axis``): else an error naming the
    option, the axis, its size and the values that would work."""
    if size % value:
        raise TrainingError(f"parallel: {option}={value} does not divide {axis} ({size}"
                            f"{': ' + context if context else ''}); {option} may be "
                            f"{', '.join(map(str, _divisors(size)))}")


def _check_zero(zero) -> None:
    if zero not in (0, 1, 2) or isinstance(zero, bool):
        raise TrainingError(f"parallel: zero must be 0 (no sharding), 1 (optimizer state) or 2 (optimizer state "
                            f"and gradients), got {zero!r}")


def _batch_of(example_inputs, option: str) -> int:
    batch = {int(x.shape[0]) if getattr(x, "ndim", 0) else None for x in example_inputs}
    if len(batch) != 1 or None in batch:
        raise TrainingError(f"{option}: every example input needs the same leading (batch) axis, got shapes "
                            f"{[tuple(x.shape) for x in example_inputs]}")
    (batch,) = batch
    return batch


def build_data_parallel(graph_of, model, example_inputs, loss, optimizer, target, options: dict,
                        model_name: str) -> DataParallelTrainer:
    """Build a :class:`DataParallelTrainer` of ``data_parallel=`` options (``graph_of(model,
    inputs, loss, optimizer)`` builds the :class:`TrainGraph` of a micro-batch, the granule)."""
    if not isinstance(options, dict):
        raise TrainingError(f"data_parallel must be a dict {{'replicas', 'microbatches', 'reproducible'}}, "
                            f"got {options!r}")
    unknown = sorted(set(options) - {"replicas", "microbatches", "reproducible"})
    if unknown:
        raise TrainingError(f"data_parallel: unknown option {unknown[0]!r} (expected replicas, microbatches, "
                            "reproducible)")
    replicas = options.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise TrainingError(f"data_parallel: replicas must be a positive integer, got {replicas!r}")
    microbatches = options.get("microbatches", replicas)
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise TrainingError(f"data_parallel: microbatches must be a positive integer, got {microbatches!r}")
    if not isinstance(example_inputs, tuple | list):
        example_inputs = (example_inputs,)
    batch = _batch_of(example_inputs, "data_parallel")
    if batch % microbatches:
        raise TrainingError(f"data_parallel: batch {batch} does not split into microbatches={microbatches} "
                            "equal micro-batches")
    return _build(graph_of, model, example_inputs, loss, optimizer, target, model_name, batch, replicas,
                  microbatches, None, 0, bool(options.get("reproducible", True)))


#: the options of ``parallel=`` (:func:`build_parallel`)
PARALLEL_OPTIONS = ("dp", "tp", "pp", "microbatches", "zero", "granule", "head_stage", "head_lag", "zero_bubble")


def _head_lag(where: str, lag, head_stage: bool) -> int:
    """``lag`` checked: an integer >= 0, and 0 unless the plan has a head stage."""
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise TrainingError(f"{where}: head_lag must be an integer >= 0, got {lag!r}")
    if lag and not head_stage:
        raise TrainingError(f"{where}: head_lag={lag} needs a head stage of its own (head_stage=True)")
    return lag


def _zero_bubble(where: str, zero_bubble, pp: int) -> bool:
    """``zero_bubble`` checked: True or False, and False unless the plan has pipeline stages."""
    if not isinstance(zero_bubble, bool):
        raise TrainingError(f"{where}: zero_bubble must be True or False, got {zero_bubble!r}")
    if zero_bubble and pp < 2:
        raise TrainingError(f"{where}: zero_bubble=True (ZB-H1) defers weight-gradient passes into a pipeline's "
                            f"fill and drain and needs pp >= 2, got pp={pp}")
    return zero_bubble


def build_parallel(graph_of, model, example_inputs, loss, optimizer, target, options: dict,
                   model_name: str) -> DataParallelTrainer:
    """Build a :class:`DataParallelTrainer` of a user-given plan ``parallel={"dp", "tp", "pp",
    "microbatches", "zero", "granule", "head_stage", "head_lag", "zero_bubble"}`` whose bits depend
    on none of the first five nor on the last three: the
    gradient program is compiled for one granule (``granule`` samples, default 1) and the step
    sums the granules' gradients in ascending order, whatever the micro-batch count, replica
    count and sharding (a micro-batch must hold whole granules)."""
    if not isinstance(options, dict):
        raise TrainingError(f"parallel must be a dict with keys among {', '.join(PARALLEL_OPTIONS)}, got {options!r}")
    unknown = sorted((k for k in options if k not in PARALLEL_OPTIONS), key=repr)
    if unknown:
        raise TrainingError(f"parallel: unknown option {unknown[0]!r} (expected {', '.join(PARALLEL_OPTIONS)})")
    dp = _positive("parallel: dp", options.get("dp", 1))
    tp = _positive("parallel: tp", options.get("tp", 1))
    pp = _positive("parallel: pp", options.get("pp", 1))
    microbatches = _positive("parallel: microbatches", options.get("microbatches", dp))
    zero = options.get("zero", 0)
    _check_zero(zero)
    granule = _positive("parallel: granule", options.get("granule", 1))
    head_stage = options.get("head_stage", False)
    if not isinstance(head_stage, bool):
        raise TrainingError(f"parallel: head_stage must be True or False, got {head_stage!r}")
    if head_stage and pp < 2:
        raise TrainingError(f"parallel: a head stage of its own needs pp >= 2 (the layers' stages and the head's), "
                            f"got pp={pp}")
    head_lag = _head_lag("parallel", options.get("head_lag", 0), head_stage)
    zero_bubble = _zero_bubble("parallel", options.get("zero_bubble", False), pp)
    if not isinstance(example_inputs, tuple | list):
        example_inputs = (example_inputs,)
    batch = _batch_of(example_inputs, "parallel")
    _check_axis("granule", granule, "the batch", batch)
    if granule == 1:
        _check_axis("microbatches", microbatches, "the batch", batch)
    else:
        _check_axis("microbatches", microbatches, "the batch's granules", batch // granule,
                    f"batch {batch} in granules of {granule} samples")
    norms = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
             if type(m).__name__.startswith("BatchNorm")]
    if norms and granule < batch:
        raise TrainingError(f"parallel: layer {norms[0]} normalizes with the statistics of its batch, which a "
                            "granule smaller than the batch would change; train it without parallel= (or with "
                            "data_parallel=, whose micro-batches normalize on their own)")
    if dp > microbatches:
        raise TrainingError(f"parallel: dp={dp} > microbatches={microbatches}: every data-parallel replica needs "
                            f"at least one micro-batch; microbatches may be "
                            f"{', '.join(str(m) for m in _divisors(batch // granule) if m >= dp) or 'none (too few granules)'}")
    layers = None
    if tp > 1 or pp > 1:
        from .model_axes import model_axes

        axes = model_axes(model)
        layers = axes.layers
        if tp > 1:
            _check_axis("tp", tp, "the attention heads", axes.heads)
        if head_stage:
            _check_axis("pp - 1", pp - 1, "the layers", axes.layers,
                        "a head stage of its own leaves pp - 1 stages to the layers")
        elif pp > 1:
            _check_axis("pp", pp, "the layers", axes.layers)
    else:
        with contextlib.suppress(TrainingError):  # not a transformer: no pipeline stages later either
            from .model_axes import model_axes

            layers = model_axes(model).layers
    return _build(graph_of, model, example_inputs, loss, optimizer, target, model_name, batch, dp,
                  microbatches, batch // granule, zero, True, pp, layers, tp, head_stage, head_lag, zero_bubble)


def _build(graph_of, model, example_inputs, loss, optimizer, target, model_name, batch: int, replicas: int,
           microbatches: int, granules: int | None, zero: int, reproducible: bool, pp: int = 1,
           layers: int | None = None, tp: int = 1, head_stage: bool = False, head_lag: int = 0,
           zero_bubble: bool = False) -> DataParallelTrainer:
    """The trainer: the gradient program compiled for one granule (``batch / granules``
    samples; ``granules=None``: one micro-batch) and the update for the granule count."""
    count = microbatches if granules is None else granules
    tgt = _resolve_target(target)
    with _replica_target(tgt) as (replica_tgt, system):
        _check_replicas(replicas, microbatches, system, tgt,
                        "data_parallel: replicas" if granules is None else "parallel: dp", pp, tp)
        if tp > 1 and system is None:
            raise TrainingError(f"parallel: tp={tp} needs a spinn target (its ranks are a system's chips), "
                                f"got {tgt}")
        size = batch // count
        micro = graph_of(model, tuple(x[:size] for x in example_inputs), loss, optimizer)
        # the step takes the whole batch: the shapes its inputs and labels are checked against. The
        # output's and the labels' leading axis is the granule's times the granule count (a
        # language model's (batch * seq, vocab) logits grow by whole sequences)
        full = dataclasses.replace(
            micro,
            input_shapes=tuple(((batch, *s[1:]), d) for s, d in micro.input_shapes),
            output_shape=(micro.output_shape[0] * count, *micro.output_shape[1:]),
            label_shape=(micro.label_shape[0] * count, *micro.label_shape[1:]))
        tp_split = None
        grad_mod = grad_module(micro)
        from .tensor_parallel import split_gemms, tp_layout

        # a transformer's reductions over its tensor-parallel axes run in the canonical order on
        # every plan, tp = 1 included, so every plan has the same bits (:mod:`.tp_chain`)
        layout = tp_layout(model, micro.param_names, micro.param_shapes, tp)
        if layout is None and tp > 1:
            raise TrainingError(f"parallel: tp={tp} splits a transformer's attention and MLP projections (GPT-2 "
                                "c_attn/c_proj/c_fc, Llama q/k/v/o/gate/up/down_proj) by heads; the model has none, "
                                "or its config names no num_attention_heads")
        if layout is not None:
            from .vocab_parallel import vocab_parallel

            # the LM head split by the vocabulary: its input gradient in the canonical order of
            # the vocabulary's leaves (:mod:`.vocab_parallel`)
            layout = vocab_parallel(grad_mod, len(micro.input_shapes), micro.param_names, layout, model)
            tp_split = split_gemms(grad_mod, len(micro.input_shapes), layout, tp)
            grad_mod = tp_split.mod
        grad_ex = relax.build(grad_mod, target=replica_tgt)
        update_ex = relax.build(update_module(micro, count), target=replica_tgt)
    trainer = DataParallelTrainer(full, micro, grad_ex, update_ex, tgt, system, loss, optimizer, model_name,
                                  microbatches, replicas, reproducible, granules, zero, pp=pp, layers=layers, tp=tp,
                                  tp_split=tp_split, head_stage=head_stage, head_lag=head_lag,
                                  zero_bubble=zero_bubble)
    trainer._set_state(list(micro.init_params), list(micro.init_optim_state))
    return trainer
