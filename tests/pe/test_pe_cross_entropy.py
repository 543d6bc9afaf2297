"""Generated PE code for the ``cross_entropy`` forward (the per-row loss): the exp/log unit's
log, and the kernel run in the instruction-set simulator bitwise equal to the simulator's C++
kernel on random rows, arithmetic edge cases, ignored labels, one-class rows and rows longer
than a PE's working SRAM (streamed through the PE in chunks)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

from tvm_spinn.mapping import map_program  # noqa: E402
from tvm_spinn.pe import PeCodegenError, run_program_iss  # noqa: E402
from tvm_spinn.pe.execute import cross_entropy_chunks  # noqa: E402
from tvm_spinn.pe.roles import layer_role  # noqa: E402
from tvm_spinn.program import Layer, Program, TensorDesc  # noqa: E402
from tvm_spinn.program.ops.elementwise import log_f32  # noqa: E402
from tvm_spinn.program.ops.loss import STREAM_CHUNK, cross_entropy_rows  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402
from tvm_spinn.target.arch import make_system  # noqa: E402

_F32 = np.float32


def _program(rows: int, classes: int, ignore: int = -100, label_dtype: str = "int32") -> Program:
    arch = make_system()
    tensors = [TensorDesc("z", [rows, classes], "float32", "input"), TensorDesc("t", [rows], label_dtype, "input"),
               TensorDesc("out", [rows], "float32", "output")]
    program = Program(symbol="loss", arch=arch, tensors=tensors, inputs=[0, 1], outputs=[2],
                      layers=[Layer("loss0", "cross_entropy", [0, 1], 2, attrs={"ignore_index": ignore})])
    return map_program(program, arch)


def _run(z: np.ndarray, t: np.ndarray, ignore: int = -100):
    """The loss in ``iss`` mode, the C++ kernel's and the default mode's (as uint32 bits)."""
    program = _program(*z.shape, ignore=ignore)
    record = []
    (got,) = run_program_iss(program, [z, t], record)
    (sim,) = run_program(program, [z, t])
    want = cross_entropy_rows(z, t, ignore)
    return got.view(np.uint32), want.view(np.uint32), np.asarray(sim, _F32).view(np.uint32), record


def _assert_same(z, t, ignore=-100):
    got, want, sim, record = _run(z, t, ignore)
    assert np.array_equal(sim, want)
    diff = np.flatnonzero(got != want)
    assert diff.size == 0, (f"rows {diff[:5]}: simulator {[hex(v) for v in want[diff[:5]]]} "
                            f"iss {[hex(v) for v in got[diff[:5]]]}")
    return record


# -- the exp/log unit's log ----------------------------------------------------------------------

def _cephes_logf(x: np.ndarray) -> np.ndarray:
    """Cephes ``logf`` transcribed into numpy float32 operations (each rounded once, no fused
    multiply-adds): an independent statement of the unit's log model."""
    x = np.asarray(x, _F32)
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        for i, v in enumerate(x):
            if np.isnan(v):
                out[i] = v
                continue
            if v < 0:
                out[i] = np.uint32(0x7FC00000).view(_F32)
                continue
            if v == 0:
                out[i] = -np.inf
                continue
            if v == np.inf:
                out[i] = v
                continue
            m, e = np.frexp(v)
            m, e = _F32(m), int(e)
            if m < _F32(0.707106781186547524):
                e -= 1
                m = _F32(_F32(m + m) - _F32(1))
            else:
                m = _F32(m - _F32(1))
            z = _F32(m * m)
            y = _F32(7.0376836292e-2)
            for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
                      2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
                y = _F32(_F32(y * m) + _F32(c))
            y = _F32(y * m)
            y = _F32(y * z)
            fe = _F32(e)
            y = _F32(y + _F32(_F32(-2.12194440e-4) * fe))
            y = _F32(y + _F32(_F32(-0.5) * z))
            r = _F32(m + y)
            out[i] = _F32(r + _F32(_F32(0.693359375) * fe))
    return out


def test_the_units_log_is_one_defined_float32_algorithm():
    """The log model (the simulator's and the ISS unit's) bit for bit against Cephes logf
    spelled in numpy float32 operations: normal, subnormal and special arguments, and the range
    a cross-entropy's sums take (1 to the classes)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(1.0, 60000.0, 3000), 10.0 ** rng.uniform(-45, 38.5, 3000),
                        [0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 1.0, 2.0, 0.5, 1e-45, 1.1754942e-38,
                         3.4028235e38]]).astype(_F32)
    want = _cephes_logf(x)
    got = log_f32(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# -- the kernel in iss mode ----------------------------------------------------------------------

@pytest.mark.parametrize("rows,classes,scale", [(12, 33, 3.0), (5, 1, 1.0), (3, 1000, 10.0), (16, 7, 40.0),
                                                (2, 3000, 2.0)])
def test_cross_entropy_iss_bits_equal_the_simulators(rows, classes, scale):
    rng = np.random.default_rng(rows * classes)
    z = (scale * rng.standard_normal((rows, classes))).astype(_F32)
    t = rng.integers(0, classes, rows).astype(np.int32)
    t[::5] = -100
    record = _assert_same(z, t)
    assert {r.layer for r in record} == {0}
    _assert_cycles(record)


def _assert_cycles(record):
    """The timing model's tile costs (:func:`~tvm_spinn.program.ops.loss.cross_entropy_tile_cycles`)
    within 10% of the executed cycles, tile by tile (none of these shapes was counted)."""
    for r in record:
        assert abs(r.modelled - r.cycles) <= 0.10 * r.cycles, (r.tile, r.modelled, r.cycles)


def test_cross_entropy_iss_edge_values():
    """NaN (payloads and signs), infinities, -0.0 and subnormal logits; rows all -inf, all +inf,
    one +inf; an ignore index that is also a class."""
    rng = np.random.default_rng(1)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-40, 3e38, -3e38, 1.0], _F32)
    z = rng.choice(specials, size=(40, 7)).astype(_F32)
    z[::3] = (5 * rng.standard_normal((14, 7))).astype(_F32)
    z[5, 2] = np.uint32(0x7FC12345).view(_F32)
    z[6, 0] = np.uint32(0xFFA00001).view(_F32)  # a signalling NaN
    z[7] = -np.inf
    z[8] = np.inf
    z[9] = -np.inf
    z[9, 3] = np.inf
    t = rng.integers(0, 7, 40).astype(np.int32)
    t[::4] = -100
    _assert_same(z, t)
    got, want, _, _ = _run(z, np.where(t == -100, 0, t).astype(np.int32), ignore=0)
    assert np.array_equal(got, want)
    assert np.all(got[np.where(t == -100, 0, t) == 0] == 0)  # ignored rows are +0.0


def test_a_vocabulary_row_streams_through_its_pe_in_chunks():
    """GPT-2's 50,257 classes: too long for the working SRAM, each row streams through one PE in
    chunks of STREAM_CHUNK logits (max pass, then sum pass), the loss the simulator's bits."""
    arch = make_system()
    chunks = cross_entropy_chunks(50257, arch)
    assert len(chunks) == -(-50257 // STREAM_CHUNK) and chunks[-1] == (49 * STREAM_CHUNK, 50257)
    assert cross_entropy_chunks(3000, arch) == [(0, 3000)]
    rng = np.random.default_rng(2)
    z = (2 * rng.standard_normal((2, 50257))).astype(_F32)
    z[1, 40000] = 30.0  # the max in a late chunk
    record = _assert_same(z, np.array([50256, 3], np.int32))
    assert len(record) == 2  # one row per tile
    _assert_cycles(record)
    # streamed rows with a NaN, an infinity and the label in later chunks, and an ignored row
    z = (2 * rng.standard_normal((4, 5000))).astype(_F32)
    z[0, 4000] = np.uint32(0x7FC00042).view(_F32)
    z[1, 2500] = np.inf
    z[3, :] = -np.inf
    _assert_same(z, np.array([4999, 2500, -100, 1024], np.int32))


def test_bad_labels_and_dtypes_are_named():
    z = np.zeros((3, 4), _F32)
    with pytest.raises(ValueError, match=r"loss0: label 4 of row 1 is out of range for 4 classes"):
        run_program_iss(_program(3, 4), [z, np.array([0, 4, -100], np.int32)])
    with pytest.raises(ValueError, match=r"label -100 of row 2"):
        run_program_iss(_program(3, 4, ignore=-1), [z, np.array([0, 1, -100], np.int32)])
    assert layer_role(_program(3, 4), 0) == ("cross_entropy",)
    good = _program(3, 4)
    bad = dataclasses.replace(good, tensors=(good.tensors[0], dataclasses.replace(good.tensors[1], dtype="int64"),
                                             *good.tensors[2:]))
    with pytest.raises(PeCodegenError, match=r"loss0 \(cross_entropy\).*labels not int32"):
        layer_role(bad, 0)


def test_firmware_of_a_loss_program_is_exported_and_loads(tmp_path):
    """export_firmware writes the cross_entropy role's image, which load_firmware accepts and
    whose bytes are the role's image."""
    from tvm_spinn.pe import load_firmware
    from tvm_spinn.pe.firmware import export_firmware
    from tvm_spinn.pe.images import role_image

    fw = export_firmware([_program(6, 40)], tmp_path / "fw")
    loaded = load_firmware(tmp_path / "fw")
    assert loaded is not None and fw is not None
    elfs = sorted(p.name for p in (tmp_path / "fw").rglob("*.elf"))
    assert any("cross_entropy" in name for name in elfs), elfs
    (path,) = [p for p in (tmp_path / "fw").rglob("*.elf") if "cross_entropy" in p.name]
    assert path.read_bytes() == role_image(("cross_entropy",)).elf


@pytest.mark.slow
def test_cross_entropy_image_bytes_identical_across_processes():
    import subprocess
    import sys

    from tvm_spinn.pe.images import role_image

    here = role_image(("cross_entropy",)).sha256
    code = "from tvm_spinn.pe.images import role_image; print(role_image(('cross_entropy',)).sha256)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == here
