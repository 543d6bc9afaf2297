"""tvm-spinn: an Apache TVM (Relax) plugin for SpiNNaker2-class many-core systems.

Importing the package registers the ``spinn`` targets, the ``relax.ext.spinn`` codegen, the
runtime module loader and the spinn-aware default build pipeline, so that
``relax.build(mod, target="spinn")`` offloads by itself. TVM imports it automatically through
the ``tvm.backends`` entry point.
"""



def _autoload() -> None:
    """Entry point of the ``tvm.backends`` group, called at ``import tvm``.

    Importing this package registers everything; when ``import tvm`` happens *inside* our own
    import (tvm_spinn imports tvm), the outer import finishes the job.
    """


from . import _lib  # noqa: E402

_lib.load_library()

from . import frontend  # noqa: E402
from .codegen import codegen_spinn  # noqa: E402,F401  (registers relax.ext.spinn)
from .mapping import MappingError, MappingOptions  # noqa: E402
from .partition import partition_for_spinn, summarize_partition  # noqa: E402
from .pipeline import install as _install_pipeline  # noqa: E402
from .report import Report, find_spinn_modules as report_modules, report  # noqa: E402
from .runtime import executor as _executor  # noqa: E402,F401  (registers the runtime callback)

import tvm_ffi as _tvm_ffi  # noqa: E402

# Raised in the runtime callback, the error crosses the FFI (VM -> spinn module -> Python); once
# registered it comes back to the caller as itself instead of a plain RuntimeError.
_tvm_ffi.register_error("tvm_spinn.SpinnRuntimeError", _executor.SpinnRuntimeError)
SpinnRuntimeError = _executor.SpinnRuntimeError
from .runtime import loader as _loader  # noqa: E402
from .runtime.loader import LibraryError, export_library, load_module  # noqa: E402
from .quant import QuantizationError, QuantScheme, quantizable_layers, quantize  # noqa: E402
from .tune import BuildOptions, TuningLogError, TuningResult, build_options, tune  # noqa: E402
from .target import (  # noqa: E402
    ArchError, SpinnArch, arch_of, get_target, host_target, known_targets, make_system,
    register_default_tags, register_system,
)

from . import training  # noqa: E402  (cheap: relax.training and torch are imported on use)
from ._version import __version__  # noqa: E402

register_default_tags()
_install_pipeline()
_loader.install_export_hook()  # ex.export_library of spinn builds writes sealed libraries


__all__ = [
    "frontend", "MappingOptions", "MappingError", "load_module", "export_library", "LibraryError", "SpinnRuntimeError", "partition_for_spinn", "summarize_partition", "report", "report_modules", "Report", "SpinnArch",
    "ArchError", "make_system", "register_system", "get_target", "known_targets", "arch_of", "host_target",
    "tune", "build_options", "BuildOptions", "TuningResult", "TuningLogError",
    "quantize", "quantizable_layers", "QuantScheme", "QuantizationError", "training",
]
