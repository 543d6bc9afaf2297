import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# Test modules are grouped by the package they test (tests/<package>/); the shared model builders
# sit at the top and some groups reuse another group's builders, so every group is importable by
# module name (basenames are unique across the groups).
for _group in sorted(os.listdir(_HERE)):
    if os.path.isdir(os.path.join(_HERE, _group)) and not _group.startswith(("_", ".")):
        sys.path.insert(0, os.path.join(_HERE, _group))
sys.path.insert(0, _HERE)
