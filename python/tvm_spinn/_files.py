"""Writing output files: atomically (a temporary file in the destination's directory, renamed
into place, removed on failure) and with the mode the umask gives a new file. A leaf module:
every layer may use it."""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable

__all__ = ["atomic_write", "file_mode"]


def _umask() -> int:
    """The process umask; from /proc where possible (``os.umask`` must set it to read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(executable: bool = False) -> int:
    """The mode the umask gives a new file (``0o777`` for executables such as libraries)."""
    return (0o777 if executable else 0o666) & ~_umask()


def atomic_write(path: "str | os.PathLike", write: Callable[[BinaryIO], None], *,
                 fsync: bool = False) -> None:
    """Write ``path`` through ``write(f)`` (``f`` a binary file object) atomically: readers see
    the previous file or the complete new one, never a half-written one; on any failure the
    temporary file is removed and ``path`` is left as it was. ``fsync``: flush to disk before
    the rename (for files whose loss after a crash matters, e.g. checkpoints)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
