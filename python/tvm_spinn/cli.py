"""``tvm-spinn`` command line: compile, run and report models for spinn systems.

The command checks its arguments (files, shapes, targets, output paths) before it imports TVM or
torch, so ``--help`` and argument errors answer at once. Library warnings (torch's per-export
``FutureWarning``\\ s, TVM's and tvm-spinn's per-op notes) are hidden unless ``--verbose``.
Ctrl-C prints one line and exits with status 130, leaving no output file.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ._interrupts import InterruptGuard

__all__ = ["main", "TARGETS"]

#: The spinn target tags registered by ``tvm_spinn.target.register_default_tags`` (a static copy,
#: checked against the registry by the tests, so that ``--help`` lists them without TVM).
TARGETS = ("spinn", "spinn/board", "spinn/cloud", "spinn/cuda", "spinn/testchip", "spinn/testchip/board")
#: Model files the command compiles, by extension.
MODEL_FORMATS = (".onnx", ".tflite", ".pt2")
#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


#: Ctrl-C during a command: TVM may turn the ``KeyboardInterrupt`` into an ordinary error that
#: its code handles, so the command asks ``check()`` before it writes and exits 130 whatever
#: became of the exception.
_INTERRUPTS = InterruptGuard()


class _Refused(Exception):
    """A refused argument or input: one line on stderr, exit status 2 (as argparse's)."""


def _fail(message: str) -> _Refused:
    return _Refused(message)


# ------------------------------------------------------------------ argument checks (no TVM here)
def _check_output(path: str, what: str, inputs: tuple = (), skip_hint: str | None = None) -> None:
    """Fail before any work when ``path`` may not be written (see :mod:`tvm_spinn._files`)."""
    from ._files import OutputPathError, output_destination

    if os.path.isdir(path):
        raise _fail(f"{what} {path!r} is a directory; give a file name")
    try:
        output_destination(path, what, [p for p in inputs if p], skip_hint)
    except OutputPathError as err:
        raise _fail(str(err)) from None
    directory = os.path.dirname(os.path.realpath(path))
    if not os.access(directory, os.W_OK | os.X_OK):
        raise _fail(f"cannot write {what} {path!r}: directory {directory!r} is not writable")


def _check_model_file(path: str, formats: tuple = MODEL_FORMATS) -> None:
    if not os.path.exists(path):
        raise _fail(f"model file {path!r} does not exist")
    if not os.path.isfile(path):
        raise _fail(f"model file {path!r} is not a regular file")
    if not path.lower().endswith(formats):
        raise _fail(f"cannot compile {path!r}: supported model formats are {', '.join(formats)}")


def _check_target(target: str | None) -> None:
    """Refuse an unknown spinn tag at once (other names, e.g. ``llvm``, are TVM's to judge)."""
    if target is not None and target.startswith("spinn") and target not in TARGETS:
        raise _fail(f"unknown spinn target {target!r}; known targets: {', '.join(TARGETS)}")


def _parse_pairs(items: list[str], option: str, example: str, value) -> dict:
    result = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            if not (sep and name and text):
                raise ValueError
            result[name] = value(text)
        except ValueError:
            raise _fail(f"bad {option} {item!r} (expected {example})") from None
    return result


def _shape(text: str) -> tuple:
    dims = tuple(int(d) for d in text.split(","))
    if any(d < 0 for d in dims):
        raise ValueError
    return dims


def _dtype(text: str) -> str:
    import numpy as np

    try:
        return str(np.dtype(text))
    except TypeError:
        raise ValueError from None


def _check_args(args) -> None:
    """Every check that needs neither TVM nor torch, before the command imports them."""
    _check_target(getattr(args, "target", None))
    if hasattr(args, "shape"):
        args.shapes = _parse_pairs(args.shape, "--shape", "name=1,3,224,224", _shape)
        args.dtypes = _parse_pairs(getattr(args, "dtype_of", None) or [], "--dtype", "name=float32", _dtype)
    command = args.command
    if command in ("compile", "tune"):
        _check_model_file(args.model)
    if command == "compile":
        if args.quant_scheme and not args.quantize:
            raise _fail("--quant-scheme needs --quantize CALIBRATION.npz")
        for path, what in ((args.quantize, "calibration data"), (args.tuning_logs, "tuning logs")):
            if path and not os.path.exists(path):
                raise _fail(f"{what} {path!r} does not exist")
        _check_output(args.output, "output library", (args.model, args.quantize),
                      "to check that a model compiles without keeping a library, use "
                      "`tvm-spinn report MODEL`")
        if args.firmware and os.path.exists(args.firmware) and not os.path.isdir(args.firmware):
            raise _fail(f"firmware directory {args.firmware!r} exists and is not a directory")
        if args.noc and not args.firmware:
            raise _fail("--noc links the firmware's images with the NoC driver: give --firmware DIR too")
        if args.self_dma and not args.firmware:
            raise _fail("--self-dma links the firmware's images with the job-table walker: give --firmware DIR too")
    elif command == "run":
        for path, what in ((args.library, "library"), (args.inputs, "inputs")):
            if not os.path.exists(path):
                raise _fail(f"{what} {path!r} does not exist")
        if args.output:
            _check_output(args.output, "output file", (args.library, args.inputs),
                          "leave out -o to print the outputs only")
    elif command == "report":
        if not os.path.exists(args.model):
            raise _fail(f"file {args.model!r} does not exist")
        if not args.model.lower().endswith(MODEL_FORMATS) and (args.target or args.shape):
            raise _fail(f"{args.model!r} is a compiled library: its target is fixed at compile time, "
                        "so --target and --shape apply to model files only")
    elif command == "plan":
        if not os.path.exists(args.config):
            raise _fail(f"config {args.config!r} does not exist")
        from .llm.spec import spec_of  # json and dataclasses only

        spec_of(args.config)  # a bad config is refused before TVM loads (LLMError: a ValueError)
        _check_plan_options(args)
        if args.system is not None and not os.path.exists(args.system):
            raise _fail(f"system description {args.system!r} does not exist")
        if args.system is not None and args.target != "spinn/board":
            raise _fail("--system names the system: leave out --target")
        if args.json:
            _check_output(args.json, "JSON output", (args.config,), "leave out --json to print the plan only")


#: ``plan`` options of training plans only, and of inference plans only (flag -> option name)
_TRAIN_ONLY = {"optimizer": "--optimizer", "micro_batch": "--micro-batch", "tp": "--tp", "pp": "--pp",
               "dp": "--dp", "zero": "--zero", "recompute": "--recompute"}
_INFERENCE_ONLY = {"dtype": "--dtype", "system": "--system", "dead_boards": "--dead-boards",
                   "dead_chips": "--dead-chips", "dead_links": "--dead-links",
                   "dead_board_links": "--dead-board-links", "boards": "--boards"}


def _check_plan_options(args) -> None:
    """``plan``'s numbers are positive, and each option belongs to the plan asked for."""
    for key in ("batch", "seq", "micro_batch", "tp", "pp", "dp"):
        value = getattr(args, key, None)
        if value is not None and value < 1:
            raise _fail(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
    if args.train:
        given = [flag for key, flag in _INFERENCE_ONLY.items() if getattr(args, key) is not None]
        if given:
            raise _fail(f"{given[0]} applies to inference plans"
                        + (": training is planned in fp32" if given[0] == "--dtype" else ""))
    else:
        given = [flag for key, flag in _TRAIN_ONLY.items() if getattr(args, key) is not None]
        given += ["--no-sequence-parallel"] if args.no_sequence_parallel else []
        given += ["--fastest"] if args.fastest else []
        if given:
            raise _fail(f"{given[0]} applies to training plans: add --train")


# ------------------------------------------------------------------------------ model loading
def _onnx_outputs(path: str) -> list[str]:
    import onnx

    return [o.name for o in onnx.load(path, load_external_data=False).graph.output]


def _tflite_outputs(path: str) -> list[str]:
    from .frontend.tflite import _parse, _read, _tensor_name

    buf, where = _read(path)
    subgraph = _parse(buf, where).Subgraphs(0)
    return [_tensor_name(subgraph, subgraph.Outputs(i)) for i in range(subgraph.OutputsLength())]


def _load_model(args):
    """``(IRModule, output names)`` of the model file ``args.model``."""
    from . import frontend

    path, lower = args.model, args.model.lower()
    shapes, dtypes = args.shapes, args.dtypes
    if lower.endswith(".onnx"):
        if dtypes:
            raise _fail("--dtype applies to .tflite models (an ONNX model declares its input types)")
        mod = frontend.from_onnx(path, shapes or None)
        return mod, _onnx_outputs(path)
    if lower.endswith(".tflite"):
        mod = frontend.from_tflite(path, shapes or None, dtypes or None)
        return mod, _tflite_outputs(path)
    if shapes or dtypes:
        raise _fail(f"{path!r} is a torch.export program: its input shapes and types are fixed in it "
                    "(export it again for others); leave out --shape/--dtype")
    from .frontend.pytorch import from_exported_file

    return from_exported_file(path)


#: Library chatter hidden unless --verbose (or TVM_SPINN_VERBOSE): see tvm_spinn._quiet.
from ._quiet import quiet as _quiet  # noqa: E402  (no TVM or torch import: --help stays fast)


# ----------------------------------------------------------------------------------- commands
def _cmd_compile(args) -> int:
    from tvm import relax

    from .target import get_target

    target = get_target(args.target or "spinn")
    mod, output_names = _load_model(args)
    if args.quantize:
        mod = _quantize(mod, args.quantize, args.quant_scheme)
    if args.tuning_logs:
        from .tune import build_options

        with build_options(tuning_logs=args.tuning_logs):
            ex = relax.build(mod, target=target)
    else:
        ex = relax.build(mod, target=target)
    from .runtime.loader import export_library

    firmware = None
    if args.firmware:  # built (and every layer checked) before anything is written
        from .pe.firmware import build_firmware, programs_of

        firmware = build_firmware(programs_of(ex), noc=args.noc, self_dma=args.self_dma)
    _INTERRUPTS.check()  # a Ctrl-C that TVM swallowed: write nothing
    export_library(ex, args.output, output_names=output_names)  # checked, atomic, sealed
    print(f"wrote {args.output}")
    if firmware is not None:
        from .pe.firmware import write_firmware

        write_firmware(firmware, args.firmware)
        print(f"wrote firmware {args.firmware} ({len(firmware.files)} files and manifest.json)")
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
        raise _fail(f"cannot read {what} {path!r}: {err}") from None
    if isinstance(data, np.ndarray):  # .npy: one array
        if single_name is None:
            raise _fail(f"{what} {path!r} is a single .npy array but the model has "
                        f"several inputs: give an .npz with one array per input name")
        return {single_name: data}
    with data:
        try:
            return {name: data[name] for name in data.files}
        except Exception as err:
            raise _fail(f"cannot read {what} {path!r}: {err}") from None


def _quantize(mod, calibration: str, scheme: str | None):
    """Post-training quantization with samples from an .npz: one array per input, each with a
    leading sample axis (``name`` keys as the model's inputs, or ``arr_0``... in input order); an
    .npy for a single-input model."""
    from .quant import QuantScheme, quantize

    params = [p.name for p in mod["main"].params]
    arrays = _read_arrays(calibration, "calibration data", params[0] if len(params) == 1 else None)
    if not arrays:
        raise _fail(f"calibration data {calibration!r} has no arrays")
    counts = {name: a.shape[0] if a.ndim else 0 for name, a in arrays.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise _fail(f"calibration arrays in {calibration!r} need the same leading "
                    f"sample axis, got {counts}")
    n = next(iter(counts.values()))
    ordered = _order_inputs(params, arrays, calibration)  # same matching as `run --inputs`
    samples = [[a[i] for a in ordered] for i in range(n)]
    return quantize(mod, samples, QuantScheme.parse(scheme) if scheme else None)


def _cmd_tune(args) -> int:
    from .tune import tune

    mod, _ = _load_model(args)
    result = tune(mod, target=args.target or "spinn", work_dir=args.work_dir, max_trials=args.max_trials,
                  max_trials_per_task=args.trials, rpc_tracker=args.rpc_tracker,
                  rpc_key=args.rpc_key, seed=args.seed, progress=not args.no_progress,
                  verbose=args.verbose)
    print(result.table())
    print(f"tuning logs in {args.work_dir} ({result.new_trials} new trials); use them with "
          f"tvm-spinn compile ... --tuning-logs {args.work_dir}")
    return 0


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
    raise _fail(f"inputs in {source!r} do not match the model: expected "
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


def _output_names(library: str, count: int) -> list[str]:
    """The model's output names kept in the library (``output0``... when it has none, e.g. a
    library exported by the Python API or by TVM's ``export_library``, or when their number
    differs). Called after :func:`~tvm_spinn.load_module` accepted the library."""
    from .runtime.loader import LibraryError, verify_library

    try:
        names = verify_library(library).get("outputs")
    except LibraryError:  # loaded, so a library as TVM exports it: it has no record
        names = None
    if isinstance(names, list) and len(names) == count and len(set(names)) == count and all(names):
        return [str(n) for n in names]
    return [f"output{i}" for i in range(count)]


def _cmd_run(args) -> int:
    import tvm
    from tvm import relax

    from .runtime.loader import load_module

    lib = load_module(args.library)
    vm = relax.VirtualMachine(lib, tvm.cpu())
    arity = int(vm.module["get_function_arity"]("main"))
    params = [str(vm.module["get_function_param_name"]("main", i)) for i in range(arity)]
    arrays = _read_arrays(args.inputs, "inputs", params[0] if arity == 1 else None)
    ordered = _order_inputs(params, arrays, args.inputs)
    try:
        out = vm["main"](*[tvm.runtime.tensor(a) for a in ordered])
    except (ValueError, TypeError, RuntimeError) as err:  # VM argument checks, SpinnRuntimeError
        _INTERRUPTS.check()
        raise _fail(f"cannot run {args.library!r}: {_call_error(err)}") from None
    outs = [out] if hasattr(out, "numpy") else list(out)
    arrays = dict(zip(_output_names(args.library, len(outs)), (o.numpy() for o in outs)))
    if args.output:
        import numpy as np

        from ._files import atomic_write

        _INTERRUPTS.check()
        atomic_write(args.output, lambda f: np.savez(f, **arrays), what="output file",
                     inputs=(args.library, args.inputs))  # a file object: numpy adds no ".npz"
        print(f"wrote {args.output}")
    for name, arr in arrays.items():
        print(f"{name}: shape {arr.shape} dtype {arr.dtype} mean {arr.mean():.6g}")
    return 0


def _cmd_report(args) -> int:
    from .report import report

    if args.model.lower().endswith(MODEL_FORMATS):
        from tvm import relax

        from .target import get_target

        ex = relax.build(_load_model(args)[0], target=get_target(args.target or "spinn"))
    else:
        from .runtime.loader import load_module

        ex = load_module(args.model)
    print(report(ex))
    return 0


def _cmd_plan(args) -> int:
    if args.train:
        return _cmd_plan_train(args)
    from .llm.plan import plan, write_json

    target, registered = _described_system(args)
    try:
        result = plan(args.config, target=target, batch=1 if args.batch is None else args.batch, seq=args.seq,
                      dtype=args.dtype or "int8", progress=not args.no_progress,
                      handover=args.handover, patches=args.patches, reduce=args.reduce)
    finally:
        if registered:
            from .target import unregister_system

            unregister_system(target)
    return _show_and_write(result, args.json, write_json)


#: ``plan``'s options describing a machine as it is (flag -> SpinnArch field)
_FAULT_OPTIONS = {"dead_chips": "--dead-chips", "dead_links": "--dead-links", "dead_board_links": "--dead-board-links",
                  "dead_boards": "--dead-boards", "boards": "--boards"}


def _described_system(args) -> tuple[str, bool]:
    """The target ``plan`` plans on: ``--target``, or the system of ``--system FILE``, with the
    fault options applied (registered for the call under a name derived from its faults:
    ``(tag, True)``); ``(args.target, False)`` when none is given."""
    import hashlib
    import json

    from .target import arch_of, register_system
    from .target.faults import FAULT_FIELDS, load_system, parse_ids

    given = {field: getattr(args, field) for field in _FAULT_OPTIONS if getattr(args, field) is not None}
    if args.system is None and not given:
        return args.target, False
    arch = load_system(args.system)[0] if args.system is not None else arch_of(args.target)
    arch = arch.replace(**{"allocated_boards" if field == "boards" else field: parse_ids(value, _FAULT_OPTIONS[field])
                           for field, value in given.items()})
    faults = json.dumps({f: getattr(arch, f) for f in FAULT_FIELDS}, sort_keys=True)
    name = f"{arch.name}-as-is-{hashlib.sha256(faults.encode()).hexdigest()[:8]}"
    return register_system(arch.replace(name=name), tag=f"spinn/{name}", fallback=arch.host_fallback), True


def _show_and_write(result, path, write_json) -> int:
    """Print a plan's table; write its JSON to ``path`` (atomically) unless Ctrl-C came first."""
    print(result.table())
    if path:
        _INTERRUPTS.check()
        write_json(result, path)
        print(f"wrote {path}")
    return 0


def _cmd_plan_train(args) -> int:
    from .training.planner import plan_training, write_json

    recompute = {"on": True, "off": False, None: None, "auto": None}[args.recompute]
    result = plan_training(args.config, args.target, seq=args.seq, global_batch=args.batch,
                           micro_batch=args.micro_batch, optimizer=args.optimizer or "adamw", tp=args.tp, pp=args.pp,
                           dp=args.dp, zero=args.zero, recompute=recompute,
                           sequence_parallel=not args.no_sequence_parallel, reproducible=not args.fastest)
    return _show_and_write(result, args.json, write_json)


#: What Ctrl-C leaves behind, per command (one line on stderr).
_INTERRUPTED_NOTE = {
    "tune": "tuning interrupted; the records measured so far are kept in {work_dir}: run the same "
            "command again to resume",
    "compile": "interrupted; no library written",
    "run": "interrupted; no output written",
    "plan": "interrupted; nothing written",
    "report": "interrupted",
}


def _add_model_options(p, verbose: bool = True) -> None:
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                   help="static input shape, e.g. x=1,3,224,224 (inputs with dynamic dims)")
    p.add_argument("--dtype", action="append", default=[], dest="dtype_of", metavar="NAME=DTYPE",
                   help="input dtype of a .tflite model, e.g. x=float32 (defaults to the file's)")
    if verbose:
        p.add_argument("--verbose", action="store_true",
                       help="show library warnings and per-operator notes (hidden by default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvm-spinn", description="Compile, tune, run and report models for spinn systems; plan LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    targets = ", ".join(TARGETS)
    models = "model file (.onnx, .tflite, or a torch.export program .pt2)"
    p = sub.add_parser("compile", help="compile a model into a deployable library")
    p.add_argument("model", help=models)
    p.add_argument("--target", help=f"spinn target tag: {targets} (default spinn), or a "
                                    "system registered with tvm_spinn.register_system")
    p.add_argument("-o", "--output", required=True, help="output library (.so), written atomically")
    p.add_argument("--report", action="store_true", help="print the performance report")
    p.add_argument("--firmware", metavar="DIR", help="also write the PE firmware (ELF images and "
                                                     "manifest.json) to this directory")
    p.add_argument("--noc", action="store_true", help="with --firmware: link every image with the PE "
                                                      "runtime's NoC driver and barrier (its PEs can run concurrently)")
    p.add_argument("--self-dma", action="store_true", help="with --firmware: link every image with the job-table "
                                                           "walker and write each region's command table (every PE "
                                                           "places its own operands with its DMA engine)")
    p.add_argument("--tuning-logs", help="apply MetaSchedule tuning logs (a tvm-spinn tune work dir)")
    p.add_argument("--quantize", metavar="CALIBRATION.npz",
                   help="int8 post-training quantization calibrated on these samples (one array per "
                        "input with a leading sample axis; an .npy for a single-input model)")
    p.add_argument("--quant-scheme", help='quantization scheme, e.g. "uint8,per-tensor,percentile=99.9" '
                                          "or \"keep_fp32=conv2d_0\"")
    _add_model_options(p)
    p.set_defaults(func=_cmd_compile)
    p = sub.add_parser("tune", help="autotune the fallback (non-offloaded) operators with MetaSchedule")
    p.add_argument("model", help=models)
    p.add_argument("--target", help=f"spinn target tag ({targets}; default spinn), or llvm for the "
                                    "whole model on CPU")
    p.add_argument("--work-dir", default="logs",
                   help="where the tuning logs go (resumed if present; one job at a time)")
    p.add_argument("--trials", type=int, default=64, help="trials per task")
    p.add_argument("--max-trials", type=int, default=None, help="global trial budget")
    p.add_argument("--rpc-tracker", help="measure on RPC servers of this tracker (host:port)")
    p.add_argument("--rpc-key", help="device key of the RPC servers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_options(p, verbose=False)
    p.add_argument("--verbose", action="store_true",
                   help="echo MetaSchedule's log and library warnings to stderr (the log always goes "
                        "to WORK_DIR/logs)")
    p.set_defaults(func=_cmd_tune)
    p = sub.add_parser("run", help="run a compiled library on inputs from an .npz file")
    p.add_argument("library")
    p.add_argument("--inputs", required=True,
                   help=".npz with one array per model input, keyed by the input names (arr_0, arr_1... "
                        "for unnamed np.savez arrays, in input order); or an .npy for a single-input model")
    p.add_argument("-o", "--output", help="write the outputs to this .npz, keyed by the model's output names")
    p.add_argument("--verbose", action="store_true", help="show library warnings")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("report", help="performance report of a library or a model file")
    p.add_argument("model", help="compiled library (.so) or " + models)
    p.add_argument("--target", help=f"for a model file: spinn target tag ({targets}; default spinn)")
    _add_model_options(p)
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("plan", help="plan LLM decoding (or, with --train, training) from a transformers config "
                                    "alone (no weights, timing model)")
    p.add_argument("config", help="transformers config.json (model_type gpt2, llama, mistral, qwen2, phi3, gemma2, "
                                  "mixtral, gptj or falcon; --train: gpt2, llama, mistral, "
                                  "qwen2 or phi3), "
                                  "e.g. the shipped python/tvm_spinn/llm/configs/llama-2-70b.json")
    p.add_argument("--target", default="spinn/board", help=f"spinn system ({targets}; default spinn/board)")
    p.add_argument("--batch", type=int, default=None, help="users decoding together (default 1); with --train, "
                                                           "sequences per training step (default 512)")
    p.add_argument("--seq", type=int, default=None, help="context length (prompt and KV-cache slots; with --train, "
                                                        "tokens per sequence); default 2048, or the model's "
                                                        "position limit where shorter")
    p.add_argument("--dtype", default=None, choices=("int8", "fp32"), help="weight GEMM arithmetic (default int8; "
                                                                         "inference plans)")
    p.add_argument("--handover", default="fp32", choices=("fp32", "fp16", "int8"),
                   help="activations handed over between boards (fp32 keeps the model's bits; inference plans)")
    p.add_argument("--reduce", default="int32", choices=("int32", "fp16", "bf16", "int8"),
                   help="partial sums all-reduced across the boards of a tensor-parallel block (int32 keeps the "
                        "model's bits; fp16/bf16/int8: dequantized and sent narrowed, int8 in chunks of 64 "
                        "elements with an fp32 scale each; inference plans)")
    p.add_argument("--patches", action="store_true",
                   help="also plan on every smaller patch of boards of the system and keep the fastest "
                        "(a plan may leave boards idle; slower to plan; inference plans)")
    p.add_argument("--train", action="store_true",
                   help="plan fp32 training instead: memory per chip, the TP x PP x DP split and ZeRO stage "
                        "(searched unless given), time per step, tokens/s, efficiency")
    p.add_argument("--optimizer", choices=("adamw", "momentum", "sgd"), default=None,
                   help="with --train: AdamW (default), SGD with momentum, or SGD")
    p.add_argument("--micro-batch", type=int, default=None, help="with --train: sequences per micro-batch")
    for axis, what in (("tp", "tensor"), ("pp", "pipeline"), ("dp", "data")):
        p.add_argument(f"--{axis}", type=int, default=None, help=f"with --train: {what} parallel size")
    p.add_argument("--zero", type=int, choices=(0, 1, 2), default=None, help="with --train: ZeRO stage")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default=None,
                   help="with --train: full activation recomputation (default auto: searched)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="with --train: tensor parallelism without Megatron's sequence parallelism")
    p.add_argument("--fastest", action="store_true",
                   help="with --train: let reductions take the fastest order (bits then depend on the split)")
    p.add_argument("--system", default=None, metavar="FILE",
                   help="inference plans: a system description (JSON: 'base' target or 'boards', and the fault "
                        "fields below; see docs/guide) planned instead of --target")
    p.add_argument("--dead-boards", default=None, metavar="IDS", help="inference plans: boards that do not work "
                                                                     "(e.g. 3,7 or 10-12)")
    p.add_argument("--dead-chips", default=None, metavar="IDS", help="inference plans: chips that do not work")
    p.add_argument("--dead-links", default=None, metavar="PAIRS",
                   help="inference plans: chip links that do not work, chip:direction (0 E 1 NE 2 N 3 W 4 SW 5 S)")
    p.add_argument("--dead-board-links", default=None, metavar="PAIRS",
                   help="inference plans: board edges whose serial link does not work, board:edge (0-5)")
    p.add_argument("--boards", default=None, metavar="IDS",
                   help="inference plans: the boards allocated to this job (e.g. 0-23 of spinn/cloud); default all")
    p.add_argument("--json", help="write the plan as JSON here (atomically)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="show library warnings")
    p.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (130 after Ctrl-C)."""
    args = build_parser().parse_args(argv)
    note = _INTERRUPTED_NOTE.get(args.command, "interrupted").format(work_dir=getattr(args, "work_dir", ""))
    _INTERRUPTS.interrupted = False
    import tvm_spinn

    # The command process only exits after the command: a late Ctrl-C must not turn a finished
    # command into a death by signal while the interpreter shuts down. In-process callers get
    # their handler back.
    _INTERRUPTS.after = signal.SIG_IGN if tvm_spinn._deferred() else None
    with _INTERRUPTS:
        try:
            try:
                _check_args(args)
                import tvm_spinn

                with _quiet(args.verbose):
                    tvm_spinn._initialize()  # registers targets, codegen and the runtime loader
                    rc = args.func(args)
                _INTERRUPTS.check()
                return rc
            except KeyboardInterrupt:
                raise
            except BaseException:
                if _INTERRUPTS.interrupted:  # whatever Ctrl-C became on its way out of TVM
                    raise KeyboardInterrupt from None
                raise
        except KeyboardInterrupt:
            _INTERRUPTS.handled()  # exit 130, not death by SIGINT (see handled())
            print(f"tvm-spinn: {note}", file=sys.stderr)
            import tvm_spinn

            if tvm_spinn._deferred():
                # the process is the command and ends now: objects that the interrupt left
                # half torn down (MetaSchedule's worker pools) may fail in their finalizers
                # while it exits; the line above is what the user gets
                sys.unraisablehook = lambda unraisable: None
            return INTERRUPTED
        except _Refused as err:
            print(f"tvm-spinn: {err}", file=sys.stderr)
            return 2
        except _error_types() as err:
            print(f"tvm-spinn: error: {err}", file=sys.stderr)
            return 2


def _error_types() -> tuple:
    """Errors that reach the user as one line: bad input (ValueError: every tvm-spinn input
    error derives from it), files (OSError), an index out of range in the inputs (IndexError), a tuning work directory held by another job, a
    file that is no torch.export program."""
    kinds: tuple = (ValueError, OSError, IndexError)  # IndexError: an id past an embedding table
    for module, name in (("tvm_spinn.tune.lock", "TuningLockError"),
                         ("tvm_spinn.frontend.pytorch", "PyTorchImportError")):
        if module in sys.modules:
            kinds += (getattr(sys.modules[module], name),)
    return kinds


if __name__ == "__main__":
    sys.exit(main())
