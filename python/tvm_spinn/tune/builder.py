"""A MetaSchedule builder that compiles in this process.

MetaSchedule's default ``LocalBuilder`` starts fresh worker processes for every batch and each
imports ``tvm.s_tir.tensor_intrin`` (tens of seconds here), so its 30 s timeout kills every
build. Building in-process avoids both; a failed build becomes that candidate's error message.
"""

from __future__ import annotations

import tvm
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import default_export
from tvm.ir.utils import derived_object

__all__ = ["InProcessBuilder"]


@derived_object
class InProcessBuilder(PyBuilder):
    """Build each candidate with ``tvm.compile`` here and export it as a tar for the runner."""

    def build(self, build_inputs):  # noqa: D102
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        results = []
        for item in build_inputs:
            try:
                mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(item.mod)
                results.append(BuilderResult(default_export(tvm_build(mod, target=item.target)), None))
            except Exception as err:  # noqa: BLE001  (a bad candidate, not a bad job)
                results.append(BuilderResult(None, f"InProcessBuilder: {type(err).__name__}: {err}"))
        return results
