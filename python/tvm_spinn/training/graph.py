"""Training-step graph: a PyTorch module -> one Relax ``main`` doing forward, backward and update.

TVM's ``relax.training`` does the calculus: :class:`~tvm.relax.training.SetupTrainer` appends
the loss (``AppendLoss``), differentiates it (``Gradient``) and adds the optimizer function. What
is replaced here, and why:

- SetupTrainer leaves three separate functions (``backbone_loss_adjoint``, ``optimizer``); the
  spinn partition works on ``main`` only (and one VM call per step avoids copying gradients
  out), so both are inlined into one ``main(inputs, params, targets, optim_states) -> (loss,
  new params, new optim states)`` (``InlinePrivateFunctions``).
- SetupTrainer's own legalization is turned off (``legalize=False``): the high-level
  ``matmul``/``add``/... must reach the spinn partition of ``relax.build``, which legalizes the
  rest for the fallback target.
- The importer: ``tvm_spinn.frontend.from_pytorch`` binds weights as constants (inference); a
  trainer needs them as function parameters, so the model is exported here with TVM's
  ``from_exported_program(keep_params_as_input=True)`` and the front-end's fix-ups
  (:class:`~tvm_spinn.frontend.fixups.FixupImported`, the aten conversion fixes) applied on top.
- Before ``Gradient``: a ``conv2d`` whose weight is trainable becomes im2col + one GEMM
  (:func:`_conv_as_gemm`; the spinn conv kind needs a constant weight), and a ``take`` with 0-d
  or N-d indices takes them flattened (:func:`_flat_take_indices`; TVM's ``take_backward``
  legalizes 1-d indices only). Gradients TVM lacks are registered by :mod:`.gradients`.
- SGD with momentum 0 is TVM's ``SGD``, with momentum TVM's ``MomentumSGD`` (same recurrence as
  ``torch.optim.SGD`` with ``dampening=0``: TVM's applies dampening on the first step too,
  so dampening is refused), Adam is TVM's ``Adam`` (``torch.optim.Adam``'s recurrence with the
  same eps placement, its terms rearranged, and its bias corrections running float32 products
  of the float32 betas where PyTorch takes ``1 - beta ** t`` in float64: its parameters drift
  from PyTorch's by ~3e-8 a step at lr 0.01, 2.9e-6 after 100 steps) with one fix: its ``init``
  keeps the parameters' dtype as a type object (``T.float32``) that ``np.ones`` rejects, so
  :class:`_Adam` stores it as a string. TVM has no AdamW: :class:`~.adamw.AdamW` is
  ``torch.optim.AdamW``'s update written as a Relax optimizer function (2.4e-7 from PyTorch
  after 100 steps).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ..frontend.fixups import FixupImported
from .adamw import AdamW
from .errors import TrainingError

__all__ = ["TrainGraph", "build_train_graph", "loss_on_pes", "make_loss", "make_optimizer", "LOSSES", "OPTIMIZERS"]

LOSSES = ("cross_entropy", "mse")
OPTIMIZERS = {"sgd": ("lr", "momentum", "weight_decay", "nesterov", "dampening"),
              "adam": ("lr", "betas", "eps", "weight_decay"),
              "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad")}

#: The widest concat the PEs' patterns match (``program.ops.movement.MAX_CONCAT_INPUTS``, which
#: this layer may not import; a test checks they agree): a wider im2col concat is split.
_CONCAT_INPUTS = 9

#: Layers that are random in training mode (a training step must be a pure function, see the
#: package's reproducibility rule) or whose running statistics a step would have to carry.
_TRAIN_MODE_LAYERS = ("Dropout", "AlphaDropout", "FeatureAlphaDropout", "InstanceNorm", "LazyBatchNorm", "SyncBatchNorm")


@dataclass(frozen=True)
class TrainGraph:
    """The training-step module and what is needed to call it.

    Attributes
    ----------
    mod : tvm.IRModule
        ``main(inputs..., params..., targets, optim_states) -> (loss, params, optim_states)``.
    input_shapes : tuple of (tuple of int, str)
        Shape and dtype of each model input.
    param_names : tuple of str
        Names of the trainable parameters (PyTorch's, or ``param_<k>`` of a Relax module), in
        the order of ``main``'s arguments.
    param_shapes : tuple of tuple of int
    output_shape : tuple of int
        Shape of the model output (the loss input).
    label_shape, label_dtype : tuple of int, str
    init_optim_state : tuple of numpy.ndarray
        The optimizer state before the first step.
    phases : tvm.IRModule
        SetupTrainer's module: ``backbone_loss`` (forward + loss), ``backbone_loss_adjoint``
        (+ backward) and ``optimizer`` (update), before they are fused into ``mod``.
    init_params : tuple of numpy.ndarray
        Initial values of the trainable parameters (float32).
    """

    mod: tvm.IRModule
    input_shapes: tuple
    param_names: tuple
    param_shapes: tuple
    output_shape: tuple
    label_shape: tuple
    label_dtype: str
    init_optim_state: tuple
    phases: tvm.IRModule
    init_params: tuple


def _fixed_adam():
    from tvm.relax.training.optimizer import Adam

    class _Adam(Adam):
        """TVM 0.27's Adam, with the state dtype as a string (see the module docstring)."""

        def _set_params_and_dtype(self, params) -> None:
            super()._set_params_and_dtype(params)
            self.dtype = str(getattr(self.dtype, "dtype", self.dtype))

    return _Adam


def make_loss(loss: str):
    """TVM loss object for a loss name (mean reduction, as PyTorch's default)."""
    from tvm.relax.training.loss import CrossEntropyLoss, MSELoss

    if loss == "cross_entropy":
        return CrossEntropyLoss(reduction="mean")
    if loss == "mse":
        return MSELoss(reduction="mean")
    raise TrainingError(f"unsupported loss {loss!r}: expected one of {', '.join(LOSSES)}")


def make_optimizer(optimizer):
    """TVM optimizer object for ``(name, {options})``."""
    from tvm.relax.training.optimizer import SGD, MomentumSGD

    if isinstance(optimizer, str):
        optimizer = (optimizer, {})
    if not (isinstance(optimizer, tuple | list) and len(optimizer) == 2 and isinstance(optimizer[1], dict)):
        raise TrainingError(f"optimizer must be (name, {{options}}), got {optimizer!r}")
    name, opts = optimizer
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise TrainingError(f"unsupported optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")
    unknown = sorted((k for k in opts if k not in OPTIMIZERS[name]), key=repr)
    if unknown:
        raise TrainingError(f"unsupported option {unknown[0]!r} of optimizer {name!r}: "
                            f"expected some of {', '.join(OPTIMIZERS[name])}")
    if "lr" not in opts:
        raise TrainingError(f"optimizer {name!r} needs a learning rate 'lr'")
    opts = _checked_options(name, opts)
    if name == "adam":
        return _fixed_adam()(opts["lr"], opts.get("betas", (0.9, 0.999)), opts.get("eps", 1e-8),
                             opts.get("weight_decay", 0.0))
    if name == "adamw":
        if opts.get("amsgrad", False):
            raise TrainingError("unsupported option value amsgrad=True of optimizer 'adamw' (only amsgrad=False: "
                                "the update keeps no running maximum of the second moment)")
        # torch.optim.AdamW's defaults
        return AdamW(opts["lr"], opts.get("betas", (0.9, 0.999)), opts.get("eps", 1e-8),
                     opts.get("weight_decay", 1e-2))
    if opts.get("dampening", 0.0) != 0.0:
        raise TrainingError("unsupported option value dampening != 0 of optimizer 'sgd' "
                            "(TVM's MomentumSGD dampens the first step, PyTorch does not)")
    momentum = opts.get("momentum", 0.0)
    wd = opts.get("weight_decay", 0.0)
    if momentum == 0.0:
        if opts.get("nesterov", False):
            raise TrainingError("optimizer 'sgd': nesterov needs a momentum > 0")
        return SGD(opts["lr"], wd)
    return MomentumSGD(opts["lr"], momentum, 0.0, wd, opts.get("nesterov", False))


def _real(name: str, key: str, value, lo: float = 0.0, below: float | None = None, open_lo: bool = False) -> float:
    """``value`` as a finite float in ``[lo, below)`` (``[lo, inf)`` without ``below``; ``lo``
    excluded with ``open_lo``), or a TrainingError naming the option; the ranges are PyTorch's
    (``torch.optim`` refuses the same), but for AdamW's ``eps``, which must be > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TrainingError(f"optimizer {name!r}: option {key!r} must be a real number, got "
                            f"{type(value).__name__} {value!r:.60}")
    v = float(value)
    if not math.isfinite(v) or v < lo or (open_lo and v == lo) or (below is not None and v >= below):
        span = f"[{lo:g}, {below:g})" if below is not None else f"{'>' if open_lo else '>='} {lo:g} and finite"
        raise TrainingError(f"optimizer {name!r}: option {key!r} must be {span}, got {value!r}")
    return v


def _checked_options(name: str, opts: dict) -> dict:
    """The options of optimizer ``name`` type- and range-checked, as plain Python values."""
    out = {}
    for key in sorted(opts):
        value = opts[key]
        if key in ("nesterov", "amsgrad"):
            if not isinstance(value, bool | np.bool_):
                raise TrainingError(f"optimizer {name!r}: option {key!r} must be a bool, got "
                                    f"{type(value).__name__} {value!r:.60}")
            out[key] = bool(value)
        elif key == "betas":
            if not (isinstance(value, tuple | list) and len(value) == 2):
                raise TrainingError(f"optimizer {name!r}: option 'betas' must be a pair (beta1, beta2), got "
                                    f"{value!r:.60}")
            out[key] = tuple(_real(name, f"betas[{k}]", b, 0.0, 1.0) for k, b in enumerate(value))
        else:
            # AdamW divides by sqrt(v) + eps, and v is 0 where a gradient has been 0 so far
            out[key] = _real(name, key, value, open_lo=(name, key) == ("adamw", "eps"))
    return out


def _check_layers(model) -> None:
    for name, sub in model.named_modules():
        kind = type(sub).__name__
        if kind.endswith("Dropout") and getattr(sub, "p", None) == 0:
            continue  # dropout with p = 0 is the identity in training mode too
        if any(kind.startswith(k) for k in _TRAIN_MODE_LAYERS):
            raise TrainingError(
                f"layer {name or '<model>'} ({kind}) behaves differently in training mode, which "
                "tvm_spinn.training does not support yet (it would train the inference graph)")


def _import(model, example_inputs):
    """Export ``model`` with its parameters as ``main`` arguments; return (mod, trainable, frozen)."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    from ..frontend.pytorch import _CONVERT_FIXES  # the same aten fixes as inference import

    # BatchNorm normalizes with the batch's statistics while training: export in training mode
    # then (batch_norm(training=True), decomposed for the Gradient pass by SetupTrainer). The
    # importer drops the running-statistics updates; they are not tracked (see Trainer).
    train_mode = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    was_training = model.training
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            exported = torch.export.export(model.train(train_mode), tuple(example_inputs))
    finally:
        model.train(was_training)
        model.load_state_dict(saved)  # tracing in training mode must not move running statistics
    mod = from_exported_program(exported, keep_params_as_input=True, unwrap_unit_return_tuple=True,
                                custom_convert_map=_CONVERT_FIXES)
    # A tied parameter (GPT-2's lm_head.weight is its token embedding) is one tensor reached
    # under two module paths: torch.export gives each path its own input, named_parameters()
    # only the first path. Every path maps to that first name, and the later inputs become
    # aliases of the first one: one trainable parameter whose gradient sums both uses.
    canonical = {id(p): n for n, p in model.named_parameters()}
    named = {n: (canonical[id(p)], p) for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = dict(model.named_buffers(remove_duplicate=False))
    trainable, frozen, aliases, arg_of = [], {}, {}, {}
    from torch.export.graph_signature import InputKind

    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        arg = spec.arg.name
        if spec.kind == InputKind.PARAMETER and named[spec.target][1].requires_grad:
            name = named[spec.target][0]
            if name in arg_of:
                aliases[arg] = arg_of[name]
            else:
                arg_of[name] = arg
                trainable.append((arg, name))
        else:
            src = named[spec.target][1] if spec.target in named else buffers[spec.target]
            frozen[arg] = src.detach().cpu().numpy()
    return mod, trainable, frozen, aliases


def _from_torch(model, example_inputs):
    """(backbone function with inputs then trainable parameters, names, initial values, input specs)."""
    import torch

    if not any(p.requires_grad for p in model.parameters()):
        raise TrainingError(f"model {type(model).__name__} has no trainable parameters "
                            "(none with requires_grad=True)")
    _check_layers(model)
    if not isinstance(example_inputs, tuple | list):
        example_inputs = (example_inputs,)
    example_inputs = tuple(torch.as_tensor(x) for x in example_inputs)

    mod, trainable, frozen, aliases = _import(model, example_inputs)
    func = mod["main"]
    n_in = len(example_inputs)
    by_name = {p.name: p for p in func.params}
    if aliases:  # each later input of a tied parameter reads the first one's
        func = func.bind_params({a: by_name[first] for a, first in aliases.items() if a in by_name})
        by_name = {p.name: p for p in func.params}
    # buffers and requires_grad=False parameters are constants of the step (the importer binds
    # some buffers itself, e.g. running statistics of a training-mode batch norm)
    frozen = {k: v for k, v in frozen.items() if k in by_name}
    if frozen:
        func = func.bind_params({k: relax.const(v) for k, v in frozen.items()})
        by_name = {p.name: p for p in func.params}
    ordered = list(func.params[:n_in]) + [by_name[arg] for arg, _ in trainable]
    # the backbone takes (inputs, parameters): put the trainable parameters in that order
    func = relax.Function(ordered, func.body, func.ret_ty, func.is_pure, func.attrs)
    named = dict(model.named_parameters())
    names = tuple(target for _, target in trainable)
    values = tuple(named[n].detach().cpu().numpy().astype(np.float32) for n in names)
    specs = tuple((tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in example_inputs)
    return func, names, values, specs


def _static_shape(ty, what: str) -> tuple:
    """A tensor type's shape as ints; a training step is compiled for static shapes."""
    try:
        return tuple(int(d) for d in ty.shape)
    except (TypeError, ValueError, AttributeError):
        raise TrainingError(f"{what} has a dynamic or unknown shape {ty}: training needs static shapes") from None


def _from_relax(mod: tvm.IRModule):
    """An imported Relax module (weights bound as constants): every float32 constant of rank >= 1
    in ``main`` becomes a trainable parameter ``param_<k>`` (k: order of first use); scalars
    (epsilons, clip bounds) stay constants. The importer may have stored a weight transposed;
    training it in that layout is the same SGD/Adam (both act element-wise)."""
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise TrainingError("the Relax module has no 'main' function to train")
    func = mod["main"]
    lifted: list = []

    @relax.expr_functor.mutator
    class _Lift(relax.PyExprMutator):
        def visit_generic_const_(self, op):  # TVM 0.27 name of the Constant visitor
            value = getattr(op, "value", None)
            if not hasattr(value, "numpy"):  # a non-tensor constant
                return op
            data = value.numpy()
            if data.dtype != np.float32 or data.ndim == 0:
                return op
            for const, (var, _) in lifted:  # one parameter per constant object (same_as, not value)
                if const.same_as(op):
                    return var
            var = relax.Var(f"param_{len(lifted)}", relax.TensorType(data.shape, "float32"))
            lifted.append((op, (var, data)))
            return var

    body = _Lift().visit_expr(func.body)
    if not lifted:
        raise TrainingError("the Relax module has no trainable parameters (no float32 weight constants in main)")
    params = [v for _, (v, _) in lifted]
    func = relax.Function(list(func.params) + params, body, func.ret_ty, func.is_pure)
    specs = tuple((_static_shape(p.ty, f"input {p.name}"), str(p.ty.dtype)) for p in func.params[:-len(params)])
    return func, tuple(p.name for p in params), tuple(d for _, (_, d) in lifted), specs


def _flat_take_indices(func: relax.Function) -> relax.Function:
    """``take(w, ids)`` with 0-d or N-d ``ids`` (``x[:, 0]``; an embedding of a (batch, seq)
    token array) becomes a ``take`` of the ids as a 1-d array and a reshape: TVM 0.27
    differentiates ``take`` into ``take_backward``, whose legalization handles 1-d indices only
    (an assertion otherwise)."""
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    data, idx = wildcard(), wildcard()
    pattern = is_op("relax.take")(data, idx)

    def rewriter(expr, matches):
        ids = matches[idx]
        shape = getattr(ids.ty, "shape", None)
        if shape is None or len(shape) == 1 or expr.attrs.axis is None:
            return expr
        try:
            n = int(np.prod([int(d) for d in shape]))
        except (TypeError, ValueError):
            return expr
        flat = relax.op.take(matches[data], relax.op.reshape(ids, (n,)), axis=expr.attrs.axis,
                             mode=expr.attrs.mode)
        return relax.op.reshape(flat, expr.ty.shape)

    return rewrite_call(pattern, rewriter, func)


def _conv_as_gemm(func: relax.Function) -> relax.Function:
    """``conv2d(x, W)`` with a trainable ``W`` (a function parameter, not a constant) becomes
    im2col and one GEMM, ``Y = W[oc, kh*kw*c] @ cols[kh*kw*c, n*oh*ow]`` (columns tap-major,
    built from the input transposed to ``(c, n, h, w)``; the weight is permuted to match).

    The spinn conv2d kind embeds its weight in the program (a constant), so a conv whose weight
    changes every step would stay on the host with both its gradients (``conv2d_transpose`` for
    the data, a ``conv2d`` for the weight). As a GEMM of two activations it runs on the PEs, and
    ``Gradient`` differentiates it into two more: ``dW = dY @ cols^T`` (the weight gradient as a
    GEMM over im2col, its reduction over the whole batch and every output pixel in one fixed
    ascending order) and ``dcols = W^T @ dY`` (the data gradient; col2im is the gradient of the
    im2col slices: zero-pads and adds). im2col is unit-stride slices (a stride ``s`` is a slice
    of ``s * out`` rows reshaped to ``(out, s)`` and the first of each ``s`` kept), so every
    piece has a gradient; the slices are joined by one concat, or, for a kernel of more than
    :data:`_CONCAT_INPUTS` taps (7x7), one per kernel row and
    one of the rows (the PEs' concat patterns are that wide; same elements in the same order).
    NCHW/OIHW, one group, no dilation; other convs are left as they are.
    """
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    data, weight = wildcard(), wildcard()
    pattern = is_op("relax.nn.conv2d")(data, weight)
    op = relax.op

    def rewriter(expr, matches):
        x, w = matches[data], matches[weight]
        a = expr.attrs
        if not isinstance(w, relax.Var) or a.data_layout != "NCHW" or a.kernel_layout != "OIHW" \
                or int(a.groups) != 1 or any(int(d) != 1 for d in a.dilation) \
                or str(a.out_dtype) not in ("", "None", "float32") or str(x.ty.dtype) != "float32":
            return expr
        try:
            n, c, h, wd = (int(d) for d in x.ty.shape)
            oc, _, kh, kw = (int(d) for d in w.ty.shape)
            _, _, oh, ow = (int(d) for d in expr.ty.shape)
        except (TypeError, ValueError):
            return expr
        sh, sw = (int(v) for v in a.strides)
        pt, pl, pb, pr = (int(v) for v in a.padding)
        # rows read by the slices below: kh - 1 + sh * oh from the top (the last sh - 1 of them
        # only feed dropped phases); pad the bottom/right up to that
        pb += max(0, kh - 1 + sh * oh - (h + pt + pb))
        pr += max(0, kw - 1 + sw * ow - (wd + pl + pr))
        # channels first, (c, n, h, w): each kernel tap's slice is then one contiguous block of
        # the columns, the taps join along axis 0 without a per-slice reshape, and the columns
        # need no transpose (one pass over x instead of one over the 9x larger columns)
        xt = op.permute_dims(x, [1, 0, 2, 3])
        xp = op.nn.pad(xt, [0, 0, 0, 0, pt, pb, pl, pr]) if any((pt, pb, pl, pr)) else xt
        cols = []
        for i in range(kh):
            for j in range(kw):
                s = xp
                if (i, j, sh * oh, sw * ow) != (0, 0, h + pt + pb, wd + pl + pr):
                    s = op.strided_slice(xp, [2, 3], [i, j], [i + sh * oh, j + sw * ow])
                if sh > 1 or sw > 1:
                    s = op.reshape(s, (c, n, oh, sh, ow, sw))
                    s = op.reshape(op.strided_slice(s, [3, 5], [0, 0], [1, 1]), (c, n, oh, ow))
                cols.append(s)
        if len(cols) > _CONCAT_INPUTS:  # one concat per kernel row, then the rows: each fits a PE pattern
            cols = [op.concat(cols[i * kw:(i + 1) * kw], axis=0) if kw > 1 else cols[i * kw] for i in range(kh)]
        col = op.concat(cols, axis=0) if len(cols) > 1 else cols[0]  # (kh*kw*c, n, oh, ow), tap-major
        col = op.reshape(col, (kh * kw * c, n * oh * ow))
        wk = op.reshape(op.permute_dims(w, [0, 2, 3, 1]), (oc, kh * kw * c))  # the same (tap, c) order
        y = op.matmul(wk, col)  # (oc, n*p)
        return op.permute_dims(op.reshape(y, (oc, n, oh, ow)), [1, 0, 2, 3])

    return rewrite_call(pattern, rewriter, func)


def _sum_as_gemm(x: relax.Expr, reduced: list[int], out_shape) -> relax.Expr:
    """``x`` summed over the axes ``reduced``, as ``x[kept, reduced] @ ones[reduced, 1]``."""
    shape = [int(d) for d in x.ty.shape]
    kept = [k for k in range(len(shape)) if k not in reduced]
    n_red = int(np.prod([shape[k] for k in reduced]))
    n_kept = int(np.prod([shape[k] for k in kept]))
    if n_red > 1:
        if kept + reduced != list(range(len(shape))):
            x = relax.op.permute_dims(x, kept + reduced)
        x = relax.op.matmul(relax.op.reshape(x, (n_kept, n_red)), relax.const(np.ones((n_red, 1), np.float32)))
    return relax.op.reshape(x, out_shape)


def _sums_as_gemms(mod: tvm.IRModule) -> tvm.IRModule:
    """The reductions ``Gradient`` emits (``collapse_sum_to``: the gradient of every broadcast,
    biases and BatchNorm's affine parameters; ``sum``: softmax, LayerNorm and BatchNorm
    backward), which the spinn partition leaves on the host, become a GEMM with a column of
    ones: products by 1 are exact and the PE accumulates in ascending order of the flattened
    reduced index, so the sum is a fixed-order fp32 sum on the PEs, the same on every system."""
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    x, target = wildcard(), wildcard()
    collapse = is_op("relax.collapse_sum_to")(x, target)
    total = is_op("relax.sum")(x)

    def static(expr):
        try:
            return [int(d) for d in expr.ty.shape]
        except (TypeError, ValueError, AttributeError):
            return None

    def rewrite_collapse(expr, matches):
        src, out = static(matches[x]), static(expr)
        if src is None or out is None or str(expr.ty.dtype) != "float32":
            return expr
        lead = len(src) - len(out)
        reduced = list(range(lead)) + [lead + k for k, d in enumerate(out) if d == 1 and src[lead + k] != 1]
        return _sum_as_gemm(matches[x], reduced, out)

    def rewrite_sum(expr, matches):
        src, out = static(matches[x]), static(expr)
        if src is None or out is None or str(expr.ty.dtype) != "float32":
            return expr
        axes = expr.attrs.axis
        reduced = list(range(len(src))) if axes is None else sorted(int(a) % len(src) for a in axes)
        return _sum_as_gemm(matches[x], reduced, out)

    out = tvm.IRModule({}, attrs=mod.attrs)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            func = rewrite_call(total, rewrite_sum, rewrite_call(collapse, rewrite_collapse, func))
        out[gv] = func
    return out


def _batch_stats_on_rows(mod: tvm.IRModule) -> tvm.IRModule:
    """``mean`` over non-trailing axes and every ``variance`` (BatchNorm's batch statistics in
    training mode: over N, H and W of NCHW) become ``mean`` over trailing axes, which the rows
    family runs on the PEs: ``p = permute_dims(x, kept + reduced)``, ``m = mean(p)`` over the
    reduced (now trailing) axes and ``variance = mean((p - m)^2)``, TVM's own two-pass variance
    (``topi``'s legalization of ``variance``) on the permuted rows. Each row's sum is a
    sequential fp32 sum in ascending order of the flattened reduced index on the PEs (rows
    split over PEs chain their partial sums) and in the llvm build of the same module, so both
    give the same bits; the mean and the variance of one ``x`` share ``p`` and ``m``."""
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    x = wildcard()
    mean_pat = is_op("relax.mean")(x)
    var_pat = is_op("relax.variance")(x)
    op = relax.op

    def static(expr):
        try:
            return [int(d) for d in expr.ty.shape]
        except (TypeError, ValueError, AttributeError):
            return None

    memo: dict = {}

    def rows_of(src, expr):
        """(p, m with keepdims, out shape) of ``expr`` = mean/variance(src), or None."""
        shape, out = static(src), static(expr)
        if shape is None or out is None or str(expr.ty.dtype) != "float32" or not shape:
            return None
        axes = expr.attrs.axis
        reduced = list(range(len(shape))) if axes is None else sorted(int(a) % len(shape) for a in axes)
        kept = [k for k in range(len(shape)) if k not in reduced]
        key = (src, tuple(reduced))
        if key not in memo:
            trailing = list(range(len(kept), len(shape)))
            p = op.permute_dims(src, kept + reduced) if kept + reduced != list(range(len(shape))) else src
            memo[key] = (p, op.mean(p, trailing, keepdims=True), trailing)
        return (*memo[key], out, reduced == list(range(len(shape) - len(reduced), len(shape))))

    def rewrite_mean(expr, matches):
        got = rows_of(matches[x], expr)
        if got is None or got[4]:  # already trailing: the rows family takes it as it is
            return expr
        _, m, _, out, _ = got
        return op.reshape(m, out)

    def rewrite_var(expr, matches):
        got = rows_of(matches[x], expr)
        if got is None:
            return expr
        p, m, trailing, out, _ = got
        d = op.subtract(p, m)
        return op.reshape(op.mean(op.multiply(d, d), trailing, keepdims=True), out)

    out = tvm.IRModule({}, attrs=mod.attrs)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            memo.clear()
            func = rewrite_call(var_pat, rewrite_var, rewrite_call(mean_pat, rewrite_mean, func))
            func = relax.transform.EliminateCommonSubexpr()(tvm.IRModule({"f": func}))["f"]
        out[gv] = func
    return out


def loss_on_pes(mod: tvm.IRModule) -> tvm.IRModule:
    """The loss and its gradient in the forms the PEs run (:mod:`tvm_spinn.program.ops.loss`,
    the rows family's ``mean``), each reduction in a fixed order that no mapping changes.

    - Cross-entropy: ``nll_loss(log_softmax(z), t)`` (mean) becomes the mean over the rows of
      ``nll_loss(log_softmax(z), int32(t), reduction="none")`` (a ``cross_entropy`` layer, then
      a ``mean`` layer whose (1,) result is reshaped to the 0-d loss), and the gradient
      ``Gradient`` emits, ``nll_loss_backward(1, logp, t) - sum(...) * exp(logp)``, becomes
      ``(softmax(z) - one_hot(t)) / rows`` (a ``cross_entropy_backward`` layer): the same
      mathematics without the log-softmax the forward no longer keeps. The mean divides by the
      rows where PyTorch divides by the rows whose label is not ``ignore_index``: the same,
      since the trainer refuses labels outside ``[0, classes)``.
    - MSE (and any mean to a 0-d scalar): ``mean(x)`` becomes ``mean(x, keepdims=True)``
      reshaped to 0-d, a rows ``mean`` (a sequential fp32 sum over the flattened elements) on
      the PEs; the partition leaves 0-d results to the host.
    """
    from tvm.ir.prim.expr import FloatImm
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    op = relax.op
    z, t = wildcard(), wildcard()
    fwd = is_op("relax.nn.nll_loss")(is_op("relax.nn.log_softmax")(z), t)
    g, z2, t2 = wildcard(), wildcard(), wildcard()
    lsm = is_op("relax.nn.log_softmax")(z2)
    bwd = is_op("relax.subtract")(is_op("relax.grad.nll_loss_backward")(g, lsm, t2),
                                  is_op("relax.multiply")(wildcard(), is_op("relax.exp")(lsm)))
    x = wildcard()
    scalar_mean = is_op("relax.mean")(x)

    def logits(expr):
        try:
            shape = [int(d) for d in expr.ty.shape]
        except (TypeError, ValueError, AttributeError):
            return None
        return shape if len(shape) == 2 and str(expr.ty.dtype) == "float32" else None

    var2val: dict = {}

    def value(expr):
        """The call bound to ``expr`` (the rewriter sees variables where the pattern matched
        through a binding)."""
        return var2val.get(expr, expr) if isinstance(expr, relax.Var) else expr

    def rewrite_fwd(expr, matches):
        a = expr.attrs
        shape = logits(matches[z])
        if shape is None or a.reduction != "mean" or int(value(expr.args[0]).attrs.axis) not in (-1, 1):
            return expr
        rows = op.nn.nll_loss(op.nn.log_softmax(matches[z], -1), op.astype(matches[t], "int32"),
                              reduction="none", ignore_index=int(a.ignore_index))
        return op.reshape(op.mean(rows, axis=[0], keepdims=True), [])

    def rewrite_bwd(expr, matches):
        nll_back, seed, shape = value(expr.args[0]), value(matches[g]), logits(matches[z2])
        if (shape is None or not isinstance(nll_back, relax.Call) or nll_back.attrs.reduction != "mean"
                or int(value(nll_back.args[1]).attrs.axis) not in (-1, 1)
                or not (isinstance(seed, relax.Call) and seed.op.name == "relax.ones")):
            return expr
        one, zero = (FloatImm("float32", v) for v in (1.0, 0.0))  # float32 one-hot (a Python float is float64)
        hot = op.one_hot(op.astype(matches[t2], "int32"), one, zero, shape[1], -1)
        diff = op.subtract(op.nn.softmax(matches[z2], -1), hot)
        return op.divide(diff, relax.const(np.float32(shape[0])))

    def rewrite_mean(expr, matches):
        try:
            rank = len(matches[x].ty.shape)
            zero_d = len(expr.ty.shape) == 0
        except (TypeError, AttributeError):
            return expr
        if not zero_d or rank == 0 or str(expr.ty.dtype) != "float32":
            return expr
        return op.reshape(op.mean(matches[x], axis=list(range(rank)), keepdims=True), [])

    out = tvm.IRModule({}, attrs=mod.attrs)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            var2val.clear()
            var2val.update(relax.analysis.get_var2val(func))
            func = rewrite_call(bwd, rewrite_bwd, func)
            func = rewrite_call(scalar_mean, rewrite_mean, rewrite_call(fwd, rewrite_fwd, func))
            func = relax.analysis.remove_all_unused(func)
        out[gv] = func
    return out


def build_train_graph(model, example_inputs, loss: str, optimizer) -> TrainGraph:
    """Build the training-step module of ``model`` (see :class:`TrainGraph`)."""
    import torch
    from tvm.relax.training import SetupTrainer

    loss_obj = make_loss(loss)
    opt_obj = make_optimizer(optimizer)
    if isinstance(model, torch.nn.Module):
        func, names, values, specs = _from_torch(model, example_inputs)
    elif isinstance(model, tvm.IRModule):
        func, names, values, specs = _from_relax(model)
    else:
        raise TrainingError(f"model must be a torch.nn.Module or an imported Relax IRModule, "
                            f"got {type(model).__name__}")
    func = _conv_as_gemm(_flat_take_indices(func))
    out_ty = func.ret_ty
    if not isinstance(out_ty, relax.TensorType) or out_ty.dtype != "float32":
        raise TrainingError(f"the model must return one float32 tensor, it returns {out_ty}")
    out_shape = _static_shape(out_ty, "the model output")
    if loss == "cross_entropy":
        if len(out_shape) != 2:
            raise TrainingError(f"loss 'cross_entropy' needs a (batch, classes) model output, got {out_shape}")
        label_shape, label_dtype = (out_shape[0],), "int64"
    else:
        label_shape, label_dtype = out_shape, "float32"

    backbone = tvm.IRModule({"backbone": func.with_attr("global_symbol", "backbone")})
    backbone = backbone.with_attrs({"param_num": len(names), "state_num": 0})
    try:
        trainer = SetupTrainer(loss_obj, opt_obj, [out_ty, relax.TensorType(label_shape, label_dtype)],
                               legalize=False)(backbone)
    except Exception as err:  # TVM's InternalError from Gradient: name the op, not a C++ check
        text = str(err)
        missing = re.search(r"FPrimalGradient has not been registered for (\S+)", text)
        if missing:
            raise TrainingError(f"the model uses {missing.group(1)}, which has no gradient in TVM's "
                                "relax.training (nor in tvm_spinn.training.gradients)") from None
        ours = re.search(r"tvm_spinn\.training: (no gradient [^\n]*)", text)
        if ours:
            raise TrainingError(ours.group(1)) from None
        raise
    trainer = _batch_stats_on_rows(_sums_as_gemms(loss_on_pes(trainer)))
    step = _fuse_step(trainer, len(names))
    step = FixupImported(step)
    init_state = tuple(np.array(s.numpy()) for s in trainer.attrs["optim_state"])
    return TrainGraph(
        mod=step,
        input_shapes=specs,
        param_names=names,
        param_shapes=tuple(v.shape for v in values),
        output_shape=out_shape,
        label_shape=label_shape,
        label_dtype=label_dtype,
        init_optim_state=init_state,
        init_params=values,
        phases=trainer,
    )


def _fuse_step(trainer: tvm.IRModule, n_params: int) -> tvm.IRModule:
    """One ``main``: the adjoint (loss + gradients) then the optimizer, inlined."""
    adjoint = trainer["backbone_loss_adjoint"].without_attr("global_symbol")
    update = trainer["optimizer"].without_attr("global_symbol")
    bb = relax.BlockBuilder()
    g_adjoint = bb.add_func(adjoint, "adjoint")
    g_update = bb.add_func(update, "update")
    args = [relax.Var(p.name, p.ty) for p in adjoint.params]  # inputs, params, targets
    state = relax.Var("optim_states", update.params[2].ty)
    n_in = len(args) - n_params - 1
    with bb.function("main", args + [state]):
        with bb.dataflow():
            res = bb.emit(relax.Call(g_adjoint, args))
            loss = bb.emit(relax.TupleGetItem(res, 0))
            grads = bb.emit(relax.TupleGetItem(res, 1))
            params = bb.emit(relax.Tuple(args[n_in:n_in + n_params]))
            upd = bb.emit(relax.Call(g_update, [params, grads, state]))
            out = bb.emit_output(relax.Tuple([loss, relax.TupleGetItem(upd, 0), relax.TupleGetItem(upd, 1)]))
        bb.emit_func_output(out)
    mod = bb.get()
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    return relax.transform.CanonicalizeBindings()(mod)
