"""Library chatter hidden for the length of one call, unless asked for.

The frameworks tvm-spinn drives warn on every ordinary use: torch's ``FutureWarning``\\ s and
deprecations per export, notes logged by TVM, torch and onnxscript, and tvm-spinn's own
per-operator partition notes (the report already lists what stays on the fallback and why).
:func:`quiet` hides them around one command or API call. It is scoped: the caller's warning
filters and logger levels are restored when it exits, and nothing of TVM or torch is patched.
tvm-spinn's own warnings (``UserWarning``: a tuning task skipped, a failed partition) stay.

``verbose=True`` (the CLI's ``--verbose``, the API's ``verbose`` argument) or the environment
variable ``TVM_SPINN_VERBOSE`` set to a non-empty value other than ``0`` shows everything.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

from ._env import env

__all__ = ["QUIET_LOGGERS", "VERBOSE_ENV", "quiet", "verbose_requested"]

#: Loggers whose notes are hidden unless verbose: per-operator partition notes and the
#: frameworks' own chatter.
QUIET_LOGGERS = ("tvm_spinn.partition", "tvm", "torch", "onnxscript")
#: Environment variable that shows the chatter everywhere (CLI and API).
VERBOSE_ENV = "TVM_SPINN_VERBOSE"
#: Modules whose warnings are chatter (a regular expression for ``warnings.filterwarnings``).
_CHATTY_MODULES = r"(torch|tvm|tvm_ffi|onnx|onnxscript|onnxruntime|transformers)(\.|$)"


def verbose_requested(verbose: bool = False) -> bool:
    """``verbose``, or whether :data:`VERBOSE_ENV` asks for the chatter."""
    return bool(verbose) or env(VERBOSE_ENV, "0").strip() not in ("", "0")


@contextlib.contextmanager
def quiet(verbose: bool = False):
    """Hide library chatter inside the ``with`` block unless :func:`verbose_requested`.

    Parameters
    ----------
    verbose : bool
        Show everything (as does :data:`VERBOSE_ENV`).
    """
    if verbose_requested(verbose):
        yield
        return
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("ignore", module=_CHATTY_MODULES)
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
