"""``relax.ext.spinn``: the BYOC codegen hook called by ``relax.transform.RunCodegen``.

Each partitioned function becomes one spinn program (lowered, mapped, serialized) wrapped in a
C++ ``spinn`` runtime module that the VM executable imports.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import tvm
import tvm_ffi

from .. import _lib
from ..mapping import map_program
from ..mapping.planner import plan_system
from ..program.format import _finish_array
from ..program.manifest import MANIFEST_MAGIC, MANIFEST_SYMBOL
from ..runtime import simulator
from ..runtime.executor import compiled
from ..runtime.native_export import native_section
from ..target.arch import SpinnArch
from .lower import lower_function

__all__ = ["compile_function", "codegen_spinn", "MANIFEST_SYMBOL", "MANIFEST_MAGIC", "make_manifest_module"]

LOG = logging.getLogger("tvm_spinn.codegen")


def _lower_and_map(func, symbol: str, arch: SpinnArch):
    return map_program(lower_function(func, symbol, arch), arch)


def compile_function(func, symbol: str, arch: SpinnArch):
    """Lower, map and serialize one region; returns ``(program, bytes)``."""
    program = _with_native_section(_lower_and_map(func, symbol, arch))
    return program, program.to_bytes()


def _with_native_section(program):
    """``program`` with its native section (its plan for the C++ module, see
    :mod:`tvm_spinn.program.native_section`) set."""
    return replace(program, native_section=native_section(program))


def _module_over(symbol: str, data: np.ndarray) -> tvm.runtime.Module:
    """A spinn module over the compiler's own program ``data`` (a uint8 array the compiler just
    serialized): the module holds it through DLPack, not a copy, and the validator skips its
    digest pass (see ``compiled``)."""
    view = tvm_ffi.from_dlpack(data)
    with compiled(data):
        return _lib._func("tvm_spinn.runtime.create_module_view")(symbol, view)


@tvm_ffi.register_global_func("relax.ext.spinn", override=True)
def codegen_spinn(functions, options, constant_names):  # noqa: ARG001 - constants live in bodies
    """Compile every ``Codegen="spinn"`` function into a ``spinn`` runtime module.

    ``relax.transform.RunCodegen`` hands over all the build's regions at once: they are lowered
    first, then :func:`~tvm_spinn.mapping.planner.plan_system` decides what part of the system
    each one gets and maps it under that budget (repeated blocks, such as transformer layers,
    are mapped once). The digest pass and the join of each program (GIL released, memory
    bound) run on a worker thread while the next region is mapped; the bytes are those of
    ``to_bytes``."""
    arch_json = options.get("arch") if options is not None else None
    arch = SpinnArch.from_dict(json.loads(str(arch_json))) if arch_json else SpinnArch()
    programs = [lower_function(func, str(func.attrs["global_symbol"]), arch) for func in functions]
    for program in programs:  # a mode the build asks for (iss) names what it cannot run, now
        simulator.check_program(program)
    pending = {}  # index -> (symbol, future); a region mapped again replaces its entry
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="spinn-serialize") as pool:
        plan_system(programs, arch,
                    on_mapped=lambda i, program: pending.__setitem__(
                        i, (program.symbol, pool.submit(_finish_array, _with_native_section(program)._parts()))))
        modules = []
        for _, (symbol, future) in sorted(pending.items()):
            data = future.result()
            LOG.info("spinn: compiled %s (%d bytes)", symbol, len(data))
            modules.append(_module_over(symbol, data))
    return modules


def make_manifest_module(manifest: dict) -> tvm.runtime.Module:
    """A ``spinn`` module carrying the compile manifest (partition summary, target) for reports."""
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return _lib.create_module(MANIFEST_SYMBOL, MANIFEST_MAGIC + body)
