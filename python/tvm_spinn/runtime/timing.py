"""Re-export of :mod:`tvm_spinn.timing.model`, the timing model's former location."""

from ..timing.model import *  # noqa: F401,F403
from ..timing.model import __all__  # noqa: F401
