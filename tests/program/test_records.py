"""The typed records a program carries (its system, mapping, timing, memory): built by the compiler, written
to and read back from the header JSON by :mod:`tvm_spinn.program.format` alone, frozen."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest

from tvm_spinn.mapping import MappingOptions, map_program
from tvm_spinn.program import Layer, Program, ProgramError, TensorDesc
from tvm_spinn.program.model import LayerDraft
from tvm_spinn.program.format import (
    mapping_from_json, mapping_to_json, memory_from_json, memory_to_json, program_digest, timing_from_json,
    timing_to_json,
)
from tvm_spinn.options import MappingOptions
from tvm_spinn.program.records import LayerMapping, MemorySummary, ProgramMapping, TimingSummary
from tvm_spinn.target.arch import CHIPS, SpinnArch, make_system

def _program(arch, k: int = 64, n: int = 64, rows: int = 4) -> Program:
    """One int8 dense ``k -> n`` with a dequantizing epilogue (fp32 output)."""
    tensors = [TensorDesc("x", [rows, k], "int8", "input"), TensorDesc("w", [k, n], "int8", "const"),
               TensorDesc("scale", [n], "float32", "const"), TensorDesc("w_zero", [n], "int32", "const"),
               TensorDesc("y", [rows, n], "float32", "output")]
    layer = Layer(name="proj", kind="dense", inputs=[0], output=4, consts={"weight": 1, "scale": 2, "w_zero": 3},
                  attrs=dict(x_zero=0, x_flip=False, relu=False, out="float32"), mode="int8")
    rng = np.random.default_rng(0)
    return Program("main", arch, tensors, [0], [4], [layer],
                   constants={1: rng.integers(-128, 128, (k, n), dtype=np.int8), 2: np.ones(n, dtype=np.float32),
                              3: rng.integers(-5, 6, n, dtype=np.int32)})


def _mapped(arch):
    return map_program(_program(arch), arch, MappingOptions())


def _header(data: bytes) -> dict:
    (hlen,) = struct.unpack_from("<Q", data, 16)
    return json.loads(data[24:24 + hlen])


@pytest.fixture(scope="module", params=["chip", "two chips"])
def mapped(request):
    arch = make_system("records-1", chips=1, pes_per_chip=32) if request.param == "chip" else \
        make_system("records-2", chips=2, pes_per_chip=32)
    return _mapped(arch)


def test_records_round_trip_byte_identical(mapped):
    assert isinstance(mapped.timing, TimingSummary) and isinstance(mapped.memory, MemorySummary)
    assert isinstance(mapped.mapping, ProgramMapping) and all(isinstance(r, LayerMapping) for r in mapped.mapping.layers)
    assert isinstance(mapped.mapping.options, MappingOptions)
    data = mapped.to_bytes()
    loaded = Program.from_bytes(data)
    assert loaded.timing == mapped.timing and loaded.memory == mapped.memory and loaded.mapping == mapped.mapping
    assert isinstance(loaded.mapping.options, MappingOptions)
    assert isinstance(loaded.arch, SpinnArch) and loaded.arch == mapped.arch
    assert loaded.to_bytes() == data
    header = _header(data)
    assert timing_from_json(header["timing"]) == mapped.timing
    assert memory_from_json(header["memory"]) == mapped.memory
    assert mapping_from_json(header["mapping"]) == mapped.mapping
    assert timing_to_json(loaded.timing) == header["timing"] and memory_to_json(loaded.memory) == header["memory"]
    assert mapping_to_json(loaded.mapping) == header["mapping"]
    # keys at their defaults are left out: the static scheduler, a placement from the range's first PE
    assert "scheduler" not in header["mapping"] and mapped.mapping.scheduler == "static"
    assert all(("rotate" in row) == bool(rec.rotate) for row, rec in zip(header["mapping"]["layers"],
                                                                         mapped.mapping.layers))
    assert loaded.arch.to_dict() == header["arch"]
    assert len(mapped.timing.layers) == len(mapped.layers)


def test_writing_changes_nothing_in_the_program(mapped):
    """to_bytes writes the constants' offsets into the header only: the descriptors, the header
    the mapper keys structures by and the bytes of a second write are as before."""
    before = tuple(dataclasses.replace(t) for t in mapped.tensors)
    header = mapped.header()
    data = mapped.to_bytes()
    assert mapped.tensors == before and mapped.header() == header
    assert all(t.offset == -1 for t in mapped.tensors)
    assert [t["offset"] for t in _header(data)["tensors"]] == [-1, 0, 4096, 4352, -1]
    assert mapped.to_bytes() == data


def test_mapping_returns_a_new_program():
    """map_program leaves the lowered program as it was (no records, no work, same bytes)."""
    arch = make_system("records-1", chips=1, pes_per_chip=32)
    program = _program(arch)
    before = program.to_bytes()
    mapped = map_program(program, arch)
    assert mapped is not program and mapped.mapping is not None and mapped.layers[0].flops > 0
    assert program.mapping is program.timing is program.memory is program.tiles is None
    assert program.layers[0].flops == 0 and program.layers[0].gemm is None
    assert program.to_bytes() == before
    assert map_program(program, arch).to_bytes() == mapped.to_bytes()


def test_system_figures_only_on_several_chips(mapped):
    chips = mapped.timing.system.chips if mapped.timing.system is not None else 1
    assert chips == mapped.arch.chips
    assert ("system" in timing_to_json(mapped.timing)) == (mapped.timing.system is not None)
    assert ("system" in mapping_to_json(mapped.mapping)) == (mapped.mapping.system is not None) == (chips > 1)
    if mapped.mapping.system is not None:
        system = mapped.mapping.system
        assert system.chips == system.tp * system.dp * system.sp == chips
        assert system.candidates and sum(n for _, n in system.splits) == len(mapped.layers)
    assert all(row.chips == chips for row in mapped.timing.layers)


def test_records_are_frozen(mapped):
    with pytest.raises(dataclasses.FrozenInstanceError):
        mapped.timing.latency_s = 0.0
    assert mapped.memory.ranges
    with pytest.raises(dataclasses.FrozenInstanceError):
        mapped.memory.ranges[0].what = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        mapped.mapping.layers[0].tile = (1, 1, 1)
    assert isinstance(mapped.mapping.layers, tuple) and isinstance(mapped.mapping.resident_layers, tuple)


def test_tensors_and_layers_are_frozen(mapped):
    """Stages build new tensor and layer records (``dataclasses.replace``), never edit one: the
    mapped program's records and those of the program read back refuse assignment."""
    loaded = Program.from_bytes(mapped.to_bytes())
    for program in (mapped, loaded):
        for record, name, value in [(program.tensors[0], "shape", [1]), (program.tensors[0], "role", "output"),
                                    (program.tensors[1], "offset", 0), (program.layers[0], "flops", 0),
                                    (program.layers[0], "gemm", None), (program.layers[0], "inputs", [])]:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(record, name, value)
    assert loaded.layers == mapped.layers
    assert tuple(dataclasses.replace(t, offset=-1) for t in loaded.tensors) == mapped.tensors


def test_program_is_frozen(mapped):
    """A Program refuses assignment to any field and holds tuples and a read-only constant map;
    a stage that changes it returns a new one (``dataclasses.replace``)."""
    loaded = Program.from_bytes(mapped.to_bytes())
    for program in (mapped, loaded):
        for name, value in [("mapping", None), ("timing", None), ("memory", None), ("tiles", None),
                            ("layers", ()), ("tensors", ()), ("inputs", (1,)), ("arch", None),
                            ("native_section", b""), ("constants", {})]:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(program, name, value)
        assert all(type(getattr(program, name)) is tuple for name in ("tensors", "inputs", "outputs", "layers"))
        with pytest.raises(TypeError):
            program.constants[1] = np.zeros(1)
        with pytest.raises(TypeError):
            program.layers[0] = program.layers[0]
        with pytest.raises(AttributeError):
            program.tensors.append(program.tensors[0])
        with pytest.raises(TypeError):  # unhashable: equal programs may hold distinct arrays
            hash(program)
    bare = dataclasses.replace(mapped, timing=None)
    assert bare.timing is None and mapped.timing is not None
    assert mapped.header()["inputs"] == [0] and type(mapped.header()["outputs"]) is list


def test_digest_is_the_checksum_of_the_bytes(mapped):
    """A program's digest is the checksum its bytes end with; one read back carries it; a
    program changed by ``replace`` has its own."""
    data = mapped.to_bytes()
    assert mapped.digest == data[-32:]
    loaded = Program.from_bytes(data)
    assert loaded.digest == data[-32:] == Program.from_bytes(loaded.to_bytes()).digest
    other = dataclasses.replace(mapped, symbol="other")
    assert other.digest == other.to_bytes()[-32:] != mapped.digest


def test_layer_draft_freezes_to_the_layer_it_describes():
    """An operator family fills a draft in place while lowering; the program gets it frozen."""
    draft = LayerDraft(name="proj", kind="dense", inputs=[], output=4)
    draft.inputs.append(0)
    draft.consts["weight"] = 1
    draft.attrs.update(relu=False)
    draft.mode = "int8"
    layer = draft.freeze()
    assert type(layer) is Layer
    assert layer == Layer("proj", "dense", [0], 4, {"weight": 1}, {"relu": False}, mode="int8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.mode = "fp32"


def test_unmapped_program_has_no_records():
    program = _program(CHIPS["production"])
    assert program.timing is None and program.memory is None and program.mapping is None
    assert timing_to_json(None) == {} and memory_to_json(None) == {} and mapping_to_json(None) == {}
    assert timing_from_json({}) is None and memory_from_json({}) is None and mapping_from_json({}) is None


@pytest.mark.parametrize("field,edit,message", [
    ("timing", lambda t: t.update(note=1), r"^timing: missing key\(s\) \[\], unknown key\(s\) \['note'\]"),
    ("timing", lambda t: t.pop("cycles"), r"^timing: missing key\(s\) \['cycles'\]"),
    ("timing", lambda t: t["layers"][0].pop("kind"), r"^timing\.layers\[0\]: missing key\(s\) \['kind'\]"),
    ("timing", lambda t: t.update(layers=3), r"^timing\.layers: expected a list"),
    ("memory", lambda m: m["ranges"].append([0, 1]), r"^memory\.ranges\[\d+\]: expected \[start, end"),
    ("memory", lambda m: m.pop("busiest_pe"), r"^memory: missing key\(s\) \['busiest_pe'\]"),
    ("mapping", lambda m: m.pop("mode"), r"^mapping: missing key\(s\) \['mode'\]"),
    ("mapping", lambda m: m.update(note=1), r"^mapping: missing key\(s\) \[\], unknown key\(s\) \['note'\]"),
    ("mapping", lambda m: m.update(options=3), r"^mapping\.options: expected an object"),
    ("mapping", lambda m: m["options"].update(nave=1), r"^mapping\.options: unknown field 'nave'"),
    ("mapping", lambda m: m["options"].update(naive=1), r"^mapping\.options\.naive: expected bool, got 1"),
    ("mapping", lambda m: m.update(resident_layers=3), r"^mapping\.resident_layers: expected a list"),
    ("mapping", lambda m: m["layers"][0].update(note=1), r"^mapping\.layers\[0\]: unknown key\(s\) \['note'\]"),
])
def test_defective_records_name_their_field(field, edit, message, chips=1):
    _check_defect(field, edit, message, chips)


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["system"].pop("tp"), r"^mapping\.system: missing key\(s\) \['tp'\]"),
    (lambda m: m["system"].update(splits=[]), r"^mapping\.system\.splits: expected an object"),
    (lambda m: m["system"]["candidates"][0].pop("fits"), r"^mapping\.system\.candidates\[0\]: missing key\(s\) \['fits'\]"),
    (lambda m: m["system"].update(replicated=[["x"]]), r"^mapping\.system\.replicated\[0\]: expected \[layer name, reason\]"),
    (lambda m: m["system"].update(collectives={}), r"^mapping\.system\.collectives: expected a list"),
    (lambda m: m["system"].update(streams=0), r"^mapping\.system\.streams: expected an int >= 1, got 0"),
    (lambda m: m["system"].update(streams=2.0), r"^mapping\.system\.streams: expected an int >= 1, got 2\.0"),
])
def test_defective_system_mapping_names_its_field(edit, message):
    _check_defect("mapping", edit, message, 2)


def _check_defect(field, edit, message, chips):
    data = _mapped(make_system(f"records-{chips}", chips=chips, pes_per_chip=32)).to_bytes()
    version = struct.unpack_from("<I", data, 8)[0]
    (hlen,) = struct.unpack_from("<Q", data, 16)
    header = json.loads(data[24:24 + hlen])
    edit(header[field])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head = data[:16] + struct.pack("<Q", len(text)) + text
    pos = 24 + hlen
    pos += -pos % 64
    head += b"\0" * (-len(head) % 64)
    body = head + data[pos:-32]
    with pytest.raises(ProgramError, match=message):
        Program.from_bytes(body + program_digest(body, version))


def test_a_layers_consts_and_attrs_are_read_only():
    """A layer's ``consts`` and ``attrs`` (nested dicts too) refuse every edit; a stage that
    needs other values builds a new layer. The header holds plain dicts (written as before), and
    the layer survives copying, pickling and a round trip through the program's bytes."""
    import copy
    import pickle

    from tvm_spinn.program.format import FrozenMap

    attrs = {"relu": False, "out": "float32", "nested": {"a": 1}}
    layer = Layer(name="l", kind="dense", inputs=[0], output=4, consts={"weight": 1}, attrs=attrs)
    assert type(layer.attrs) is FrozenMap and type(layer.consts) is FrozenMap
    attrs["relu"] = True  # the layer holds its own copy
    assert layer.attrs["relu"] is False
    edits = [lambda: layer.attrs.__setitem__("relu", True), lambda: layer.attrs.update(relu=True),
             lambda: layer.attrs.setdefault("k", 1), lambda: layer.attrs.pop("relu"), lambda: layer.attrs.clear(),
             lambda: layer.attrs.popitem(), lambda: layer.attrs.__delitem__("out"),
             lambda: layer.consts.__setitem__("bias", 2), lambda: layer.attrs["nested"].__setitem__("a", 2)]
    for edit in edits:
        with pytest.raises(TypeError, match="read-only: build a new layer"):
            edit()
    with pytest.raises(TypeError, match="read-only"):
        layer.attrs |= {"relu": True}
    assert dict(layer.attrs) == {"relu": False, "out": "float32", "nested": {"a": 1}}
    new = dataclasses.replace(layer, attrs={**layer.attrs, "relu": True})
    assert new.attrs["relu"] is True and layer.attrs["relu"] is False and type(new.attrs) is FrozenMap
    assert json.dumps(layer.attrs, sort_keys=True) == json.dumps(
        {"relu": False, "out": "float32", "nested": {"a": 1}}, sort_keys=True)
    for copied in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer), copy.copy(layer)):
        assert copied == layer and type(copied.attrs) is FrozenMap and type(copied.attrs["nested"]) is FrozenMap

    program = _mapped(SpinnArch())
    header = program.header()
    assert type(header["layers"][0]["attrs"]) is dict and type(header["layers"][0]["consts"]) is dict
    back = Program.from_bytes(program.to_bytes())
    assert back.to_bytes() == program.to_bytes()
    assert type(back.layers[0].attrs) is FrozenMap
    with pytest.raises(TypeError, match="read-only"):
        back.layers[0].attrs["relu"] = True
