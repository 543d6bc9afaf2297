"""Pipeline parallelism: a granule's gradient program cut into stages by layers.

The cut is made on the *differentiated* program (the adjoint function of
:func:`~tvm_spinn.training.parallel.grad_module`), not on the model: every binding of the
uncut program goes to exactly one stage program, unchanged, so a stage computes the same ops on
the same operands as the uncut program does and the gradients are the uncut program's bit for
bit, provided each op's result does not depend on the program it is compiled in (the spinn
kernels are simulated bit-exactly and map every reduction in a fixed order on one PE; the host
ops are the same llvm code; ``tests/training/test_training_pipeline.py`` checks the bits).

Stages (``pp`` of them, ``layers / pp`` consecutive layers each):

- a parameter whose name holds a layer index (``...h.3...``, ``...layers.3...``) belongs to
  its layer's stage; the others (embeddings, final norm) to the first stage that uses them;
- a forward binding (an ancestor of the loss) runs in the latest stage among its operands
  (inputs and constants: stage 0), so forward values flow from lower to higher stages and the
  loss is in the last stage;
- a backward binding runs in the lowest stage that every one of its consumers allows and that
  holds its forward operands (it needs them: saved activations, parameters), and a parameter's
  gradient in the parameter's stage: backward values flow from higher to lower stages.

With a head stage of its own (``cut_stages(..., head_stage=True)``), the layers fill the first
``pp - 1`` stages and the last holds the LM head: the parameters only values computed after the
last layer read (the final norm's weights, an untied head) and every forward binding reading
them or their results (the logits, the loss). Like any cut it moves bindings, not arithmetic.

Each stage ``s`` is then two programs: ``forward[s]`` (its forward bindings; outputs: the
values later stages and the backward programs read, the activations a stage saves) and
``backward[s]`` (its backward bindings; outputs: the values lower stages read and its
parameters' gradients). A micro-batch runs ``forward[0..pp-1]`` then ``backward[pp-1..0]``;
:func:`one_f_one_b` orders the micro-batches of a step as Megatron's 1F1B schedule does.

With ``zero_bubble`` (ZB-H1, Qi et al. 2024, "Zero Bubble Pipeline Parallelism") each stage's
backward is cut once more, into an input-gradient program ``backward[s]`` (B: the bindings the
lower stages' backward programs wait for, and on the first stage the tables' gradients, which the
input-gradient chain through its layers ends in) and a weight-gradient program ``weight[s]`` (W:
the rest, the weight-gradient GEMMs and what only they read), which reads B's outputs and the
stage's saved activations; :func:`zb_h1` defers the W passes into the fill and drain. Another cut
of the same bindings: the gradients are the uncut program's bit for bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tvm
from tvm import relax

from .errors import TrainingError

__all__ = ["StageProgram", "PipelineCut", "cut_stages", "layer_of", "one_f_one_b", "zb_h1", "pipeline_makespan",
           "schedule_times"]

#: the layer index in a parameter name (transformers' GPT-2 ``h.<i>``, Llama/BERT
#: ``layers.<i>`` / ``layer.<i>``, a ``blocks.<i>`` sequence), as torch.export names it (dots
#: become underscores in Relax parameter names)
_LAYER = re.compile(r"(?:^|[._])(?:h|layers|layer|blocks)[._](\d+)(?:[._]|$)")


def layer_of(name: str) -> int | None:
    """The layer index in a parameter name, or None (embeddings, final norm, head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StageProgram:
    """One stage program: ``main(*inputs) -> tuple(outputs)``.

    Attributes
    ----------
    mod : tvm.IRModule
    inputs, outputs : tuple of str
        Keys of the values it reads and writes (the uncut program's variables; its own
        parameters are ``param:<k>``, ``input:<k>``, ``targets``).
    """

    mod: tvm.IRModule
    inputs: tuple
    outputs: tuple


@dataclass(frozen=True)
class PipelineCut:
    """The stage programs of a gradient program.

    Attributes
    ----------
    forward, backward : tuple of StageProgram
        Per stage, in stage order (with ``weight``: ``backward`` holds the input-gradient programs).
    loss : str
        Key of the loss value; ``grads``: keys of the parameters' gradients, in parameter order.
    param_stage : tuple of int
        Each parameter's stage.
    boundary_bytes : tuple of int
        Bytes stage ``s`` sends to stage ``s + 1`` in a forward pass (and ``s + 1`` to ``s``
        in a backward pass, the same shapes' adjoints are of the same size or smaller): the
        activations crossing each cut, for the timing model.
    weight : tuple of (StageProgram or None)
        Per stage, the weight-gradient program of a cut made with ``zero_bubble`` (None where a
        stage has no binding to defer); empty otherwise.
    """

    forward: tuple
    backward: tuple
    loss: str
    grads: tuple
    param_stage: tuple
    boundary_bytes: tuple
    weight: tuple = ()


def _operands(expr) -> list:
    out = []
    relax.analysis.post_order_visit(expr, lambda e: out.append(e) if isinstance(e, relax.Var) else None)
    return out


def _nbytes(var) -> int:
    ty = var.ty
    try:
        n = 1
        for d in ty.shape:
            n *= int(d)
        return n * tvm.DataType(ty.dtype).bits // 8
    except (TypeError, AttributeError, ValueError):
        return 0


def _make_program(bindings, inputs_of, key_of, outputs) -> StageProgram:
    """A function of ``bindings`` reading the free variables ``inputs_of`` (in order) and
    returning ``outputs`` (variables of the bindings or inputs)."""
    mapping = {}
    params = []
    for var in inputs_of:
        p = relax.Var(f"in_{len(params)}", var.ty)
        mapping[var] = p
        params.append(p)

    @relax.expr_functor.mutator
    class Remap(relax.PyExprMutator):
        def visit_var_(self, op):
            return mapping.get(op, op)

        def visit_dataflow_var_(self, op):
            return mapping.get(op, op)

    remap = Remap()
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            for b in bindings:
                mapping[b.var] = bb.emit(remap.visit_expr(b.value), name_hint=b.var.name)
            out = bb.emit_output(relax.Tuple([mapping[v] for v in outputs]))
        bb.emit_func_output(out)
    mod = relax.transform.DeadCodeElimination(["main"])(bb.get())
    from ..frontend.fixups import FixupImported

    return StageProgram(FixupImported(mod), tuple(key_of(v) for v in inputs_of), tuple(key_of(v) for v in outputs))


def cut_stages(grad_mod: tvm.IRModule, param_names, n_inputs: int, layers: int, pp: int,
               head_stage: bool = False, zero_bubble: bool = False) -> PipelineCut:
    """Cut ``main(inputs..., params..., targets) -> (loss, grads)`` into ``pp`` stages of
    ``layers / pp`` layers (see the module docstring). With ``head_stage``, the layers fill the
    first ``pp - 1`` stages and the last is the LM head's own: the parameters without a layer
    index that only values computed after the last layer read (the final norm's weights, an
    untied head's) belong to it, and so does every forward binding reading them or their results
    (the final norm's scale and shift on, the logits, the loss; the norm's statistics stay with
    the last layer, which hands them over; a tied head's table stays with the embedding's stage
    and is read from there). With ``zero_bubble``, each stage's backward is cut into its
    input-gradient and weight-gradient programs (``PipelineCut.weight``; the module docstring)."""
    if not isinstance(zero_bubble, bool):
        raise TrainingError(f"pipeline: zero_bubble must be True or False, got {zero_bubble!r}")
    func = grad_mod["main"]
    # a stage program is ``main``'s bindings alone: a gradient program is one function (the
    # training step's modules inline their helpers), and one that calls another is refused
    # here rather than as an unbound function when a stage is built
    others = sorted(g.name_hint for g, _ in grad_mod.functions_items() if g.name_hint != "main")
    if others:
        raise TrainingError(f"pipeline: the gradient program has functions besides main ({', '.join(others)}); "
                            "a stage cut takes one function (inline them first)")
    fparams = list(func.params)
    n_params = len(param_names)
    if len(fparams) != n_inputs + n_params + 1:
        raise TrainingError(f"pipeline: the gradient program takes {len(fparams)} arguments, expected "
                            f"{n_inputs} inputs, {n_params} parameters and the targets")
    blocks = pp - 1 if head_stage else pp
    if head_stage and blocks < 1:
        raise TrainingError(f"pipeline: a head stage of its own needs pp >= 2 (the layers' stages and the head's), "
                            f"got pp={pp}")
    if layers % blocks:
        raise TrainingError(f"pipeline: {blocks} layer stage(s) do not divide the {layers} layers")
    per = layers // blocks
    key = {}
    for k, v in enumerate(fparams[:n_inputs]):
        key[v] = f"input:{k}"
    for k, v in enumerate(fparams[n_inputs:n_inputs + n_params]):
        key[v] = f"param:{k}"
    key[fparams[-1]] = "targets"
    bindings = [b for block in func.body.blocks for b in block.bindings]
    for k, b in enumerate(bindings):
        key[b.var] = f"v{k}"
    defined = {b.var: b for b in bindings}
    ret = func.body.body
    skip = set()
    while isinstance(ret, relax.Var) and ret in defined:
        skip.add(ret)
        ret = defined[ret].value
    if not (isinstance(ret, relax.Tuple) and len(ret.fields) == 2):
        raise TrainingError("pipeline: the gradient program must return (loss, grads)")
    loss_var, grads_expr = ret.fields
    # the gradient tuple: a variable bound to a Tuple, or the Tuple itself
    while isinstance(grads_expr, relax.Var) and grads_expr in defined:
        skip.add(grads_expr)
        grads_expr = defined[grads_expr].value
    grad_vars = list(grads_expr.fields)
    # the binding of the gradient tuple itself is the program's return, not a stage's work
    bindings = [b for b in bindings if b.var not in skip]
    param_vars = fparams[n_inputs:n_inputs + n_params]

    # forward: the ancestors of the loss
    forward = set()
    todo = [loss_var]
    while todo:
        v = todo.pop()
        if v in defined and v not in forward:
            forward.add(v)
            todo.extend(_operands(defined[v].value))
    layer_stage = {}
    for name, p in zip(param_names, param_vars):
        layer = layer_of(name)
        if layer is not None:
            if layer >= layers:
                raise TrainingError(f"pipeline: parameter {name} names layer {layer}, the model has {layers}")
            layer_stage[p] = layer // per
    if head_stage:
        # forward values computed after the last layer: the ancestors include one of its
        # parameters (the final norm reads the last block's output)
        last = {p for p, name in zip(param_vars, param_names) if layer_of(name) == layers - 1}
        after, pure, readers = set(), set(), {}
        for b in bindings:
            if b.var in forward:
                ops = _operands(b.value)
                if any(o in last or o in after for o in ops):
                    after.add(b.var)
                if ops and all(o in param_vars or o in pure for o in ops):
                    pure.add(b.var)  # from parameters alone (a transpose of the head's weight)
                for o in ops:
                    readers.setdefault(o, []).append(b.var)

        def users(v):  # the bindings reading v, through those computed from parameters alone
            return [w for u in readers.get(v, []) for w in (users(u) if u in pure else [u])]

        head = [p for p in param_vars if p not in layer_stage and readers.get(p)
                and all(u in after for u in users(p))]
        if not head:
            raise TrainingError("pipeline: a head stage of its own needs a parameter read only after the last layer "
                                "(a final norm or an untied LM head); the model has none")
        for p in head:
            layer_stage[p] = pp - 1
    empty = sorted(set(range(pp)) - set(layer_stage.values()))
    if empty:
        raise TrainingError(f"pipeline: no parameter names a layer of stage {empty[0]} (layers "
                            f"{empty[0] * per}..{empty[0] * per + per - 1}; parameter names with a layer index look "
                            "like '...h.3...' or '...layers.3...')")
    stage = {}
    for b in bindings:
        if b.var in forward:
            stage[b.var] = max([stage.get(o, layer_stage.get(o, 0)) for o in _operands(b.value)] + [0])
    home = dict(layer_stage)
    for b in bindings:
        if b.var in forward:
            for o in _operands(b.value):
                if o in param_vars and o not in layer_stage:
                    home[o] = min(home.get(o, pp), stage[b.var])
    for p in param_vars:
        home.setdefault(p, 0)
    # backward: consumers first
    consumers: dict = {}
    for b in bindings:
        for o in set(_operands(b.value)):
            consumers.setdefault(o, []).append(b.var)
    grad_home = {}
    for p, g in zip(param_vars, grad_vars):
        if isinstance(g, relax.Var):
            grad_home[g] = max(grad_home.get(g, 0), home[p])
    for b in reversed(bindings):
        v = b.var
        if v in forward:
            continue
        lb = [stage[o] if o in forward else home.get(o, 0) for o in _operands(b.value)
              if o in forward or o in home]
        after = [stage[c] for c in consumers.get(v, []) if c not in forward]
        stage[v] = max(lb + after + [grad_home.get(v, 0)])
        if v == loss_var:
            stage[v] = pp - 1
    # a value each stage program reads or writes
    phases = ("f", "b", "w") if zero_bubble else ("f", "b")
    where = {b.var: (stage[b.var], "f" if b.var in forward else "b") for b in bindings}
    if zero_bubble:
        tables = {g for p, g in zip(param_vars, grad_vars)
                  if isinstance(g, relax.Var) and p not in layer_stage and home[p] == 0}
        where.update(_weight_passes(bindings, where, consumers, defined, tables))
    progs_bindings = {(s, ph): [] for s in range(pp) for ph in phases}
    for b in bindings:
        progs_bindings[where[b.var]].append(b)
    needed: dict = {k: [] for k in progs_bindings}
    for k, bs in progs_bindings.items():
        own = {b.var for b in bs}
        seen = set()
        for b in bs:
            for o in _operands(b.value):
                if o not in own and o not in seen and (o in defined or o in key):
                    seen.add(o)
                    needed[k].append(o)
    # outputs: values read by other programs, the loss, the gradients
    final = [loss_var] + [g for g in grad_vars if isinstance(g, relax.Var)]
    outs: dict = {k: [] for k in progs_bindings}
    for k, ins in needed.items():
        for o in ins:
            if o in where and o not in outs[where[o]]:
                outs[where[o]].append(o)
    for v in final:
        if v in where and v not in outs[where[v]]:
            outs[where[v]].append(v)
    for v in list(defined):
        t = defined[v].value
        if isinstance(v.ty, relax.TupleType) and any(
                where[v] != where.get(c, where[v]) for c in consumers.get(v, [])):
            raise TrainingError(f"pipeline: a tuple value ({t.op.name if hasattr(t, 'op') else type(t).__name__}) "
                                "crosses a stage cut")
    order = {v: k for k, v in enumerate(fparams)}
    order.update({b.var: len(fparams) + k for k, b in enumerate(bindings)})

    def program(k):
        ins = sorted(needed[k], key=order.__getitem__)
        return _make_program(progs_bindings[k], ins, key.__getitem__, sorted(outs[k], key=order.__getitem__))

    fwd = tuple(program((s, "f")) for s in range(pp))
    bwd = tuple(program((s, "b")) for s in range(pp))
    wgt = tuple(program((s, "w")) if progs_bindings[(s, "w")] else None for s in range(pp)) if zero_bubble else ()
    # activations crossing cut s -> s + 1 in the forward pass
    crossing = []
    for s in range(pp - 1):
        crossing.append(sum(_nbytes(o) for k, ins in needed.items() if k[0] > s for o in ins
                            if o in forward and stage[o] <= s and (k[1] == "f")))
    grads = tuple(key[g] if isinstance(g, relax.Var) else "" for g in grad_vars)
    return PipelineCut(fwd, bwd, key[loss_var], grads, tuple(home[p] for p in param_vars), tuple(crossing), wgt)


def _weight_passes(bindings, where: dict, consumers: dict, defined: dict, tables: set) -> dict:
    """The backward bindings that go to their stage's weight-gradient program (ZB-H1): those that
    no input-gradient binding needs. A stage's input-gradient pass is what the lower stages'
    backward programs read, with every binding of its own backward it needs; on the first stage
    (no lower stage) the tables' gradients (``tables``: an embedding's gradient is where the
    input-gradient chain through its layers ends). A binding reading a tuple of the
    input-gradient pass joins it (a tuple value does not cross a program)."""
    keep = set()
    for b in bindings:
        s, ph = where[b.var]
        if ph != "b":
            continue
        if b.var in tables or any(where.get(c, (s, ph)) != (s, ph) and where[c][1] == "b"
                                  for c in consumers.get(b.var, [])):
            keep.add(b.var)
    todo = list(keep)
    while todo:
        while todo:  # every binding of the same backward program that a kept one reads
            v = todo.pop()
            for o in _operands(defined[v].value):
                if o in defined and o not in keep and where[o] == where[v]:
                    keep.add(o)
                    todo.append(o)
        for b in bindings:
            if where[b.var][1] == "b" and b.var not in keep and any(
                    o in keep and isinstance(o.ty, relax.TupleType) for o in _operands(b.value)):
                keep.add(b.var)
                todo.append(b.var)
    return {b.var: (where[b.var][0], "w") for b in bindings if where[b.var][1] == "b" and b.var not in keep}


def one_f_one_b(pp: int, microbatches: int, lag: int = 0) -> tuple[tuple[str, int, int], ...]:
    """Megatron's 1F1B schedule as one sequence of ``(kind, stage, micro-batch)`` events
    (``kind`` ``"f"`` or ``"b"``), each stage's own order being: ``pp - 1 - s`` warm-up
    forwards, then alternating one forward and one backward, then the remaining backwards. The
    sequence is the events sorted by the earliest step each can start at with unit-time
    events (ties by stage), which respects every dependency.

    ``lag``: the last stage (a head stage) runs that many micro-batches behind the others: every
    earlier stage takes ``lag`` more warm-up forwards (and holds that many more micro-batches'
    activations), so the last stage's next forward input is ready while it computes. A schedule
    order only: each event reads its own micro-batch's values, so no bit moves."""
    return _schedule(pp, microbatches, lag, False)


def zb_h1(pp: int, microbatches: int, lag: int = 0) -> tuple[tuple[str, int, int], ...]:
    """The ZB-H1 schedule (Qi et al. 2024) as one sequence of ``(kind, stage, micro-batch)``
    events, ``kind`` ``"f"``, ``"b"`` (input gradient) or ``"w"`` (weight gradient): each
    stage's forwards and input-gradient passes in 1F1B's order (:func:`one_f_one_b`, ``lag``
    included), and its weight-gradient passes after them, stage ``s`` deferring ``s`` of them:
    the first stage runs ``F B W`` in turn once warm, the last lets ``pp - 1`` W passes wait, so
    the fill's input gradients cross the stages at the B passes' pace and the deferred W passes
    fill the drain's idle time, where the later stages wait for the first to finish. A stage
    thus holds 1F1B's ``pp`` micro-batches' values at most (ZB-H1's memory), and with at least
    ``pp`` micro-batches of equal stages the makespan is ``m (F + B + W) + (pp - 1) (F + B - W)``
    (1F1B's: ``(m + pp - 1) (F + B + W)``). A schedule order only: every event reads its own
    micro-batch's values, so no bit moves."""
    return _schedule(pp, microbatches, lag, True)


def _schedule(pp: int, microbatches: int, lag: int, zero_bubble: bool) -> tuple[tuple[str, int, int], ...]:
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise TrainingError(f"pipeline: head_lag must be an integer >= 0, got {lag!r}")
    per_stage = []
    for s in range(pp):
        warm = min(pp - 1 - s + (lag if s < pp - 1 else 0), microbatches)
        seq = [("f", m) for m in range(warm)]
        f, b, w = warm, 0, 0
        while b < microbatches:
            if f < microbatches:
                seq.append(("f", f))
                f += 1
            seq.append(("b", b))
            b += 1
            if zero_bubble and b - w > s:  # more W passes wait than the stage defers
                seq.append(("w", w))
                w += 1
        if zero_bubble:
            seq += [("w", k) for k in range(w, microbatches)]
        per_stage.append(seq)
    done: dict = {}
    pos = [0] * pp
    free = [0] * pp
    out = []
    while any(pos[s] < len(per_stage[s]) for s in range(pp)):
        best = None
        for s in range(pp):
            if pos[s] == len(per_stage[s]):
                continue
            kind, m = per_stage[s][pos[s]]
            dep = _dependency(kind, s, m, pp)
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep is not None else 0)
            if best is None or (start, s) < best[:2]:
                best = (start, s, kind, m)
        if best is None:
            raise TrainingError("pipeline: the schedule deadlocked (an internal error)")
        start, s, kind, m = best
        done[(kind, s, m)] = start + 1
        free[s] = start + 1
        pos[s] += 1
        out.append((kind, s, m))
    return tuple(out)


def _dependency(kind: str, s: int, m: int, pp: int):
    """The event another stage's (or this stage's) event ``(kind, s, m)`` waits for."""
    if kind == "f":
        return ("f", s - 1, m) if s > 0 else None
    if kind == "b":
        return ("b", s + 1, m) if s < pp - 1 else ("f", s, m)
    return ("b", s, m)


def schedule_times(events, forward_s, backward_s, transfer_s: float, weight_s=None) -> tuple[dict, list]:
    """Simulate a schedule of :func:`one_f_one_b` or :func:`zb_h1`: stage ``s``'s forward of one
    micro-batch takes ``forward_s[s]``, its backward (with ``weight_s``: its input-gradient
    pass) ``backward_s[s]``, its weight-gradient pass ``weight_s[s]``; a hand-over between
    neighbouring stages ``transfer_s`` (a weight-gradient pass hands nothing over). Each stage
    runs its events one at a time in the schedule's order. Returns ``(end of each event, end of
    each stage's last event)``."""
    pp = len(forward_s)
    done: dict = {}
    free = [0.0] * pp
    for kind, s, m in events:
        if kind == "f":
            ready = done[("f", s - 1, m)] + transfer_s if s > 0 else 0.0
            dur = forward_s[s]
        elif kind == "b":
            ready = done[("b", s + 1, m)] + transfer_s if s < pp - 1 else done[("f", s, m)]
            dur = backward_s[s]
        else:
            if weight_s is None:
                raise TrainingError("pipeline: a schedule with weight-gradient passes needs their times (weight_s)")
            ready = done[("b", s, m)]
            dur = weight_s[s]
        start = max(free[s], ready)
        done[(kind, s, m)] = free[s] = start + dur
    return done, free


def pipeline_makespan(pp: int, microbatches: int, forward_s, backward_s, transfer_s: float,
                      lag: int = 0, weight_s=None) -> float:
    """Simulated time of the 1F1B schedule: stage ``s``'s forward of one micro-batch takes
    ``forward_s[s]``, its backward ``backward_s[s]``; a hand-over between neighbouring stages
    ``transfer_s``. Each stage runs its events one at a time in its 1F1B order (the last stage
    ``lag`` micro-batches behind, :func:`one_f_one_b`). With ``weight_s``: the ZB-H1 schedule
    (:func:`zb_h1`) of input-gradient passes ``backward_s`` and weight-gradient passes
    ``weight_s``."""
    events = zb_h1(pp, microbatches, lag) if weight_s is not None else one_f_one_b(pp, microbatches, lag)
    return max(schedule_times(events, forward_s, backward_s, transfer_s, weight_s)[1])
