"""A MetaSchedule builder that compiles in this process.

MetaSchedule's default ``LocalBuilder`` starts fresh worker processes for every batch and each
imports ``tvm.s_tir.tensor_intrin`` (tens of seconds here), so its 30 s timeout kills every
build. Building in-process avoids both; a failed build becomes that candidate's error message.

CUDA candidates are compiled by NVRTC, about a second each (measured on an H100 machine: 1.2 s,
nearly all of a candidate's cost), in a library call that releases the GIL: they are built on a
pool of threads (``max_workers``, default: the cores, at most 16). llvm candidates stay serial
(their compile time is mostly Python-held lowering).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import default_export
from tvm.ir.utils import derived_object

__all__ = ["InProcessBuilder"]


@derived_object
class InProcessBuilder(PyBuilder):
    """Build each candidate with ``tvm.compile`` here and export it as a tar for the runner.

    Parameters
    ----------
    max_workers : int, optional
        Threads building CUDA candidates at once (default: ``os.cpu_count()``, at most 16);
        results come back in candidate order whatever the count.
    """

    def __init__(self, max_workers: int | None = None):
        super().__init__()
        if max_workers is not None and int(max_workers) < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = int(max_workers) if max_workers is not None else min(16, os.cpu_count() or 1)

    def build(self, build_inputs):  # noqa: D102
        items = list(build_inputs)
        gpu = bool(items) and all(item.target.kind.name == "cuda" for item in items)
        if gpu and self.max_workers > 1 and len(items) > 1:
            with ThreadPoolExecutor(max_workers=min(self.max_workers, len(items))) as pool:
                return list(pool.map(_build_one, items))
        return [_build_one(item) for item in items]


def _build_one(item) -> BuilderResult:
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    try:
        mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(item.mod)
        return BuilderResult(default_export(tvm_build(mod, target=item.target)), None)
    except Exception as err:  # noqa: BLE001  (a bad candidate, not a bad job)
        return BuilderResult(None, f"InProcessBuilder: {type(err).__name__}: {err}")
