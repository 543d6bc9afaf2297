"""The native section a compiled program carries (:mod:`tvm_spinn.program.native_section`): the
simulator's execution plan of the program, so the C++ ``spinn`` module runs it without Python."""

from __future__ import annotations

import json

from ..program import Program
from ..program.format import NATIVE_PROGRAM_VERSION
from ..program.native_section import encode_plan, encode_python
from .simulator import _Plan

__all__ = ["native_section"]


def native_section(program: Program) -> bytes:
    """The native section of ``program``: its plan when every layer has a native description
    (one native run), else a record naming the first layer that needs Python and why."""
    plan = _Plan(program, native=True)
    if plan.python_layers:
        index, why = plan.python_layers[0]
        layer = program.layers[index]
        return encode_python(index, layer.name, f"kind {layer.kind}: {why}")
    if len(plan.native_runs) != 1:
        return encode_python(-1, program.symbol, "the program has no layer to run")
    offsets, blob_bytes = program.blob_offsets()
    # the header text to_bytes writes for the program with its section
    header = json.dumps({**program.header(offsets), "version": NATIVE_PROGRAM_VERSION},
                        sort_keys=True, separators=(",", ":")).encode()
    data = encode_plan(program, plan.native_runs[0], offsets, blob_bytes, header)
    if data is None:
        return encode_python(-1, program.symbol, "an output is also an input, or is repeated")
    return data
