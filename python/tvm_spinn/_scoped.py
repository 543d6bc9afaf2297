"""Options objects usable as thread-local, nestable ``with`` contexts.

``relax.build`` has no slot for backend options, so the spinn passes read the innermost active
options object of each kind (``MappingOptions``, ``BuildOptions``) from here.
"""

from __future__ import annotations

import threading

__all__ = ["ScopedOptions"]


class ScopedOptions:
    """Mixin: ``with options:`` makes ``type(options).current()`` return it in this thread."""

    _state: threading.local

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._state = threading.local()  # one stack per options kind

    def __enter__(self):
        stack = getattr(type(self)._state, "stack", [])
        stack.append(self)
        type(self)._state.stack = stack
        return self

    def __exit__(self, *exc) -> None:
        type(self)._state.stack.pop()

    @classmethod
    def current(cls):
        """The innermost active options of this kind, or None."""
        stack = getattr(cls._state, "stack", [])
        return stack[-1] if stack else None
