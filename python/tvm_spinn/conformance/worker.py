"""Run one ONNX node test case through one pipeline (inside a worker process).

Two pipelines are defined:

``tvm``
    ``tvm.relax.frontend.onnx.from_onnx(model, keep_params_in_input=False)`` on the model as
    given, ``tvm.relax.build(mod, target="llvm")``, run on ``relax.VirtualMachine(ex, tvm.cpu())``.
``spinn``
    ``tvm_spinn.frontend.from_onnx`` with the integer-typed (int32/int64, i.e. shape-like) graph
    inputs frozen into initializers and static input shapes taken from the data set, with the
    ONNX-level passes of :mod:`tvm_spinn.frontend.onnx_passes` unless disabled, then
    ``relax.build(mod, target="spinn")`` and the same VM.

Outputs are compared like the ONNX backend test runner: same number of outputs, same shape and
dtype, object/string outputs exactly, everything else with
``numpy.testing.assert_allclose(actual, expected, rtol, atol)`` using the case's tolerances
(``rtol=1e-3``, ``atol=1e-7`` for every node test), NaNs compared equal.

Each call returns a plain ``dict`` (picklable, JSON-able): ``stage`` is the last stage reached
(``none`` < ``imported`` < ``built`` < ``ran`` < ``matched``) and ``error`` the first line of the
error that stopped the pipeline.
"""

from __future__ import annotations

import inspect
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

STAGES = ("none", "imported", "built", "ran", "matched")
"""Pipeline stages in order; a result's ``stage`` is the last one reached."""

PIPELINES = ("tvm", "spinn")

_FROZEN_TYPES = ("int32", "int64")


def first_line(err: BaseException) -> str:
    """First non-empty line of an exception message, prefixed by its type name.

    Parameters
    ----------
    err : BaseException

    Returns
    -------
    str
    """
    text = str(err).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {line}"[:300]


def _graph_inputs(model) -> List[Any]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _np_elem_type(value_info) -> Optional[str]:
    from onnx import helper

    tt = value_info.type
    if not tt.HasField("tensor_type") or not tt.tensor_type.elem_type:
        return None
    try:
        return str(helper.tensor_dtype_to_np_dtype(tt.tensor_type.elem_type))
    except Exception:  # noqa: BLE001  (exotic types)
        return None


def _to_tvm(value):
    import numpy as np
    import tvm

    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_to_tvm(v) for v in value]
    # np.ascontiguousarray would turn 0-d arrays into 1-d ones.
    return tvm.runtime.tensor(np.array(value, order="C", copy=True))


def _from_tvm(value):
    import numpy as np

    if value is None:
        return None
    if hasattr(value, "numpy"):
        return value.numpy()
    if isinstance(value, (list, tuple)) or type(value).__name__ in ("Array", "List"):
        return [_from_tvm(v) for v in value]
    if isinstance(value, (int, float, bool, np.generic)):
        return np.asarray(value)
    if type(value).__name__ == "Shape" or hasattr(value, "__len__"):
        return np.asarray(list(value), dtype="int64")
    return value


def compare(actual: List[Any], expected: List[Any], rtol: float, atol: float) -> None:
    """Raise ``AssertionError`` unless ``actual`` matches ``expected`` (see module docstring).

    Parameters
    ----------
    actual, expected : list
        Output values (numpy arrays, lists of them for sequences, or ``None``).
    rtol, atol : float
        Tolerances for ``numpy.testing.assert_allclose``.
    """
    import numpy as np

    if len(actual) != len(expected):
        raise AssertionError(f"got {len(actual)} outputs, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None or isinstance(e, list):
            if not isinstance(a, list) and not (e is None and a is None):
                raise AssertionError(f"output {i}: got {type(a).__name__}, expected "
                                     f"{'sequence' if e is not None else 'None'}")
            if e is not None:
                compare(a, e, rtol, atol)
            continue
        a = np.asarray(a)
        e = np.asarray(e)
        if a.shape != e.shape:
            raise AssertionError(f"output {i}: shape {a.shape} != expected {e.shape}")
        if a.dtype != e.dtype:
            raise AssertionError(f"output {i}: dtype {a.dtype} != expected {e.dtype}")
        if e.dtype == object or e.dtype.kind in "USb":
            np.testing.assert_array_equal(a, e, err_msg=f"output {i}")
        else:
            try:
                np.testing.assert_allclose(a.astype(np.float64) if e.dtype.kind == "V" else a,
                                           e.astype(np.float64) if e.dtype.kind == "V" else e,
                                           rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as err:
                lines = [ln.strip() for ln in str(err).splitlines() if "Mismatched" in ln
                         or "Max absolute" in ln]
                raise AssertionError(f"output {i}: " + ("; ".join(lines) or "values differ")) \
                    from None


def _import_tvm(model, data_inputs, options):
    from tvm.relax.frontend.onnx import from_onnx

    return from_onnx(model, keep_params_in_input=False), list(data_inputs)


def _import_spinn(model, data_inputs, options):
    from tvm_spinn.frontend import from_onnx

    passes = bool(options.get("passes", True))
    inputs = _graph_inputs(model)
    frozen: Dict[str, Any] = {}
    runtime: List[Any] = []
    shape_dict: Dict[str, tuple] = {}
    for vi, value in zip(inputs, data_inputs):
        if value is not None and not isinstance(value, list) \
                and _np_elem_type(vi) in _FROZEN_TYPES:
            frozen[vi.name] = value
        else:
            runtime.append(value)
            if value is not None and not isinstance(value, list):
                shape_dict[vi.name] = tuple(int(d) for d in getattr(value, "shape", ()))
    params = inspect.signature(from_onnx).parameters
    kwargs: Dict[str, Any] = {}
    if "shape_dict" in params:
        kwargs["shape_dict"] = shape_dict
    if "passes" in params and "input_values" in params:
        kwargs["passes"] = passes
        kwargs["input_values"] = frozen or None
    else:  # older front-end: run the ONNX passes here
        from tvm_spinn.frontend.onnx_passes import freeze_inputs, run_passes

        if frozen:
            model, _ = freeze_inputs(model, frozen)
        if passes:
            model, _ = run_passes(model)
        if "passes" in params:
            kwargs["passes"] = False
    return from_onnx(model, **kwargs), runtime


def run_pipeline(name: str, path: str, pipeline: str, options: Optional[dict] = None,
                 progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run one cached case through one pipeline.

    Parameters
    ----------
    name : str
        Case name (for the result only).
    path : str
        Case folder (see :func:`tvm_spinn.conformance.cases.load_case`).
    pipeline : {"tvm", "spinn"}
        Which pipeline to run.
    options : dict, optional
        ``passes`` (bool, default True): run the ONNX passes in the spinn pipeline.
    progress : callable, optional
        Called with each stage name as it is reached (lets the pool know how far a task got
        before a crash).

    Returns
    -------
    dict
        ``case``, ``pipeline``, ``stage`` (see :data:`STAGES`), ``error`` (first line or None),
        ``seconds`` and, on failure, ``traceback`` (last lines).
    """
    options = dict(options or {})
    t0 = time.monotonic()
    result = {"case": name, "pipeline": pipeline, "stage": "none", "error": None}

    def reach(stage: str) -> None:
        if STAGES.index(stage) > STAGES.index(result["stage"]):
            result["stage"] = stage
            if progress is not None:
                progress(stage)
    try:
        import tvm
        from tvm import relax

        if pipeline == "spinn":
            import tvm_spinn  # noqa: F401  (registers the spinn target and pipeline)
        from .cases import load_case

        model, data_sets, meta = load_case(path)
        target = "spinn" if pipeline == "spinn" else "llvm"
        importer = _import_spinn if pipeline == "spinn" else _import_tvm
        built = None
        for ds_inputs, expected in data_sets:
            # The spinn pipeline freezes per-data-set values, so it re-imports per data set.
            if built is None or pipeline == "spinn":
                mod, args = importer(model, ds_inputs, options)
                reach("imported")
                built = relax.build(mod, target=target)
                reach("built")
            else:
                args = list(ds_inputs)
            vm = relax.VirtualMachine(built, tvm.cpu())
            out = vm["main"](*[_to_tvm(a) for a in args])
            out = _from_tvm(out)
            if len(expected) != 1 and isinstance(out, list):
                actual = out
            else:
                actual = [out]
            reach("ran")
            compare(actual, list(expected), meta["rtol"], meta["atol"])
        reach("matched")
    except BaseException as err:  # noqa: BLE001  (every failure is a result)
        if isinstance(err, KeyboardInterrupt):
            raise
        # A failure after a complete earlier data set still reports the failing stage.
        result["error"] = first_line(err)
        result["traceback"] = "".join(traceback.format_exception(err)[-6:])[-2000:]
    result["seconds"] = round(time.monotonic() - t0, 3)
    return result
