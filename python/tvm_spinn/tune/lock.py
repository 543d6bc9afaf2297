"""One tuning job per work directory at a time.

MetaSchedule's JSON database only appends: two jobs writing one directory interleave their
workload lines (each job commits every workload itself, so the file holds them twice) and their
record indices no longer match, which leaves logs that neither a build nor a resumed job can
load. A job therefore holds an exclusive :func:`fcntl.flock` on ``work_dir/LOCK_FILE`` while it
runs; a second job fails at once with :class:`TuningLockError` naming the holder (pid, host,
start time). The kernel drops the lock when the holder exits, however it exits (a killed job
leaves no stale lock); the file itself stays.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import time

__all__ = ["LOCK_FILE", "TuningLockError", "WorkDirLock"]

LOCK_FILE = "tvm_spinn_tuning.lock"


class TuningLockError(RuntimeError):
    """The tuning work directory is in use by another tuning job (names its pid, host, start)."""


def _holder(path: str) -> str:
    """Who holds the lock, from the file's JSON (the holder writes it right after locking:
    read again for a moment when it is not there yet)."""
    for attempt in range(20):
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
            return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.025)
    return "a job that has not written its name"


class WorkDirLock:
    """Exclusive lock of a tuning work directory (``with WorkDirLock(work_dir): ...``).

    Parameters
    ----------
    work_dir : str
        The directory (created if missing).

    Raises
    ------
    TuningLockError
        Another process (or another job in this process) holds the directory.
    """

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, LOCK_FILE)
        self._fd: int | None = None

    def __enter__(self) -> "WorkDirLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TuningLockError(
                f"{os.path.dirname(self.path)}: this tuning work directory is in use by another tuning "
                f"job ({_holder(self.path)}; lock {self.path}): wait for it to end, or tune into "
                "another --work-dir") from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None
