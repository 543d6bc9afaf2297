"""NHWC graphs (TFLite, Keras) to the MAC path's NCHW, transposing only at the graph's edges.

``relax.transform.ConvertLayout`` converts each NHWC ``conv2d`` but leaves the ops around it
(``quantize``/``dequantize``, int8 ``clip``, pools) in NHWC, so a QDQ conv becomes
``conv2d(permute_dims(dequantize(xq)), permute_dims(dequantize(Wq)))``: the int8 patterns no
longer see ``conv2d(dequantize(xq), dequantize(Wq))`` and every conv pays two transposes.
:func:`nhwc_to_nchw` instead rewrites a dataflow block once, in order, keeping for each NHWC
tensor an NCHW twin:

- ``conv2d`` (NHWC data, HWIO or depthwise HWOI kernel) reads the twin of its data and an OIHW
  weight; a quantized weight is transposed *before* its ``dequantize``
  (``dequantize(permute_dims(Wq), axis=0)``, folded to an int8 constant after the weights are
  restored, see :mod:`.qweights`);
- layout-free ops (per-tensor ``quantize``/``dequantize``, ``clip``, ``relu``, ``astype``,
  unary activations, binary arithmetic of same-rank tensors or with a per-channel vector),
  pools, ``mean`` over H and W, ``concat`` and constant ``pad`` follow their inputs' twins;
- any other reader of a converted tensor gets one ``permute_dims`` back to NHWC (memoized), put
  on the int8 tensor where there is one (before its ``dequantize``);
- int8 pools (TFLite's quantized ``MAX_POOL_2D``/``AVERAGE_POOL_2D``, imported as integer pools)
  are spelled as ``quantize(pool(dequantize(x, 1, 0)), 1, 0)`` (the pool of the raw integers, as
  TFLite computes it), which the fp32 pool and QDQ families offload; an int8 ``clip`` covering the whole type range (a fused
  ReLU whose calibrated range starts at zero) is dropped.

So an NHWC network (TFLite, Keras; float or quantized) has one transpose at its input and one per
NHWC output (or flatten), and every QDQ conv reaches the int8 patterns (MobileNetV2: 2 transposes
instead of 104 with ``ConvertLayout``).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import Constant

__all__ = ["nhwc_to_nchw", "has_nhwc_qconv"]

_TO_NCHW = [0, 3, 1, 2]
_TO_NHWC = [0, 2, 3, 1]
_AXIS = {0: 0, 1: 2, 2: 3, 3: 1}  # NHWC axis -> NCHW axis
_INT_RANGE = {"int8": (-128, 127), "uint8": (0, 255)}

_UNARY = ("relax.nn.relu", "relax.clip", "relax.astype", "relax.sigmoid", "relax.tanh", "relax.nn.gelu",
          "relax.nn.silu", "relax.negative", "relax.abs", "relax.exp", "relax.sqrt", "relax.rsqrt")
_BINARY = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum",
           "relax.minimum")


def _op(expr) -> str:
    return str(expr.op.name) if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else ""


def _shape(expr) -> list[int] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
        return None
    try:
        return [int(d) for d in ty.shape.values]
    except TypeError:
        return None  # symbolic dims


def _dtype(expr) -> str:
    return str(getattr(expr.ty, "dtype", ""))


def _per_tensor(call: relax.Call) -> bool:
    """A ``quantize``/``dequantize`` with one scale and zero point (layout-free)."""
    return all(isinstance(a, Constant) and a.value.numpy().size == 1 for a in call.args[1:3])


def _is_nhwc_conv(call) -> bool:
    if _op(call) != "relax.nn.conv2d":
        return False
    a = call.attrs
    return (a.data_layout == "NHWC" and (a.out_layout in ("", "NHWC") or a.out_layout is None)
            and a.kernel_layout in ("HWIO", "HWOI", "OHWI") and _shape(call.args[0]) is not None)


def has_nhwc_qconv(func: relax.Function, float_too: bool = False) -> bool:
    """Whether ``func`` has an NHWC ``conv2d`` reading a ``dequantize`` (a quantized TFLite conv;
    any NHWC conv with ``float_too``) or an NHWC pool of integer data (TFLite's quantized pools)."""
    value_of = relax.analysis.get_var2val(func)
    found = []

    def visit(expr):
        if (not found and _op(expr) in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d")
                and expr.attrs.layout == "NHWC" and _dtype(expr.args[0]) in ("int8", "uint8", "int32")):
            found.append(expr)
            return
        if not found and _is_nhwc_conv(expr) and (float_too or any(_reads_dequantize(a) for a in expr.args[:2])):
            found.append(expr)

    def _reads_dequantize(arg) -> bool:
        while isinstance(arg, relax.Var) and arg in value_of and _op(value_of[arg]) == "relax.reshape":
            arg = value_of[arg].args[0]
        return isinstance(arg, relax.Var) and _op(value_of.get(arg)) == "relax.dequantize"

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


class _Converter:
    def __init__(self, bb: relax.BlockBuilder, value_of: dict):
        self.bb = bb
        self.old_value = value_of  # the original bindings (var -> value)
        self.remap: dict = {}  # original var -> new NHWC var (when emitted)
        self.twin: dict = {}  # original var -> new NCHW var
        self.new_value: dict = {}  # new var -> its value
        self.nhwc_cache: dict = {}

    # -- emission --------------------------------------------------------------------------------
    def emit(self, value, name: str = "") -> relax.Var:
        var = self.bb.emit(value, name)
        self.new_value[var] = value
        return var

    def nhwc(self, old):
        """The NHWC value of an original expression (materialized from its twin if needed)."""
        if isinstance(old, relax.Tuple):
            return relax.Tuple([self.nhwc(f) for f in old.fields])
        if not isinstance(old, relax.Var):
            return old
        if old in self.remap:
            return self.remap[old]
        if old in self.twin:
            var = self.nhwc_cache.get(old)
            if var is None:
                var = self._edge(self.twin[old], _TO_NHWC, f"{old.name}_nhwc")
                self.nhwc_cache[old] = var
            return var
        return old  # a parameter

    def _edge(self, new_var, axes, name):
        """``permute_dims(new_var, axes)``, moved before a per-tensor ``dequantize`` (int8 data)."""
        value = self.new_value.get(new_var)
        if _op(value) == "relax.dequantize" and _per_tensor(value) and len(_shape(value.args[0]) or []) == 4:
            moved = self.emit(relax.op.permute_dims(value.args[0], axes))
            return self.emit(relax.op.dequantize(moved, value.args[1], value.args[2], axis=0,
                                                 out_dtype=str(value.attrs.out_dtype)), name)
        return self.emit(relax.op.permute_dims(new_var, axes), name)

    def nchw(self, old):
        """The NCHW twin of a 4-D NHWC original expression (made at an edge if there is none)."""
        if isinstance(old, relax.Var) and old in self.twin:
            return self.twin[old]
        if isinstance(old, relax.Var) and old in self.old_value:
            value = self.old_value[old]
            # An edge: a quantized input's dequantize reads the transposed int8 tensor.
            if _op(value) == "relax.dequantize" and _per_tensor(value) and old not in self.twin:
                data = self.nchw(value.args[0])
                twin = self.emit(relax.op.dequantize(data, value.args[1], value.args[2], axis=0,
                                                     out_dtype=str(value.attrs.out_dtype)))
                self.twin[old] = twin
                return twin
        twin = self.emit(relax.op.permute_dims(self.nhwc(old), _TO_NCHW))
        if isinstance(old, relax.Var):
            self.twin[old] = twin
        return twin

    def has_twin(self, old) -> bool:
        return isinstance(old, relax.Var) and old in self.twin

    # -- one binding -----------------------------------------------------------------------------
    def binding_plain(self, var, value) -> None:
        """Emit ``var = value`` as it is, its arguments in NHWC."""
        if isinstance(value, relax.Call):
            args = [self.nhwc(a) for a in value.args]
            new = relax.Call(value.op, args, value.attrs, value.ty_args)
        elif isinstance(value, relax.Tuple):
            new = self.nhwc(value)
        elif isinstance(value, relax.TupleGetItem):
            new = relax.TupleGetItem(self.nhwc(value.tuple_value), value.index)
        else:
            new = self.nhwc(value) if isinstance(value, relax.Var) else value
        self.remap[var] = self.emit(new, var.name)

    def convert(self, var, call: relax.Call):
        """The NCHW twin of ``var = call``, or None when ``call`` stays as it is."""
        op = _op(call)
        if _is_nhwc_conv(call):
            weight = self._oihw_weight(call)
            if weight is None:
                return None
            a = call.attrs
            return self.emit(relax.op.nn.conv2d(
                self.nchw(call.args[0]), weight, strides=a.strides, padding=a.padding, dilation=a.dilation,
                groups=a.groups, data_layout="NCHW", kernel_layout="OIHW", out_layout="NCHW",
                out_dtype=a.out_dtype if str(a.out_dtype) not in ("", "void") else None), var.name)
        if len(_shape(var) or []) != 4:
            return self._reduce(var, call) if op == "relax.mean" else None
        if op in ("relax.quantize", "relax.dequantize") and self.has_twin(call.args[0]):
            if not _per_tensor(call):
                return None
            return self.emit(relax.Call(call.op, [self.twin[call.args[0]], *call.args[1:]], call.attrs), var.name)
        if op in _UNARY and self.has_twin(call.args[0]):
            if op == "relax.clip" and self._is_full_range_clip(call):
                return self.twin[call.args[0]]
            if op == "relax.astype" and _dtype(self.twin[call.args[0]]) == str(call.attrs.dtype):
                return self.twin[call.args[0]]  # the int32 round trip of an int8 average pool
            return self.emit(relax.Call(call.op, [self.twin[call.args[0]], *call.args[1:]], call.attrs,
                                        call.ty_args), var.name)
        if op in _BINARY:
            return self._binary(var, call)
        if op in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d") and call.attrs.layout == "NHWC":
            return self._pool(var, call)
        if op == "relax.mean":
            return self._reduce(var, call)
        if op == "relax.concat":
            return self._concat(var, call)
        if op == "relax.nn.pad" and self.has_twin(call.args[0]) and len(call.attrs.pad_width) == 8:
            # TF's explicit (SAME / ZeroPadding2D) pads: (before, after) pairs in NCHW order
            w = [int(v) for v in call.attrs.pad_width]
            width = [v for axis in _TO_NCHW for v in w[2 * axis:2 * axis + 2]]
            return self.emit(relax.op.nn.pad(self.twin[call.args[0]], width, pad_mode=str(call.attrs.pad_mode),
                                             pad_value=float(call.attrs.pad_value)), var.name)
        return None

    def _is_full_range_clip(self, call) -> bool:
        rng = _INT_RANGE.get(_dtype(call.args[0]))
        inner = [getattr(getattr(a, "value", None), "value", None) for a in call.args[1:3]]
        lo, hi = (float(v) if v is not None else None for v in inner)
        return rng is not None and lo is not None and hi is not None and lo <= rng[0] and hi >= rng[1]

    def _oihw_weight(self, call):
        w = call.args[1]
        layout = call.attrs.kernel_layout
        value = self.old_value.get(w) if isinstance(w, relax.Var) else None
        # Depthwise (TFLite): reshape(dequantize(Wq (1, kh, kw, C*m), axis=3), (kh, kw, C*m, 1)), HWOI
        if (layout == "HWOI" and _op(value) == "relax.reshape" and isinstance(value.args[0], relax.Var)
                and _op(self.old_value.get(value.args[0])) == "relax.dequantize"):
            dq = self.old_value[value.args[0]]
            src, dst = _shape(dq.args[0]), _shape(w)
            if src is not None and len(src) == 4 and src[0] == 1 and dst == [src[1], src[2], src[3], 1] \
                    and int(dq.attrs.axis) in (3, -1):
                moved = relax.op.permute_dims(self.nhwc(dq.args[0]), [3, 0, 1, 2])
                return self.emit(relax.op.dequantize(self.emit(moved), dq.args[1], dq.args[2], axis=0,
                                                     out_dtype=str(dq.attrs.out_dtype)))
        perm = [layout.index(c) for c in "OIHW"]
        if _op(value) == "relax.dequantize":
            axis = int(value.attrs.axis) % 4
            moved = self.emit(relax.op.permute_dims(self.nhwc(value.args[0]), perm))
            return self.emit(relax.op.dequantize(moved, value.args[1], value.args[2], axis=perm.index(axis),
                                                 out_dtype=str(value.attrs.out_dtype)))
        return self.emit(relax.op.permute_dims(self.nhwc(w), perm))

    def _binary(self, var, call):
        a, b = call.args
        if not (self.has_twin(a) or self.has_twin(b)):
            return None
        args = []
        for x in (a, b):
            shape = _shape(x)
            if shape is None:
                return None
            if len(shape) == 4:
                args.append(self.nchw(x))
            elif len(shape) <= 1 and (not shape or shape[0] == 1):
                args.append(self.nhwc(x))  # a scalar broadcasts in any layout
            elif len(shape) == 1:  # a per-channel vector on the last (C) axis
                args.append(self.emit(relax.op.reshape(self.nhwc(x), [1, shape[0], 1, 1])))
            else:
                return None
        return self.emit(relax.Call(call.op, args, call.attrs, call.ty_args), var.name)

    def _pool(self, var, call):
        a = call.attrs
        data = call.args[0]
        kwargs = dict(pool_size=a.pool_size, strides=a.strides, dilation=a.dilation, padding=a.padding,
                      ceil_mode=a.ceil_mode, layout="NCHW", out_layout="NCHW")
        maxpool = _op(call) == "relax.nn.max_pool2d"
        if not maxpool:
            kwargs["count_include_pad"] = a.count_include_pad
        pool = relax.op.nn.max_pool2d if maxpool else relax.op.nn.avg_pool2d
        source = self._int_pool_source(call)
        if source is not None:
            # An integer pool (TFLite's pools run on the raw integers): the same pool on the
            # integers as float32, quantized back with zero point 0, which the fp32 pool and QDQ
            # families offload. Max pools are exact. TFLite rounds an average ``S / n`` half away
            # from zero, ``quantize`` half to even: its scale ``1 - 2**-20`` magnifies ``|S / n|``
            # by ``~2**-20``, which moves exact ties away from zero and no other average across
            # a rounding boundary (those lie >= 1 / (2n) from one; |S / n| <= 255, n < 2048),
            # with room for the fp32 rounding of the average (~2**-23 relative).
            dtype = _dtype(source)
            one, zero = relax.const(1.0, "float32"), relax.const(0, "int32")
            window = int(call.attrs.pool_size[0]) * int(call.attrs.pool_size[1])
            out_scale = one if maxpool or window >= 2048 else relax.const(1.0 - 2.0 ** -20, "float32")
            x = self.emit(relax.op.dequantize(self.nchw(source), one, zero, axis=0))
            y = self.emit(pool(x, **kwargs))
            return self.emit(relax.op.quantize(y, out_scale, zero, axis=0, out_dtype=dtype), var.name)
        if not self.has_twin(data) and _shape(data) is None:
            return None
        return self.emit(pool(self.nchw(data), **kwargs), var.name)

    def _int_pool_source(self, call):
        """The int8/uint8 tensor an integer pool averages or maxes (an int8 max pool, or an int32
        average pool of ``astype(int8 data)``), else None."""
        data = call.args[0]
        if _dtype(data) in _INT_RANGE and _op(call) == "relax.nn.max_pool2d":
            return data
        if _dtype(data) == "int32" and isinstance(data, relax.Var) and _op(self.old_value.get(data)) == "relax.astype":
            src = self.old_value[data].args[0]
            if _dtype(src) in _INT_RANGE:
                return src
        return None

    def _reduce(self, var, call):
        data = call.args[0]
        axes = call.attrs.axis
        if not self.has_twin(data) or axes is None or len(_shape(data) or []) != 4:
            return None
        new_axes = sorted(_AXIS[int(x) % 4] for x in axes)
        keep = bool(call.attrs.keepdims)
        if not keep and sorted(int(x) % 4 for x in axes) != [1, 2]:
            return None  # the output's remaining axes would come out in another order
        out = self.emit(relax.op.mean(self.twin[data], axis=new_axes, keepdims=keep), var.name)
        if keep:
            return out
        self.remap[var] = out  # (N, C): the same in both layouts
        return _NoTwin

    def _concat(self, var, call):
        fields = call.args[0]
        if not isinstance(fields, relax.Tuple) or not any(self.has_twin(f) for f in fields.fields):
            return None
        if any(len(_shape(f) or []) != 4 for f in fields.fields):
            return None
        axis = _AXIS[int(call.attrs.axis) % 4]
        return self.emit(relax.op.concat([self.nchw(f) for f in fields.fields], axis=axis), var.name)


_NoTwin = object()  # a conversion whose result is layout-free (bound in remap, no twin)


def nhwc_to_nchw(func: relax.Function) -> relax.Function:
    """``func`` with its NHWC convs (and the ops around them) in NCHW; see the module docstring.

    Functions whose body is not a single dataflow block are returned unchanged (ConvertLayout
    handles them)."""
    body = func.body
    if not (isinstance(body, relax.SeqExpr) and len(body.blocks) == 1
            and isinstance(body.blocks[0], relax.DataflowBlock) and isinstance(body.body, relax.Var)):
        return func
    block = body.blocks[0]
    value_of = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
    if len(value_of) != len(block.bindings):
        return func  # match-cast bindings: left to ConvertLayout
    bb = relax.BlockBuilder()
    attrs = {str(k): v for k, v in func.attrs.items()} if func.attrs else None
    with bb.function("main", list(func.params), attrs=attrs, pure=func.is_pure):
        with bb.dataflow():
            conv = _Converter(bb, value_of)
            for binding in block.bindings:
                twin = conv.convert(binding.var, binding.value) if isinstance(binding.value, relax.Call) else None
                if twin is _NoTwin:
                    continue
                if twin is not None:
                    conv.twin[binding.var] = twin
                    continue
                conv.binding_plain(binding.var, binding.value)
            result = conv.nhwc(body.body)
            out = bb.emit_output(result)
        bb.emit_func_output(out)
    new = bb.get()["main"]
    new = relax.transform.DeadCodeElimination()(tvm.IRModule({"main": new}))["main"]
    return new
