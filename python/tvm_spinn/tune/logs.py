"""Per-job loggers for a tuning job, private to that job.

Why not MetaSchedule's ``ms.logging.get_loggers_from_work_dir``: it reconfigures the *whole
process's* logging with ``logging.config.dictConfig`` on every call. That closes every handler
of every library in the process (``logging.config._clearExistingHandlers``), leaves a console
handler on the global ``tvm.s_tir.meta_schedule`` logger that prints every INFO line to stdout,
and lists the names of the handlers already on that logger in its config: a handler without a
name there (one added by a log-capture tool, the user, or anything else) makes that call and
every later one in the process fail with ``AttributeError: 'NoneType' object has no attribute
'format'`` inside ``_parameterize_config``. So each job here builds its own loggers, which are
not registered with :mod:`logging`'s manager (nobody's ``dictConfig`` or ``getLogger`` reaches
them and they reach nobody), writes them to ``work_dir/logs`` and closes them when it ends.
"""

from __future__ import annotations

import logging
import os
import re
import sys

__all__ = ["JobLogs"]

_FORMAT = logging.Formatter("%(asctime)s [%(levelname)s] %(message)s", "%Y-%m-%d %H:%M:%S")


def _file_name(name: str) -> str:
    """A task name made safe for a file name (and short: some names are very long)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100]


class JobLogs:
    """The loggers of one tuning job: one for the job (task scheduler), one per task.

    Parameters
    ----------
    work_dir : str
        Tuning work directory; logs go to ``work_dir/logs`` (appended, so a resumed job keeps
        the history): ``task_scheduler.log`` and ``task_<i>_<name>.log``.
    task_names : list of str
        Task names, in tuning order.
    verbose : bool
        Also echo INFO and above to stderr (stdout stays for results). Without it the console
        gets nothing from MetaSchedule; the files always get everything (DEBUG).
    """

    def __init__(self, work_dir: str, task_names: list[str], verbose: bool = False) -> None:
        log_dir = os.path.join(work_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        self._handlers: list[logging.Handler] = []
        console = None
        if verbose:
            console = logging.StreamHandler(sys.stderr)
            console.setLevel(logging.INFO)
            console.setFormatter(_FORMAT)
        width = len(str(max(0, len(task_names) - 1)))
        self.scheduler = self._make("tvm_spinn.tune.task_scheduler",
                                    os.path.join(log_dir, "task_scheduler.log"), console)
        self.tasks = [
            self._make(f"tvm_spinn.tune.task_{i:0{width}d}_{name}",
                       os.path.join(log_dir, f"task_{i:0{width}d}_{_file_name(name)}.log"), console)
            for i, name in enumerate(task_names)
        ]
        if console is not None:
            self._handlers.append(console)

    def _make(self, name: str, path: str, console: logging.Handler | None) -> logging.Logger:
        # logging.Logger(...) directly, not logging.getLogger: unregistered, so private.
        logger = logging.Logger(name, logging.DEBUG)
        logger.propagate = False
        handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=True)
        handler.setLevel(logging.DEBUG)
        handler.setFormatter(_FORMAT)
        logger.addHandler(handler)
        self._handlers.append(handler)
        if console is not None:
            logger.addHandler(console)
        return logger

    def close(self) -> None:
        """Flush and close every file of the job (idempotent)."""
        for handler in self._handlers:
            handler.close()
        self._handlers = []

    def __enter__(self) -> "JobLogs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
