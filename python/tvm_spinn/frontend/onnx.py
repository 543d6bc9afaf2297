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


def _check_opset(model, where: str) -> None:
    """Refuse a default-domain opset newer than the installed onnx package defines: its ops'
    meaning is unknown here (onnx.checker accepts any number)."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx") and not 1 <= entry.version <= newest:
            raise OnnxImportError(
                f"ONNX model {where} imports opset {entry.version} of the default domain, which does "
                f"not exist (the installed onnx {onnx.__version__} defines opsets 1 to {newest})")


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
        Run the ONNX-level passes (:mod:`.onnx_passes`: opset upgrade, shape inference, QOperator
        expansion, QDQ simplification, identity removal, constant folding, BatchNorm folding,
        Gemm canonicalization) before import;
        ``True`` runs ``DEFAULT_PASSES``, a tuple names the passes, ``False`` none.
    input_values : dict, optional
        Values for shape-only (integer) inputs, frozen into initializers before the passes.

    Returns
    -------
    tvm.IRModule

    Raises
    ------
    OnnxImportError
        For a missing/invalid file, dynamic input dims without ``shape_dict``, ops the importer
        lacks, or quantization schemes other than int8/uint8 per-tensor/per-axis (int4, int16,
        float8, blocked quantization, ...: :func:`.onnx_quant.check_quant_schemes`).
    """
    import onnx
    from tvm.relax.frontend.onnx import from_onnx as _from_onnx

    model, where = _load(model_or_path)
    try:
        onnx.checker.check_model(model)
    except Exception as err:
        raise OnnxImportError(f"ONNX model {where} failed onnx.checker: {err}") from None
    _check_opset(model, where)
    initializers = {init.name for init in model.graph.initializer}
    shape_dict = _checked_shape_dict(model, where, shape_dict, initializers)
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
    from .onnx_passes import DEFAULT_PASSES, run_passes
    from .onnx_quant import EXPANDABLE_OPS, check_quant_schemes

    names = DEFAULT_PASSES if passes is True else tuple(passes or ())
    # QLinearConv/QLinearMatMul/ORT's com.microsoft QLinear* become Q/DQ + float ops there
    expandable = EXPANDABLE_OPS if "expand_qlinear" in names else frozenset()
    _check_supported_ops(model, where, expandable)
    problems = check_quant_schemes(model)
    if problems:
        raise OnnxImportError(
            f"ONNX model {where} uses {len(problems)} unsupported quantization scheme(s): "
            + "; ".join(problems))
    applied = []
    if names or input_values:
        model, results = run_passes(model, names, input_values=input_values)
        applied = [r.detail for r in results if r.changed]
        if expandable:
            _check_supported_ops(model, where)  # nodes expand_qlinear had to keep
    mod = _from_onnx(model, shape_dict=shape_dict or None, keep_params_in_input=False)
    return mod.with_attr("spinn_source", {"framework": "onnx", "opset": opset, "file": where,
                                          "passes": applied})


def _checked_shape_dict(model, where: str, shape_dict: dict | None, initializers: set) -> dict:
    """``shape_dict`` with every entry checked against the graph input it names (inputs that
    are not ``initializers``)."""
    from .shapes import check_shape

    inputs = {inp.name: inp for inp in model.graph.input if inp.name not in initializers}
    unknown = sorted(set(shape_dict or {}) - set(inputs))
    if unknown:
        raise OnnxImportError(
            f"shape_dict names {unknown} are not inputs of ONNX model {where} "
            f"(inputs: {sorted(inputs)})")
    checked = {}
    for name, given in (shape_dict or {}).items():
        ttype = inputs[name].type.tensor_type
        declared = None
        if ttype.HasField("shape"):
            declared = [d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim]
        checked[name] = check_shape(OnnxImportError, f"ONNX model {where}", name, given, declared)
    return checked


def _check_supported_ops(model, where: str, extra_known=frozenset()) -> None:
    """One error listing every op type the importer lacks, with the nodes that use them.

    ``extra_known`` holds domain-qualified op names (``"QLinearConv"``,
    ``"com.microsoft.QLinearAdd"``) an ONNX pass will rewrite before the import.
    """
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"If"}  # If is converted by the graph walker itself
    missing: dict[str, list[str]] = {}
    for i, node in enumerate(model.graph.node):
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        if key in extra_known:
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in known:
            missing.setdefault(key, []).append(node.name or f"#{i}")
    if missing:
        detail = "; ".join(f"{op} (nodes: {', '.join(nodes[:5])}{' ...' if len(nodes) > 5 else ''})"
                           for op, nodes in sorted(missing.items()))
        raise OnnxImportError(f"ONNX model {where} uses {len(missing)} unsupported op type(s): {detail}")
