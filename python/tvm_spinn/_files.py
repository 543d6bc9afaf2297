"""Writing output files: checked, atomic and durable. A leaf module: every layer may use it.

Every writer of the package (``compile -o``, ``run -o``, ``plan --json``, tuning manifests,
:func:`tvm_spinn.export_library`, checkpoints) goes through :func:`atomic_output` or
:func:`atomic_write`:

* the destination is checked before anything is written (:func:`output_destination`): a
  symbolic link is followed and its *target* is replaced, never the link; an existing device,
  FIFO, socket or directory is refused (``/dev/null`` included: writing there would replace the
  device node when run as root); the output may not be one of the command's inputs;
* the content goes to a temporary file in the destination's directory, is flushed to disk and
  renamed over the destination (:func:`os.replace`, atomic on POSIX): readers and a crash see
  the old file or the complete new one, never half of one; on any failure (Ctrl-C included) the
  temporary file is removed and the destination is left as it was;
* the file gets the mode the umask gives a new file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import BinaryIO, Callable, Iterable, Iterator

__all__ = ["OutputPathError", "atomic_output", "atomic_write", "file_mode", "output_destination"]


class OutputPathError(ValueError):
    """An output path that must not be written (a device, FIFO, socket, directory, or an input)."""


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


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def output_destination(path: "str | os.PathLike", what: str = "output",
                       inputs: Iterable["str | os.PathLike"] = (), skip_hint: str | None = None) -> str:
    """The file that writing ``path`` replaces, after checking that it may be replaced.

    Parameters
    ----------
    path : str or os.PathLike
        The output path as given.
    what : str
        What the file is, for messages (``"output library"``).
    inputs : iterable of paths
        Files the command reads; the output may be none of them.
    skip_hint : str, optional
        How to run without writing the output, appended to the refusal of ``/dev/null``.

    Returns
    -------
    str
        Absolute path of the regular file to create or replace: ``path`` itself, or the final
        target of a symbolic link (a dangling link's target is created).

    Raises
    ------
    OutputPathError
        ``path`` (or its link target) is a device, FIFO, socket or directory, is one of
        ``inputs``, or its directory does not exist.
    """
    given = os.fspath(path)
    if not given:
        raise OutputPathError(f"{what}: empty file name")
    dest = os.path.realpath(given)  # follows every link: the target is what gets replaced
    shown = repr(given) if dest == os.path.abspath(given) else f"{given!r} (a link to {dest!r})"
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        st = None
    except OSError as err:
        raise OutputPathError(f"cannot write {what} {shown}: {err.strerror}") from None
    if st is not None:
        kind = _kind(st.st_mode)
        if kind is not None:
            message = f"refusing to write {what} {shown}: it is {kind}, and outputs are written to regular files only"
            if dest == os.devnull:
                message += f" ({os.devnull} is refused too: replacing it would break the system"
                message += f"; {skip_hint})" if skip_hint else ")"
            raise OutputPathError(message)
    directory = os.path.dirname(dest)
    if not os.path.isdir(directory):
        raise OutputPathError(f"cannot write {what} {shown}: directory {directory!r} does not exist")
    for source in inputs:
        source = os.fspath(source)
        same = os.path.realpath(source) == dest
        if not same and st is not None:
            with contextlib.suppress(OSError):
                same = os.path.samefile(source, dest)  # hard links, bind mounts
        if same:
            raise OutputPathError(f"{what} {shown} is the input {source!r}: writing it would destroy "
                                  "the input; give another output file")
    return dest


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_output(path: "str | os.PathLike", *, what: str = "output",
                  inputs: Iterable["str | os.PathLike"] = (), skip_hint: str | None = None,
                  suffix: str = ".tmp", executable: bool = False, fsync: bool = True) -> Iterator[str]:
    """Yield a temporary file name to write; on success it replaces the checked destination.

    For writers that need a file name (a compiler, TVM's ``export_library``); see
    :func:`output_destination` for the checks and :func:`atomic_write` for a file object.
    ``suffix`` ends the temporary name (tools that pick a format by extension); ``executable``
    gives the file the executable mode the umask allows; ``fsync`` flushes the file and the
    rename to disk.
    """
    dest = output_destination(path, what, inputs, skip_hint)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}.", suffix=suffix,
                               dir=os.path.dirname(dest))
    os.close(fd)
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(tmp, file_mode(executable))  # mkstemp creates 0600
        # the destination may have been replaced by a device or FIFO meanwhile: check again
        output_destination(dest, what, inputs, skip_hint)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(os.path.dirname(dest))


def atomic_write(path: "str | os.PathLike", write: Callable[[BinaryIO], None], *,
                 fsync: bool = True, what: str = "output", inputs: Iterable["str | os.PathLike"] = (),
                 skip_hint: str | None = None) -> None:
    """Write ``path`` through ``write(f)`` (``f`` a binary file object), checked and atomically.

    Readers see the previous file or the complete new one, never a half-written one; on any
    failure the temporary file is removed and ``path`` is left as it was. A link is followed
    (its target is replaced); devices, FIFOs, sockets, directories and ``inputs`` are refused
    with :class:`OutputPathError` (see :func:`output_destination`). ``fsync``: flush to disk
    before the rename.
    """
    inputs = list(inputs)
    with atomic_output(path, what=what, inputs=inputs, skip_hint=skip_hint, fsync=False) as tmp:
        with open(tmp, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    if fsync:
        _fsync_dir(os.path.dirname(os.path.realpath(path)))
