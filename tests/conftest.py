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


# ------------------------------------------------------------------ systems registered by one test
import pytest  # noqa: E402


@pytest.fixture
def register_system():
    """``tvm_spinn.register_system`` for one test: each tag it adds is unregistered when the test
    ends, so a system one test makes never shows in a later test's ``known_targets()``. A tag
    that was registered before (a built-in one) is left as it was."""
    from tvm_spinn.target import known_targets, register_system as register, unregister_system

    added = []

    def _register(arch, *args, **kwargs):
        before = set(known_targets())
        tag = register(arch, *args, **kwargs)
        if tag not in before:
            added.append(tag)
        return tag

    yield _register
    for tag in reversed(added):
        unregister_system(tag)
