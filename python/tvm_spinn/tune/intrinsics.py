"""Register only the tensor intrinsics a target needs before MetaSchedule asks for them.

``TuneContext`` imports ``tvm.s_tir.tensor_intrin``, which parses every intrinsic of every
backend (about 100 s here, 78 s of it CUDA). When that package is not imported yet, we install
it as a bare package (its ``__init__`` only imports the submodules) and import just the
submodules for the target: ``x86``/``arm_cpu``/``riscv_cpu`` for llvm hosts, ``cuda`` for cuda.
Any other submodule can still be imported later by name.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import types

__all__ = ["ensure_intrinsics"]

_PACKAGE = "tvm.s_tir.tensor_intrin"


def _submodules(kind: str) -> list[str]:
    if kind == "cuda":
        return ["cuda"]
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["arm_cpu"]
    if machine.startswith("riscv"):
        return ["riscv_cpu"]
    return ["x86"]


def ensure_intrinsics(target) -> None:
    """Make the tensor intrinsics for ``target`` (and its host) available, cheaply."""
    import tvm.s_tir

    if _PACKAGE not in sys.modules:
        base = os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")
        package = types.ModuleType(_PACKAGE, "Intrinsics for tensorization (loaded per target).")
        package.__path__ = [base]
        package.__file__ = os.path.join(base, "__init__.py")
        package.__package__ = _PACKAGE
        sys.modules[_PACKAGE] = package
        tvm.s_tir.tensor_intrin = package
    kinds = {target.kind.name}
    if target.host is not None:
        kinds.add(target.host.kind.name)
    for kind in sorted(kinds):
        for name in _submodules(kind):
            importlib.import_module(f"{_PACKAGE}.{name}")
