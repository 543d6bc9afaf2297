"""Re-export of :mod:`tvm_spinn._tuning_db` (moved below ``fallback``, which applies tuning logs).

``tune`` builds on ``fallback``, so the tuning-log database lives in a lower module and this
name stays importable.
"""

from .._tuning_db import *  # noqa: F401,F403
from .._tuning_db import __all__  # noqa: F401
