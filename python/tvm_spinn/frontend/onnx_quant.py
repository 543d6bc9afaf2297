"""Quantized ONNX models: QOperator -> QDQ expansion and quantization-scheme checks.

Two entry points, both working on an ``onnx.ModelProto`` before the Relax import:

* :func:`expand_qlinear` (registered as the ONNX pass ``"expand_qlinear"`` in
  :mod:`.onnx_passes`) rewrites QOperator-format nodes (``QLinearConv``, ``QLinearMatMul`` and
  the ``com.microsoft`` ``QLinearAdd``/``QLinearMul``/``QLinearGlobalAveragePool``/
  ``QLinearAveragePool``/``QLinearConcat``/``QLinearSigmoid``/``QLinearLeakyRelu``/
  ``QLinearSoftmax``/``QLinearReduceMean``/``QGemm`` that ``onnxruntime.quantization`` writes) into
  the QDQ form ``DequantizeLinear -> float op -> QuantizeLinear``, which TVM's importer
  understands (``relax.dequantize``/``relax.quantize``).  Weights stay int8/uint8 initializers
  behind a ``DequantizeLinear`` so that the spinn int8 matcher sees
  ``conv2d(dequantize(xq), dequantize(Wq))``.
* :func:`check_quant_schemes` lists every Q/DQ/QLinear node whose quantization scheme the spinn
  flow does not support (quantized types other than int8/uint8 -- int32 only for a dequantized
  bias --, blocked quantization, ``precision``); :func:`tvm_spinn.frontend.from_onnx` raises one
  :class:`~tvm_spinn.frontend.OnnxImportError` from it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .onnx_graph import (PassResult, _attrs, _constants, _consumers, _copy, _eliminate_dead,
                          _elem_types, _opset, _partial_shapes, _plural, _producers,
                          _replace_nodes, _unique_name)

__all__ = ["expand_qlinear", "simplify_qdq", "check_quant_schemes", "EXPANDABLE_OPS"]

_INT8 = (TensorProto.INT8, TensorProto.UINT8)
# Stand-alone int16/uint16 QuantizeLinear/DequantizeLinear import (TVM legalizes them) and run on
# the fallback target; only int8/uint8 reach the MAC arrays (the partitioner logs the reason).
_QDQ_TYPES = _INT8 + (TensorProto.INT16, TensorProto.UINT16)
_MS = "com.microsoft"

# op -> (domains, quantized input slots that must be int8/uint8)
_QUANT_SLOTS: Dict[str, Tuple[Tuple[str, ...], Tuple[int, ...]]] = {
    "QLinearConv": (("", "ai.onnx", _MS), (0, 2, 3, 5, 7)),
    "QLinearMatMul": (("", "ai.onnx"), (0, 2, 3, 5, 7)),
    "QLinearAdd": ((_MS,), (0, 2, 3, 5, 7)),
    "QLinearMul": ((_MS,), (0, 2, 3, 5, 7)),
    "QLinearGlobalAveragePool": ((_MS,), (0, 2, 4)),
    "QLinearAveragePool": ((_MS,), (0, 2, 4)),
    "QLinearSigmoid": ((_MS,), (0, 2, 4)),
    "QLinearLeakyRelu": ((_MS,), (0, 2, 4)),
    "QLinearSoftmax": ((_MS,), (0, 2, 4)),
    "QLinearReduceMean": ((_MS,), (0, 2, 4)),
    "QGemm": ((_MS,), (0, 2, 3, 5, 8)),
    "QLinearConcat": ((_MS,), (1,)),  # + every (X, X_zero_point) of the input triples
}

#: Domain-qualified op names :func:`expand_qlinear` rewrites (``"QLinearConv"``,
#: ``"com.microsoft.QLinearAdd"``, ...); the front-end's unsupported-op check accepts them when
#: the pass runs.
EXPANDABLE_OPS = frozenset(
    (op if d in ("", "ai.onnx") else f"{d}.{op}")
    for op, (domains, _) in _QUANT_SLOTS.items() for d in domains)


def _is_qlinear(node: onnx.NodeProto) -> bool:
    spec = _QUANT_SLOTS.get(node.op_type)
    return spec is not None and (node.domain or "") in spec[0]


def _inp(node: onnx.NodeProto, k: int) -> str:
    return node.input[k] if len(node.input) > k else ""


# --------------------------------------------------------------------------
# expand_qlinear
# --------------------------------------------------------------------------


class _Expander:
    """Emits the QDQ replacement of one node at a time, tracking names, constants and types."""

    def __init__(self, graph: onnx.GraphProto, opset: int):
        self.g = graph
        self.opset = opset
        self.consts = {k: v for k, v in _constants(graph).items()
                       if k not in {i.name for i in graph.input}}
        self.shapes = _partial_shapes(graph)
        self.types = _elem_types(graph)
        for k, v in self.consts.items():
            self.types.setdefault(k, helper.np_dtype_to_tensor_dtype(v.dtype))
        self.taken: Set[str] = ({t.name for t in graph.initializer} | {i.name for i in graph.input}
                                | {o for n in graph.node for o in n.output}
                                | {v.name for v in graph.value_info} | {""})
        self.nodes: List[onnx.NodeProto] = []

    # ---- naming / constants
    def name(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def const(self, value: np.ndarray, base: str) -> str:
        name = self.name(base)
        value = np.asarray(value)
        self.g.initializer.append(numpy_helper.from_array(value, name))
        self.consts[name] = value
        self.types[name] = helper.np_dtype_to_tensor_dtype(value.dtype)
        return name

    def node(self, op: str, inputs: Sequence[str], outputs: Sequence[str], name: str,
             **attrs) -> None:
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), name=name,
                                           **{k: v for k, v in attrs.items() if v is not None}))

    def shape(self, name: str) -> Optional[List[Optional[int]]]:
        if name in self.consts:
            return list(self.consts[name].shape)
        return self.shapes.get(name)

    def rank(self, name: str) -> Optional[int]:
        s = self.shape(name)
        return None if s is None else len(s)

    # ---- scale / zero point handling
    def _channels(self, scale: str) -> Optional[int]:
        """Number of per-axis channels of a scale (None: per-tensor)."""
        s = self.shape(scale)
        if s is None or len(s) == 0:
            return None
        if len(s) == 1 and s[0] is not None and s[0] > 1:
            return s[0]
        if len(s) == 1 and s[0] == 1:
            return None
        raise _Skip(f"scale {scale!r} has unsupported shape {s}")

    def _scalar(self, name: str, base: str) -> str:
        """A rank-0 version of a one-element tensor (constants re-stored, others reshaped)."""
        s = self.shape(name)
        if s is not None and len(s) == 0:
            return name
        if name in self.consts:
            return self.const(self.consts[name].reshape(()), base)
        shape = self.const(np.zeros((0,), np.int64), base + "_shape")
        out = self.name(base)
        self.node("Reshape", [name, shape], [out], self.name(base + "_reshape"))
        self.types[out] = self.types.get(name, 0)
        self.shapes[out] = []
        return out

    def _float32(self, name: str, base: str) -> str:
        """Scales in float32: the expanded float ops then compute in float32 even when the
        model stores float16 scales (QLinearMatMul allows them), closer to the integer kernels."""
        t = self.types.get(name)
        if name in self.consts:
            v = self.consts[name]
            return name if v.dtype == np.float32 else self.const(v.astype(np.float32), base)
        if t is None or t == TensorProto.FLOAT:
            return name
        out = self.name(base + "_f32")
        self.node("Cast", [name], [out], self.name(base + "_cast"), to=TensorProto.FLOAT)
        self.types[out] = TensorProto.FLOAT
        if name in self.shapes:
            self.shapes[out] = self.shapes[name]
        return out

    def qparams(self, scale: str, zp: str, base: str,
                zp_type: Optional[int] = None) -> Tuple[str, str, Optional[int]]:
        """Normalized (scale, zero point, channels) for a Q/DQ node.

        Per-tensor parameters become scalars; per-axis zero points are broadcast to the scale's
        length (QLinear ops allow a scalar zero point with a per-channel scale, Q/DQ do not).
        A missing zero point is materialised as 0 of ``zp_type`` when that type is given.
        """
        channels = self._channels(scale)
        if channels is None:
            scale = self._scalar(scale, base + "_scale")
        scale = self._float32(scale, base + "_scale")
        if not zp and zp_type is not None:
            dtype = helper.tensor_dtype_to_np_dtype(zp_type)
            zp = self.const(np.zeros((channels,) if channels else (), dtype), base + "_zero_point")
        elif zp:
            zs = self.shape(zp)
            zn = None if zs is None else int(np.prod([d or 0 for d in zs])) if zs else 1
            if channels is None:
                if zs is None or zn != 1:
                    raise _Skip(f"zero point {zp!r} has shape {zs} but the scale is per-tensor")
                zp = self._scalar(zp, base + "_zero_point")
            elif zn != channels or len(zs) != 1:
                if zn != 1 or zp not in self.consts:
                    raise _Skip(f"zero point {zp!r} of shape {zs} does not match "
                                f"{channels} channels")
                v = self.consts[zp].reshape(())
                zp = self.const(np.full((channels,), v, v.dtype), base + "_zero_point")
        return scale, zp, channels

    def dq(self, x: str, scale: str, zp: str, base: str, axis: Optional[int] = None) -> str:
        scale, zp, channels = self.qparams(scale, zp, base)
        out = self.name(base + "_dq")
        ins = [x, scale] + ([zp] if zp else [])
        self.node("DequantizeLinear", ins, [out], self.name(base + "_DequantizeLinear"),
                  axis=axis if channels else None)
        self.types[out] = TensorProto.FLOAT
        return out

    def q(self, y: str, scale: str, zp: str, out: str, base: str, qtype: Optional[int],
          axis: Optional[int] = None) -> None:
        scale, zp, channels = self.qparams(scale, zp, base, zp_type=qtype)
        ins = [y, scale] + ([zp] if zp else [])
        self.node("QuantizeLinear", ins, [out], self.name(base + "_QuantizeLinear"),
                  axis=axis if channels else None)
        self.types[out] = self.types.get(zp, TensorProto.UINT8) if zp else TensorProto.UINT8

    def qtype(self, *names: str) -> Optional[int]:
        for n in names:
            if n and self.types.get(n) in _INT8:
                return self.types[n]
        return None

    def mul_scales(self, a: str, b: str, base: str) -> str:
        """``a * b`` as a float32 initializer when both are constant, else a Mul node."""
        if a in self.consts and b in self.consts:
            va, vb = self.consts[a].astype(np.float32), self.consts[b].astype(np.float32)
            if va.size == 1:
                va = va.reshape(())
            if vb.size == 1:
                vb = vb.reshape(())
            return self.const((va * vb).astype(np.float32), base)
        out = self.name(base)
        self.node("Mul", [a, b], [out], self.name(base + "_mul"))
        sa, sb = self.shape(a), self.shape(b)
        if sa is not None and sb is not None:
            self.shapes[out] = list(np.broadcast_shapes(tuple(d or 1 for d in sa),
                                                        tuple(d or 1 for d in sb)))
        self.types[out] = TensorProto.FLOAT
        return out

    def bias(self, b: str, x_scale: str, w_scale: str, base: str, axis: int = 0) -> str:
        """Dequantize an int32 bias with scale ``x_scale * w_scale`` and zero point 0."""
        scale = self.mul_scales(x_scale, w_scale, base + "_scale")
        channels = self._channels(scale)
        zp = self.const(np.zeros((channels,) if channels else (), np.int32), base + "_zero_point")
        if channels is None:
            scale = self._scalar(scale, base + "_scale")
        out = self.name(base + "_dq")
        self.node("DequantizeLinear", [b, scale, zp], [out],
                  self.name(base + "_DequantizeLinear"), axis=axis if channels else None)
        self.types[out] = TensorProto.FLOAT
        return out


class _Skip(Exception):
    """The node cannot be expanded (reason in the message); it is left as is."""


def _axis_from_end(ex: _Expander, name: str, k: int) -> int:
    """Axis ``rank - k`` of ``name`` (``-k`` when the rank is unknown)."""
    r = ex.rank(name)
    return -k if r is None else r - k


def _expand_node(ex: _Expander, node: onnx.NodeProto) -> None:
    op, base = node.op_type, node.name or node.output[0]
    a = _attrs(node)
    i = lambda k: _inp(node, k)  # noqa: E731
    out = node.output[0]
    if a.get("channels_last", 0):
        raise _Skip("channels_last=1 is not supported")

    if op == "QLinearConv":
        x = ex.dq(i(0), i(1), i(2), base + "_x")
        w = ex.dq(i(3), i(4), i(5), base + "_w", axis=0)
        ins = [x, w]
        if i(8):
            ins.append(ex.bias(i(8), i(1), i(4), base + "_bias", axis=0))
        y = ex.name(base + "_y")
        conv_attrs = {k: v for k, v in a.items() if k != "channels_last"}
        ex.node("Conv", ins, [y], ex.name(base + "_conv"), **conv_attrs)
        ex.q(y, i(6), i(7), out, base + "_y", ex.qtype(i(7), i(0)))
        return
    if op == "QLinearMatMul":
        ra = ex.rank(i(0))
        # per-row a/y scales (1-D, size M) quantize axis rank-2; per-column b axis rank-1
        x = ex.dq(i(0), i(1), i(2), base + "_a", axis=_axis_from_end(ex, i(0), 2))
        w = ex.dq(i(3), i(4), i(5), base + "_b", axis=_axis_from_end(ex, i(3), 1))
        y = ex.name(base + "_y")
        ex.node("MatMul", [x, w], [y], ex.name(base + "_matmul"))
        rb = ex.rank(i(3))
        ry = None if ra is None or rb is None else max(ra, rb)
        ex.q(y, i(6), i(7), out, base + "_y", ex.qtype(i(7), i(0)),
             axis=-2 if ry is None else ry - 2)
        return
    if op == "QGemm":
        trans_b = a.get("transB", 0)
        alpha = float(a.get("alpha", 1.0))
        x = ex.dq(i(0), i(1), i(2), base + "_a")
        w = ex.dq(i(3), i(4), i(5), base + "_b", axis=0 if trans_b else 1)
        ins = [x, w]
        if i(6):
            # C is int32 in units of a_scale * b_scale, added to the accumulator before alpha:
            # Y = alpha * (A'B' + C')  ==  Gemm(A', B', C', alpha, beta=alpha)
            rc = ex.rank(i(6))
            ins.append(ex.bias(i(6), i(1), i(4), base + "_bias", axis=0 if rc == 1 else 1))
        y = ex.name(base + "_y") if i(7) else out
        ex.node("Gemm", ins, [y], ex.name(base + "_gemm"), alpha=alpha if alpha != 1.0 else None,
                beta=alpha if (alpha != 1.0 and i(6)) else None,
                transA=a.get("transA") or None, transB=trans_b or None)
        if i(7):
            ex.q(y, i(7), i(8), out, base + "_y", ex.qtype(i(8), i(0)))
        else:
            ex.types[out] = TensorProto.FLOAT
        return
    if op in ("QLinearAdd", "QLinearMul"):
        qt = ex.qtype(i(0), i(2), i(3), i(5), i(7))
        xa = ex.dq(i(0), i(1), i(2), base + "_a")
        xb = ex.dq(i(3), i(4), i(5), base + "_b")
        y = ex.name(base + "_y")
        ex.node(op[len("QLinear"):], [xa, xb], [y], ex.name(base + "_" + op[7:].lower()))
        ex.q(y, i(6), i(7), out, base + "_y", qt)
        return
    if op == "QLinearConcat":
        triples = list(node.input[2:])
        if len(triples) % 3:
            raise _Skip("QLinearConcat inputs are not (X, scale, zero point) triples")
        qt = ex.qtype(i(1), *triples[0::3], *triples[2::3])
        xs = []
        for k in range(0, len(triples), 3):
            t, s, z = triples[k:k + 3]
            if ex.types.get(t) == TensorProto.FLOAT:
                xs.append(t)  # a float input of a QLinearConcat is taken as is
            else:
                xs.append(ex.dq(t, s, z, f"{base}_in{k // 3}"))
        y = ex.name(base + "_y")
        ex.node("Concat", xs, [y], ex.name(base + "_concat"), axis=a["axis"])
        ex.q(y, i(0), i(1), out, base + "_y", qt)
        return
    # unary ops: (X, X_scale, X_zp, Y_scale, Y_zp)
    float_op = {"QLinearGlobalAveragePool": "GlobalAveragePool",
                "QLinearAveragePool": "AveragePool", "QLinearSigmoid": "Sigmoid",
                "QLinearLeakyRelu": "LeakyRelu", "QLinearSoftmax": "Softmax",
                "QLinearReduceMean": "ReduceMean"}[op]
    attrs = {k: v for k, v in a.items() if k != "channels_last"}
    extra_inputs = []
    if op == "QLinearSoftmax":
        axis = attrs.get("axis", -1)
        rank = ex.rank(i(0))
        # opset < 13 Softmax flattens from `axis`: the same as per-axis only for the last axis
        if attrs.pop("opset", 13) < 13 and not (axis == -1 or (rank and axis == rank - 1)):
            raise _Skip("QLinearSoftmax with opset < 13 semantics on a non-last axis")
        attrs = {"axis": axis}
    if op == "QLinearReduceMean" and ex.opset >= 18 and "axes" in attrs:
        extra_inputs = [ex.const(np.asarray(attrs.pop("axes"), np.int64), base + "_axes")]
    qt = ex.qtype(i(0), i(2), i(4))
    x = ex.dq(i(0), i(1), i(2), base + "_x")
    y = ex.name(base + "_y")
    ex.node(float_op, [x] + extra_inputs, [y], ex.name(base + "_" + float_op.lower()), **attrs)
    ex.q(y, i(3), i(4), out, base + "_y", qt)


def expand_qlinear(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Rewrite QOperator-format nodes into ``DequantizeLinear -> float op -> QuantizeLinear``.

    * ``QLinearConv(x, xs, xz, w, ws, wz, ys, yz[, B])`` -> ``DQ(x)``, ``DQ(w, axis=0)``
      (per-channel when ``ws`` has more than one element), ``DQ(B, xs*ws, 0, axis=0)`` (the
      product stored as a new float32 initializer), ``Conv`` (same attributes), ``Q(y, ys, yz)``.
    * ``QLinearMatMul(a, as, az, b, bs, bz, ys, yz)`` -> ``DQ(a)``, ``DQ(b)`` (per column, axis
      ``rank(b)-1``, when ``bs`` is 1-D), ``MatMul``, ``Q(y)``.
    * ``com.microsoft`` ops written by ``onnxruntime.quantization`` in QOperator format:
      ``QLinearAdd``/``QLinearMul``/``QLinearConcat``/``QLinearGlobalAveragePool``/
      ``QLinearAveragePool``/``QLinearSigmoid``/``QLinearLeakyRelu``/``QLinearSoftmax``/
      ``QLinearReduceMean`` (DQ inputs, float op, Q output) and ``QGemm`` (as ``Gemm`` with the
      int32 ``C`` dequantized like a Conv bias; float output when ``y_scale`` is absent).

    Quantized tensors (weights included) stay int8/uint8; only their interpretation moves into
    explicit Q/DQ nodes.  Nodes that cannot be expanded (``channels_last=1``, odd scale shapes)
    are left unchanged and named in the pass detail.  When something changed, shape inference
    runs again so that later passes see the new float tensors' shapes.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified).

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Rewritten model and pass result.
    """
    new = _copy(model)
    g = new.graph
    if not any(_is_qlinear(n) for n in g.node):
        return new, PassResult("expand_qlinear", False, "no QLinear* nodes")
    ex = _Expander(g, _opset(new))
    counts: Dict[str, int] = {}
    skipped: List[str] = []
    for node in list(g.node):
        if not _is_qlinear(node):
            ex.nodes.append(node)
            continue
        mark = len(ex.nodes)
        try:
            _expand_node(ex, node)
        except _Skip as why:
            del ex.nodes[mark:]
            ex.nodes.append(node)
            skipped.append(f"{node.name or node.output[0]} ({node.op_type}: {why})")
            continue
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    if not counts:  # (drop the initializers the failed attempts added)
        return _copy(model), PassResult("expand_qlinear", False, "kept " + "; ".join(skipped))
    _replace_nodes(g, ex.nodes)
    _eliminate_dead(g)
    if not any(n.domain == _MS for n in g.node):
        keep = [o for o in new.opset_import if o.domain != _MS]
        if len(keep) != len(new.opset_import):
            copies = [onnx.OperatorSetIdProto() for _ in keep]
            for c, o in zip(copies, keep):
                c.CopyFrom(o)
            del new.opset_import[:]
            new.opset_import.extend(copies)
    new = onnx.shape_inference.infer_shapes(new, data_prop=True)
    detail = "expanded " + ", ".join(_plural(c, f"{op} node") for op, c in sorted(counts.items()))
    if skipped:
        detail += "; kept " + "; ".join(skipped)
    return new, PassResult("expand_qlinear", True, detail)


# --------------------------------------------------------------------------
# simplify_qdq
# --------------------------------------------------------------------------


def _is_std(node: onnx.NodeProto, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def simplify_qdq(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Normalise QDQ graphs so a producer's ``[relu] [quantize]`` epilogue is adjacent to it.

    * ``QuantizeLinear``/``DequantizeLinear`` scales and zero points that are constant
      one-element 1-D tensors (onnxruntime writes bias scales as ``[1]``) become scalars.
    * ``y -> Q(s, z) -> DQ(s, z) -> Relu -> Q(s, z)`` (identical constant per-tensor parameters,
      single consumers; what onnxruntime writes for ``Conv+Relu`` with symmetric activations)
      becomes ``y -> Relu -> Q(s, z)``.  This is exact: 0 is on the quantization grid, so
      ``Q(relu(DQ(Q(y)))) == Q(relu(y))`` for every ``y`` (saturation included).  With
      asymmetric activations onnxruntime already drops the Relu (``Q`` with ``z = qmin``
      clamps at 0).

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified).

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Rewritten model and pass result.
    """
    new = _copy(model)
    g = new.graph
    qdq = [n for n in g.node if _is_std(n, "QuantizeLinear") or _is_std(n, "DequantizeLinear")]
    if not qdq:
        return new, PassResult("simplify_qdq", False, "no QuantizeLinear/DequantizeLinear")
    overridable = {i.name for i in g.input}
    consts = {k: v for k, v in _constants(g).items() if k not in overridable}

    # 1. one-element 1-D scale/zero point -> scalar
    scalars: Dict[str, str] = {}
    n_scalar = 0
    from .onnx_graph import _taken_names  # (names built once: linear in the scalar count)

    taken = _taken_names(g)
    for n in qdq:
        params = [k for k in (1, 2) if _inp(n, k) in consts]
        if len(params) != len([k for k in (1, 2) if _inp(n, k)]):
            continue  # a non-constant parameter: leave the node alone
        if not params or any(consts[_inp(n, k)].size != 1 for k in params):
            continue
        vector = [k for k in params if consts[_inp(n, k)].shape == (1,)]
        if not vector:
            continue
        for k in vector:
            old = n.input[k]
            if old not in scalars:
                scalars[old] = _unique_name(g, old + "_scalar", taken)
                g.initializer.append(numpy_helper.from_array(consts[old].reshape(()),
                                                             scalars[old]))
                consts[scalars[old]] = consts[old].reshape(())
            n.input[k] = scalars[old]
        n_scalar += 1

    # 2. Q -> DQ -> Relu -> Q with identical parameters -> Relu -> Q
    def same_params(x: onnx.NodeProto, y: onnx.NodeProto) -> bool:
        for k in (1, 2):
            a_name, b_name = _inp(x, k), _inp(y, k)
            if not a_name and not b_name:
                continue
            if a_name not in consts or b_name not in consts:
                return False
            va, vb = consts[a_name], consts[b_name]
            if (va.size != 1 or vb.size != 1 or va.dtype != vb.dtype
                    or va.ravel()[0] != vb.ravel()[0]):
                return False
        return True

    graph_outputs = {o.name for o in g.output}
    cons = _consumers(g)
    prods = _producers(g)
    removed: List[onnx.NodeProto] = []
    for relu in g.node:
        if not _is_std(relu, "Relu"):
            continue
        dq = prods.get(relu.input[0])
        q1 = prods.get(dq.input[0]) if _is_std(dq, "DequantizeLinear") else None
        users = cons.get(relu.output[0], [])
        if not _is_std(q1, "QuantizeLinear") or len(users) != 1:
            continue
        q2 = users[0]
        if not _is_std(q2, "QuantizeLinear") or q2.input[0] != relu.output[0]:
            continue
        if any(len(cons.get(v, [])) != 1 or v in graph_outputs
               for v in (q1.output[0], dq.output[0], relu.output[0])):
            continue
        if any(_attrs(n).get("block_size", 0) or _attrs(n).get("output_dtype", 0)
               for n in (q1, dq, q2)):
            continue
        if not (same_params(q1, dq) and same_params(q1, q2)):
            continue
        relu.input[0] = q1.input[0]
        removed += [q1, dq]
    if removed:
        gone = {id(r) for r in removed}
        _replace_nodes(g, [n for n in g.node if id(n) not in gone])
    if not n_scalar and not removed:
        return new, PassResult("simplify_qdq", False, "nothing to simplify")
    _eliminate_dead(g)
    parts = []
    if n_scalar:
        parts.append(f"scalar scale/zero point in {_plural(n_scalar, 'Q/DQ node')}")
    if removed:
        parts.append(f"removed {_plural(len(removed) // 2, 'Q/DQ pair')} before Relu")
    return new, PassResult("simplify_qdq", True, "; ".join(parts))


# --------------------------------------------------------------------------
# check_quant_schemes
# --------------------------------------------------------------------------

_BIAS_CONSUMERS = {("Conv", 2), ("ConvTranspose", 2), ("Gemm", 2)}


def _type_name(t: int) -> str:
    try:
        return TensorProto.DataType.Name(t).lower()
    except ValueError:
        return f"type {t}"


def _model_types(model: onnx.ModelProto) -> Dict[str, int]:
    """Element types of every value we can find (declared, inferred and constant)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # an invalid model: use what is declared
        inferred = model
    types = _elem_types(inferred.graph)
    for k, v in _constants(model.graph).items():
        types.setdefault(k, helper.np_dtype_to_tensor_dtype(v.dtype))
    return types


def check_quant_schemes(model: onnx.ModelProto) -> List[str]:
    """Describe every quantization scheme in ``model`` that the importer does not support.

    Supported: ``QuantizeLinear``/``DequantizeLinear``/QLinear* nodes whose quantized tensors are
    int8 or uint8 (per-tensor or per-axis, any zero point), and int32 ``DequantizeLinear`` of a
    constant bias (read by a ``Conv``/``ConvTranspose``/``Gemm`` bias input or an ``Add``).
    int16/uint16 ``QuantizeLinear``/``DequantizeLinear`` are accepted (they run on the fallback
    target). Everything else -- int4/uint4/int32 activations, float8/float4 types, blocked
    quantization (``block_size`` != 0), a non-default ``precision`` -- is reported.

    Parameters
    ----------
    model : onnx.ModelProto
        The model (main graph; not modified).

    Returns
    -------
    list of str
        One message per offending node, naming node, op and scheme (empty when all is fine).
    """
    g = model.graph
    relevant = [n for n in g.node
                if (n.op_type in ("QuantizeLinear", "DequantizeLinear")
                    and n.domain in ("", "ai.onnx")) or _is_qlinear(n)]
    if not relevant:
        return []
    types = _model_types(model)
    consts = set(_constants(g)) - {i.name for i in g.input}
    consumers: Dict[str, List[Tuple[onnx.NodeProto, int]]] = {}
    for n in g.node:
        for k, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, k))
    graph_outputs = {o.name for o in g.output}
    problems = []

    def label(n):
        return f"{n.op_type} node '{n.name or n.output[0]}'"

    for n in relevant:
        a = _attrs(n)
        issues = []
        if a.get("block_size", 0):
            issues.append(f"uses blocked quantization (block_size={a['block_size']}), "
                          "which is not supported")
        if a.get("precision", 0):
            issues.append(f"uses precision={_type_name(a['precision'])}, which is not supported")
        if n.op_type == "QuantizeLinear":
            t = a.get("output_dtype") or types.get(_inp(n, 2)) or (
                None if _inp(n, 2) else TensorProto.UINT8)
            t = t or types.get(n.output[0])
            if t is not None and t not in _QDQ_TYPES:
                issues.append(f"quantizes to {_type_name(t)} (only int8/uint8, and int16/uint16 on the "
                              "fallback target, are supported)")
        elif n.op_type == "DequantizeLinear":
            t = types.get(n.input[0]) or types.get(_inp(n, 2))
            if t == TensorProto.INT32:
                uses = consumers.get(n.output[0], [])
                is_bias = (n.input[0] in consts and uses and n.output[0] not in graph_outputs
                           and all((c.op_type, k) in _BIAS_CONSUMERS or c.op_type == "Add"
                                   for c, k in uses))
                if not is_bias:
                    issues.append("dequantizes int32 that is not a constant Conv/Gemm/Add bias "
                                  "(int32 is only supported for biases)")
            elif t is not None and t not in _QDQ_TYPES:
                issues.append(f"dequantizes {_type_name(t)} (only int8/uint8, int16/uint16 on the "
                              "fallback target, and int32 for biases, are supported)")
        else:
            slots = list(_QUANT_SLOTS[n.op_type][1])
            if n.op_type == "QLinearConcat":
                slots += [k for k in range(2, len(n.input)) if (k - 2) % 3 != 1]
            bad = sorted({types[_inp(n, k)] for k in slots
                          if _inp(n, k) and types.get(_inp(n, k)) not in (None,) + _INT8
                          and not (n.op_type == "QLinearConcat"
                                   and types.get(_inp(n, k)) == TensorProto.FLOAT)})
            if bad:
                issues.append("has quantized inputs of type "
                              + "/".join(_type_name(t) for t in bad)
                              + " (only int8/uint8 are supported)")
        for issue in issues:
            problems.append(f"{label(n)} {issue}")
    return problems
