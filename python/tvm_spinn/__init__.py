"""tvm-spinn: an Apache TVM (Relax) plugin for SpiNNaker2-class many-core systems.

Importing the package registers the ``spinn`` targets, the ``relax.ext.spinn`` codegen, the
runtime module loader and the ``spinn`` build pipeline, so that
``relax.build(mod, target="spinn")`` offloads by itself (:mod:`tvm_spinn.integration` lists every
point where the package plugs into TVM). TVM imports it automatically through the
``tvm.backends`` entry point (``TVM_DEVICE_BACKEND_AUTOLOAD=0`` turns that off).
"""



def _autoload() -> None:
    """Entry point of the ``tvm.backends`` group, called at ``import tvm``.

    Importing this package registers everything; when ``import tvm`` happens *inside* our own
    import (tvm_spinn imports tvm), the outer import finishes the job.
    """


import os as _os
import sys as _sys

from ._version import __version__


def _deferred() -> bool:
    """Whether this process is the ``tvm-spinn`` command (its console script, or ``python -m
    tvm_spinn.cli``). The command checks its arguments (and answers ``--help``) before it needs
    TVM or torch, which take seconds to import, and then calls :func:`_initialize` itself."""
    if _sys.argv and _os.path.basename(_sys.argv[0]) in ("tvm-spinn", "tvm-spinn-script.py"):
        return True
    args = list(getattr(_sys, "orig_argv", []))[1:]
    i = 0
    while i < len(args) and args[i].startswith("-"):  # interpreter options, up to -m
        if args[i] == "-m":
            return args[i + 1:i + 2] == ["tvm_spinn.cli"]
        i += 2 if args[i] in ("-X", "-W") else 1
    return False


_initialized = False


def _initialize() -> None:
    """Load the runtime library and register the targets, codegen, pipeline and loader; bind
    the public names (idempotent: runs at import, or when the command line is ready for it)."""
    global _initialized
    if _initialized:
        return
    _initialized = True  # first: importing TVM below calls back into this package
    try:
        _register()
    except BaseException:
        _initialized = False
        raise


def _register() -> None:
    from . import _lib

    _lib.load_library()

    from . import frontend
    from .codegen import codegen_spinn  # noqa: F401  (registers relax.ext.spinn)
    from .mapping import MappingError, MappingOptions
    from .options import SpinnOptions
    from .partition import partition_for_spinn, summarize_partition
    from .report import Report, find_spinn_modules as report_modules, report
    from .runtime import executor as _executor  # registers the runtime callback
    from .runtime import simulator as _simulator

    _simulator.register_mode("iss", _run_iss, _check_iss)

    SpinnRuntimeError = _executor.SpinnRuntimeError
    from .runtime.loader import LibraryError, export_library, load_module
    from .quant import QuantizationError, QuantScheme, quantizable_layers, quantize
    from .tune import BuildOptions, TuningLogError, TuningResult, build_options, tune
    from .target import (
        ArchError, SpinnArch, arch_of, get_target, host_target, known_targets, make_system,
        register_default_tags, register_system,
    )

    from . import training  # noqa: F401  (cheap: relax.training and torch are imported on use)

    from . import integration as _integration

    # every registration with TVM, and the hooks it has no registry for (see integration.py)
    _integration.install()
    globals().update({k: v for k, v in locals().items() if not k.startswith("__")})


def _run_iss(program, inputs):
    """Simulator mode ``iss``: the program as generated PE code in the instruction-set
    simulator (imported on first use: it needs unicorn, capstone, pyelftools and ziglang)."""
    from .pe import run_program_iss

    return run_program_iss(program, inputs)


def _check_iss(program):
    """Mode ``iss`` at compile time: every layer of ``program`` has a PE kernel, else a
    :class:`tvm_spinn.pe.PeCodegenError` naming the first layer that has none and why."""
    from .pe.roles import layer_role

    for index in range(len(program.layers)):
        layer_role(program, index)


def export_firmware(ex, directory, noc: bool = False, self_dma: bool = False):
    """Write the firmware of a model compiled for a spinn target: one Cortex-M4F ELF image per
    PE role and a manifest (see :func:`tvm_spinn.pe.export_firmware`; needs the ``pe`` extra);
    ``noc``: the images linked with the PE runtime's NoC driver and barrier; ``self_dma``: with
    the job-table walker, each PE placing its own operands by DMA."""
    from .pe import export_firmware as _export

    return _export(ex, directory, noc=noc, self_dma=self_dma)


def __getattr__(name: str):
    # the command's deferred import: the public API is there as soon as it is used
    if not _initialized and name in __all__:
        _initialize()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "frontend", "MappingOptions", "MappingError", "load_module", "export_library", "export_firmware", "LibraryError", "SpinnRuntimeError", "partition_for_spinn", "summarize_partition", "report", "report_modules", "Report", "SpinnArch",
    "ArchError", "make_system", "register_system", "get_target", "known_targets", "arch_of", "host_target",
    "tune", "build_options", "BuildOptions", "SpinnOptions", "TuningResult", "TuningLogError",
    "quantize", "quantizable_layers", "QuantScheme", "QuantizationError", "training",
]


if not _deferred():
    _initialize()
