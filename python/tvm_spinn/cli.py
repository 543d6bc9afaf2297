"""``tvm-spinn`` command line: compile, run and report models for spinn systems."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _check_output(path: str, what: str) -> None:
    """Fail before any work when ``path`` cannot be written (missing directory, a directory)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SystemExit(f"tvm-spinn: {what} {path!r} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise SystemExit(f"tvm-spinn: cannot write {what} {path!r}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SystemExit(f"tvm-spinn: cannot write {what} {path!r}: directory {directory!r} is not writable")


def _write_npz(path: str, arrays: dict) -> None:
    """Write ``arrays`` to ``path`` atomically (temporary file renamed into place, removed on
    failure) with the mode the umask gives a new file."""
    import numpy as np

    from ._files import atomic_write

    atomic_write(path, lambda f: np.savez(f, **arrays))  # a file object: numpy adds no ".npz"


def _load_model(path: str, shapes: list[str]):
    from . import frontend

    if not os.path.exists(path):
        raise SystemExit(f"tvm-spinn: model file {path!r} does not exist")
    if path.endswith(".onnx"):
        shape_dict = {}
        for item in shapes:
            name, _, dims = item.partition("=")
            try:
                shape_dict[name] = tuple(int(d) for d in dims.split(","))
            except ValueError:
                raise SystemExit(f"tvm-spinn: bad --shape {item!r} (expected name=1,3,224,224)") from None
        return frontend.from_onnx(path, shape_dict or None)
    raise SystemExit(f"tvm-spinn: cannot compile {path!r}: supported model formats are .onnx")


def _cmd_compile(args) -> int:
    from tvm import relax

    from .target import get_target

    target = get_target(args.target)
    _check_output(args.output, "output library")
    mod = _load_model(args.model, args.shape)
    if args.quantize:
        mod = _quantize(mod, args.quantize, args.quant_scheme)
    elif args.quant_scheme:
        raise SystemExit("tvm-spinn: --quant-scheme needs --quantize CALIBRATION.npz")
    if args.tuning_logs:
        from .tune import build_options

        with build_options(tuning_logs=args.tuning_logs):
            ex = relax.build(mod, target=target)
    else:
        ex = relax.build(mod, target=target)
    from .runtime.loader import export_library

    export_library(ex, args.output)  # atomic, sealed (verified by tvm-spinn run/report)
    print(f"wrote {args.output}")
    if args.report:
        from .report import report

        print(report(ex))
    return 0


def _read_arrays(path: str, what: str, single_name: str | None) -> dict:
    """Arrays of an ``.npz`` (by key) or of an ``.npy`` (one array, named ``single_name``).

    ``single_name`` is the model's only input name, or ``None`` when the model has several
    inputs (an ``.npy`` then is an error naming the file).
    """
    import numpy as np

    try:
        data = np.load(path, allow_pickle=False)
    except Exception as err:
        raise SystemExit(f"tvm-spinn: cannot read {what} {path!r}: {err}") from None
    if isinstance(data, np.ndarray):  # .npy: one array
        if single_name is None:
            raise SystemExit(f"tvm-spinn: {what} {path!r} is a single .npy array but the model has "
                             f"several inputs: give an .npz with one array per input name")
        return {single_name: data}
    with data:
        try:
            return {name: data[name] for name in data.files}
        except Exception as err:
            raise SystemExit(f"tvm-spinn: cannot read {what} {path!r}: {err}") from None


def _quantize(mod, calibration: str, scheme: str | None):
    """Post-training quantization with samples from an .npz: one array per input, each with a
    leading sample axis (``name`` keys as the model's inputs, or ``arr_0``... in input order); an
    .npy for a single-input model."""
    from .quant import QuantScheme, quantize

    params = [p.name for p in mod["main"].params]
    arrays = _read_arrays(calibration, "calibration data", params[0] if len(params) == 1 else None)
    if not arrays:
        raise SystemExit(f"tvm-spinn: calibration data {calibration!r} has no arrays")
    counts = {name: a.shape[0] if a.ndim else 0 for name, a in arrays.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise SystemExit(f"tvm-spinn: calibration arrays in {calibration!r} need the same leading "
                         f"sample axis, got {counts}")
    n = next(iter(counts.values()))
    ordered = _order_inputs(params, arrays, calibration)  # same matching as `run --inputs`
    samples = [[a[i] for a in ordered] for i in range(n)]
    return quantize(mod, samples, QuantScheme.parse(scheme) if scheme else None)


def _cmd_tune(args) -> int:
    from .tune import tune

    mod = _load_model(args.model, args.shape)
    try:
        result = tune(mod, target=args.target, work_dir=args.work_dir, max_trials=args.max_trials,
                      max_trials_per_task=args.trials, rpc_tracker=args.rpc_tracker,
                      rpc_key=args.rpc_key, seed=args.seed, progress=not args.no_progress,
                      verbose=args.verbose)
    except KeyboardInterrupt:
        # the logs hold every batch measured before Ctrl-C; the batch in flight is dropped
        print(f"tvm-spinn: tuning interrupted; the logs in {args.work_dir} are kept: run the same "
              "command again to resume", file=sys.stderr)
        return 130
    print(result.table())
    print(f"tuning logs in {args.work_dir} ({result.new_trials} new trials); use them with "
          f"tvm-spinn compile ... --tuning-logs {args.work_dir}")
    return 0


def _load_lib(path: str):
    from .runtime.loader import load_module

    return load_module(path)


def _order_inputs(params: list[str], arrays: dict, source: str) -> list:
    """The arrays in parameter order, matched by name (or ``arr_0``... positionally, numpy's
    names for unnamed ``np.savez`` arguments); any mismatch is one error listing both sides."""
    given = list(arrays)
    if set(given) == set(params) and len(given) == len(params):
        return [arrays[name] for name in params]
    positional = [f"arr_{i}" for i in range(len(params))]
    if sorted(given) == sorted(positional) and not set(params) & set(given):
        return [arrays[name] for name in positional]
    missing = [p for p in params if p not in arrays]
    unknown = [g for g in given if g not in params]
    detail = "; ".join(part for part in (f"missing {missing}" if missing else "",
                                         f"unknown {unknown}" if unknown else "") if part)
    raise SystemExit(f"tvm-spinn: inputs in {source!r} do not match the model: expected "
                     f"{len(params)} array(s) named {params}, got {len(given)}: {given} ({detail})")


def _call_error(err: Exception) -> str:
    """One line from a VM/runtime failure (argument checks name the parameter and its type)."""
    import re

    text = str(err).strip()
    found = re.search(r"param=([^,]+), annotation=(.*?)\)\s+(.*)$", text, re.S)
    if found:
        name, annotation, why = found.groups()
        return f"input {name!r} expects {annotation}: {' '.join(why.split())}"
    return text.splitlines()[-1] if text else type(err).__name__


def _cmd_run(args) -> int:
    import tvm
    from tvm import relax

    if args.output:
        _check_output(args.output, "output file")
    lib = _load_lib(args.library)
    vm = relax.VirtualMachine(lib, tvm.cpu())
    arity = int(vm.module["get_function_arity"]("main"))
    params = [str(vm.module["get_function_param_name"]("main", i)) for i in range(arity)]
    arrays = _read_arrays(args.inputs, "inputs", params[0] if arity == 1 else None)
    ordered = _order_inputs(params, arrays, args.inputs)
    try:
        out = vm["main"](*[tvm.runtime.tensor(a) for a in ordered])
    except (ValueError, TypeError, RuntimeError) as err:  # VM argument checks, SpinnRuntimeError
        raise SystemExit(f"tvm-spinn: cannot run {args.library!r}: {_call_error(err)}") from None
    outs = [out] if hasattr(out, "numpy") else list(out)
    arrays = {f"output{i}": o.numpy() for i, o in enumerate(outs)}
    if args.output:
        _write_npz(args.output, arrays)
        print(f"wrote {args.output}")
    for name, arr in arrays.items():
        print(f"{name}: shape {arr.shape} dtype {arr.dtype} mean {arr.mean():.6g}")
    return 0


def _cmd_report(args) -> int:
    from .report import report

    if args.model.endswith(".onnx"):
        from tvm import relax

        from .target import get_target

        ex = relax.build(_load_model(args.model, args.shape), target=get_target(args.target))
    else:
        ex = _load_lib(args.model)
    print(report(ex))
    return 0


def _cmd_plan(args) -> int:
    from .llm.plan import plan, write_json

    if args.json:
        _check_output(args.json, "JSON output")
    result = plan(args.config, target=args.target, batch=args.batch, seq=args.seq, dtype=args.dtype,
                  progress=not args.no_progress)
    print(result.table())
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvm-spinn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile", help="compile an ONNX model into a deployable library")
    p.add_argument("model", help="model file (.onnx)")
    p.add_argument("--target", default="spinn", help="spinn target tag (spinn, spinn/board, spinn/cuda, spinn/testchip, spinn/testchip/board, or a registered system)")
    p.add_argument("-o", "--output", required=True, help="output library (.so)")
    p.add_argument("--shape", action="append", default=[], help="input shape, name=1,3,224,224")
    p.add_argument("--report", action="store_true", help="print the performance report")
    p.add_argument("--tuning-logs", help="apply MetaSchedule tuning logs (a tvm-spinn tune work dir)")
    p.add_argument("--quantize", metavar="CALIBRATION.npz",
                   help="int8 post-training quantization calibrated on these samples (one array per "
                        "input with a leading sample axis; an .npy for a single-input model)")
    p.add_argument("--quant-scheme", help='quantization scheme, e.g. "uint8,per-tensor,percentile=99.9" '
                                          "or \"keep_fp32=conv2d_0\"")
    p.set_defaults(func=_cmd_compile)
    p = sub.add_parser("tune", help="autotune the fallback (non-offloaded) operators with MetaSchedule")
    p.add_argument("model", help="model file (.onnx)")
    p.add_argument("--target", default="spinn", help="spinn target tag, or llvm for the whole model on CPU")
    p.add_argument("--work-dir", default="logs", help="where the tuning logs go (resumed if present)")
    p.add_argument("--trials", type=int, default=64, help="trials per task")
    p.add_argument("--max-trials", type=int, default=None, help="global trial budget")
    p.add_argument("--shape", action="append", default=[], help="input shape, name=1,3,224,224")
    p.add_argument("--rpc-tracker", help="measure on RPC servers of this tracker (host:port)")
    p.add_argument("--rpc-key", help="device key of the RPC servers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true",
                   help="echo MetaSchedule's log to stderr (it always goes to WORK_DIR/logs)")
    p.set_defaults(func=_cmd_tune)
    p = sub.add_parser("run", help="run a compiled library on inputs from an .npz file")
    p.add_argument("library")
    p.add_argument("--inputs", required=True,
                   help=".npz with one array per model input, keyed by the input names (arr_0, arr_1... "
                        "for unnamed np.savez arrays, in input order); or an .npy for a single-input model")
    p.add_argument("-o", "--output", help="write outputs to this .npz")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("report", help="performance report of a library or an ONNX model")
    p.add_argument("model", help="compiled library (.so) or model (.onnx)")
    p.add_argument("--target", default="spinn")
    p.add_argument("--shape", action="append", default=[])
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("plan", help="plan LLM decoding from a transformers config alone (no weights, timing model)")
    p.add_argument("config", help="transformers config.json (model_type llama or gpt2), e.g. the shipped "
                                  "python/tvm_spinn/llm/configs/llama-2-70b.json")
    p.add_argument("--target", default="spinn/board", help="spinn system (spinn, spinn/board, spinn/cloud, ...)")
    p.add_argument("--batch", type=int, default=1, help="users decoding together")
    p.add_argument("--seq", type=int, default=None, help="context length (prompt and KV-cache slots); default "
                                                        "2048, or the model's position limit where shorter")
    p.add_argument("--dtype", default="int8", choices=("int8", "fp32"), help="weight GEMM arithmetic")
    p.add_argument("--json", help="write the plan as JSON here (atomically)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import tvm_spinn  # noqa: F401  (registers targets, codegen and the runtime loader)

    try:
        return args.func(args)
    except (ValueError, OSError) as err:
        print(f"tvm-spinn: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
