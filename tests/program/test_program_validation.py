"""Spinn programs are validated when a module is created or loaded, not at the first call.

Crafted programs are real compiled programs with one header edit, re-sealed with a valid
checksum by an independent writer of the format (``seal``), so only the validator stands between
them and the simulator. Each must fail as ``ProgramError`` naming the field, at
``create_module`` / ``load_from_bytes.spinn`` / ``tvm.runtime.load_module``; accepted programs
are compared with the same Relax module built for llvm.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
import re
import struct
import zlib

import numpy as np
import pytest
import xxhash
import torch
import tvm
import tvm_ffi
from tvm import relax

import tvm_spinn
from tvm_spinn import _lib
from tvm_spinn.program import Program, ProgramError
from tvm_spinn.program import format as fmt
from tvm_spinn.runtime import executor, loader
from tvm_spinn.runtime.simulator import run_program
from models import TransformerBlock, make
from test_int8 import qgemm_module

#: A ProgramError message starts with the field: ``layers[3].inputs[0]: ...``, ``header: ...``.
FIELD = re.compile(r"^[a-z_ ]+(\[\d+\]|\.[A-Za-z_]+)*: ")
VALIDATOR = "tvm_spinn.runtime.validate_program"


# ----------------------------------------------------------------------------------------------
# An independent reader/writer of the program layout (program/format.py's docstring)
# ----------------------------------------------------------------------------------------------
def split(data: bytes) -> tuple[int, dict, bytes]:
    version, _, hlen = struct.unpack_from("<IIQ", data, 8)
    header = json.loads(data[24:24 + hlen])
    pos = 24 + hlen + (-(24 + hlen) % 64)  # then blob length, blob, 32-byte digest
    (blen,) = struct.unpack_from("<Q", data, pos)
    return version, header, data[pos + 8:pos + 8 + blen]


def seal(header, blob: bytes, version: int = fmt.PROGRAM_VERSION, hlen: int | None = None) -> bytes:
    """Program bytes around ``header`` (dict, or raw bytes) with a valid checksum (the format
    version's digest: :func:`~tvm_spinn.program.format.program_digest`)."""
    text = header if isinstance(header, bytes) else json.dumps(
        header, sort_keys=True, separators=(",", ":")).encode()
    out = b"SPINNPRG" + struct.pack("<IIQ", version, 0, len(text) if hlen is None else hlen) + text
    out += b"\0" * (-len(out) % 64) + struct.pack("<Q", len(blob)) + blob
    return out + _digest(out, version)


def _digest(data: bytes, version: int) -> bytes:
    """The format's checksum, written here independently of the package: version 5 is SHA-256
    over the XXH3-128 digests of 32 MiB segments and the byte count; version 4 BLAKE2b-256."""
    if version == 4:
        return hashlib.blake2b(data, digest_size=32).digest()
    root = hashlib.sha256()
    for start in range(0, max(len(data), 1), 32 << 20):
        root.update(xxhash.xxh3_128(data[start:start + (32 << 20)]).digest())
    root.update(struct.pack("<Q", len(data)))
    return root.digest()


def programs_of(ex) -> list[bytes]:
    """The programs of ``ex`` as version 5 (without their native sections: the cases below edit
    headers and blobs; the section's layout is checked by test_native_section_layout, its
    contents by tests/runtime/test_native_runtime.py)."""
    out = []
    for data in native_programs_of(ex):
        program = dataclasses.replace(Program.from_bytes(data), native_section=None)
        out.append(program.to_bytes())
    return out


def native_programs_of(ex) -> list[bytes]:
    return [bytes(m["get_program"]()) for m in tvm_spinn.report_modules(ex)
            if m["get_symbol"]() != "__spinn_manifest__"]


def test_native_section_layout():
    """Version 6: version 5's layout with the native section, 64-byte aligned, between the blob
    and the digest; its framing: magic, version, status, its own length, CRC-32 at the end."""
    torch.manual_seed(0)
    model, x = make("mlp")
    (data,) = native_programs_of(relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn"))
    version, header, blob = split(data)
    assert version == header["version"] == 6
    hlen = struct.unpack_from("<Q", data, 16)[0]
    start = 24 + hlen + (-(24 + hlen) % 64) + 8 + len(blob)
    start += -start % 64
    section = data[start:-32]
    assert section[:8] == b"SPINNPLN" and struct.unpack_from("<IIQ", section, 8) == (1, 0, len(section))
    assert struct.unpack_from("<II", section, len(section) - 8) == (zlib.crc32(section[:-8]), 0)
    assert data[-32:] == _digest(data[:-32], 6)
    v5 = dataclasses.replace(Program.from_bytes(data), native_section=None)
    assert split(v5.to_bytes()) == (5, {**header, "version": 5}, blob)


@pytest.fixture(scope="module")
def built():
    """name -> (program bytes, input, reference output) of small compiled models (fp32: PyTorch;
    int8: the same Relax module built for llvm)."""
    out = {}
    torch.manual_seed(0)
    small = {"transformer": (TransformerBlock(dim=16, heads=2, hidden=32).eval(), torch.randn(1, 4, 16)),
             "cnn": make("cnn")}  # small programs keep each crafted case fast
    for name, (model, x) in small.items():
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        (data,) = programs_of(relax.build(mod, target="spinn"))
        with torch.no_grad():
            out[name] = (data, x.numpy(), model(x).numpy())
    rng = np.random.default_rng(0)
    wq = rng.integers(-128, 128, (8, 4, 3, 3)).astype(np.int8)
    mod = qgemm_module((1, 4, 6, 6), "int8", wq, 0.02, 0, 0.05, 3, bias=rng.standard_normal(8),
                       relu=True, out=(0.1, -5, "int8"),
                       conv_attrs={"padding": (1, 1, 1, 1)})
    xq = rng.integers(-128, 128, (1, 4, 6, 6)).astype(np.int8)
    (data,) = programs_of(relax.build(mod, target="spinn"))
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    out["qconv"] = (data, xq, vm["main"](tvm.runtime.tensor(xq)).numpy())
    return out


def check(data: bytes, match: str) -> ProgramError:
    """Creating a module of ``data`` fails with a ProgramError matching ``match`` (a regex) that
    starts with a field (the module factory runs Program.from_bytes through the validator)."""
    try:  # the module symbol the program claims, where it can be read at all
        symbol = split(data)[1]["symbol"]
        symbol = symbol if isinstance(symbol, str) and symbol else "f"
    except Exception:
        symbol = "f"
    with pytest.raises(ProgramError, match=match) as info:
        _lib.create_module(symbol, data)
    assert FIELD.match(str(info.value)), str(info.value)
    return info.value


def edited(data: bytes, edit) -> bytes:
    version, header, blob = split(data)  # a fresh header (faster than a deep copy)
    edit(header)
    return seal(header, blob, version)


def layer_index(header: dict, kind: str, mode: str = "fp32") -> int:
    return next(i for i, layer in enumerate(header["layers"]) if layer["kind"] == kind and layer["mode"] == mode)


# ----------------------------------------------------------------------------------------------
# The independent writer and the good programs
# ----------------------------------------------------------------------------------------------
def test_real_programs_pass_and_match_llvm(built):
    for name, (data, x, expected) in built.items():
        version, header, blob = split(data)
        assert seal(header, blob, version) == data, name  # the test's writer is the format
        program = Program.from_bytes(data)
        (got,) = run_program(program, [x])
        if got.dtype == np.int8:
            assert np.array_equal(got, expected), name
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=name)


def test_version_4_programs_are_still_read(built):
    """Version 4 programs (BLAKE2b-256 digest, row tiles of one number: whole rows) load and
    run as their version-5 twins; each version has its own digest (a version-4 program carrying
    a version-5 digest is damage)."""
    data, x, _ = built["transformer"]
    _, header, blob = split(data)
    header["version"] = 4
    rows = 0
    for layer, record in zip(header["layers"], header["mapping"]["layers"]):
        if layer["kind"] in ("softmax", "layer_norm", "mean"):
            # version 4 has whole rows only: a row split over PEs becomes whole rows, one per
            # tile (a different tiling, the same bits)
            record["tile"] = record["tile"][:1]
            rows += 1
    assert rows
    old = seal(header, blob, 4)
    assert old[-32:] == hashlib.blake2b(old[:-32], digest_size=32).digest()
    (a,) = run_program(Program.from_bytes(old), [x])
    (b,) = run_program(Program.from_bytes(data), [x])
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    _lib.create_module(header["symbol"], old)  # the runtime module accepts it too
    check(old[:-32] + _digest(old[:-32], 5), r"^checksum")


# ----------------------------------------------------------------------------------------------
# The crafted cases of the issue, each re-sealed with a valid checksum
# ----------------------------------------------------------------------------------------------
def test_framing_defects(built, monkeypatch):
    data = built["transformer"][0]
    version, header, blob = split(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    check(seal(text, blob, hlen=2**62), r"^header length: 4611686018427387904 bytes")
    check(seal(text, blob, hlen=len(text) + 10**6), r"^header length")
    check(seal(text, blob, version=99), r"^version: spinn program format version 99")
    check(seal(b"\xff\xfe" + text[2:], blob), r"^header: not UTF-8")
    check(seal(text[:-1], blob), r"^header: not valid JSON")
    check(seal(b"[1, 2]", blob), r"^header: expected a JSON object")
    check(seal(text.replace(b'"epsilon":', b'"epsilon":NaN,"x":', 1), blob), r"^header: not valid JSON")
    check(seal(b"[" * 100000 + b"]" * 100000, blob), r"^header: ")
    check(data[:-33] + bytes([data[-33] ^ 1]) + data[-32:], r"^checksum")
    short = seal(header, blob)[:-32]  # blob length field says more than there is
    check(short[:-8] + _digest(short[:-8], fmt.PROGRAM_VERSION), r"^blob length")
    monkeypatch.setattr(fmt, "MAX_HEADER_BYTES", 1000)
    check(data, r"^header length: .* exceeds the 1000-byte cap")


def test_header_version_must_match_the_binary(built):
    data = built["transformer"][0]
    check(edited(data, lambda h: h.update(version=99)), rf"^version: header says 99, the binary header says {fmt.PROGRAM_VERSION}")
    version, header, blob = split(data)
    # Version 3 stored every tile and the schedule: refused with a request to rebuild.
    check(seal(header, blob, version=3), r"^version: spinn program format version 3 is not supported .*rebuild")


@pytest.mark.parametrize("edit,match", [
    (lambda h: h["layers"][0].update(bogus=1), r"^layers\[0\]: unknown key\(s\) \['bogus'\]"),
    (lambda h: h["layers"][0].pop("attrs"), r"^layers\[0\]: missing key\(s\) \['attrs'\]"),
    (lambda h: h.update(extra={}), r"^header: unknown key\(s\) \['extra'\]"),
    (lambda h: h["tensors"][0].update(shape=[-3, 64]), r"^tensors\[0\]\.shape\[0\]: -3 is below the minimum 1"),
    (lambda h: h["tensors"][0].update(shape=[2**22] * 3), r"^tensors\[0\]\.shape: .* more than"),
    (lambda h: h["tensors"][0].update(shape=[1.5, 64]), r"^tensors\[0\]\.shape\[0\]: expected an integer"),
    (lambda h: h["tensors"][0].update(shape=[True, 64]), r"^tensors\[0\]\.shape\[0\]: expected an integer"),
    (lambda h: h["tensors"][0].update(shape=[1] * 9), r"^tensors\[0\]\.shape: rank 9"),
    (lambda h: h["tensors"][0].update(dtype="float64"), r"^tensors\[0\]\.dtype: 'float64' is not one of"),
    (lambda h: h["tensors"][0].update(role="weights"), r"^tensors\[0\]\.role"),
    (lambda h: h.update(inputs=[99]), r"^inputs\[0\]: 99 is above the maximum"),
    (lambda h: h.update(outputs=[]), r"^outputs: lists tensors \[\]"),
    (lambda h: h["layers"][0]["inputs"].__setitem__(0, 99), r"^layers\[0\]\.inputs\[0\]: 99 is above"),
    (lambda h: h["layers"][0].update(kind="conv3d"), r"^layers\[0\]\.kind: 'conv3d' is not one of"),
    (lambda h: h["layers"][0].update(mode="int4"), r"^layers\[0\]\.mode"),
    (lambda h: h["layers"][1]["inputs"].__setitem__(0, h["layers"][-1]["output"]),
     r"^layers\[1\]\.inputs\[0\]: tensor \d+ is read before any layer writes it"),
    (lambda h: h["layers"][1].update(output=h["layers"][0]["output"]), r"^layers\[1\]\.output: tensor"),
    (lambda h: h["mapping"].pop("layers"), r"^mapping\.layers: expected a list"),
    (lambda h: h["mapping"]["layers"].pop(), r"^mapping\.layers: expected \d+ entries"),
    (lambda h: h["mapping"]["layers"][0].update(bogus=1), r"^mapping\.layers\[0\]: unknown key\(s\) \['bogus'\]"),
    (lambda h: h["mapping"]["layers"][0].update(tile=[0] * len(h["mapping"]["layers"][0]["tile"])),
     r"^mapping\.layers\[0\]\.tile\[0\]: 0 is below the minimum 1"),
    (lambda h: h["mapping"]["layers"][0].update(tile=[4] * 5), r"^mapping\.layers\[0\]\.tile: expected \d entries"),
    (lambda h: h["mapping"]["layers"][0].update(tile="all"), r"^mapping\.layers\[0\]\.tile"),
    (lambda h: h["mapping"]["layers"][0].update(pes=[10**6, 1]), r"^mapping\.layers\[0\]\.pes\[0\]: 1000000 is above the maximum"),
    (lambda h: h["mapping"]["layers"][0].update(pes=[0, 10**6]), r"^mapping\.layers\[0\]\.pes\[1\]: 1000000 is above the maximum"),
    (lambda h: h["mapping"]["layers"][0].update(pes=[0, 0]), r"^mapping\.layers\[0\]\.pes\[1\]: 0 is below the minimum 1"),
    (lambda h: h["arch"].update(pes_per_chip=-1), r"^arch: "),
    (lambda h: h.update(symbol=""), r"^symbol: empty"),
], ids=lambda v: None if callable(v) else v[:30])
def test_header_defects_name_the_field(built, edit, match):
    check(edited(built["cnn"][0], edit), match)


def test_layer_defects_name_the_field(built):
    data = built["transformer"][0]
    _, h, _ = split(data)
    dense, mm, ln = layer_index(h, "dense"), layer_index(h, "matmul"), layer_index(h, "layer_norm")
    cases = [
        (lambda h: h["layers"][dense]["consts"].update(weight=999), rf"^layers\[{dense}\]\.consts\.weight: 999 is above"),
        (lambda h: h["layers"][dense]["consts"].update(gamma=h["layers"][dense]["consts"]["weight"]),
         rf"^layers\[{dense}\]\.consts: unknown key\(s\) \['gamma'\]"),
        (lambda h: h["layers"][ln]["consts"].pop("beta"), rf"^layers\[{ln}\]\.consts: missing key\(s\) \['beta'\]"),
        (lambda h: h["layers"][ln]["attrs"].update(epsilon="tiny"), rf"^layers\[{ln}\]\.attrs\.epsilon"),
        (lambda h: h["layers"][mm]["inputs"].pop(), rf"^layers\[{mm}\]\.inputs: matmul needs 2 input"),
        # A layer whose output tensor has the wrong shape for its inputs (too many values to unpack)
        (lambda h: h["tensors"][h["layers"][dense]["output"]]["shape"].append(1), rf"^layers\[{dense}\]\.output: tensor \d+ has shape"),
        (lambda h: h["layers"][dense].update(gemm=[1, 2, 3]), rf"^layers\[{dense}\]\.gemm"),
    ]
    for edit, match in cases:
        check(edited(data, edit), match)
    const = next(i for i, t in enumerate(h["tensors"]) if t["role"] == "const")
    check(edited(data, lambda h: h["tensors"][const].update(offset=len(split(data)[2]))), rf"^tensors\[{const}\]\.offset")
    check(edited(data, lambda h: h["tensors"][const].update(offset=h["tensors"][const]["offset"] + 4)), rf"^tensors\[{const}\]\.offset: .*aligned")
    _, hc, _ = split(built["cnn"][0])
    conv, pool = layer_index(hc, "conv2d"), next(i for i, x in enumerate(hc["layers"]) if x["kind"].endswith("pool2d"))
    check(edited(built["cnn"][0], lambda h: h["layers"][conv]["attrs"].update(groups=3)), rf"^layers\[{conv}\]\.attrs\.groups")
    check(edited(built["cnn"][0], lambda h: h["layers"][conv]["attrs"].update(strides=[1])), rf"^layers\[{conv}\]\.attrs\.strides: expected 2")
    check(edited(built["cnn"][0], lambda h: h["layers"][pool]["attrs"].update(pool_size=[99, 99])), rf"^layers\[{pool}\]\.attrs\.pool_size")


def test_int8_defects_name_the_field(built):
    data = built["qconv"][0]
    version, h, blob = split(data)
    q = layer_index(h, "conv2d", "int8")
    check(edited(data, lambda h: h["layers"][q]["attrs"].update(x_flip=True)), rf"^layers\[{q}\]\.attrs\.x_flip")
    check(edited(data, lambda h: h["layers"][q]["attrs"].pop("y_zero")), rf"^layers\[{q}\]\.attrs: missing key\(s\) \['y_zero'\]")
    check(edited(data, lambda h: h["layers"][q]["attrs"].update(y_min=100, y_max=-100)), rf"^layers\[{q}\]\.attrs\.y_min")
    check(edited(data, lambda h: h["layers"][q].update(mode="fp32")), rf"^layers\[{q}\]")
    # A shift of 0 makes the rounding term 1 << -1; re-seal a blob with one shift zeroed.
    shift = h["tensors"][h["layers"][q]["consts"]["shift"]]
    raw = bytearray(blob)
    raw[shift["offset"]:shift["offset"] + 4] = struct.pack("<i", 0)
    check(seal(h, bytes(raw), version), rf"^layers\[{q}\]\.consts\.shift: value 0 is outside \[1, 62\]")
    # k-chunks longer than the accumulator allows would wrap it: the result would depend on tiling
    def one_chunk_on_tiny_accumulator(h):
        h["arch"]["acc_bits"] = 16
    check(edited(data, one_chunk_on_tiny_accumulator), rf"^(mapping\.layers\[{q}\]\.tile\[2\]|arch): ")


# ----------------------------------------------------------------------------------------------
# Tiles are a function of each layer's tile shape: any accepted shape covers every output once
# and computes the same bits
# ----------------------------------------------------------------------------------------------
def _coverage(program: Program, index: int, tile) -> np.ndarray:
    """How many tiles of ``tile`` cover each element of the layer's output space (independent
    of the expansion code: regions painted onto a dense counter)."""
    from tvm_spinn.program.tiles import expand_regions, region_extent

    count = np.zeros(region_extent(program, index), dtype=np.int64)
    lo, hi, _ = expand_regions(program, index, tile)
    for a, b in zip(lo.tolist(), hi.tolist()):
        count[tuple(slice(x, y) for x, y in zip(a, b))] += 1
    return count


def test_any_accepted_tile_shape_covers_each_output_once_and_gives_the_same_bits(built):
    rng = random.Random(0)
    for name in ("cnn", "transformer", "qconv"):
        data, x, _ = built[name]
        version, header, blob = split(data)
        (reference,) = run_program(Program.from_bytes(data), [x], mode="tiles")
        ranks = set()
        for trial in range(6):
            h = copy.deepcopy(header)
            for record in h["mapping"]["layers"]:
                record["tile"] = [rng.choice([1, 2, 3, 5, 8, 64, 10**6]) for _ in record["tile"]]
            try:
                program = Program.from_bytes(seal(h, blob, version))
            except ProgramError as err:  # int8 chunks longer than the accumulator allows
                assert re.match(r"^mapping\.layers\[\d+\]\.tile\[2\]: k-chunks", str(err)), str(err)
                continue
            for i, record in enumerate(h["mapping"]["layers"]):
                cover = _coverage(program, i, record["tile"])
                assert (cover == 1).all(), (name, i, record["tile"])
                ranks.add(cover.ndim)
            (got,) = run_program(program, [x], mode="tiles")
            assert np.array_equal(got, reference), (name, trial)
        assert name != "cnn" or ranks == {1, 2, 3}, ranks


def test_tile_shapes_that_cut_too_many_tiles_are_rejected(built, monkeypatch):
    from tvm_spinn.program import validate

    data = built["cnn"][0]
    monkeypatch.setattr(validate, "MAX_TILES", 4)
    check(edited(data, lambda h: h["mapping"]["layers"][0].update(tile=[1] * len(h["mapping"]["layers"][0]["tile"]))),
          r"^mapping\.layers\[0\]\.tile: \[.*\] cuts \d+ tiles, more than 4")


def test_header_is_o_layers(built):
    """No per-tile or per-PE lists: the header's size does not grow with the tile count."""
    for name in ("cnn", "transformer", "qconv"):
        _, header, _ = split(built[name][0])
        assert "tiles" not in header and "schedule" not in header
        per_layer = len(json.dumps(header["mapping"]["layers"])) / len(header["layers"])
        assert per_layer < 64, per_layer


# ----------------------------------------------------------------------------------------------
# Load paths: the module factory, the container loader, tvm.runtime.load_module
# ----------------------------------------------------------------------------------------------
class _LibraryAlone:
    """Take the validator out of the registry (a process that loaded only the C++ library)."""

    def __enter__(self):
        self.previous = tvm_ffi.get_global_func(VALIDATOR)
        tvm_ffi.remove_global_func(VALIDATOR)

    def __exit__(self, *exc):
        tvm_ffi.register_global_func(VALIDATOR, self.previous, override=True)


def crafted_module(symbol: str, data: bytes):
    with _LibraryAlone():
        return _lib.create_module(symbol, data)


def test_container_load_validates(built):
    data = built["transformer"][0]
    symbol = split(data)[1]["symbol"]
    bad = edited(data, lambda h: h.update(inputs=[99]))
    raw = _lib.save_to_bytes(crafted_module(symbol, bad))
    with pytest.raises(ProgramError, match=r"^inputs\[0\]: 99"):
        _lib.load_module_from_bytes(raw)
    with pytest.raises(ProgramError, match=r"^symbol: the program implements"):
        _lib.create_module("other_symbol", data)
    with pytest.raises(ProgramError, match=r"^magic: not a spinn program"):
        _lib.create_module(symbol, b"PRG")
    with pytest.raises(ProgramError, match=r"^manifest"):
        _lib.create_module("__spinn_manifest__", b"SPINNMAN[1]")
    good = _lib.load_module_from_bytes(_lib.save_to_bytes(crafted_module(symbol, data)))
    assert good["get_key"]() in executor._CACHE  # parsed once, at load, for the first call


def _executable_with(symbol: str, module, shape, dtype):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape), dtype))
    with bb.function("main", [x]):
        y = bb.emit(relax.call_dps_packed(symbol, (x,), out_ty=relax.TensorType(list(shape), dtype)))
        bb.emit_func_output(y)
    ex = relax.build(bb.get(), target="llvm")
    ex.mod.import_module(module)
    return ex


def test_exported_library_with_a_crafted_program_fails_at_load(built, tmp_path):
    data, x, _ = built["transformer"]
    _, header, _ = split(data)
    symbol = header["symbol"]
    good_path, bad_path = str(tmp_path / "good.so"), str(tmp_path / "bad.so")
    _executable_with(symbol, crafted_module(symbol, data), x.shape, "float32").export_library(good_path)
    lib = tvm.runtime.load_module(good_path)
    assert "spinn" in [m.kind for m in lib.imports]
    # The same bytes except an empty tile shape in the last layer's mapping.
    last = len(header["layers"]) - 1

    def empty_tile(h):
        h["mapping"]["layers"][last]["tile"][0] = 0
    bad = edited(data, empty_tile)
    _executable_with(symbol, crafted_module(symbol, bad), x.shape, "float32").export_library(bad_path)
    with pytest.raises(ProgramError, match=rf"^mapping\.layers\[{last}\]\.tile\[0\]"):
        tvm.runtime.load_module(bad_path)
    # The same through tvm_spinn.load_module on a sealed library: the digest is right, so the
    # program's own validation speaks, with the file and the field named.
    sealed = str(tmp_path / "sealed.so")
    tvm_spinn.export_library(
        _executable_with(symbol, crafted_module(symbol, bad), x.shape, "float32"), sealed)
    with pytest.raises(ProgramError, match=rf"sealed.so: mapping\.layers\[{last}\]\.tile\[0\]"):
        tvm_spinn.load_module(sealed)


def test_a_program_claiming_another_programs_digest_is_refused(built):
    """A program ending with another program's digest fails validation (its digest does not
    match its contents) and leaves the other program's cache entry alone."""
    a = built["cnn"][0]
    symbol = split(a)[1]["symbol"]
    ka = _lib.create_module(symbol, a)["get_key"]()
    cached = executor._CACHE[ka]
    version, h, blob = split(a)
    h["layers"][0]["name"] = "impostor"
    forged = seal(h, blob, version)[:-32] + a[-32:]
    with pytest.raises(ProgramError, match=r"^checksum"):
        _lib.create_module(symbol, forged)
    assert executor._CACHE[ka] is cached and cached.layers[0].name != "impostor"


def test_sealed_library_programs_skip_only_the_digest_pass(built, tmp_path, monkeypatch):
    """tvm_spinn.load_module verifies every byte of the file first; the programs inside then
    skip their own digest pass (the rest of validation runs). A plain TVM load verifies each
    program's digest once: the loader hashes the program it picks (``_holds``), and that check
    stands for the validator's digest pass."""
    data, x, _ = built["transformer"]
    symbol = split(data)[1]["symbol"]
    path = str(tmp_path / "m.so")
    tvm_spinn.export_library(_executable_with(symbol, _lib.create_module(symbol, data), x.shape, "float32"), path)
    verified = []
    original = Program.from_bytes.__func__

    def spy(cls, raw, verify_checksum=True):
        verified.append(verify_checksum)
        return original(cls, raw, verify_checksum)

    monkeypatch.setattr(Program, "from_bytes", classmethod(spy))
    tvm_spinn.load_module(path)
    assert verified == [False]
    held = []
    holds = loader._holds

    def spy_holds(mapped, where, digest):
        held.append(holds(mapped, where, digest))
        return held[-1]

    monkeypatch.setattr(loader, "_holds", spy_holds)
    loader._FOUND.clear()
    tvm.runtime.load_module(path)
    assert held == [True] and verified == [False, False]


def test_cache_keeps_every_program_of_a_model(built, monkeypatch):
    """A model with many regions (MobileNetV2 has 52) must not re-parse programs at each call:
    the cache is bounded by bytes, not by a count."""
    a = built["cnn"][0]
    symbol = split(a)[1]["symbol"]
    programs = [edited(a, lambda h, i=i: h["timing"].update(latency_s=float(i))) for i in range(80)]
    keys = [_lib.create_module(symbol, p)["get_key"]() for p in programs]
    assert all(k in executor._CACHE for k in keys)
    # room for three programs (the edits' notes may add a 64-byte pad step to some of them)
    monkeypatch.setattr(executor, "_CACHE_BYTES", 3 * max(len(p) for p in (a, *programs)))
    _lib.create_module(symbol, a)
    assert len([k for k in keys if k in executor._CACHE]) == 2  # least recently used out


def test_each_module_has_its_own_cache_entry(built):
    a = built["cnn"][0]
    b = edited(a, lambda h: h["timing"].update(latency_s=-1.0))  # valid, different bytes
    symbol = split(a)[1]["symbol"]
    ka, ka2, kb = (_lib.create_module(symbol, p)["get_key"]() for p in (a, a, b))
    assert len({ka, ka2, kb}) == 3
    assert executor._CACHE[ka] is not executor._CACHE[kb]
    assert executor._CACHE[ka].timing == executor._CACHE[ka2].timing != executor._CACHE[kb].timing


# ----------------------------------------------------------------------------------------------
# Fuzz: random header edits, re-sealed, are rejected naming a field or run like the original
# ----------------------------------------------------------------------------------------------
_JUNK = [-1, 0, 1, 99, 2**62, -(2**62), 2**70, 1.5, True, None, "x", [], {}, [1, 2], {"a": 1}]


def _paths(value, prefix=()):
    """Every (path) to a JSON value under ``value``, schedule/timing sampled, not enumerated."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:6]):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@pytest.mark.parametrize("name,edits", [
    ("cnn", 120),
    pytest.param("cnn", 3000, marks=pytest.mark.slow),
    pytest.param("transformer", 3000, marks=pytest.mark.slow),
    pytest.param("qconv", 3000, marks=pytest.mark.slow),
])
def test_fuzz_header_edits(built, name, edits):
    data, x, _ = built[name]
    version, header, blob = split(data)
    (reference,) = run_program(Program.from_bytes(data), [x])
    # The mapping's tile shapes and PE ranges are fuzzed too (they decide the tiles); its other
    # fields, timing and memory are the compiler's report, not read when running.
    body = {k: v for k, v in header.items() if k not in ("timing", "mapping", "memory")}
    body["mapping"] = {"layers": header["mapping"]["layers"]}
    paths = sorted(set(_paths(body)), key=repr)
    paths = [p for p in paths if p != ("mapping",)]
    rng = random.Random(edits)
    rejected = accepted = 0
    for _ in range(edits):
        h = copy.deepcopy(header)
        path = rng.choice(paths)
        parent = h
        for key in path[:-1]:
            parent = parent[key]
        action = rng.random()
        if action < 0.1 and isinstance(parent, dict):
            del parent[path[-1]]
        elif action < 0.2 and isinstance(parent, list):
            del parent[path[-1]]
        else:
            old = parent[path[-1]]
            parent[path[-1]] = rng.choice(_JUNK + ([old + rng.choice([-1, 1])] if type(old) is int else []))
        try:
            program = Program.from_bytes(seal(h, blob, version))
        except ProgramError as err:
            assert FIELD.match(str(err)), (path, str(err))
            rejected += 1
            continue
        # Accepted: the edit was harmless for execution (a name, a byte or cycle count, an
        # equivalent value) and gives the same bits, or it made another well-formed program:
        # an operator attribute (another pool size), another input or constant tensor, a
        # constant read from elsewhere in the blob. Those may change the values, not the shape.
        accepted += 1
        (got,) = run_program(program, [x])
        assert got.shape == reference.shape, path
        if not np.array_equal(got, reference):
            assert ((path[0] == "layers" and path[2] in ("attrs", "inputs", "consts"))
                    or path[:1] + path[2:3] == ("tensors", "offset")), path
    assert rejected > edits // 2 and accepted > edits // 50, (rejected, accepted)
