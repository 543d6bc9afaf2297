"""``relax.ext.spinn``: the BYOC codegen hook called by ``relax.transform.RunCodegen``.

Each partitioned function becomes one spinn program (lowered, mapped, serialized) wrapped in a
C++ ``spinn`` runtime module that the VM executable imports.
"""

from __future__ import annotations

import json
import logging

import tvm
import tvm_ffi

from .. import _lib
from ..mapping import map_program
from ..mapping.schedule import shared_mappings
from ..program.manifest import MANIFEST_MAGIC, MANIFEST_SYMBOL
from ..runtime.executor import compiled
from ..target.arch import SpinnArch
from .lower import lower_function

__all__ = ["compile_function", "codegen_spinn", "MANIFEST_SYMBOL", "MANIFEST_MAGIC", "make_manifest_module"]

LOG = logging.getLogger("tvm_spinn.codegen")


def compile_function(func, symbol: str, arch: SpinnArch):
    """Lower, map and serialize one region; returns ``(program, bytes)``."""
    program = lower_function(func, symbol, arch.to_dict())
    map_program(program, arch)
    return program, program.to_bytes()


@tvm_ffi.register_global_func("relax.ext.spinn", override=True)
def codegen_spinn(functions, options, constant_names):  # noqa: ARG001 - constants live in bodies
    """Compile every ``Codegen="spinn"`` function into a ``spinn`` runtime module."""
    arch_json = options.get("arch") if options is not None else None
    arch = SpinnArch.from_dict(json.loads(str(arch_json))) if arch_json else SpinnArch()
    modules = []
    with shared_mappings():  # repeated blocks (transformer layers) are mapped once
        for func in functions:
            symbol = str(func.attrs["global_symbol"])
            _, data = compile_function(func, symbol, arch)
            LOG.info("spinn: compiled %s (%d bytes)", symbol, len(data))
            with compiled(data):  # our own bytes: validated, without a second digest pass
                modules.append(_lib.create_module(symbol, data))
    return modules


def make_manifest_module(manifest: dict) -> tvm.runtime.Module:
    """A ``spinn`` module carrying the compile manifest (partition summary, target) for reports."""
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return _lib.create_module(MANIFEST_SYMBOL, MANIFEST_MAGIC + body)
