"""GEMMs of descriptor programs (weights passed as inputs): weight matmuls made dense layers,
biases fused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...model import Layer
from ..base import dedupe_layers


# -- descriptor programs (weights passed as inputs) -------------------------------------------------
def weight_matmuls_to_dense(program, weight_inputs: set, dtype: str, new_tensor, set_const, tensors: list) -> list:
    """The layers of ``program`` with every ``matmul`` of a 2-D activation by a weight input
    ``(K, N)``, or by the ``permute_dims`` of a weight ``(N, K)`` (``nn.Linear``), made a
    ``dense`` layer with that weight as its ``(K, N)`` constant (``int8``: a ``quantize`` of the
    activation, an int8 weight and per-channel scales): what the compiler makes of a GEMM with
    a bound weight. ``new_tensor(name, shape, dtype, role)`` adds a tensor; ``set_const(tid,
    shape, dtype)`` records a constant's value; ``tensors``: the tensor records being rewritten
    (those of ``program``, which stays as it is), a list whose weights' records are replaced
    and to which ``new_tensor`` appends."""
    users: dict[int, list[int]] = {}
    for i, layer in enumerate(program.layers):
        for t in layer.inputs:
            users.setdefault(t, []).append(i)
    transposed = {}  # output of permute_dims(weight (N, K)) -> the weight
    for layer in program.layers:
        if (layer.kind == "permute_dims" and len(layer.inputs) == 1 and layer.inputs[0] in weight_inputs
                and len(tensors[layer.inputs[0]].shape) == 2
                and all(program.layers[u].kind == "matmul" and program.layers[u].inputs[1:] == [layer.output]
                        for u in users.get(layer.output, []))):
            transposed[layer.output] = layer.inputs[0]

    layers = []
    for layer in program.layers:
        if layer.kind == "permute_dims" and layer.output in transposed:
            continue
        b = layer.inputs[1] if layer.kind == "matmul" and len(layer.inputs) == 2 else None
        x = layer.inputs[0]
        if b is not None and (b in transposed or (b in weight_inputs and len(tensors[b].shape) == 2)) \
                and len(tensors[x].shape) == 2:
            k, n = tensors[x].shape[1], tensors[layer.output].shape[-1]
            w_dtype = "int8" if dtype == "int8" else "float32"
            # the weight tensor itself becomes the dense layer's (K, N) constant: no orphan left
            weight = transposed.get(b, b)
            tensors[weight] = replace(tensors[weight], shape=[int(k), int(n)], dtype=w_dtype)
            set_const(weight, (k, n), w_dtype)
            if dtype == "int8":
                xq = new_tensor(f"{layer.name}.xq", tensors[x].shape, "int8", "temp")
                layers.append(Layer(name=f"{layer.name}.quantize", kind="quantize", inputs=[x], output=xq,
                                    consts={"scale": new_tensor(f"{layer.name}.xs", (1,), "float32", "const"),
                                            "zero": new_tensor(f"{layer.name}.xz", (1,), "int32", "const")},
                                    attrs={"axis": 1}))
                layers.append(Layer(name=layer.name, kind="dense", inputs=[xq], output=layer.output,
                                    consts={"weight": weight,
                                            "scale": new_tensor(f"{layer.name}.ws", (n,), "float32", "const")},
                                    attrs={"x_zero": 0, "x_flip": False, "relu": False, "out": "float32"},
                                    mode="int8"))
            else:
                layers.append(Layer(name=layer.name, kind="dense", inputs=[x], output=layer.output,
                                    consts={"weight": weight}, attrs={"relu": False}))
            continue
        layers.append(layer)
    return layers


def fuse_bias(program, layers: list) -> list:
    """``dense`` then ``add`` of a constant vector (directly or after a reshape) -> ``dense`` with ``bias``,
    the form the compiler gives a GEMM with a bound bias."""
    tensors = program.tensors
    layers = list(layers)  # the fused layers replace their records here
    users: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        for t in layer.inputs:
            users.setdefault(t, []).append(i)
    drop = set()
    for j, layer in enumerate(layers):
        if layer.kind != "dense" or "bias" in layer.consts or layer.output in program.outputs:
            continue
        n = tensors[layer.output].shape[-1]
        chain, out = [], layer.output
        while len(users.get(out, [])) == 1 and layers[users[out][0]].kind == "reshape" and out not in program.outputs:
            chain.append(users[out][0])
            out = layers[users[out][0]].output
        nxt = users.get(out, [])
        if len(nxt) != 1 or layers[nxt[0]].kind != "add" or out in program.outputs:
            continue
        add = layers[nxt[0]]
        others = [t for t in add.inputs if t != out]
        if len(others) != 1 or tensors[others[0]].role != "const" or tensors[others[0]].shape != [n] \
                or tensors[add.output].shape != tensors[out].shape:
            continue
        layers[j] = replace(layer, consts={**layer.consts, "bias": others[0]})
        if chain:
            layers[chain[-1]] = replace(layers[chain[-1]], output=add.output)
        else:
            layers[j] = replace(layers[j], output=add.output)
        drop.add(nxt[0])
    return [layer for i, layer in enumerate(layers) if i not in drop]


def _const_key(program, tid: int) -> tuple:
    """What identifies constant ``tid``'s value: its dtype, shape and bytes (the tensor id itself
    where the program holds no value for it, so that it matches only itself)."""
    if tid not in program.constants:
        return ("tensor", tid)
    value = np.asarray(program.constants[tid])
    return (str(value.dtype), value.shape, np.ascontiguousarray(value).tobytes())


def share_quantizes(program, layers: list) -> list:
    """Drop repeated ``quantize`` layers of one activation (same input, dtype, attributes and
    values of scale and zero point, compared by their bytes): post-training quantization
    quantizes each activation tensor once, for every GEMM that reads it (the q, k and v
    projections' hidden state, the gate and up projections'), where
    :func:`weight_matmuls_to_dense` gave each GEMM its own; later readers use the first one's
    output. Two quantizes of one input with different scales or zero points stay apart. Run
    after :func:`~tvm_spinn.program.ops.movement.dedupe_movement`, which makes the GEMMs'
    reshaped inputs one tensor."""
    tensors = program.tensors

    def key(layer):
        if layer.kind != "quantize":
            return None
        return (tuple(layer.inputs), tensors[layer.output].dtype,
                tuple(_const_key(program, layer.consts[c]) for c in ("scale", "zero")),
                tuple(sorted(layer.attrs.items())))

    return dedupe_layers(program, layers, key)

