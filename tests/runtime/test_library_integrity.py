"""Libraries sealed by ``tvm_spinn.export_library`` are verified before TVM's loader sees them.

Damage anywhere in the file (VM bytecode, constants, ELF headers, the trailer itself), a
truncated file, a huge length field, a foreign shared object: each is one ``LibraryError``,
never a crash, a hang or a multi-gigabyte allocation. Crash-prone loops run in a subprocess so
that a signal shows up as a failed test rather than a dead test runner. A library exported by
TVM's own ``ex.export_library`` loads too, its spinn modules verifying themselves.
"""

import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn.program import ProgramError
from tvm_spinn.runtime import loader
from models import make


def _run(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"subprocess died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return proc


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    model, x = make("mlp")
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn")
    directory = tmp_path_factory.mktemp("sealed")
    path = directory / "mlp.so"
    tvm_spinn.export_library(ex, path)
    expected = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy())).numpy()
    return ex, path, x.numpy(), expected


def test_export_seals_and_reloads_same_bits(mlp):
    ex, path, x, expected = mlp
    meta = loader.verify_library(str(path))
    assert meta["exporter"] == "tvm_spinn.export_library" and meta["tvm_spinn"] == tvm_spinn.__version__
    assert open(path, "rb").read()[-8:] == loader.TRAILER_MAGIC
    assert os.listdir(path.parent) == ["mlp.so"]  # no temporary left behind
    assert os.stat(path).st_mode & 0o777 == loader.file_mode(executable=True)
    got = relax.VirtualMachine(tvm_spinn.load_module(path), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    # the sealed file is still an ordinary shared library for plain TVM
    plain = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    assert np.array_equal(plain["main"](tvm.runtime.tensor(x)).numpy(), expected)


def test_libraries_sealed_by_the_previous_version_still_load(mlp, tmp_path, monkeypatch):
    """Version 4 seals with XXH3-128 segment digests; a version-3 library (SHA-256 segments,
    same container) is still verified and loaded, and damage to it is still found."""
    ex, _, x, expected = mlp
    path = tmp_path / "v3.so"
    monkeypatch.setattr(loader, "_VERSION", 3)
    tvm_spinn.export_library(ex, path)
    monkeypatch.undo()
    assert struct.unpack("<I", open(path, "rb").read()[-44:-40])[0] == 3  # the footer's version field
    got = relax.VirtualMachine(tvm_spinn.load_module(path), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    bad = tmp_path / "v3_damaged.so"  # a copy: never rewrite a library dlopen has mapped
    bad.write_bytes(bytes(data))
    with pytest.raises(loader.LibraryError, match="digest|damaged|corrupt"):
        tvm_spinn.load_module(bad)


def test_a_file_replaced_during_the_load_is_refused(mlp, tmp_path, monkeypatch):
    """The programs of a verified library skip their own digest pass, so the file TVM reads
    must be the file that was verified: one replaced at the path in between (a concurrent
    export) is refused."""
    import shutil

    _, path, _, _ = mlp
    target = tmp_path / "model.so"
    shutil.copy(path, target)
    other = tmp_path / "other.so"
    shutil.copy(path, other)
    original = loader._verify  # load_module's verification (it keeps the verified map)

    def verify_then_replace(source):
        verified = original(source)
        os.replace(other, target)  # the path now names another file
        return verified

    monkeypatch.setattr(loader, "_verify", verify_then_replace)
    with pytest.raises(tvm_spinn.LibraryError, match="changed while it was being loaded"):
        tvm_spinn.load_module(target)


def test_damaged_copies_raise_library_error_fast(mlp, tmp_path):
    """In one subprocess (a crash fails the test): 200 single-bit flips at seeded positions spread
    over the whole file (plus the ELF header and the trailer), and length fields set to 2^32 (a
    TVM-internal one: the serialized type key of the VM executable; the trailer's body length),
    refused in well under a second without allocating."""
    _, path, _, _ = mlp
    data = bytearray(open(path, "rb").read())
    key = data.find(b"relax.VMExecutable")
    assert key > 8 and struct.unpack_from("<Q", data, key - 8)[0] == len(b"relax.VMExecutable")
    inner = bytearray(data)
    struct.pack_into("<Q", inner, key - 8, 2**32)
    trailer = bytearray(data)
    struct.pack_into("<Q", trailer, len(data) - loader._FOOTER.size, 2**32)
    (tmp_path / "inner.so").write_bytes(inner)
    (tmp_path / "trailer.so").write_bytes(trailer)
    proc = _run(f"""
        import resource, time, numpy as np, tvm_spinn
        data = open({str(path)!r}, "rb").read()
        rng = np.random.default_rng(0)
        positions = np.concatenate([rng.integers(0, len(data), 184), len(data) - 1 - np.arange(8) * 8,
                                    np.arange(8) * 8])
        bad = {str(tmp_path / "flip.so")!r}
        outcomes = {{}}
        for pos in positions:
            damaged = bytearray(data)
            damaged[pos] ^= 1 << int(rng.integers(0, 8))
            open(bad, "wb").write(damaged)
            try:
                tvm_spinn.load_module(bad)
                kind = "loaded"
            except tvm_spinn.LibraryError:
                kind = "LibraryError"
            except Exception as err:
                kind = type(err).__name__
            outcomes[kind] = outcomes.get(kind, 0) + 1
        print(outcomes)
        for name in ("inner", "trailer"):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            start = time.perf_counter()
            try:
                tvm_spinn.load_module({str(tmp_path)!r} + f"/{{name}}.so")
                print(name, "loaded")
            except tvm_spinn.LibraryError as err:
                grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
                print(name, "refused", round(time.perf_counter() - start, 3), grew, err)
    """)
    lines = proc.stdout.strip().splitlines()[-3:]
    assert lines[0] == "{'LibraryError': 200}", proc.stdout
    for line, name in zip(lines[1:], ("inner", "trailer")):
        fields = line.split()
        assert fields[:2] == [name, "refused"], line
        assert float(fields[2]) < 1.0 and int(fields[3]) < 64 * 1024, line  # seconds, KiB


def test_truncated_files_raise_library_error(mlp, tmp_path):
    _, path, _, _ = mlp
    data = open(path, "rb").read()
    for size in (0, 3, 64, len(data) // 2, len(data) - 65, len(data) - 1):
        bad = tmp_path / f"cut{size}.so"
        bad.write_bytes(data[:size])
        with pytest.raises(tvm_spinn.LibraryError, match=rf"cut{size}\.so"):
            tvm_spinn.load_module(bad)
    bad = tmp_path / "grown.so"
    bad.write_bytes(data + b"\0" * 16)
    with pytest.raises(tvm_spinn.LibraryError, match="no integrity trailer"):
        tvm_spinn.load_module(bad)


def test_foreign_shared_object_is_library_error(tmp_path):
    src = tmp_path / "f.c"
    src.write_text("int f(int x) { return x + 1; }\n")
    so = tmp_path / "f.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    with pytest.raises(tvm_spinn.LibraryError, match="not a library exported by tvm-spinn"):
        tvm_spinn.load_module(so)
    # even a well-sealed foreign library is refused: it holds no Relax VM executable
    loader._seal(str(so), {"exporter": "test"})
    with pytest.raises(tvm_spinn.LibraryError, match="not a Relax VM executable"):
        tvm_spinn.load_module(so)
    text = tmp_path / "notes.so"
    text.write_bytes(b"hello")
    with pytest.raises(tvm_spinn.LibraryError, match="notes.so"):
        tvm_spinn.load_module(text)
    with pytest.raises(tvm_spinn.LibraryError, match="no such file"):
        tvm_spinn.load_module(tmp_path / "missing.so")


def test_plain_tvm_library_loads_and_export_library_seals_it(tmp_path):
    """A non-spinn build exported by TVM's ``export_library`` (no trailer) loads; export_library
    seals the same executable, and the sealed file loads to the same outputs."""
    model, x = make("mlp")
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="llvm")
    ex.export_library(str(tmp_path / "plain.so"))
    plain = relax.VirtualMachine(tvm_spinn.load_module(tmp_path / "plain.so"), tvm.cpu())["main"](
        tvm.runtime.tensor(x.numpy())).numpy()
    with pytest.raises(tvm_spinn.LibraryError, match="no integrity trailer"):
        loader.verify_library(str(tmp_path / "plain.so"))
    tvm_spinn.export_library(ex, tmp_path / "sealed.so")
    got = relax.VirtualMachine(tvm_spinn.load_module(tmp_path / "sealed.so"), tvm.cpu())["main"](
        tvm.runtime.tensor(x.numpy())).numpy()
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert np.array_equal(plain.view(np.uint32), got.view(np.uint32))
    with pytest.raises(tvm_spinn.LibraryError, match="does not exist"):
        tvm_spinn.export_library(ex, tmp_path / "missing" / "x.so")
    assert sorted(os.listdir(tmp_path)) == ["plain.so", "sealed.so"]


def test_tvm_export_of_a_spinn_build(mlp, tmp_path):
    """``ex.export_library`` is TVM's own: the programs travel inside TVM's module blob, each in
    a container that verifies itself. Both loaders load it to the sealed library's bits; a
    damaged program or container is one error naming the defect; extra or missing bytes at
    the end (a sealed file whose trailer is cut or grown) are refused, never loaded unverified."""
    ex, sealed, x, expected = mlp
    path = tmp_path / "plain.so"
    ex.export_library(str(path))
    data = path.read_bytes()
    assert data[-8:] != loader.TRAILER_MAGIC and b"SPINNPRG" in data
    for lib in (tvm_spinn.load_module(path), tvm.runtime.load_module(str(path))):
        got = relax.VirtualMachine(lib, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    program, container = data.find(b"SPINNPRG"), data.find(b"SPINNMOD")
    for name, offset, error, match in (
            ("program", program + 200, ProgramError, "checksum mismatch"),
            ("container", container + 9, tvm_spinn.LibraryError, "container version")):
        damaged = bytearray(data)
        damaged[offset] ^= 0x10
        bad = tmp_path / f"{name}.so"
        bad.write_bytes(bytes(damaged))
        with pytest.raises(error, match=match) as info:
            tvm_spinn.load_module(bad)
        assert f"{name}.so" in str(info.value)
    ends = {"plain_grown": data + b"\0", "plain_cut": data[:-1]}
    whole = sealed.read_bytes()
    ends.update({"sealed_grown": whole + b"\0" * 16, "sealed_cut": whole[:-1],
                 "sealed_magic": whole[:-1] + bytes([whole[-1] ^ 1])})
    for name, blob in ends.items():
        bad = tmp_path / f"{name}.so"
        bad.write_bytes(blob)
        with pytest.raises(tvm_spinn.LibraryError, match="no integrity trailer"):
            tvm_spinn.load_module(bad)
    # cut at its ELF end, a sealed file is a complete ELF library whose programs are missing
    bad = tmp_path / "sealed_elf_only.so"
    bad.write_bytes(whole[:_elf_end(whole)])
    with pytest.raises(tvm_spinn.LibraryError,
                       match="programs and integrity trailer cut off") as info:
        tvm_spinn.load_module(bad)
    assert "sealed_elf_only.so" in str(info.value) and "load_module" not in str(info.value)


def _elf_end(data: bytes) -> int:
    """Where the ELF contents of ``data`` (64-bit little-endian) end: its headers, segments and
    sections (SHT_NOBITS ones occupy no bytes)."""
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(phnum):
        _, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        end = max(end, offset + filesz)
    for i in range(shnum):
        _, kind, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        end = max(end, offset + (0 if kind == 8 else size))
    return end


@pytest.mark.parametrize("sealed_file", [True, False])
def test_an_error_without_a_message_is_named_by_its_type(mlp, tmp_path, monkeypatch, sealed_file):
    """TVM's loader failing with an empty message is still one LibraryError naming the file."""
    ex, sealed, _, _ = mlp
    path = sealed if sealed_file else tmp_path / "plain.so"
    if not sealed_file:
        ex.export_library(str(path))

    def fail(_path):
        raise MemoryError()

    monkeypatch.setattr(tvm.runtime, "load_module", fail)
    with pytest.raises(tvm_spinn.LibraryError, match=r"cannot load: MemoryError$") as info:
        tvm_spinn.load_module(path)
    assert os.path.basename(path) in str(info.value)


def test_offloaded_weights_are_stored_once(tmp_path):
    """The exported size is the weights plus a small overhead (they used to be stored twice)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).eval()
    x = torch.randn(2, 256)
    weights = sum(p.numel() * 4 for p in model.parameters())
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn")
    tvm_spinn.export_library(ex, tmp_path / "m.so")
    size = os.path.getsize(tmp_path / "m.so")
    assert weights < size < 1.1 * weights + 64 * 1024, (size, weights)
    got = relax.VirtualMachine(tvm_spinn.load_module(tmp_path / "m.so"), tvm.cpu())["main"](
        tvm.runtime.tensor(x.numpy())).numpy()
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-4, atol=1e-5)


def test_spinn_runtime_error_keeps_its_type(mlp):
    """Raised behind the FFI (VM -> spinn module -> Python callback), it is not a RuntimeError."""
    _, path, _, _ = mlp
    lib = tvm_spinn.load_module(path)
    region = next(m for m in tvm_spinn.report_modules(lib) if str(m["get_symbol"]()) != "__spinn_manifest__")
    func = region[str(region["get_symbol"]())]
    with pytest.raises(tvm_spinn.SpinnRuntimeError, match=r"input .x. \(argument 0\) expects shape"):
        func(np.zeros((1, 1), "float32"), np.zeros((1, 1), "float32"))


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the file at ``path``."""
    st = os.stat(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and int(fields[4]) == st.st_ino:
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                out.append((lo, hi))
    return out


def test_programs_are_read_in_place_from_the_sealed_file(mlp):
    """The programs lie after the ELF contents, located by the trailer's record; load_module
    reads them from the verified memory map (no copy), and their constants are read-only."""
    from tvm_spinn.runtime import executor

    _, path, _, _ = mlp
    meta = loader.verify_library(str(path))
    data = open(path, "rb").read()
    assert meta["programs"], meta
    lib = tvm_spinn.load_module(path)
    ranges = _mapped_ranges(path)
    regions = [m for m in tvm_spinn.report_modules(lib) if str(m["get_symbol"]()) != "__spinn_manifest__"]
    assert regions
    for region in regions:
        raw = bytes(region["get_program"]())
        digest, offset, size = next(e for e in meta["programs"] if e[0] == raw[-32:].hex())
        assert data[offset:offset + size] == raw
        program = executor._CACHE[str(region["get_key"]())]
        for array in program.constants.values():
            assert not array.flags.writeable
            if array.size:
                assert any(lo <= array.ctypes.data < hi for lo, hi in ranges)
                with pytest.raises(ValueError):
                    array.reshape(-1)[0] = 0


def test_external_program_needs_its_library():
    """A module container naming a program stored in a library that is not loaded fails
    clearly (not a crash)."""
    from test_runtime_lib import fnv1a64
    from tvm_spinn import _lib

    # version 3: symbol, program length, the program's digest, checksum (src/container.h)
    body = b"SPINNMOD" + struct.pack("<II", 3, 2) + b"fn" + struct.pack("<Q", 4096) + b"\x01" * 32
    with pytest.raises(Exception, match="tvm_spinn.load_module"):
        _lib.load_module_from_bytes(body + struct.pack("<Q", fnv1a64(body)))
    with pytest.raises(ValueError, match="checksum mismatch"):
        _lib.load_module_from_bytes(body + struct.pack("<Q", fnv1a64(body) ^ 1))


def test_a_damaged_library_mapped_earlier_is_not_read_for_a_new_build(mlp, tmp_path, monkeypatch):
    """Plain TVM loading (``VirtualMachine(ex)`` jit-exports and reloads) finds a program by
    its digest among the libraries mapped into the process. An earlier export of the same model
    holds the same program; damaged on disk since, it must be passed over, not read."""
    ex, _, x, expected = mlp
    path = tmp_path / "earlier.so"
    tvm_spinn.export_library(ex, path)
    meta = loader.verify_library(str(path))
    _, offset, size = meta["programs"][0]
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40  # damage the program's magic: read, it could not load
    damaged = tmp_path / "damaged.so"  # a copy: a library dlopen has mapped is never rewritten
    damaged.write_bytes(bytes(data))
    mapped_paths = loader._mapped_paths
    monkeypatch.setattr(loader, "_mapped_paths", lambda: [str(damaged)] + mapped_paths())  # looked at first
    loader._FOUND.clear()
    model, x_t = make("mlp")
    fresh = relax.build(tvm_spinn.frontend.from_pytorch(model, (x_t,)), target="spinn")
    got = relax.VirtualMachine(fresh, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
