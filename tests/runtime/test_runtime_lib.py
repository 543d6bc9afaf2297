"""Tests of the C++ runtime library (libtvm_spinn.so) through tvm_spinn._lib.

Every kernel is checked bit-for-bit against an independent numpy model of the hardware; the
module container against a Python re-implementation of its layout.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tvm_ffi

from tvm_spinn import _lib

ROOT = Path(__file__).resolve().parents[2]
F32 = np.float32


# ----------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------
def ref_gemm_f32(a, b, c):
    """Non-fused multiply-add, k ascending: product rounded to fp32, then the sum."""
    acc = c.astype(F32).copy()
    for k in range(a.shape[1]):
        acc = (acc + (a[:, k : k + 1] * b[k : k + 1, :]).astype(F32)).astype(F32)
    return acc


def wrap(x, bits):
    """Signed `bits`-bit two's complement wrap of int64 values."""
    x = np.asarray(x, dtype=np.int64)
    half = np.int64(1) << (bits - 1)
    return ((x + half) & ((np.int64(1) << bits) - 1)) - half


def ref_gemm_int(a, b, c, bits):
    """Sequential int64 model: exact products, every addition wrapped; returns (C, wraps)."""
    acc = c.astype(np.int64)
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    wraps = 0
    for k in range(a.shape[1]):
        exact = acc + a64[:, k : k + 1] * b64[k : k + 1, :]
        acc = wrap(exact, bits)
        wraps += int(np.count_nonzero(acc != exact))
    return acc.astype(np.int32), wraps


def ref_row_sum(x):
    acc = np.zeros(x.shape[0], F32)
    for j in range(x.shape[1]):
        acc = (acc + x[:, j]).astype(F32)
    return acc


def bits_equal(x, y):
    x, y = np.asarray(x), np.asarray(y)
    same_layout = x.shape == y.shape and x.dtype == y.dtype
    return same_layout and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def encode_container(symbol: bytes, program: bytes, version: int = 2, magic: bytes = b"SPINNMOD"):
    """The container (src/container.h): its checksum covers the framing and, for a spinn
    program (which carries its own BLAKE2b-256 digest in its last 32 bytes), that digest only."""
    framing = magic + struct.pack("<II", version, len(symbol)) + symbol + struct.pack("<Q", len(program))
    covered = program[-32:] if program[:8] == b"SPINNPRG" and len(program) >= 40 else program
    return framing + program + struct.pack("<Q", fnv1a64(framing + covered))


def spiky(rng, shape):
    """float32 values over many binades, so that rounding order is observable."""
    mant = rng.standard_normal(shape)
    return (mant * np.exp2(rng.integers(-12, 12, size=shape))).astype(F32)


# ----------------------------------------------------------------------------------------------
# Library loading
# ----------------------------------------------------------------------------------------------
def test_load_library_and_version():
    path = _lib.load_library()
    assert Path(path).is_file() and path.endswith("libtvm_spinn.so")
    assert _lib.load_library() == path  # loaded once
    assert _lib.version() == "spinn-runtime 0.1.0"
    for name in ["tvm_spinn.runtime.create_module", "ffi.Module.load_from_bytes.spinn",
                 "tvm_spinn.sim.gemm_f32", "tvm_spinn.sim.gemm_i8", "tvm_spinn.sim.gemm_i16",
                 "tvm_spinn.sim.row_sum_f32"]:
        assert tvm_ffi.get_global_func(name, allow_missing=True) is not None, name


def test_missing_library_raises_import_error(tmp_path):
    # Load _lib.py without the package's __init__ (which loads the library) with the library path
    # overridden: an empty package object stands in for tvm_spinn, so _lib's leaf imports resolve.
    script = textwrap.dedent(
        f"""
        import importlib, sys, types
        pkg = types.ModuleType("tvm_spinn")
        pkg.__path__ = [{str(ROOT / "python/tvm_spinn")!r}]
        sys.modules["tvm_spinn"] = pkg
        mod = importlib.import_module("tvm_spinn._lib")
        try:
            mod.load_library()
        except ImportError as err:
            print("IMPORTERROR", err)
        """
    )
    missing = tmp_path / "nowhere" / "libtvm_spinn.so"
    env = dict(os.environ, TVM_SPINN_LIBRARY_PATH=str(missing), TVM_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "IMPORTERROR" in out.stdout, out.stderr
    assert str(missing) in out.stdout and "pip install -e ." in out.stdout


# ----------------------------------------------------------------------------------------------
# gemm_f32
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 33, 19), (5, 64, 1030), (9, 0, 4), (0, 3, 5)])
def test_gemm_f32_bit_exact(m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a, b, c0 = spiky(rng, (m, k)), spiky(rng, (k, n)), spiky(rng, (m, n))
    c = c0.copy()
    assert _lib.gemm_f32(a, b, c) is None
    assert bits_equal(c, ref_gemm_f32(a, b, c0))


def test_gemm_f32_order_is_observable():
    # Guard against a test that cannot fail: float64 accumulation differs from the hardware.
    rng = np.random.default_rng(1)
    a, b, c0 = spiky(rng, (16, 200)), spiky(rng, (200, 16)), spiky(rng, (16, 16))
    c = c0.copy()
    _lib.gemm_f32(a, b, c)
    wide = (c0.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)).astype(F32)
    assert not bits_equal(c, wide)


def test_gemm_f32_multiply_add_is_not_fused():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds (tie to even) to 1 + 2^-11 in fp32, so the
    # separately rounded c + a*b is exactly 0, while a fused multiply-add would give 2^-24.
    x = F32(1 + 2.0**-12)
    a = np.full((1, 1), x, F32)
    b = np.full((1, 1), x, F32)
    c = np.full((1, 1), -F32(1 + 2.0**-11), F32)
    _lib.gemm_f32(a, b, c)
    assert c[0, 0] == 0.0


def test_gemm_f32_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    a, b, c0 = spiky(rng, (4, 9)), spiky(rng, (9, 6)), spiky(rng, (4, 6))
    ct = torch.from_numpy(c0.copy())
    _lib.gemm_f32(torch.from_numpy(a), torch.from_numpy(b), ct)
    assert bits_equal(ct.numpy(), ref_gemm_f32(a, b, c0))


def test_gemm_f32_read_only_inputs():
    rng = np.random.default_rng(3)
    a = np.broadcast_to(spiky(rng, (1, 5)), (3, 5))  # read-only, non-contiguous view
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    b = spiky(rng, (5, 2))
    c = np.zeros((3, 2), F32)
    _lib.gemm_f32(a, b, c)
    assert bits_equal(c, ref_gemm_f32(a, b, np.zeros((3, 2), F32)))


# ----------------------------------------------------------------------------------------------
# gemm_i8 / gemm_i16
# ----------------------------------------------------------------------------------------------
def test_gemm_i8_no_overflow_matches_int64():
    rng = np.random.default_rng(4)
    a = rng.integers(-128, 128, size=(13, 300), dtype=np.int8)
    b = rng.integers(-128, 128, size=(300, 600), dtype=np.int8)
    c0 = rng.integers(-1000, 1000, size=(13, 600), dtype=np.int32)
    c = c0.copy()
    wraps = _lib.gemm_i8(a, b, c)
    assert wraps == 0
    exact = c0.astype(np.int64) + a.astype(np.int64) @ b.astype(np.int64)
    assert np.array_equal(c, exact.astype(np.int32))


def test_gemm_i8_overflows_29_bit_accumulator():
    k = 40000  # 40000 * (-128 * -128) = 655,360,000 > 2^28 - 1
    a = np.full((2, k), -128, np.int8)
    b = np.full((k, 3), -128, np.int8)
    c = np.zeros((2, 3), np.int32)
    wraps = _lib.gemm_i8(a, b, c, acc_bits=29)
    total = k * 128 * 128
    assert np.all(c == wrap(total, 29))
    assert int(wrap(total, 29)) == total - (1 << 29)
    # Each output crosses +2^28 exactly once.
    assert wraps == 6 and wraps > 0
    # The default width is the hardware's 29 bits.
    c2 = np.zeros((2, 3), np.int32)
    assert _lib.gemm_i8(a, b, c2) == wraps and np.array_equal(c2, c)
    # A 32-bit accumulator does not wrap.
    c3 = np.zeros((2, 3), np.int32)
    assert _lib.gemm_i8(a, b, c3, acc_bits=32) == 0 and np.all(c3 == total)


@pytest.mark.parametrize("bits", [2, 9, 12, 17, 29, 32])
def test_gemm_i8_wrapping_matches_sequential_model(bits):
    rng = np.random.default_rng(bits)
    a = rng.integers(-128, 128, size=(6, 70), dtype=np.int8)
    b = rng.integers(-128, 128, size=(70, 11), dtype=np.int8)
    lim = 1 << (bits - 1)
    c0 = rng.integers(-lim, lim, size=(6, 11)).astype(np.int32)
    c = c0.copy()
    wraps = _lib.gemm_i8(a, b, c, acc_bits=bits)
    ref, ref_wraps = ref_gemm_int(a, b, c0, bits)
    assert np.array_equal(c, ref)
    assert wraps == ref_wraps
    if bits <= 17:
        assert wraps > 0
    # Wrapping is a ring homomorphism: final value == wrap of the exact sum.
    exact = c0.astype(np.int64) + a.astype(np.int64) @ b.astype(np.int64)
    assert np.array_equal(c, wrap(exact, bits).astype(np.int32))


@pytest.mark.parametrize("bits", [29, 32])
def test_gemm_i16(bits):
    rng = np.random.default_rng(100 + bits)
    a = rng.integers(-32768, 32768, size=(5, 40), dtype=np.int16)
    b = rng.integers(-32768, 32768, size=(40, 520), dtype=np.int16)
    c0 = np.zeros((5, 520), np.int32)
    c = c0.copy()
    wraps = _lib.gemm_i16(a, b, c, acc_bits=bits)
    ref, ref_wraps = ref_gemm_int(a, b, c0, bits)
    assert np.array_equal(c, ref) and wraps == ref_wraps
    assert wraps > 0  # products up to 2^30 overflow both widths with K=40


def test_gemm_i16_no_overflow():
    rng = np.random.default_rng(7)
    a = rng.integers(-300, 300, size=(4, 50), dtype=np.int16)
    b = rng.integers(-300, 300, size=(50, 8), dtype=np.int16)
    c = np.zeros((4, 8), np.int32)
    assert _lib.gemm_i16(a, b, c) == 0
    assert np.array_equal(c, (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32))


def test_gemm_int_accumulator_checks():
    a = np.ones((2, 3), np.int8)
    b = np.ones((3, 4), np.int8)
    for bits in (1, 33, 0, -5):
        with pytest.raises(ValueError, match="acc_bits"):
            _lib.gemm_i8(a, b, np.zeros((2, 4), np.int32), acc_bits=bits)
    c = np.zeros((2, 4), np.int32)
    c[1, 2] = 1 << 28  # not representable in 29 bits
    with pytest.raises(ValueError, match="does not fit the signed 29-bit accumulator"):
        _lib.gemm_i8(a, b, c)
    assert c[1, 2] == 1 << 28 and c.sum() == 1 << 28  # untouched on error


# ----------------------------------------------------------------------------------------------
# row_sum_f32
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 1000), (3, 0), (0, 4)])
def test_row_sum_f32_bit_exact(rows, cols):
    rng = np.random.default_rng(rows + cols)
    x = spiky(rng, (rows, cols))
    out = np.full(rows, np.nan, F32)
    _lib.row_sum_f32(x, out)
    assert bits_equal(out, ref_row_sum(x))


def test_row_sum_f32_is_sequential():
    # 1e8 has an fp32 ulp of 8: adding 1.0 sequentially never changes it (pairwise would).
    x = np.ones((2, 1001), F32)
    x[:, 0] = 1e8
    out = np.zeros(2, F32)
    _lib.row_sum_f32(x, out)
    assert np.all(out == F32(1e8))


# ----------------------------------------------------------------------------------------------
# Argument validation: errors, never crashes
# ----------------------------------------------------------------------------------------------
def test_kernel_argument_errors():
    f = np.zeros((2, 3), F32)
    g = np.zeros((3, 4), F32)
    h = np.zeros((2, 4), F32)
    with pytest.raises(TypeError, match="argument `B` must have dtype float32, got float64"):
        _lib.gemm_f32(f, g.astype(np.float64), h)
    with pytest.raises(TypeError, match="argument `A` must have dtype int8, got float32"):
        _lib.gemm_i8(f, g.astype(np.int8), h.astype(np.int32))
    with pytest.raises(TypeError, match="argument `C` must have dtype int32"):
        _lib.gemm_i16(f.astype(np.int16), g.astype(np.int16), h.astype(np.int64))
    with pytest.raises(ValueError, match="argument `A` must be 2-D, got a 3-D"):
        _lib.gemm_f32(np.zeros((2, 3, 1), F32), g, h)
    with pytest.raises(ValueError, match=r"B.shape\[0\] is 4 but must be 3"):
        _lib.gemm_f32(f, np.zeros((4, 4), F32), h)
    with pytest.raises(ValueError, match=r"C.shape\[1\] is 5 but must be 4"):
        _lib.gemm_f32(f, g, np.zeros((2, 5), F32))
    with pytest.raises(ValueError, match="argument `C` .* must be C-contiguous"):
        _lib.gemm_f32(f, g, np.zeros((4, 2), F32).T)
    with pytest.raises(ValueError, match="argument `A` .* must be C-contiguous"):
        _lib.gemm_f32(np.zeros((2, 6), F32)[:, ::2], g, h)
    with pytest.raises(TypeError):
        _lib.gemm_f32(f, g, [[0.0] * 4] * 2)
    with pytest.raises(TypeError):
        _lib.gemm_i8(f.astype(np.int8), g.astype(np.int8), h.astype(np.int32), acc_bits="x")
    with pytest.raises(ValueError, match="argument `out` must be 1-D"):
        _lib.row_sum_f32(f, np.zeros((2, 1), F32))
    with pytest.raises(ValueError, match=r"out.shape\[0\] is 3 but must be 2"):
        _lib.row_sum_f32(f, np.zeros(3, F32))
    with pytest.raises(TypeError, match="argument `X` must have dtype float32"):
        _lib.row_sum_f32(f.astype(np.float16), np.zeros(2, F32))


def test_output_aliasing_input_is_rejected():
    buf = np.zeros((3, 3), F32)
    with pytest.raises(ValueError, match="output `C` overlaps input `A`"):
        _lib.gemm_f32(buf, np.zeros((3, 3), F32), buf)
    x = np.zeros(8, F32)
    with pytest.raises(ValueError, match="output `out` overlaps input `X`"):
        _lib.row_sum_f32(x.reshape(2, 4), x[:2])


# ----------------------------------------------------------------------------------------------
# The "spinn" runtime module
# ----------------------------------------------------------------------------------------------
PROGRAM = bytes(range(256)) * 3 + b"\x00spinn-program\xff"


@pytest.fixture(autouse=True)
def _library_alone():
    """These tests check the C++ module with opaque payloads: take the package's program
    validator (tvm_spinn.runtime.validate_program, see test_program_validation.py) out of the
    registry while they run, as in a process that loaded only the library."""
    name = "tvm_spinn.runtime.validate_program"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    if previous is not None:
        tvm_ffi.remove_global_func(name)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)


def test_module_accessors():
    mod = _lib.create_module("tvmgen_default_spinn_main_0", PROGRAM)
    assert mod.kind == "spinn"
    assert tvm_ffi.get_global_func("ffi.ModuleGetPropertyMask")(mod) == 0b011
    assert bytes(mod["get_program"]()) == PROGRAM
    assert bytes(mod.get_program()) == PROGRAM
    assert mod["get_symbol"]() == "tvmgen_default_spinn_main_0"
    assert mod["get_key"]().startswith("spinn-module-")
    assert mod.implements_function("tvmgen_default_spinn_main_0")
    assert not mod.implements_function("something_else")
    with pytest.raises(AttributeError):
        mod["something_else"]
    with pytest.raises(ValueError, match="non-empty"):
        _lib.create_module("", b"x")


def test_module_keys_are_unique_per_module():
    """The executor caches parsed programs by key: each module object gets its own, so no
    module can select another's cache entry, and making a key reads none of the program."""
    keys = [_lib.create_module("f", b"abc")["get_key"]() for _ in range(3)]
    keys.append(_lib.create_module("g", b"abd")["get_key"]())
    assert len(set(keys)) == len(keys)
    mod = _lib.create_module("f", b"abc")
    assert mod["get_key"]() == mod["get_key"]()  # stable for one module
    back = _lib.load_module_from_bytes(_lib.save_to_bytes(mod))
    assert back["get_key"]() != mod["get_key"]()  # a loaded copy is another module


@pytest.fixture
def fake_execute():
    """Temporarily replace tvm_spinn.runtime.execute with a recorder; restore afterwards."""
    name = "tvm_spinn.runtime.execute"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    calls = []

    def execute(key, program_getter, symbol, *args):
        calls.append((key, bytes(program_getter()), symbol, args))
        out = np.from_dlpack(args[-1])
        out[...] = np.from_dlpack(args[0]) + np.from_dlpack(args[1])

    tvm_ffi.register_global_func(name, execute, override=True)
    try:
        yield calls
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)
        else:
            tvm_ffi.remove_global_func(name)


def test_module_forwards_dps_call_to_execute(fake_execute):
    mod = _lib.create_module("fused_spinn_0", PROGRAM)
    x = np.arange(6, dtype=F32).reshape(2, 3)
    y = np.full((2, 3), 10, F32)
    out = np.zeros((2, 3), F32)
    mod["fused_spinn_0"](x, y, out)
    (key, program, symbol, args), = fake_execute
    assert key == mod["get_key"]() and program == PROGRAM and symbol == "fused_spinn_0"
    assert len(args) == 3
    assert np.array_equal(out, x + y)  # outputs are forwarded as views of the caller's memory


def test_module_without_executor_raises():
    # In a clean process that only loads the library (the package would register execute).
    script = textwrap.dedent(
        f"""
        import ctypes, numpy as np, tvm_ffi
        ctypes.CDLL({_lib.load_library()!r}, mode=ctypes.RTLD_GLOBAL)
        mod = tvm_ffi.get_global_func("tvm_spinn.runtime.create_module")("f", b"p")
        try:
            mod["f"](np.zeros(2, np.float32))
        except RuntimeError as err:
            print("RUNTIMEERROR", err)
        """
    )
    env = dict(os.environ, TVM_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "RUNTIMEERROR" in out.stdout, out.stderr
    assert "import tvm_spinn to run spinn modules" in out.stdout


# ----------------------------------------------------------------------------------------------
# Serialization container
# ----------------------------------------------------------------------------------------------
def test_container_layout_and_round_trip():
    mod = _lib.create_module("sym", PROGRAM)
    raw = _lib.save_to_bytes(mod)
    assert raw == encode_container(b"sym", PROGRAM)  # independent encoder
    assert raw[:8] == b"SPINNMOD"
    assert struct.unpack_from("<II", raw, 8) == (2, 3)
    back = _lib.load_module_from_bytes(raw)
    assert back.kind == "spinn"
    assert bytes(back["get_program"]()) == PROGRAM and back["get_symbol"]() == "sym"
    assert back["get_key"]() != mod["get_key"]()  # another module object, its own cache entry
    # The registered loader is what TVM calls; it accepts Python bytes directly.
    loader = tvm_ffi.get_global_func("ffi.Module.load_from_bytes.spinn")
    assert bytes(loader(raw)["get_program"]()) == PROGRAM


def test_container_via_tvm_import_packer():
    """TVM's export path (runtime.ModulePackImportsToTensor, used by export_library)."""
    tvm = pytest.importorskip("tvm")
    mod = _lib.create_module("sym", PROGRAM)
    packed = tvm.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy().tobytes()
    # <u64 nbytes> <vec<u64> indptr> <vec<u64> children> (<str kind> <bytes payload>)*
    (nbytes,) = struct.unpack_from("<Q", packed, 0)
    assert nbytes == len(packed) - 8
    off = 8
    for _ in range(2):
        (count,) = struct.unpack_from("<Q", packed, off)
        off += 8 + 8 * count
    (klen,) = struct.unpack_from("<Q", packed, off)
    kind = packed[off + 8 : off + 8 + klen].decode()
    off += 8 + klen
    (plen,) = struct.unpack_from("<Q", packed, off)
    payload = packed[off + 8 : off + 8 + plen]
    assert kind == "spinn"
    assert payload == _lib.save_to_bytes(mod)
    assert bytes(_lib.load_module_from_bytes(payload)["get_program"]()) == PROGRAM


def test_container_every_truncation_is_a_value_error():
    raw = encode_container(b"fn", b"program-bytes")
    for size in range(len(raw)):
        expected = rf"truncated container \(need \d+ bytes, have {size}\)"
        with pytest.raises(ValueError, match=expected):
            _lib.load_module_from_bytes(raw[:size])


def test_container_every_byte_flip_is_a_value_error():
    raw = encode_container(b"fn", b"program-bytes")
    for i in range(len(raw)):
        for flip in (0x01, 0x80):
            bad = bytearray(raw)
            bad[i] ^= flip
            with pytest.raises(ValueError, match="spinn module: "):
                _lib.load_module_from_bytes(bytes(bad))


def test_container_of_a_spinn_program_checks_framing_and_digest():
    """A spinn program's body is covered by its own digest (verified by the validator at load,
    tests/program/test_program_validation.py): the container checks its framing and that digest, so a
    module of hundreds of MB is not hashed twice; a changed digest or framing byte is caught."""
    program = b"SPINNPRG" + bytes(range(200)) + hashlib.blake2b(b"x", digest_size=32).digest()
    raw = _lib.save_to_bytes(_lib.create_module("fn", program))
    assert raw == encode_container(b"fn", program)
    for i in [*range(0, 28), *range(len(raw) - 40, len(raw))]:  # framing, digest, checksum
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(ValueError, match="spinn module: "):
            _lib.load_module_from_bytes(bytes(bad))


def test_container_specific_messages():
    good = encode_container(b"fn", b"prog")
    with pytest.raises(ValueError, match="checksum mismatch"):
        _lib.load_module_from_bytes(good[:-9] + b"X" + good[-8:])  # flip last program byte
    with pytest.raises(ValueError, match="unknown container version 1"):
        _lib.load_module_from_bytes(encode_container(b"fn", b"prog", version=1))
    with pytest.raises(ValueError, match="bad magic"):
        _lib.load_module_from_bytes(encode_container(b"fn", b"prog", magic=b"TVMSPINN"))
    with pytest.raises(ValueError, match="trailing bytes"):
        _lib.load_module_from_bytes(good + b"\x00")
    with pytest.raises(ValueError, match="empty symbol"):
        _lib.load_module_from_bytes(encode_container(b"", b"prog"))
    with pytest.raises(ValueError, match=r"truncated container \(need 4294967311 bytes"):
        body = b"SPINNMOD" + struct.pack("<II", 2, 0xFFFFFFFF) + b"fn"
        _lib.load_module_from_bytes(body)
    # A u64 program length near 2^64 must not overflow the bounds check.
    body = b"SPINNMOD" + struct.pack("<II", 2, 2) + b"fn" + struct.pack("<Q", 2**64 - 1)
    with pytest.raises(ValueError, match="truncated container .* while reading program"):
        _lib.load_module_from_bytes(body + struct.pack("<Q", fnv1a64(body)))
    with pytest.raises(ValueError, match="truncated container"):
        _lib.load_module_from_bytes(b"")


# ----------------------------------------------------------------------------------------------
# End to end: export_library -> load_module in a fresh process
# ----------------------------------------------------------------------------------------------
_EXPORT = """
import ctypes, sys
import tvm, tvm_ffi
from tvm import relax
from tvm.script import relax as R
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)

@tvm.script.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 3), "float32")):
        with R.dataflow():
            y = R.call_dps_packed("fused_spinn_0", (x,), out_ty=R.Tensor((2, 3), "float32"))
            R.output(y)
        return y

ex = relax.build(Mod, target="llvm")
create = tvm_ffi.get_global_func("tvm_spinn.runtime.create_module")
ex.mod.import_module(create("fused_spinn_0", b"PRG"))
ex.export_library(sys.argv[2])
"""

_LOAD = """
import ctypes, sys
import numpy as np, tvm, tvm_ffi
from tvm import relax
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)

@tvm_ffi.register_global_func("tvm_spinn.runtime.execute")
def execute(key, getter, symbol, x, y):
    assert bytes(getter()) == b"PRG" and symbol == "fused_spinn_0", (getter(), symbol)
    y.copyfrom(x.numpy() * 2 + 1)

lib = tvm.runtime.load_module(sys.argv[2])
assert "spinn" in [m.kind for m in lib.imports], [m.kind for m in lib.imports]
vm = relax.VirtualMachine(lib, tvm.cpu())
out = vm["main"](tvm.runtime.tensor(np.ones((2, 3), "float32"))).numpy()
assert np.array_equal(out, np.full((2, 3), 3, "float32")), out
print("ROUNDTRIP-OK")
"""


@pytest.mark.timeout(600)
def test_export_library_round_trip(tmp_path):
    pytest.importorskip("tvm")
    lib_path = _lib.load_library()
    so = tmp_path / "spinn_exec.so"
    # TVM_DEVICE_BACKEND_AUTOLOAD=0: only this library, not the rest of the tvm_spinn package.
    env = dict(os.environ, TVM_DEVICE_BACKEND_AUTOLOAD="0")
    for name, script in (("export.py", _EXPORT), ("load.py", _LOAD)):
        path = tmp_path / name  # TVMScript needs a real source file
        path.write_text(script)
        out = subprocess.run([sys.executable, str(path), lib_path, str(so)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
    assert "ROUNDTRIP-OK" in out.stdout
