"""The emulated FPv4-SP arithmetic itself, instruction by instruction, against the architecture's
rules (Arm v7-M Architecture Reference Manual, A2.5 "Floating-point support": FPProcessNaNs,
default NaN, flush-to-zero, rounding; Cortex-M4 TRM r0p1 section 7.2: VMLA is a multiply then an
add, each rounded, VFMA rounds once) with the expected values computed in numpy (float64 for
exact products, bit operations for NaN payloads). Each vector runs one instruction in ``unicorn``
with the FPSCR the vector names.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
from elftools.elf.elffile import ELFFile  # noqa: E402
from unicorn import UC_ARCH_ARM, UC_MODE_MCLASS, UC_MODE_THUMB, Uc  # noqa: E402
from unicorn import arm_const as A  # noqa: E402

from tvm_spinn.pe.runtime import zig  # noqa: E402

_OPS = {
    "vmla": "vmla.f32 s0, s1, s2", "vfma": "vfma.f32 s0, s1, s2", "vadd": "vadd.f32 s0, s1, s2",
    "vsub": "vsub.f32 s0, s1, s2", "vmul": "vmul.f32 s0, s1, s2", "vdiv": "vdiv.f32 s0, s1, s2",
    "vcvt_s32": "vcvt.s32.f32 s0, s1", "vcvtr_s32": "vcvtr.s32.f32 s0, s1", "vcvt_u32": "vcvt.u32.f32 s0, s1",
}
FZ, DN = 1 << 24, 1 << 25


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    """Each instruction assembled (ziglang's clang) at its own symbol: name -> (address, code)."""
    tmp = tmp_path_factory.mktemp("vec")
    src = [".syntax unified", ".thumb", ".text"]
    for name, insn in _OPS.items():
        # FPSCR is set by the code (VMSR), as the PE's start-up does: unicorn's register write
        # of FPSCR does not reach the soft-float status (DN and FZ would be ignored)
        src += [f".global t_{name}", ".thumb_func", f"t_{name}: vmsr fpscr, r0", insn, "nop", "nop"]
    (tmp / "v.s").write_text("\n".join(src) + "\n")
    zig("cc", "-target", "thumb-freestanding-eabihf", "-mcpu=cortex_m4+vfp4d16sp", "-c", str(tmp / "v.s"),
        "-o", str(tmp / "v.o"))
    elf = ELFFile(io.BytesIO((tmp / "v.o").read_bytes()))
    text = elf.get_section_by_name(".text").data()
    syms = {s.name[2:]: int(s["st_value"]) & ~1 for s in elf.get_section_by_name(".symtab").iter_symbols()
            if s.name.startswith("t_")}
    return syms, text


def _f(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _bits(x) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def run(code, name: str, s0=0.0, s1=0.0, s2=0.0, fpscr: int = 0) -> int:
    """Bits of s0 after executing instruction ``name`` with the given inputs (floats or bit
    patterns as ints) and FPSCR."""
    syms, text = code
    uc = Uc(UC_ARCH_ARM, UC_MODE_THUMB | UC_MODE_MCLASS)
    uc.mem_map(0, 0x1000)
    uc.mem_write(0, text)
    for reg, v in ((A.UC_ARM_REG_S0, s0), (A.UC_ARM_REG_S1, s1), (A.UC_ARM_REG_S2, s2)):
        uc.reg_write(reg, v if isinstance(v, int) else _bits(v))
    uc.reg_write(A.UC_ARM_REG_R0, fpscr)
    start = syms[name]
    uc.emu_start(start | 1, start + 8)
    return uc.reg_read(A.UC_ARM_REG_S0) & 0xFFFFFFFF


def test_vmla_rounds_twice_vfma_once(code):
    a, b, c = np.float32(1 + 2**-23), np.float32(1 - 2**-23), np.float32(-1.0)
    unfused = np.float32(np.float32(a * b) + c)  # numpy float32: each operation rounded
    fused = np.float32(np.float64(a) * np.float64(b) + np.float64(c))  # exact product, one rounding
    assert unfused == 0.0 and fused == np.float32(-2**-46)
    assert run(code, "vmla", c, a, b) == _bits(unfused)
    assert run(code, "vfma", c, a, b) == _bits(fused)


@pytest.mark.parametrize("seed", range(3))
def test_vmla_matches_numpy_float32_on_random_operands(code, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(40, 3)) * 10.0 ** rng.integers(-30, 30, size=(40, 3))).astype(np.float32)
    for acc, a, b in x:
        assert run(code, "vmla", acc, a, b) == _bits(np.float32(acc + np.float32(a * b)))
        assert run(code, "vmul", 0.0, a, b) == _bits(np.float32(a * b))
        assert run(code, "vdiv", 0.0, a, b) == _bits(np.float32(a / b))


QNAN1, QNAN2, SNAN1, SNAN2 = 0x7FC00001, 0xFFC00002, 0x7F800003, 0xFF800004
QUIET = 0x00400000


def _process_nans(op1: int, op2: int) -> int:
    """FPProcessNaNs (v7-M ARM, FPSCR.DN = 0): a signalling NaN first (op1 before op2), then a
    quiet one (op1 before op2); the chosen NaN is returned quieted."""
    def is_nan(b):
        return (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF

    def is_snan(b):
        return is_nan(b) and not b & QUIET

    for pick in (lambda b: is_snan(b), lambda b: is_nan(b)):
        for op in (op1, op2):
            if pick(op):
                return op | QUIET
    raise AssertionError("no NaN operand")


@pytest.mark.parametrize("op1,op2", [(QNAN1, QNAN2), (QNAN2, QNAN1), (SNAN1, QNAN2), (QNAN1, SNAN2),
                                     (SNAN1, SNAN2), (QNAN1, 0x3F800000), (0x3F800000, SNAN2)])
@pytest.mark.parametrize("name", ["vadd", "vmul", "vsub", "vdiv"])
def test_nan_propagation_and_default_nan(code, name, op1, op2):
    assert run(code, name, 0, op1, op2) == _process_nans(op1, op2)
    assert run(code, name, 0, op1, op2, fpscr=DN) == 0x7FC00000  # default NaN


INF, NINF = 0x7F800000, 0xFF800000


@pytest.mark.parametrize("name,op1,op2", [("vmul", 0x00000000, INF), ("vmul", NINF, 0x80000000),
                                          ("vadd", INF, NINF), ("vsub", INF, INF), ("vsub", NINF, NINF),
                                          ("vdiv", 0x00000000, 0x80000000), ("vdiv", INF, NINF)])
@pytest.mark.parametrize("fpscr", [0, DN])
def test_invalid_operation_gives_the_default_nan(code, name, op1, op2, fpscr):
    """An invalid operation on numbers (0 * inf, inf - inf, 0 / 0, inf / inf) returns the
    default NaN 0x7FC00000 (positive, payload 0: FPDefaultNaN in the v7-M ARM) whether
    FPSCR.DN is set or not; x86 returns 0xFFC00000 for the same operations."""
    assert run(code, name, 0, op1, op2, fpscr=fpscr) == 0x7FC00000


def test_vmla_invalid_product_and_sum(code):
    """VMLA: an invalid product (0 * inf) gives the default NaN, which the addition then propagates
    as a quiet NaN; inf + (-inf) from a valid product is invalid too."""
    assert run(code, "vmla", 1.0, 0.0, np.inf) == 0x7FC00000
    assert run(code, "vmla", np.inf, -1.0, np.inf) == 0x7FC00000
    assert run(code, "vmla", QNAN2, 0.0, np.inf) == QNAN2  # Sd's quiet NaN before the product's


def test_vmla_nan_operands_order(code):
    """VMLA: the product's NaN is processed first (op1, op2 = Sn, Sm), then the addition with Sd
    as op1; an accumulator NaN beats a product NaN when both are quiet."""
    assert run(code, "vmla", QNAN1, 0x3F800000, QNAN2) == QNAN1 | QUIET
    assert run(code, "vmla", 0x3F800000, QNAN2, 0x3F800000) == QNAN2 | QUIET


@pytest.mark.parametrize("name,a,b", [("vadd", -0.0, -0.0), ("vadd", -0.0, 0.0), ("vsub", 0.0, 0.0),
                                      ("vsub", -0.0, 0.0), ("vmul", -0.0, 3.0), ("vmul", -0.0, -3.0),
                                      ("vdiv", 1.0, -0.0), ("vadd", 1.0, -1.0)])
def test_signed_zero(code, name, a, b):
    f = {"vadd": np.add, "vsub": np.subtract, "vmul": np.multiply, "vdiv": np.divide}[name]
    with np.errstate(all="ignore"):
        want = f(np.float32(a), np.float32(b))
    assert run(code, name, 0, np.float32(a), np.float32(b)) == _bits(want)


SUB = [np.float32(1e-39), np.float32(-3e-41), _f(1), np.float32(1.17e-38)]


@pytest.mark.parametrize("name", ["vadd", "vmul", "vsub"])
@pytest.mark.parametrize("a,b", [(SUB[0], np.float32(0.5)), (SUB[1], SUB[0]), (SUB[2], np.float32(3.0)),
                                 (np.float32(1.2e-38), np.float32(-1.19e-38)), (SUB[3], np.float32(0.99))])
def test_subnormals_with_and_without_flush_to_zero(code, name, a, b):
    f = {"vadd": np.add, "vsub": np.subtract, "vmul": np.multiply}[name]
    assert run(code, name, 0, a, b) == _bits(f(a, b))  # FZ = 0: IEEE 754 gradual underflow

    def flush(x):  # FZ = 1: subnormal inputs and results are zeros of the same sign
        x = np.float32(x)
        return np.float32(np.copysign(0.0, x)) if x != 0 and abs(x) < np.finfo(np.float32).tiny else x
    want = flush(f(flush(a), flush(b)))
    assert run(code, name, 0, a, b, fpscr=FZ) == _bits(want)


_I32 = (-(2**31), 2**31 - 1)


@pytest.mark.parametrize("x", [2.5, -2.5, 3.5, -0.5, 0.49999997, 1.5, 2**31, -(2**31), 3e9, -3e9, np.inf, -np.inf,
                               np.nan, -0.0, 1e-40, 16777217.0])
def test_vcvt_rounding_and_saturation(code, x):
    x = np.float32(x)
    nan = np.isnan(x)
    trunc = 0 if nan else int(np.clip(np.trunc(np.float64(x)), *_I32))
    nearest = 0 if nan else int(np.clip(np.rint(np.float64(x)), *_I32))  # FPSCR.RMode = RN: ties to even
    unsigned = 0 if nan else int(np.clip(np.trunc(np.float64(x)), 0, 2**32 - 1))
    assert run(code, "vcvt_s32", 0, x) == trunc & 0xFFFFFFFF
    assert run(code, "vcvtr_s32", 0, x) == nearest & 0xFFFFFFFF
    assert run(code, "vcvt_u32", 0, x) == unsigned
