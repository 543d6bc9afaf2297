"""GEMM partition patterns and their checks, lowering of int8 GEMMs, and validation of the int8
epilogue."""

from __future__ import annotations

import math

import numpy as np

from ...checks import fail
from ...model import Layer
from ...quant import QUANT_RANGES, quantize_multiplier, quantize_multiplier_tflite, to_signed
from ..base import LoweringError
from .geometry import _QRANGE, _REQUANT, smallest_gemm_tile_bytes


# -- partition patterns and checks ----------------------------------------------------------------
def _epilogue(main, ann: dict, bias: bool, do_relu: bool):
    """Wrap a GEMM pattern in the optional constant bias add and ReLU (annotated in ``ann``)."""
    from tvm.relax.dpl import is_const, is_op

    pat = main
    if bias:
        ann["bias"] = b = is_const()
        pat = is_op("relax.add")(pat, b)
    if do_relu:
        pat = is_op("relax.nn.relu")(pat)
    return pat


def _gemm_patterns(kit, prefix: str, op: str, check) -> list:
    """``op(x, W const)`` with optional constant bias add and ReLU: four patterns, largest first."""
    from tvm.relax.dpl import is_const, is_op, wildcard

    out = []
    for bias in (True, False):
        for do_relu in (True, False):
            data, weight = wildcard(), is_const()
            main = is_op(op)(data, weight)
            # "conv" is the conv2d call itself (its attrs are checked); "main" is the GEMM output.
            ann = {"input": data, "weight": weight, "conv": main, "main": main}
            ann["root"] = pat = _epilogue(main, ann, bias, do_relu)
            name = prefix + ("_bias" if bias else "") + ("_relu" if do_relu else "")
            out.append(kit.entry(name, pat, ann, check))
    return out


def _qgemm_patterns(kit, prefix: str, op: str, weight_const: bool) -> list:
    """``op(dequantize(xq), dequantize(wq))`` with optional bias, ReLU and output ``quantize``.

    Eight patterns, largest first. With ``weight_const`` the weight is an int8 constant (conv2d,
    dense); otherwise both operands are activations (matmul, no bias/ReLU variants).
    """
    from tvm.relax.dpl import is_const, is_op, wildcard

    out = []
    for requant in (True, False):
        for bias in ((True, False) if weight_const else (False,)):
            for do_relu in ((True, False) if weight_const else (False,)):
                xq, sx, zx = wildcard(), is_const(), is_const()
                wq, sw, zw = (is_const() if weight_const else wildcard()), is_const(), is_const()
                xdq = is_op("relax.dequantize")(xq, sx, zx)
                wdq = is_op("relax.dequantize")(wq, sw, zw)
                main = is_op(op)(xdq, wdq)
                ann = {"xq": xq, "sx": sx, "zx": zx, "xdq": xdq, "wq": wq, "sw": sw, "zw": zw,
                       "wdq": wdq, "main": main}
                pat = _epilogue(main, ann, bias, do_relu)
                if requant:
                    sy, zy = is_const(), is_const()
                    pat = is_op("relax.quantize")(pat, sy, zy)
                    ann.update(quant=pat, sy=sy, zy=zy)
                ann["root"] = pat
                name = prefix + ("_bias" if bias else "") + ("_relu" if do_relu else "") + ("_requant" if requant else "")
                out.append(kit.entry(name, pat, ann, _check_qgemm))
    return out


def _check_gemm_fits(kit, op: str, root, k: int, elem_bytes: int) -> bool:
    # The tiler's own smallest tile: what passes here always tiles.
    return kit.check_fits(op, root, smallest_gemm_tile_bytes(kit.arch, k, elem_bytes, elem_bytes),
                          f"the smallest GEMM tile (K={k})")


def _check_channel_bias(kit, op: str, ctx, axis: int, rank: int) -> bool:
    root = ctx.annotated_expr["root"]
    out_shape = kit.static_shape(ctx.annotated_expr["main"])
    bshape = kit.static_shape(ctx.annotated_expr["bias"])
    channels = out_shape[axis]
    padded = (1,) * (rank - len(bshape)) + tuple(bshape)
    expect = tuple(channels if i == axis % rank else 1 for i in range(rank))
    if padded != expect and math.prod(bshape) != 1:
        return kit.refuse(op, root, f"bias shape {bshape} is not per-channel {expect}")
    return True


def _check_conv2d(kit, op: str, ctx) -> bool:
    if not kit.check_tensors(op, ctx, ("input", "weight", "bias")):
        return False
    root = ctx.annotated_expr["root"]
    attrs = ctx.annotated_expr["conv"].attrs
    if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW":
        return kit.refuse(op, root, f"layout {attrs.data_layout}/{attrs.kernel_layout} (need NCHW/OIHW)")
    if str(attrs.out_dtype) not in ("", "None", "float32"):
        return kit.refuse(op, root, f"out_dtype {attrs.out_dtype}")
    if "bias" in ctx.annotated_expr and not _check_channel_bias(kit, op, ctx, axis=1, rank=4):
        return False
    wshape = kit.static_shape(ctx.annotated_expr["weight"])
    return _check_gemm_fits(kit, op, root, wshape[1] * wshape[2] * wshape[3], 4)


def _check_dense(kit, op: str, ctx) -> bool:
    if not kit.check_tensors(op, ctx, ("input", "weight", "bias")):
        return False
    root = ctx.annotated_expr["root"]
    ashape = kit.static_shape(ctx.annotated_expr["input"])
    wshape = kit.static_shape(ctx.annotated_expr["weight"])
    if len(wshape) != 2 or len(ashape) < 1:
        return kit.refuse(op, root, f"weight rank {len(wshape)} (need a 2-D constant)")
    if "bias" in ctx.annotated_expr:
        oshape = kit.static_shape(ctx.annotated_expr["main"])
        bshape = kit.static_shape(ctx.annotated_expr["bias"])
        if tuple(d for d in bshape if d != 1) not in ((), (oshape[-1],)) or bshape[-1] not in (1, oshape[-1]):
            return kit.refuse(op, root, f"bias shape {bshape} is not per-output-feature")
    return _check_gemm_fits(kit, op, root, wshape[0], 4)


def _check_matmul(kit, op: str, ctx) -> bool:
    if not kit.check_tensors(op, ctx, ("lhs", "rhs")):
        return False
    root = ctx.annotated_expr["root"]
    a = kit.static_shape(ctx.annotated_expr["lhs"])
    b = kit.static_shape(ctx.annotated_expr["rhs"])
    if len(a) < 2 or len(b) < 2:
        return kit.refuse(op, root, "matmul operands must be at least 2-D")
    return _check_gemm_fits(kit, op, root, a[-1], 4)


def _check_qgemm(kit, op: str, ctx) -> bool:
    """``gemm(dequantize(xq), dequantize(wq))`` [+ bias] [relu] [quantize] on the MAC array."""
    ann = ctx.annotated_expr
    root = ann["root"]
    main = ann["main"]
    shape = kit.static_shape
    if shape(main) is None or shape(root) is None:
        return kit.refuse(op, root, "dynamic shape")
    for name in ("root", "main", "xq", "wq"):
        if not kit.check_nonempty(op, root, name, ann[name]):
            return False
    is_conv, is_dense = op.startswith("spinn.qconv2d"), op.startswith("spinn.qdense")
    out_shape = shape(main)
    channels = out_shape[1] if is_conv else out_shape[-1]
    for q, s, z, what in (("xq", "sx", "zx", "activation"), ("wq", "sw", "zw", "weight")):
        if not kit.check_quantized(op, root, ann[q], what):
            return False
        per_channel = channels if (what == "weight" and (is_conv or is_dense or len(shape(ann[q])) >= 2)) else None
        if not kit.check_qparams(op, root, ctx, s, z, per_channel, what):
            return False
    if not kit.check_dq_axis(op, root, ctx, "xdq", "sx", -1):
        return False
    w_axis = 0 if is_conv else -1
    if not kit.check_dq_axis(op, root, ctx, "wdq", "sw", w_axis):
        return False
    if is_conv:
        attrs = ann["main"].attrs
        if attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW":
            return kit.refuse(op, root, f"layout {attrs.data_layout}/{attrs.kernel_layout} (need NCHW/OIHW)")
        wshape = shape(ann["wq"])
        if not _check_gemm_fits(kit, op, root, wshape[1] * wshape[2] * wshape[3], 1):
            return False
    elif is_dense and len(shape(ann["wq"])) != 2:
        return kit.refuse(op, root, "weight must be a 2-D constant")
    elif not is_dense and (len(shape(ann["xq"])) < 2 or len(shape(ann["wq"])) < 2):
        return kit.refuse(op, root, "matmul operands must be at least 2-D")
    if not is_conv:
        k = shape(ann["wq"])[0] if is_dense else shape(ann["xq"])[-1]
        if not _check_gemm_fits(kit, op, root, k, 1):
            return False
    if str(getattr(main.attrs, "out_dtype", "")) not in ("", "None", "float32", "void"):
        return kit.refuse(op, root, f"out_dtype {main.attrs.out_dtype}")
    if "bias" in ann:
        if kit.dtype(ann["bias"]) != "float32":
            return kit.refuse(op, root, f"bias dtype {kit.dtype(ann['bias'])}")
        if is_conv and not _check_channel_bias(kit, op, ctx, axis=1, rank=4):
            return False
        bshape = shape(ann["bias"])
        if not is_conv and (tuple(d for d in bshape if d != 1) not in ((), (channels,)) or bshape[-1] not in (1, channels)):
            return kit.refuse(op, root, f"bias shape {bshape} is not per-output-feature")
    if "quant" in ann:
        if str(ann["quant"].attrs.out_dtype) not in kit.QUANTIZED_DTYPES:
            return kit.refuse(op, root, f"output quantized to {ann['quant'].attrs.out_dtype}")
        if not kit.check_qparams(op, root, ctx, "sy", "zy", None, "output"):
            return False
    return True


# -- lowering -------------------------------------------------------------------------------------
def _lower_bias(lowerer, bias, out: int, base: str, name: str) -> int:
    from tvm.ir.expr import Constant

    if not isinstance(bias, Constant):
        raise LoweringError(f"{name}: bias must be a constant")
    channels = lowerer.tensors[out].shape[1 if base == "conv2d" else -1]
    value = np.broadcast_to(bias.value.numpy().reshape(-1), (channels,)).astype(np.float32)
    return lowerer.add_const("bias", value)


def _lower_qgemm(lowerer, layer: Layer, name: str, calls: list, env: dict) -> None:
    """An int8 GEMM (see :mod:`tvm_spinn.program.quant` for the arithmetic)."""
    from tvm.ir.expr import Constant

    by_var = dict(calls)
    ops = {c.op.name: c for _, c in calls}
    main = next(c for _, c in calls if c.op.name in ("relax.nn.conv2d", "relax.matmul"))
    xdq, wdq = by_var[main.args[0]], by_var[main.args[1]]
    base = "conv2d" if main.op.name == "relax.nn.conv2d" else ("dense" if layer.kind.startswith("qdense") else "matmul")
    layer.kind, layer.mode = base, "int8"
    layer.name = f"q{base}_{len(lowerer.layers)}"  # e.g. qconv2d_4 (fused epilogue in attrs)
    out_shape = [int(d.value) for d in main.ty.shape.values]
    channels = out_shape[1] if base == "conv2d" else out_shape[-1]

    def qparams(dq, per_channel: bool) -> tuple[np.ndarray, np.ndarray, str]:
        scale = np.asarray(dq.args[1].value.numpy(), dtype=np.float64).reshape(-1)
        zero = dq.args[2].value.numpy().astype(np.int64).reshape(-1)
        dtype = str(dq.args[0].ty.dtype)
        zero = zero - (128 if dtype == "uint8" else 0)  # the array sees uint8 with its top bit flipped
        if per_channel:
            scale, zero = np.broadcast_to(scale, (channels,)), np.broadcast_to(zero, (channels,))
        return scale, zero, dtype

    sx, zx, xdtype = qparams(xdq, False)
    sw, zw, wdtype = qparams(wdq, base != "matmul")
    layer.inputs = [lowerer.operand(xdq.args[0], env)]
    layer.attrs.update(x_zero=int(zx[0]), x_flip=xdtype == "uint8", relu="relax.nn.relu" in ops)
    if base == "matmul":  # both operands are activations, per-tensor
        layer.inputs.append(lowerer.operand(wdq.args[0], env))
        layer.attrs.update(b_zero=int(zw[0]), b_flip=wdtype == "uint8")
        s_acc = np.broadcast_to(sx[0] * sw[0], (channels,))
    else:
        weight = wdq.args[0]
        if not isinstance(weight, Constant):
            raise LoweringError(f"{name}: the int8 weight must be a constant")
        layer.consts["weight"] = lowerer.add_const("qweight", to_signed(weight.value.numpy()))
        if np.any(zw != 0):
            layer.consts["w_zero"] = lowerer.add_const("wzero", zw.astype(np.int32))
        if base == "conv2d":
            a = main.attrs
            layer.attrs.update(strides=[int(v) for v in a.strides], padding=[int(v) for v in a.padding],
                               dilation=[int(v) for v in a.dilation], groups=int(a.groups))
        s_acc = sx[0] * sw
    bias = None
    if "relax.add" in ops:
        add = ops["relax.add"]
        b = add.args[1] if isinstance(add.args[1], Constant) else add.args[0]
        bias = np.broadcast_to(b.value.numpy().astype(np.float64).reshape(-1), (channels,))
    quant = ops.get("relax.quantize")
    if quant is None:
        layer.attrs["out"] = "float32"
        layer.consts["scale"] = lowerer.add_const("qscale", s_acc.astype(np.float32))
        if bias is not None:
            layer.consts["bias"] = lowerer.add_const("bias", bias.astype(np.float32))
        return
    ydtype = str(quant.attrs.out_dtype)
    sy = float(np.asarray(quant.args[1].value.numpy(), dtype=np.float64).reshape(-1)[0])
    zy = int(quant.args[2].value.numpy().reshape(-1)[0])
    lo, hi = QUANT_RANGES[ydtype]
    # A composite named ``..._tflite`` (relax_rewrites.folds.TagRequantRounding) requantizes with
    # TFLite's rule (program/quant.py).
    rounding = "tflite" if name.endswith("_tflite") else "half_up"
    to_fixed = quantize_multiplier_tflite if rounding == "tflite" else quantize_multiplier
    mult, shift = np.zeros(channels, np.int32), np.zeros(channels, np.int32)
    for c in range(channels):
        try:
            mult[c], shift[c] = to_fixed(float(s_acc[c]) / sy)
        except ValueError as err:
            raise LoweringError(f"{name}: channel {c}: {err}") from None
    with np.errstate(divide="ignore", invalid="ignore"):
        bias_q = np.where(s_acc > 0, np.rint((bias if bias is not None else 0.0) / s_acc), 0.0)
    if np.any(np.abs(bias_q) >= 2**31):
        raise LoweringError(f"{name}: the quantized bias does not fit 32 bits (scales too small)")
    layer.attrs.update(out=ydtype, y_zero=zy, y_min=max(lo, zy) if layer.attrs["relu"] else lo, y_max=hi)
    if rounding != "half_up":
        layer.attrs["rounding"] = rounding
    layer.consts["bias_q"] = lowerer.add_const("biasq", bias_q.astype(np.int32))
    layer.consts["multiplier"] = lowerer.add_const("mult", mult)
    layer.consts["shift"] = lowerer.add_const("shift", shift)


# -- validation of the int8 epilogue --------------------------------------------------------------
def _check_int8_epilogue(v, f: str, kind: str, ins: list[int], consts: dict, out: int, attrs: dict,
                         channels: int, k: int) -> None:
    if attrs["x_flip"] != (v.dtypes[ins[0]] == "uint8"):
        fail(f"{f}.attrs.x_flip", f"must be {v.dtypes[ins[0]] == 'uint8'} for a {v.dtypes[ins[0]]} input")
    if kind == "matmul" and attrs["b_flip"] != (v.dtypes[ins[1]] == "uint8"):
        fail(f"{f}.attrs.b_flip", f"must be {v.dtypes[ins[1]] == 'uint8'} for a {v.dtypes[ins[1]]} input")
    for key in ("x_zero", "b_zero"):
        if key in attrs and not -128 <= attrs[key] <= 127:
            fail(f"{f}.attrs.{key}", f"{attrs[key]} is outside the signed int8 range")
    weight = set() if kind == "matmul" else {"weight"}
    odt = attrs["out"]
    v.dtype(f"{f}.output", out, (odt,))
    if odt == "int32":  # the raw 32-bit sums of the products: no epilogue, no zero points
        v.consts(f, consts, weight, set())
        extra = sorted((set(_REQUANT) | {"rounding"}) & attrs.keys())
        if extra:
            fail(f"{f}.attrs", f"{extra} belong to a requantizing epilogue, output is int32")
        for key in ("x_zero", "b_zero"):
            if attrs.get(key, 0) != 0:
                fail(f"{f}.attrs.{key}", f"an int32 output is the raw sums: zero points must be 0, got {attrs[key]}")
        if attrs["relu"]:
            fail(f"{f}.attrs.relu", "an int32 output is the raw sums: no ReLU")
        return
    if odt == "float32":
        v.consts(f, consts, weight | {"scale"}, {"bias", "w_zero"})
        if (set(_REQUANT) | {"rounding"}) & attrs.keys():
            fail(f"{f}.attrs", f"y_zero/y_min/y_max belong to a requantizing epilogue, output is {odt}")
        roles = {"scale": "float32", "bias": "float32"}
    else:
        v.consts(f, consts, weight | {"bias_q", "multiplier", "shift"}, {"w_zero"})
        missing = sorted(set(_REQUANT) - attrs.keys())
        if missing:
            fail(f"{f}.attrs", f"missing key(s) {missing} of the requantizing epilogue")
        lo, hi = _QRANGE[odt]
        if not lo <= attrs["y_min"] <= attrs["y_max"] <= hi or not lo <= attrs["y_zero"] <= hi:
            fail(f"{f}.attrs.y_min", f"y_zero/y_min/y_max must lie in [{lo}, {hi}] with y_min <= y_max")
        roles = {"bias_q": "int32", "multiplier": "int32", "shift": "int32"}
    roles["w_zero"] = "int32"
    for role, dtype in roles.items():
        if role in consts:
            v.dtype(f"{f}.consts.{role}", consts[role], (dtype,))
            v.shape(f"{f}.consts.{role}", consts[role], [channels])
    if odt != "float32":
        # Fixed-point multiplier ranges of program/quant.py: a shift outside [1, 62] makes
        # the rounding term 1 << (shift - 1) negative or the shift exceed the int64 width.
        v.values(f"{f}.consts.multiplier", consts["multiplier"], 0, (1 << 31) - 1)
        v.values(f"{f}.consts.shift", consts["shift"], 1, 62)
