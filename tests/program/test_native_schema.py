"""The native instruction schema: the checked-in C++ header is what the schema generates, the
interpreter's codes are the schema's, and the Python writer refuses an instruction whose word
count differs from the schema's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tvm_spinn import _lib
from tvm_spinn.program import native_schema
from tvm_spinn.program.ops.native import NativeBuilder

HEADER = Path(__file__).resolve().parents[2] / "src" / "native_schema.h"


def test_header_is_generated_from_the_schema():
    assert HEADER.read_text(encoding="utf-8") == native_schema.render_header()


def test_interpreter_codes_are_the_schema_codes():
    built = {str(k): int(v) for k, v in dict(_lib._func("tvm_spinn.sim.plan_ops")()).items()}
    assert built == native_schema.codes()


def test_writer_checks_word_counts():
    nb = NativeBuilder(program=None)
    nb.emit("softmax", 0, 1, 2, 3)
    assert nb.code == [native_schema.instruction("softmax").code, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="softmax: 3 words, the schema gives it 4"):
        nb.emit("softmax", 0, 1, 2)
    # ranked: rank 2 -> 3 arrays of 2 words after the fields
    nb.emit("binary", 0, 1, 2, 0, 0, 2, [1, 2], [2, 1], [0, 1])
    with pytest.raises(ValueError, match="binary: 11 words"):
        nb.emit("binary", 0, 1, 2, 0, 0, 2, [1, 2], [2, 1], [0])
