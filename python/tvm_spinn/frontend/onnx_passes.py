"""ONNX-level graph transformation passes run before the TVM Relax import.

Every pass is a function ``ModelProto -> (ModelProto, PassResult)`` that never
mutates its input (it works on a deep copy).  :func:`run_passes` chains them.

The passes exist mainly to make the Relax ONNX importer's life easier: shape
computation subgraphs (``Shape -> Gather -> Concat -> Reshape``, ``Split`` with
computed sizes, ...) are folded into constants so that the importer sees static
shapes, and a few common patterns (BatchNorm after Conv, transposed Gemm
weights, MatMul+Add) are canonicalised.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

__all__ = [
    "PassResult",
    "DEFAULT_PASSES",
    "PASSES",
    "run_passes",
    "upgrade_opset",
    "shape_inference",
    "expand_qlinear",
    "simplify_qdq",
    "remove_identity",
    "fold_constants",
    "fold_batchnorm",
    "canonicalize_gemm",
    "freeze_inputs",
]

TARGET_OPSET = 13

DEFAULT_PASSES = (
    "upgrade_opset",
    "shape_inference",
    "expand_qlinear",
    "simplify_qdq",
    "remove_identity",
    "fold_constants",
    "fold_batchnorm",
    "canonicalize_gemm",
    "shape_inference",
)

# Ops that may create large tensors from tiny inputs: their output size is inferred before
# they are evaluated.  No folded value may exceed this many elements unless its inputs
# together have as many.
_EXPANDING_OPS = {"ConstantOfShape", "Expand", "Range", "Tile", "Pad"}
_MAX_EXPANDED_ELEMS = 1 << 20


from .onnx_graph import (
    PassResult,
    _copy,
    _opset,
    _attrs,
    _del_attr,
    _node_uses,
    _consumers,
    _producers,
    _resolve_uses,
    _taken_names,
    _unique_name,
    _constant_node_value,
    _constants,
    _static_shapes,
    _partial_shapes,
    _shape_value,
    _fold_gather_of_shape,
    _elem_types,
    _eliminate_dead,
    _replace_nodes,
    _replace_repeated,
    _plural,
)


# --------------------------------------------------------------------------
# upgrade_opset / shape_inference
# --------------------------------------------------------------------------


def upgrade_opset(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Convert models with a default-domain opset below 13 to opset 13.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified).

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Converted model and pass result.

    Raises
    ------
    ValueError
        If the ONNX version converter fails.
    """
    version = _opset(model)
    if version == 0 or version >= TARGET_OPSET:
        return _copy(model), PassResult("upgrade_opset", False, f"opset {version} kept")
    try:
        new = onnx.version_converter.convert_version(_copy(model), TARGET_OPSET)
    except Exception as err:  # converter raises assorted error types
        raise ValueError(
            f"upgrade_opset: failed to convert model from opset {version} to "
            f"opset {TARGET_OPSET}: {err}"
        ) from err
    return new, PassResult("upgrade_opset", True, f"opset {version} -> {TARGET_OPSET}")


def shape_inference(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Run ONNX shape inference with data propagation.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified).

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Model with populated ``value_info`` and pass result.
    """
    before = {v.SerializeToString() for v in model.graph.value_info}
    before |= {v.SerializeToString() for v in model.graph.output}
    new = onnx.shape_inference.infer_shapes(_copy(model), data_prop=True)
    after = {v.SerializeToString() for v in new.graph.value_info}
    after |= {v.SerializeToString() for v in new.graph.output}
    changed = before != after
    detail = f"{len(new.graph.value_info)} value_info entries"
    if changed:
        detail += f" ({len(new.graph.value_info) - len(model.graph.value_info):+d})"
    return new, PassResult("shape_inference", changed, detail)


# --------------------------------------------------------------------------
# expand_qlinear (implemented in onnx_quant, which imports this module's helpers)
# --------------------------------------------------------------------------


def expand_qlinear(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Rewrite QOperator nodes (``QLinearConv``, ``QLinearMatMul``, ORT's ``com.microsoft``
    ``QLinear*``/``QGemm``) into ``DequantizeLinear -> float op -> QuantizeLinear``.

    See :func:`tvm_spinn.frontend.onnx_quant.expand_qlinear`.
    """
    from .onnx_quant import expand_qlinear as _expand

    return _expand(model)


def simplify_qdq(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Scalar one-element Q/DQ parameters; ``Q -> DQ -> Relu -> Q`` (same parameters) becomes
    ``Relu -> Q`` (exact).

    See :func:`tvm_spinn.frontend.onnx_quant.simplify_qdq`.
    """
    from .onnx_quant import simplify_qdq as _simplify

    return _simplify(model)


# --------------------------------------------------------------------------
# remove_identity
# --------------------------------------------------------------------------


def _is_passthrough(node: onnx.NodeProto, graph_outputs: Set[str], cons, consts) -> bool:
    if node.domain not in ("", "ai.onnx") or not node.input or not node.input[0]:
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type != "Dropout":
        return False
    # The mask output must be absent or unused.
    if len(node.output) > 1 and node.output[1]:
        mask = node.output[1]
        if mask in graph_outputs or cons.get(mask):
            return False
    # training_mode (opset >= 12) must be absent or constant false.
    if len(node.input) > 2 and node.input[2]:
        tm = consts.get(node.input[2])
        if tm is None or bool(np.asarray(tm).any()):
            return False
    if _attrs(node).get("is_test", 1) == 0:  # opset < 7 training mode
        return False
    return True


def remove_identity(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Remove ``Identity`` and inference-mode ``Dropout`` nodes.

    Consumers are rewired to the node input.  When the node output is a graph
    output, the producer's output is renamed instead so graph output names stay
    stable; if that is impossible (input is a graph input, initializer or
    another graph output) the node is kept.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified).

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Rewritten model and pass result.
    """
    import heapq

    new = _copy(model)
    g = new.graph
    graph_outputs = {o.name for o in g.output}
    graph_inputs = {i.name for i in g.input} | {t.name for t in g.initializer}
    consts = _constants(g)
    counts: Dict[str, int] = {}
    # One forward sweep removes every node the old "remove the first removable node, rebuild
    # all maps, restart" loop removed, in the same order: removing a node never makes an
    # earlier node removable, except a Dropout whose mask only fed a removed node, hence the
    # (rare) extra sweeps.  Renames are recorded in ``alias`` and applied once at the end,
    # so the pass is linear in the graph size.
    alias: Dict[str, str] = {}
    drop_vi: Set[str] = set()

    def resolve(name: str) -> str:
        root = name
        while root in alias:
            root = alias[root]
        while name in alias and alias[name] != root:  # path compression
            alias[name], name = root, alias[name]
        return root

    def try_remove(node: onnx.NodeProto) -> bool:
        for k, i in enumerate(node.input):
            if i in alias:
                node.input[k] = resolve(i)
        if not _is_passthrough(node, graph_outputs, ncons, consts):
            if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1]:
                mask_owner[node.output[1]] = node
            return False
        src, dst = node.input[0], node.output[0]
        if dst not in graph_outputs:
            alias[dst] = src
            merged, keep_name = dst, src
        else:
            producer = prods.get(src)
            if producer is None or src in graph_outputs or src in graph_inputs:
                return False  # must keep: cannot rename a graph input/initializer
            for k, o in enumerate(producer.output):
                if o == src:
                    producer.output[k] = dst
            del prods[src]
            prods[dst] = producer
            alias[src] = dst
            # value_info of src (renamed to dst) and of dst (the graph output has it)
            drop_vi.update((src, dst))
            merged, keep_name = src, dst
        removed.add(id(node))
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        for name in _node_uses(node):
            name = resolve(name)
            if name in ncons:
                ncons[name] -= 1
                owner = mask_owner.get(name)
                if not ncons[name] and owner is not None and id(owner) not in removed:
                    # an earlier Dropout whose mask lost its last reader: the old
                    # restart-from-the-top loop removed it next
                    heapq.heappush(revisit, pos[id(owner)])
        ncons[keep_name] = ncons.get(keep_name, 0) + ncons.pop(merged, 0)
        return True

    swept = True
    while swept:
        swept = False
        ncons: Dict[str, int] = {}
        for n in g.node:
            for name in _node_uses(n):
                name = resolve(name)
                ncons[name] = ncons.get(name, 0) + 1
        prods = _producers(g)
        pos = {id(n): k for k, n in enumerate(g.node)}
        mask_owner: Dict[str, onnx.NodeProto] = {}
        removed: Set[int] = set()
        revisit: List[int] = []
        nodes = list(g.node)
        for node in nodes:
            swept |= try_remove(node)
            while revisit:
                owner = nodes[heapq.heappop(revisit)]
                if id(owner) not in removed:
                    try_remove(owner)
        if swept:
            _resolve_uses(g, resolve)
            _replace_nodes(g, [n for n in nodes if id(n) not in removed])
    if drop_vi:
        _replace_repeated(g.value_info, [v for v in g.value_info if v.name not in drop_vi])
    _eliminate_dead_value_info(g)
    total = sum(counts.values())
    if not total:
        return new, PassResult("remove_identity", False, "no Identity/Dropout nodes removed")
    detail = "removed " + ", ".join(_plural(c, f"{op} node") for op, c in sorted(counts.items()))
    return new, PassResult("remove_identity", True, detail)


def _eliminate_dead_value_info(g: onnx.GraphProto) -> None:
    produced = {o for n in g.node for o in n.output}
    vis = [v for v in g.value_info if v.name in produced]
    if len(vis) != len(g.value_info):
        _replace_repeated(g.value_info, vis)


# --------------------------------------------------------------------------
# fold_constants
# --------------------------------------------------------------------------


# Evaluation is onnx's reference evaluator (``onnx.reference``), one node at a time; output
# shapes of the size-expanding ops come from onnx's shape inference before anything is
# allocated.  QuantizeLinear/DequantizeLinear are deliberately absent from the whitelist:
# quantized weights must reach the importer as int8/uint8 initializers behind a
# DequantizeLinear (the int8 MAC matcher keys on ``dequantize(const)``), not as pre-computed
# float tensors.
_FOLDABLE = {
    "Constant", "Shape", "Size", "Identity", "Gather", "Concat", "Unsqueeze", "Squeeze",
    "Reshape", "Flatten", "Cast", "Add", "Sub", "Mul", "Div", "Mod", "Pow", "Max", "Min",
    "Neg", "Abs", "Sqrt", "Reciprocal", "Floor", "Ceil", "Not", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where", "Slice", "Transpose",
    "ConstantOfShape", "Range", "Expand", "Tile", "Split", "ReduceProd", "ReduceSum",
    "ReduceMax", "ReduceMin",
    # exact data movement: e.g. the causal mask of a torch-exported GPT-2 (Trilu -> Where)
    "Trilu", "Sign", "GatherElements", "GatherND", "Pad", "NonZero",
}


# Pure memo of a function of (opset, canonical node): state-free in effect.
@functools.lru_cache(maxsize=512)
def _evaluator(opset: int, key: tuple):
    """The reference implementation (``onnx.reference`` op) of the canonical node ``key``
    (:func:`_node_key`): nodes that differ only in their value names share one, so building it
    (~0.5 ms) is paid once per distinct op/attributes/opset, not once per node."""
    node = _canonical(key)
    graph = helper.make_graph([node], "fold", [helper.make_empty_tensor_value_info(i)
                                               for i in node.input if i],
                              [helper.make_empty_tensor_value_info(o) for o in node.output if o])
    # A graph, not the bare node (which the evaluator runs at the newest opset).  Its one op
    # is called directly: ``ReferenceEvaluator.run``'s bookkeeping would double the cost.
    return ReferenceEvaluator(graph, opsets={"": opset}).rt_nodes_[0]


def _node_key(node: onnx.NodeProto) -> tuple:
    return (node.op_type, tuple(bool(i) for i in node.input),
            tuple(bool(o) for o in node.output),
            tuple(a.SerializeToString() for a in node.attribute))


def _canonical(key: tuple) -> onnx.NodeProto:
    """The node of :func:`_node_key` ``key``, in the default domain ("ai.onnx" spelled ""),
    with inputs ``i<k>`` and outputs ``o<k>``."""
    op_type, ins, outs, attrs = key
    node = onnx.NodeProto(op_type=op_type)
    node.input.extend(f"i{k}" if i else "" for k, i in enumerate(ins))
    node.output.extend(f"o{k}" if o else "" for k, o in enumerate(outs))
    node.attribute.extend(onnx.AttributeProto.FromString(a) for a in attrs)
    return node


def _output_elems(canon: onnx.NodeProto, ins: List[Optional[np.ndarray]],
                  opset: int) -> Optional[int]:
    """Element count of the output of a size-expanding op (``Expand``, ``Tile``, ...) on the
    constant inputs ``ins``, from onnx shape inference; None if it cannot tell."""
    try:
        types, data = {}, {}
        for name, v in zip(canon.input, ins):
            if name:
                types[name] = helper.make_tensor_type_proto(
                    helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                if v.size <= 64:  # shape-like operands; the data operand is not needed
                    data[name] = numpy_helper.from_array(v, name)
        out = onnx.shape_inference.infer_node_outputs(
            onnx.defs.get_schema(canon.op_type, opset), canon, types, data,
            opset_imports=[helper.make_opsetid("", opset)])
        tt = out[canon.output[0]].tensor_type
    except Exception:  # no schema / inference failure: do not fold
        return None
    if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
        return None
    return math.prod(d.dim_value for d in tt.shape.dim)  # Python ints: no overflow


def _eval_node(node: onnx.NodeProto, ins: List[Optional[np.ndarray]],
               opset: int) -> Optional[List[np.ndarray]]:
    """Outputs of ``node`` on the constant inputs ``ins`` (None for absent optional inputs), or
    None if it is not folded: the reference evaluator fails, or the result would be larger
    than :data:`_MAX_EXPANDED_ELEMS` elements and larger than its inputs."""
    if node.op_type == "Constant":
        v = _constant_node_value(node)
        return None if v is None else [v]
    key = _node_key(node)
    limit = max(_MAX_EXPANDED_ELEMS, sum(v.size for v in ins if v is not None))
    if node.op_type in _EXPANDING_OPS:
        n = _output_elems(_canonical(key), ins, opset)
        if n is None or n > limit:
            return None
    try:
        outs = _evaluator(opset, key).run(*ins)
    except Exception:  # unsupported corner case: leave the node
        return None
    if len(outs) != len(node.output):
        return None
    outs = [np.asarray(o) if name else None for name, o in zip(node.output, outs)]
    if any(o is not None and (o.dtype == object or o.size > limit) for o in outs):
        return None
    return outs


def fold_constants(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Evaluate constant subgraphs with ``onnx.reference`` and store results as initializers.

    A node is folded when it is in a whitelist of ops and all its inputs are
    initializers or ``Constant`` outputs.  ``Shape`` (and ``Size``) also folds
    when the dimensions it reads are static in ``value_info``, which collapses
    shape-computation subgraphs such as ``Shape -> Gather -> Concat -> Reshape``.
    One sweep in (topological) node order, then dead nodes and initializers are removed.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified); run :func:`shape_inference` first so that
        static shapes are known.

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Folded model and pass result.
    """
    new = _copy(model)
    g = new.graph
    opset = _opset(new)
    graph_outputs = {o.name for o in g.output}
    # Initializers that are also graph inputs may be overridden at run time.
    overridable = {i.name for i in g.input}
    partial = _partial_shapes(g)
    consts = {k: v for k, v in _constants(g).items() if k not in overridable}
    prods = _producers(g)
    folded: Dict[str, int] = {}
    remaining = []
    for node in g.node:
        out = None
        if (node.op_type in _FOLDABLE and node.domain in ("", "ai.onnx")
                and not any(o in graph_outputs for o in node.output)):
            ins = [consts.get(i) if i else None for i in node.input]
            if all(v is not None for i, v in zip(node.input, ins) if i):
                out = _eval_node(node, ins, opset)
            elif node.op_type in ("Shape", "Size") and node.input[0] in partial:
                out = _shape_value(node, partial[node.input[0]])
            elif node.op_type == "Gather" and node.input[1] in consts:
                # e.g. the static feature dim of a dynamic-batch input
                out = _fold_gather_of_shape(node, consts, prods, partial)
        if out is None or len(out) != len(node.output):
            remaining.append(node)
            continue
        for name, val in zip(node.output, out):
            if name:
                consts[name] = val
        folded[node.op_type] = folded.get(node.op_type, 0) + 1
    if not folded:
        return new, PassResult("fold_constants", False, "nothing to fold")
    _replace_nodes(g, remaining)
    # Materialise folded values that are still read by some node.
    existing = {t.name for t in g.initializer}
    used = set()
    for n in g.node:
        used |= _node_uses(n)
    for name, val in consts.items():
        if name in used and name not in existing:
            g.initializer.append(numpy_helper.from_array(np.asarray(val, order="C"), name))
    # value_info of folded names is redundant with the initializer.
    init_names = {t.name for t in g.initializer}
    _replace_repeated(g.value_info, [v for v in g.value_info if v.name not in init_names])
    _eliminate_dead(g)
    total = sum(folded.values())
    detail = f"folded {_plural(total, 'node')} (" + ", ".join(
        f"{op}x{c}" for op, c in sorted(folded.items())) + ")"
    return new, PassResult("fold_constants", True, detail)


# --------------------------------------------------------------------------
# fold_batchnorm
# --------------------------------------------------------------------------


def fold_batchnorm(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Fold inference ``BatchNormalization`` into a preceding ``Conv``.

    Requires constant Conv weights/bias and BN parameters, a Conv output with
    no other consumer, and no used BN training outputs.  The arithmetic is done
    in float64 and cast back to the weight dtype.

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
    consts = _constants(g)
    overridable = {i.name for i in g.input}
    graph_outputs = {o.name for o in g.output}
    cons = _consumers(g)
    prods = _producers(g)
    removed = []
    taken = _taken_names(g)
    for bn in list(g.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx"):
            continue
        if _attrs(bn).get("training_mode", 0):
            continue
        if any(o and (o in graph_outputs or cons.get(o)) for o in bn.output[1:]):
            continue
        conv = prods.get(bn.input[0])
        if conv is None or conv.op_type != "Conv":
            continue
        y = conv.output[0]
        if y in graph_outputs or len(cons.get(y, [])) != 1:
            continue
        has_bias = len(conv.input) > 2 and bool(conv.input[2])
        names = list(bn.input[1:5]) + list(conv.input[1:3] if has_bias else conv.input[1:2])
        if any(n in overridable or n not in consts for n in names):
            continue
        w = consts[conv.input[1]]
        if not np.issubdtype(w.dtype, np.floating):
            continue
        scale, beta, mean, var = (consts[n].astype(np.float64) for n in bn.input[1:5])
        eps = float(_attrs(bn).get("epsilon", 1e-5))
        b = consts[conv.input[2]].astype(np.float64) if has_bias else np.zeros(w.shape[0])
        s = scale / np.sqrt(var + eps)
        w_new = (w.astype(np.float64) * s.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        b_new = ((b - mean) * s + beta).astype(w.dtype)
        w_name = _unique_name(g, conv.input[1] + "_bnfold", taken)
        g.initializer.append(numpy_helper.from_array(w_new, w_name))
        b_name = _unique_name(g, (conv.input[2] if has_bias else conv.input[1]) + "_bnfold_bias",
                              taken)
        g.initializer.append(numpy_helper.from_array(b_new, b_name))
        conv.input[1] = w_name
        if len(conv.input) > 2:
            conv.input[2] = b_name
        else:
            conv.input.append(b_name)
        conv.output[0] = bn.output[0]
        removed.append(bn)
    if not removed:
        return new, PassResult("fold_batchnorm", False, "no Conv+BatchNormalization pairs")
    gone = {id(r) for r in removed}
    _replace_nodes(g, [n for n in g.node if id(n) not in gone])
    _eliminate_dead(g)
    return new, PassResult("fold_batchnorm", True,
                           f"folded {_plural(len(removed), 'BatchNormalization node')} into Conv")


# --------------------------------------------------------------------------
# canonicalize_gemm
# --------------------------------------------------------------------------

_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                onnx.TensorProto.BFLOAT16}


def _transposed_dequantize(g: onnx.GraphProto, dq: Optional[onnx.NodeProto],
                           const, taken: Optional[Set[str]] = None) -> Optional[onnx.NodeProto]:
    """For ``B = DequantizeLinear(Wq)`` with a constant 2-D ``Wq``: a new DequantizeLinear of
    ``Wq.T`` (new initializer) with the per-axis ``axis`` flipped, or None."""
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx"):
        return None
    wq = const(dq.input[0])
    params = [const(i) for i in dq.input[1:] if i]
    if wq is None or wq.ndim != 2 or any(p is None for p in params):
        return None
    attrs = _attrs(dq)
    if attrs.get("block_size", 0):
        return None
    w_name = _unique_name(g, dq.input[0] + "_T", taken)
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(wq.T), w_name))
    out = _unique_name(g, dq.output[0] + "_T", taken)
    new_attrs = {}
    if params[0].size > 1:  # per-axis: the quantized axis moves with the transpose
        axis = attrs.get("axis", 1)
        new_attrs["axis"] = 1 - (axis + 2 if axis < 0 else axis)
    return helper.make_node("DequantizeLinear", [w_name] + list(dq.input[1:]), [out],
                            name=_unique_name(g, (dq.name or "dequantize") + "_T", taken),
                            **new_attrs)


def canonicalize_gemm(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, PassResult]:
    """Canonicalise ``Gemm`` and fuse ``MatMul + Add`` into ``Gemm``.

    * ``Gemm`` with constant ``B`` and ``transB=1``: ``B`` is transposed into a
      new initializer and ``transB`` dropped; ``alpha`` is folded into constant
      ``B`` and ``beta`` into constant ``C``.
    * ``Gemm`` with ``transB=1`` and ``B = DequantizeLinear(Wq)`` of a constant
      quantized weight (QDQ models of ``nn.Linear``): ``Wq`` is transposed into a
      new int8/uint8 initializer under a new DequantizeLinear (per-axis ``axis``
      flipped), so the importer emits ``matmul(x, dequantize(Wq.T))`` rather than
      a ``permute_dims`` of the dequantized weight.
    * ``MatMul(A, W) -> Add(bias)`` with 2-D ``A`` and ``W``, a constant 1-D
      bias and a MatMul output used only by the Add becomes ``Gemm(A, W, bias)``.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified); shapes come from ``value_info``.

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Rewritten model and pass result.
    """
    new = _copy(model)
    g = new.graph
    consts = _constants(g)
    overridable = {i.name for i in g.input}
    graph_outputs = {o.name for o in g.output}
    shapes = _static_shapes(g)
    types = _elem_types(g)

    vi_ranks: Dict[str, Optional[int]] = {}  # first entry of a name decides, as a scan would
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.name not in vi_ranks or vi_ranks[vi.name] is None:
            has = vi.type.tensor_type.HasField("shape")
            vi_ranks[vi.name] = len(vi.type.tensor_type.shape.dim) if has else None

    def ranks(name):
        if name in consts:
            return consts[name].ndim
        if vi_ranks.get(name) is not None:
            return vi_ranks[name]
        return shapes.get(name) and len(shapes[name])

    def const(name):
        return None if name in overridable else consts.get(name)

    n_trans = n_scale = n_fused = 0
    # MatMul + Add -> Gemm
    cons = _consumers(g)
    prods = _producers(g)
    removed = []
    node_names = {n.name for n in g.node if n.name}  # onnxruntime rejects duplicate node names
    for add in list(g.node):
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        for k in (0, 1):
            mm = prods.get(add.input[k])
            bias = const(add.input[1 - k])
            if mm is None or mm.op_type != "MatMul" or bias is None or bias.ndim != 1:
                continue
            y = mm.output[0]
            if y in graph_outputs or len(cons.get(y, [])) != 1:
                continue
            if ranks(mm.input[0]) != 2 or ranks(mm.input[1]) != 2:
                continue
            if types.get(mm.input[0]) not in _FLOAT_TYPES:
                continue
            out_n = shapes.get(mm.input[1], (None, None))[1]
            if bias.shape[0] != 1 and out_n is not None and bias.shape[0] != out_n:
                continue
            gemm = helper.make_node("Gemm", [mm.input[0], mm.input[1], add.input[1 - k]],
                                    [add.output[0]],
                                    name=_unique_name(g, (mm.name or "matmul") + "_gemm", node_names))
            mm.CopyFrom(gemm)
            removed.append(add)
            n_fused += 1
            break
    if removed:
        gone = {id(r) for r in removed}
        _replace_nodes(g, [n for n in g.node if id(n) not in gone])
        _eliminate_dead_value_info(g)

    # Gemm canonicalisation
    inserted: Dict[int, onnx.NodeProto] = {}  # new DequantizeLinear nodes, keyed by Gemm id
    prods = _producers(g)
    taken = _taken_names(g)
    for node in g.node:
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx"):
            continue
        a = _attrs(node)
        b = const(node.input[1])
        if b is None and a.get("transB", 0):
            dq = _transposed_dequantize(g, prods.get(node.input[1]), const, taken)
            if dq is not None:
                inserted[id(node)] = dq
                node.input[1] = dq.output[0]
                _del_attr(node, "transB")
                n_trans += 1
            continue
        if b is None or not np.issubdtype(b.dtype, np.floating):
            continue
        b_new, c_new = b, None
        if a.get("transB", 0):
            b_new = b_new.T
            _del_attr(node, "transB")
            n_trans += 1
        alpha = float(a.get("alpha", 1.0))
        if alpha != 1.0:
            b_new = (b_new.astype(np.float64) * alpha).astype(b.dtype)
            _del_attr(node, "alpha")
            n_scale += 1
        beta = float(a.get("beta", 1.0))
        has_c = len(node.input) > 2 and node.input[2]
        if has_c and beta != 1.0:
            c = const(node.input[2])
            if c is not None:
                c_new = (c.astype(np.float64) * beta).astype(c.dtype)
                _del_attr(node, "beta")
                n_scale += 1
        elif not has_c and "beta" in a:
            _del_attr(node, "beta")
        if b_new is not b:
            name = _unique_name(g, node.input[1] + "_canon", taken)
            g.initializer.append(numpy_helper.from_array(np.asarray(b_new, order="C"), name))
            node.input[1] = name
        if c_new is not None:
            name = _unique_name(g, node.input[2] + "_canon", taken)
            g.initializer.append(numpy_helper.from_array(np.asarray(c_new, order="C"), name))
            node.input[2] = name
    if inserted:
        nodes = []
        for n in g.node:
            if id(n) in inserted:
                nodes.append(inserted[id(n)])
            nodes.append(n)
        _replace_nodes(g, nodes)
    parts = []
    if n_fused:
        parts.append(f"fused {_plural(n_fused, 'MatMul+Add')} into Gemm")
    if n_trans:
        parts.append(f"pre-transposed {_plural(n_trans, 'Gemm weight')}")
    if n_scale:
        parts.append(f"folded {_plural(n_scale, 'alpha/beta scale')}")
    if not parts:
        return new, PassResult("canonicalize_gemm", False, "no Gemm/MatMul+Add to canonicalize")
    _eliminate_dead(g)
    return new, PassResult("canonicalize_gemm", True, "; ".join(parts))


# --------------------------------------------------------------------------
# freeze_inputs
# --------------------------------------------------------------------------


def freeze_inputs(model: onnx.ModelProto,
                  values: Dict[str, np.ndarray]) -> Tuple[onnx.ModelProto, PassResult]:
    """Turn named graph inputs into initializers with the given values.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified).
    values : dict of str to numpy.ndarray
        Values for graph inputs; they are cast to the declared input dtype.

    Returns
    -------
    tuple of (onnx.ModelProto, PassResult)
        Model with the inputs frozen and pass result.

    Raises
    ------
    ValueError
        If a name is not a graph input or the value's shape contradicts the
        declared static dimensions.
    """
    new = _copy(model)
    g = new.graph
    inputs = {i.name: i for i in g.input}
    init_pos: Dict[str, int] = {}  # first initializer of each name
    for k, t in enumerate(g.initializer):
        init_pos.setdefault(t.name, k)
    for name, value in values.items():
        if name not in inputs:
            raise ValueError(f"freeze_inputs: {name!r} is not a graph input "
                             f"(inputs: {sorted(inputs)})")
        tt = inputs[name].type.tensor_type
        arr = np.asarray(value)
        if tt.elem_type:
            arr = arr.astype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if tt.HasField("shape"):
            dims = tt.shape.dim
            ok = len(dims) == arr.ndim and all(
                not d.HasField("dim_value") or d.dim_value == s for d, s in zip(dims, arr.shape))
            if not ok:
                want = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
                raise ValueError(f"freeze_inputs: value for {name!r} has shape {arr.shape}, "
                                 f"input declares {want}")
        if name in init_pos:
            g.initializer[init_pos[name]].CopyFrom(numpy_helper.from_array(arr, name))
        else:
            init_pos[name] = len(g.initializer)
            g.initializer.append(numpy_helper.from_array(arr, name))
    keep = [i for i in g.input if i.name not in values]
    if len(keep) != len(g.input):
        _replace_repeated(g.input, keep)
    if not values:
        return new, PassResult("freeze_inputs", False, "no inputs frozen")
    return new, PassResult("freeze_inputs", True,
                           f"froze {_plural(len(values), 'input')}: {', '.join(values)}")


# --------------------------------------------------------------------------
# Pass manager
# --------------------------------------------------------------------------

PASSES: Dict[str, Callable[[onnx.ModelProto], Tuple[onnx.ModelProto, PassResult]]] = {
    "upgrade_opset": upgrade_opset,
    "shape_inference": shape_inference,
    "expand_qlinear": expand_qlinear,
    "simplify_qdq": simplify_qdq,
    "remove_identity": remove_identity,
    "fold_constants": fold_constants,
    "fold_batchnorm": fold_batchnorm,
    "canonicalize_gemm": canonicalize_gemm,
}


def run_passes(model: onnx.ModelProto, passes: Optional[Sequence[str]] = None,
               check: bool = True,
               input_values: Optional[Dict[str, np.ndarray]] = None,
               ) -> Tuple[onnx.ModelProto, List[PassResult]]:
    """Run a sequence of ONNX passes.

    Parameters
    ----------
    model : onnx.ModelProto
        Input model (not modified).
    passes : sequence of str, optional
        Pass names from :data:`PASSES`; defaults to :data:`DEFAULT_PASSES`.
    check : bool
        Run ``onnx.checker.check_model`` on the result (skipped for models
        above the 2 GiB protobuf limit).
    input_values : dict of str to numpy.ndarray, optional
        If given, :func:`freeze_inputs` runs first with these values, so that
        e.g. shape-only integer inputs become constants before folding.

    Returns
    -------
    tuple of (onnx.ModelProto, list of PassResult)
        Transformed model and one result per pass.

    Raises
    ------
    ValueError
        On an unknown pass name.
    """
    names = DEFAULT_PASSES if passes is None else tuple(passes)
    unknown = [p for p in names if p not in PASSES]
    if unknown:
        raise ValueError(f"unknown ONNX pass(es) {unknown}; available: {sorted(PASSES)}")
    results = []
    if input_values is not None:
        model, res = freeze_inputs(model, input_values)
        results.append(res)
    for name in names:
        model, res = PASSES[name](model)
        results.append(res)
    if check and model.ByteSize() < (2 << 30) - 1:
        onnx.checker.check_model(model)
    return model, results
