"""ONNX front-end: load (path or ModelProto), check, import with ``relax.frontend.onnx``."""

from __future__ import annotations

import os

import tvm

__all__ = ["from_onnx", "OnnxImportError"]


class OnnxImportError(ValueError):
    """An ONNX model that cannot be imported (names the file, input or ops)."""


def _load(model_or_path):
    import onnx

    if isinstance(model_or_path, (str, os.PathLike)):
        path = os.fspath(model_or_path)
        if not os.path.exists(path):
            raise OnnxImportError(f"ONNX file {path!r} does not exist")
        try:
            return onnx.load(path), path
        except Exception as err:  # protobuf DecodeError and friends
            raise OnnxImportError(f"ONNX file {path!r} is not a valid ONNX model: {err}") from None
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path, "<ModelProto>"
    raise OnnxImportError(f"expected a path or onnx.ModelProto, got {type(model_or_path).__name__}")


def from_onnx(model_or_path, shape_dict: dict | None = None, passes: bool | tuple = True,
              input_values: dict | None = None) -> tvm.IRModule:
    """Import an ONNX model into Relax with its weights bound as constants.

    Parameters
    ----------
    model_or_path : str, os.PathLike or onnx.ModelProto
        The model.
    shape_dict : dict, optional
        Input name -> static shape, for inputs whose shape has symbolic dims.
    passes : bool or tuple of str
        Run the ONNX-level passes (:mod:`.onnx_passes`: opset upgrade, shape inference, identity
        removal, constant folding, BatchNorm folding, Gemm canonicalization) before import;
        ``True`` runs ``DEFAULT_PASSES``, a tuple names the passes, ``False`` none.
    input_values : dict, optional
        Values for shape-only (integer) inputs, frozen into initializers before the passes.

    Returns
    -------
    tvm.IRModule
    """
    import onnx
    from tvm.relax.frontend.onnx import from_onnx as _from_onnx

    model, where = _load(model_or_path)
    try:
        onnx.checker.check_model(model)
    except Exception as err:
        raise OnnxImportError(f"ONNX model {where} failed onnx.checker: {err}") from None
    shape_dict = dict(shape_dict or {})
    initializers = {init.name for init in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in initializers or inp.name in shape_dict:
            continue
        dims = inp.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise OnnxImportError(
                f"ONNX input '{inp.name}' of {where} has dynamic dims "
                f"{[d.dim_param or '?' if not d.HasField('dim_value') else d.dim_value for d in dims]}; "
                "pass shape_dict={'" + inp.name + "': (...)}"
            )
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    _check_supported_ops(model, where)
    applied = []
    if passes or input_values:
        from .onnx_passes import DEFAULT_PASSES, run_passes

        names = DEFAULT_PASSES if passes is True else tuple(passes or ())
        model, results = run_passes(model, names, input_values=input_values)
        applied = [r.detail for r in results if r.changed]
    mod = _from_onnx(model, shape_dict=shape_dict or None, keep_params_in_input=False)
    return mod.with_attr("spinn_source", {"framework": "onnx", "opset": opset, "file": where,
                                          "passes": applied})


def _check_supported_ops(model, where: str) -> None:
    """One error listing every op type the importer lacks, with the nodes that use them."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"If"}  # If is converted by the graph walker itself
    missing: dict[str, list[str]] = {}
    for i, node in enumerate(model.graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in known:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            missing.setdefault(key, []).append(node.name or f"#{i}")
    if missing:
        detail = "; ".join(f"{op} (nodes: {', '.join(nodes[:5])}{' ...' if len(nodes) > 5 else ''})"
                           for op, nodes in sorted(missing.items()))
        raise OnnxImportError(f"ONNX model {where} uses {len(missing)} unsupported op type(s): {detail}")
