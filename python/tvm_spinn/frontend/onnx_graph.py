"""Graph helpers shared by the ONNX-level passes (``onnx_passes``) and the quantized-model
passes (``onnx_quant``): name maps, producers/consumers, constant and shape tables, dead-node
elimination, and the :class:`PassResult` every pass returns.

Both pass modules import this one and nothing imports them from here, so they form no cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["PassResult"]


@dataclass
class PassResult:
    """Outcome of one pass.

    Attributes
    ----------
    name : str
        Pass name.
    changed : bool
        Whether the pass modified the model.
    detail : str
        Short human-readable description, e.g. ``"removed 3 Identity nodes"``.
    """

    name: str
    changed: bool
    detail: str


# --------------------------------------------------------------------------
# Generic helpers
# --------------------------------------------------------------------------


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    new = onnx.ModelProto()
    new.CopyFrom(model)
    return new


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 0


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _del_attr(node: onnx.NodeProto, name: str) -> None:
    keep = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(keep)


def _subgraphs(node: onnx.NodeProto) -> Iterable[onnx.GraphProto]:
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def _graph_refs(graph: onnx.GraphProto) -> Set[str]:
    """All value names read inside ``graph`` (recursively, incl. outputs)."""
    refs = {o.name for o in graph.output}
    for n in graph.node:
        refs.update(i for i in n.input if i)
        for g in _subgraphs(n):
            refs |= _graph_refs(g)
    return refs


def _node_uses(node: onnx.NodeProto) -> Set[str]:
    """Names read by ``node``, including implicit reads from its subgraphs."""
    uses = {i for i in node.input if i}
    for g in _subgraphs(node):
        uses |= _graph_refs(g)
    return uses


def _consumers(graph: onnx.GraphProto) -> Dict[str, List[onnx.NodeProto]]:
    cons: Dict[str, List[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in _node_uses(n):
            cons.setdefault(name, []).append(n)
    return cons


def _producers(graph: onnx.GraphProto) -> Dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output if o}


def _resolve_uses(graph: onnx.GraphProto, resolve: Callable[[str], str],
                  outputs: bool = False) -> None:
    """Replace every read ``x`` by ``resolve(x)`` in nodes (recursively into subgraphs, whose
    outputs count as reads) and, if ``outputs``, in the graph outputs: one linear walk."""
    for n in graph.node:
        for k, i in enumerate(n.input):
            if i:
                r = resolve(i)
                if r != i:
                    n.input[k] = r
        for sg in _subgraphs(n):
            _resolve_uses(sg, resolve, outputs=True)
    if outputs:
        for o in graph.output:
            r = resolve(o.name)
            if r != o.name:
                o.name = r


def _taken_names(graph: onnx.GraphProto) -> Set[str]:
    taken = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    taken |= {o for n in graph.node for o in n.output} | {v.name for v in graph.value_info}
    return taken


def _unique_name(graph: onnx.GraphProto, base: str, taken: Optional[Set[str]] = None) -> str:
    """A name not used in ``graph``.  Passes that create many names pass ``taken`` (from
    :func:`_taken_names`, built once; the new name is added to it) to stay linear."""
    if taken is None:
        taken = _taken_names(graph)
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def _initializers(graph: onnx.GraphProto) -> Dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in graph.initializer}


def _constant_node_value(node: onnx.NodeProto) -> Optional[np.ndarray]:
    a = _attrs(node)
    if "value" in a:
        return numpy_helper.to_array(a["value"])
    if "value_float" in a:
        return np.array(a["value_float"], dtype=np.float32)
    if "value_floats" in a:
        return np.array(a["value_floats"], dtype=np.float32)
    if "value_int" in a:
        return np.array(a["value_int"], dtype=np.int64)
    if "value_ints" in a:
        return np.array(a["value_ints"], dtype=np.int64)
    return None  # sparse / string constants are left alone


def _constants(graph: onnx.GraphProto) -> Dict[str, np.ndarray]:
    """Initializers plus outputs of ``Constant`` nodes."""
    consts = _initializers(graph)
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            v = _constant_node_value(n)
            if v is not None:
                consts[n.output[0]] = v
    return consts


def _static_shapes(graph: onnx.GraphProto) -> Dict[str, Tuple[int, ...]]:
    """Fully static shapes known from graph inputs, value_info and outputs."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = vi.type
        if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            continue
        dims = t.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = tuple(int(d.dim_value) for d in dims)
    return shapes


def _partial_shapes(graph: onnx.GraphProto) -> Dict[str, List[Optional[int]]]:
    """Known ranks with per-dimension static sizes (None for symbolic dims)."""
    shapes: Dict[str, List[Optional[int]]] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = vi.type
        if t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
            shapes[vi.name] = [int(d.dim_value) if d.HasField("dim_value") else None
                               for d in t.tensor_type.shape.dim]
    return shapes


def _shape_dims(node: onnx.NodeProto, dims: List[Optional[int]]) -> List[Optional[int]]:
    """The dims of an input of shape ``dims`` that ``Shape`` ``node`` reads (start/end)."""
    a = _attrs(node)
    rank = len(dims)
    start, end = a.get("start", 0), a.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return dims[start:end]


def _shape_value(node: onnx.NodeProto, dims: List[Optional[int]]) -> Optional[List[np.ndarray]]:
    """The output of ``Shape``/``Size`` ``node`` on an input of shape ``dims`` (None for a
    symbolic dim), or None if a dimension it reads is not static."""
    if node.op_type == "Size":
        return None if None in dims else [np.array(int(np.prod(dims)), dtype=np.int64)]
    dims = _shape_dims(node, dims)
    return None if None in dims else [np.array(dims, dtype=np.int64)]


def _fold_gather_of_shape(node, consts, prods, partial) -> Optional[List[np.ndarray]]:
    """``Gather(Shape(x), const idx)`` where only the selected dims are static."""
    shape_node = prods.get(node.input[0])
    idx = consts.get(node.input[1])
    if (shape_node is None or shape_node.op_type != "Shape" or idx is None
            or _attrs(node).get("axis", 0) != 0 or shape_node.input[0] not in partial):
        return None
    dims = _shape_dims(shape_node, partial[shape_node.input[0]])
    flat = [int(i) for i in np.asarray(idx).reshape(-1)]
    if any(not -len(dims) <= i < len(dims) for i in flat):
        return None
    picked = [dims[i] for i in flat]
    if any(d is None for d in picked):
        return None
    return [np.array(picked, dtype=np.int64).reshape(np.asarray(idx).shape)]


def _elem_types(graph: onnx.GraphProto) -> Dict[str, int]:
    types = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in graph.initializer:
        types[t.name] = t.data_type
    return types


def _eliminate_dead(graph: onnx.GraphProto) -> Tuple[int, int]:
    """Remove nodes and initializers that do not contribute to graph outputs.

    Returns
    -------
    tuple of int
        Number of removed nodes and initializers.
    """
    live = {o.name for o in graph.output}
    kept = []
    for n in reversed(graph.node):
        if any(o in live for o in n.output if o):
            kept.append(n)
            live |= _node_uses(n)
    removed_nodes = len(graph.node) - len(kept)
    if removed_nodes:
        kept.reverse()
        _replace_repeated(graph.node, kept)
    input_names = {i.name for i in graph.input}
    keep_init = [t for t in graph.initializer if t.name in live or t.name in input_names]
    removed_inits = len(graph.initializer) - len(keep_init)
    if removed_inits:
        _replace_repeated(graph.initializer, keep_init)
    # Drop value_info of names that no longer exist.
    existing = live | {o for n in graph.node for o in n.output}
    vis = [v for v in graph.value_info if v.name in existing]
    if len(vis) != len(graph.value_info):
        _replace_repeated(graph.value_info, vis)
    return removed_nodes, removed_inits


def _replace_repeated(field, keep: list) -> None:
    """Make the repeated proto ``field`` hold copies of ``keep`` (elements of it, in order).

    The copies are taken before clearing: ``keep`` holds references into ``field``."""
    copies = []
    for item in keep:
        c = type(item)()
        c.CopyFrom(item)
        copies.append(c)
    del field[:]
    field.extend(copies)


def _replace_nodes(graph: onnx.GraphProto, nodes: List[onnx.NodeProto]) -> None:
    _replace_repeated(graph.node, nodes)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
