"""Autotuning the fallback with MetaSchedule, and the build options that reuse the logs.

Tune, then build with the logs::

    import tvm_spinn
    result = tvm_spinn.tune(mod, target="spinn", work_dir="logs", max_trials_per_task=64)
    print(result.table())
    with tvm_spinn.build_options(tuning_logs="logs"):
        ex = relax.build(mod, target="spinn")

* :func:`tune` extracts the fallback tasks (what spinn does not offload, legalized and fused
  like the build does), tunes them one by one (XGBoost cost model, evolutionary search, seeded)
  and writes MetaSchedule's JSON database plus ``tvm_spinn_tuning.json`` (TVM version, target,
  model hashes). Re-running resumes: trials in the logs count against the budgets. One job
  per work directory at a time (a lock; a second job gets :class:`TuningLockError` naming the
  first).
* Measurement: local by default; ``rpc_tracker="host:port", rpc_key="KEY"`` (or your own
  ``runner=``) measures on TVM RPC servers.
* Each task's default schedule is measured too and kept as a candidate
  (``work_dir/defaults``): a build applies per task the faster of default and tuned, so tuning
  never makes a task slower. :func:`roofline_table` shows where the time goes.
* :func:`build_options` is a thread-local context read by the spinn-aware default pipeline.
  spinn targets always get default schedules (dlight CPU rules + parallel/vectorize; dlight on
  GPU); plain ``llvm``/``cuda`` targets only inside the context. Without ``tuning_logs`` the
  build uses those defaults; ``default_schedules=False`` gives TVM's untuned build.
* For plain llvm targets TVM's own route works as well:
  ``relax.get_pipeline("static_shape_tuning", total_trials=..., target=..., work_dir=...)``
  tunes and applies in one pipeline; its logs can also be passed to ``build_options``.
"""

from .database import TuningLogError, validate_logs  # noqa: F401
from .job import TaskResult, TuningResult, TuningWarning, tune  # noqa: F401
from .lock import TuningLockError  # noqa: F401
from .roofline import HostPeaks, measure_host_peaks, roofline_table  # noqa: F401
from .options import BuildOptions, build_options, current_build_options  # noqa: F401
from .runner import make_runner  # noqa: F401
from .tasks import extract_fallback_tasks  # noqa: F401

__all__ = [
    "tune", "TuningResult", "TaskResult", "TuningWarning", "TuningLogError", "TuningLockError",
    "validate_logs",
    "BuildOptions", "build_options", "current_build_options", "make_runner",
    "extract_fallback_tasks", "HostPeaks", "measure_host_peaks", "roofline_table",
]
