"""Re-export of :mod:`tvm_spinn._tuning_db` (moved below ``fallback``, which applies tuning logs).

``tune`` builds on ``fallback``, so the tuning-log database lives in a lower module and this
name stays importable.
"""

from .._tuning_db import *  # noqa: F401,F403
from .._tuning_db import (  # noqa: F401
    MANIFEST_FORMAT, __all__, _lines, _parse, _set_aside_partial_tail, _target_kind, _write_manifest,
)
