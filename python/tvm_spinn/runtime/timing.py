"""Re-export of :mod:`tvm_spinn.timing`, the timing model's former location."""

from ..timing import *  # noqa: F401,F403
from ..timing import __all__  # noqa: F401
