"""Remember a Ctrl-C that TVM may swallow.

A ``KeyboardInterrupt`` raised inside a Python callback of TVM's C++ code (MetaSchedule's
builder and runner, the codegen hook, the VM's packed functions) crosses the FFI boundary as an
ordinary error that code may handle. :class:`InterruptGuard` sets a flag that outlives the
exception, so the caller can turn whatever came out back into a ``KeyboardInterrupt``
(:meth:`InterruptGuard.check`). No package imports: the command line uses it before TVM loads.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["InterruptGuard"]


class InterruptGuard:
    """While active (``with``), SIGINT sets :attr:`interrupted` and raises ``KeyboardInterrupt``.

    Installed only from the main thread (Python delivers signals there only). On exit the
    previous handler comes back, or ``after`` when given (e.g. ``signal.SIG_IGN`` for a process
    that only exits afterwards).
    """

    def __init__(self) -> None:
        self.interrupted = False
        self._previous = None
        self._installed = False
        self.after = None

    def _handle(self, signum, frame) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    @staticmethod
    def handled() -> None:
        """Tell the interpreter that the ``KeyboardInterrupt`` just caught was handled.

        CPython (3.11 to 3.13) marks a ``KeyboardInterrupt`` that leaves code run by ``exec`` of
        a string (dataclasses and namedtuples build their methods that way, so a Ctrl-C during
        an import can land there) as unhandled, even when a caller catches it, and at exit
        kills the process with SIGINT instead of returning its exit status. Each completed
        ``exec`` of a string clears that mark.
        """
        exec("pass")

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if SIGINT arrived while the guard was active."""
        if self.interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            restore = self.after if self.after is not None else self._previous
            signal.signal(signal.SIGINT, restore if restore is not None else signal.default_int_handler)
            self._installed = False
