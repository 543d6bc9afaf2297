"""Re-export of :mod:`tvm_spinn._build_options` (moved below ``pipeline`` and ``fallback``).

``pipeline`` and ``fallback`` read the build options; ``tune`` builds on ``pipeline``, so the
options live in a lower module and this name stays importable.
"""

from .._build_options import *  # noqa: F401,F403
from .._build_options import __all__  # noqa: F401
