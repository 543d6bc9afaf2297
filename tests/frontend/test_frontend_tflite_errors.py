"""Damaged ``.tflite`` files: every failure of the import is one TFLiteImportError naming the
file (and what is wrong where known), checked before the lazy flatbuffer readers run."""

from __future__ import annotations

import struct

import numpy as np
import pytest

pytest.importorskip("tflite")

import fuzz_inputs  # noqa: E402
from tvm_spinn.frontend.tflite import TFLiteImportError, from_tflite  # noqa: E402

MODEL = fuzz_inputs.tflite_model()


def _root():
    import importlib

    return importlib.import_module("tflite.Model").Model.GetRootAsModel(MODEL, 0)


def _field(table, slot: int) -> int:
    """Absolute position of field ``slot`` of a generated-reader table."""
    off = table._tab.Offset(4 + 2 * slot)
    assert off, slot
    return table._tab.Pos + off


def _patch(pos: int, fmt: str, value) -> bytes:
    buf = bytearray(MODEL)
    struct.pack_into(fmt, buf, pos, value)
    return bytes(buf)


def _refused(data: bytes, tmp_path, match: "str | None" = None) -> str:
    path = tmp_path / "damaged.tflite"
    path.write_bytes(data)
    with pytest.raises(TFLiteImportError, match=match) as err:
        from_tflite(str(path))
    assert str(path) in str(err.value)
    return str(err.value)


def test_the_seed_model_imports_and_computes_its_reference():
    import tvm
    from tvm import relax

    mod = from_tflite(MODEL)
    assert [p.name for p in mod["main"].params] == ["x", "z"]
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(1)
    x, z = rng.standard_normal((1, 8), dtype=np.float32), rng.standard_normal((1, 4), dtype=np.float32)
    out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(z)).numpy()
    np.testing.assert_allclose(out, fuzz_inputs.tflite_reference(x, z), rtol=1e-5, atol=1e-6)


def test_zero_length_and_wrong_magic(tmp_path):
    _refused(b"", tmp_path, "'TFL3' flatbuffer identifier")
    _refused(MODEL[:4] + b"ONNX" + MODEL[8:], tmp_path, "'TFL3' flatbuffer identifier")
    _refused(b"\x00" * 4096, tmp_path, "identifier")


def test_every_truncation_is_refused(tmp_path):
    path = tmp_path / "cut.tflite"
    for cut in range(0, len(MODEL), 3):
        path.write_bytes(MODEL[:cut])
        with pytest.raises(TFLiteImportError, match="cut.tflite"):
            from_tflite(str(path))


def test_one_corrupted_offset_is_named(tmp_path):
    model = _root()
    sub = model.Subgraphs(0)
    # the root offset past the end
    assert "outside the file" in _refused(_patch(0, "<I", len(MODEL) + 64), tmp_path)
    # a tensor table whose vtable would lie before the file's start (Python's struct would
    # otherwise read it counting from the end: wrong bytes, no error)
    pos = sub.Tensors(3)._tab.Pos
    assert "tensors[3]" in _refused(_patch(pos, "<i", pos + 100), tmp_path)
    # a vector length past the end: the subgraph's tensors
    vec = sub._tab.Vector(sub._tab.Offset(4)) - 4
    assert "runs past the end" in _refused(_patch(vec, "<I", 10**6), tmp_path)
    # a string offset pointing outside
    name = _field(sub.Tensors(2), 3)
    assert "tensors[2].field3" in _refused(_patch(name, "<I", 2**31), tmp_path)


def test_indices_out_of_range_are_named(tmp_path):
    model = _root()
    sub = model.Subgraphs(0)
    assert "operator code index 7" in _refused(_patch(_field(sub.Operators(1), 0), "<I", 7), tmp_path)
    assert "buffer index 99" in _refused(_patch(_field(sub.Tensors(1), 2), "<I", 99), tmp_path)
    inputs = sub._tab.Vector(sub._tab.Offset(6))
    assert "inputs[1]: tensor index 42" in _refused(_patch(inputs + 4, "<i", 42), tmp_path)
    outputs = sub._tab.Vector(sub._tab.Offset(8)) - 4
    assert "has no outputs" in _refused(_patch(outputs, "<I", 0), tmp_path)
    op_inputs = sub.Operators(0)._tab.Vector(sub.Operators(0)._tab.Offset(6))
    assert "operators[0].inputs[0]: tensor index -7" in _refused(_patch(op_inputs, "<i", -7), tmp_path)


def test_a_name_that_is_not_utf8_is_named(tmp_path):
    at = MODEL.index(b"\x02\x00\x00\x00fc\x00") + 4
    data = MODEL[:at] + b"\xff\xfe" + MODEL[at + 2:]
    assert "not UTF-8" in _refused(data, tmp_path)


def test_seeded_byte_damage_is_refused_or_imports(tmp_path):
    """Bit flips, boundary words, zeroed/duplicated/inserted spans: an import or one
    TFLiteImportError, never another exception (an out-of-bounds read, a decode error...)."""
    outcomes = {"imported": 0, "refused": 0}
    for seed in range(150):
        data, what = fuzz_inputs.mutate_bytes(MODEL, np.random.default_rng(seed))
        try:
            from_tflite(data)
            outcomes["imported"] += 1
        except TFLiteImportError as err:
            assert "'<bytes>'" in str(err), (seed, what)
            outcomes["refused"] += 1
        except Exception as err:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"seed {seed} ({what}): {type(err).__name__}: {err}")
    assert outcomes["refused"] > 50 and outcomes["imported"] > 5, outcomes


def test_a_converter_made_model_damaged_is_refused(tmp_path):
    """The same on a flatbuffer written by TensorFlow's converter (options tables, metadata,
    signature defs the hand-built model lacks)."""
    pytest.importorskip("tensorflow")
    import tflite_models

    from tvm_spinn.frontend.tflite import keras_to_tflite

    buf = keras_to_tflite(tflite_models.mlp())
    assert from_tflite(buf) is not None
    for seed in range(60):
        data, what = fuzz_inputs.mutate_bytes(buf, np.random.default_rng(1000 + seed))
        try:
            from_tflite(data)
        except TFLiteImportError:
            pass
        except Exception as err:  # pragma: no cover
            pytest.fail(f"seed {1000 + seed} ({what}): {type(err).__name__}: {err}")
    for cut in range(0, len(buf), max(1, len(buf) // 97)):
        with pytest.raises(TFLiteImportError):
            from_tflite(buf[:cut])
