"""TFLite's integer row operators as PE code: ``iss`` outputs equal to the default simulator's
(TFLite's reference arithmetic) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

pytest.importorskip("unicorn")
pytest.importorskip("ziglang")
pytest.importorskip("tensorflow")
pytest.importorskip("tflite")

import tvm_spinn  # noqa: E402
import tflite_models as tm  # noqa: E402
from tvm_spinn.frontend.tflite import from_tflite, keras_to_tflite  # noqa: E402
from tvm_spinn.pe import run_program_iss  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*tf.lite.Interpreter is deprecated:UserWarning")


def _check(programs, kind):
    layers = [(p, layer) for p in programs for layer in p.layers if layer.kind == kind]
    assert layers and all(layer.attrs.get("rounding") == "tflite" for _, layer in layers)
    rng = np.random.default_rng(3)
    for program, _ in layers:
        dtypes = [program.tensors[t].dtype for t in program.inputs]
        for near in (False, True):  # random, and rows near their maximum (exp's fine range)
            lo = 96 if near else -128
            inputs = [rng.integers(lo, 128, size=program.tensors[t].shape).astype(d) if d == "int8" else
                      rng.integers(lo + 128, 256, size=program.tensors[t].shape).astype(d)
                      for t, d in zip(program.inputs, dtypes)]
            want = run_program(program, inputs)
            got = run_program_iss(program, inputs)
            for w, g in zip(want, got):
                assert w.dtype == g.dtype and w.shape == g.shape
                np.testing.assert_array_equal(g, w)
            if not near:
                assert len({int(v) for w in want for v in w.reshape(-1)}) > 3  # not a constant output


@pytest.mark.slow  # ~50 s: LLVM compiles the fixed-point kernel for ~20 s, the ISS runs its exps twice
@pytest.mark.parametrize("shape, spread", [((16, 10), 1.0), ((2, 300), 4.0), ((64, 3), 1.0)])
def test_tflite_softmax_bit_identical(shape, spread):
    """int8 softmax (gemmlowp's fixed-point exp and reciprocal); (2, 300): rows the mapper
    splits over PEs, their max and sum chained; (64, 3): short rows."""
    mod = from_tflite(keras_to_tflite(tm.softmax(shape), quantize=tm.calibration(shape, normal=True) * spread))
    programs = tvm_spinn.report(relax.build(mod, target="spinn")).programs
    _check(programs, "softmax")
    _check_cycles(programs, "softmax", 0.08)  # errors -3.6% (16, 10), -1.4% (2, 300), -6.6% (64, 3)


@pytest.mark.parametrize("shape, spread, keepdims", [
    ((24, 5, 7), 2.0, False),
    pytest.param((8, 16, 16), 1.0, True, marks=pytest.mark.slow),
])
def test_tflite_mean_bit_identical(shape, spread, keepdims):
    """int8 mean over the spatial axes (the output's scale and zero point differ from the
    input's); whole rows, and (16 x 16 rows, few of them) rows the mapper may chain over PEs."""
    rep = tm.calibration(shape, normal=True) * spread + 0.3
    mod = from_tflite(keras_to_tflite(tm.mean(shape, keepdims), quantize=rep))
    programs = tvm_spinn.report(relax.build(mod, target="spinn")).programs
    _check(programs, "mean")
    _check_cycles(programs, "mean", 0.08)  # errors -2.5% (24, 5, 7), +0.2% (8, 16, 16)


def _check_cycles(programs, kind, tol):
    """The timing model's cycles of the layer's tiles (the kernel's counted job, rows and
    elements; a split row's chain wait, not executed code, left out) within ``tol`` of the
    executed ones."""
    from tvm_spinn.mapping.schedule import derive_tables
    from tvm_spinn.program.ops.base import family_of
    for program in programs:
        for index, layer in enumerate(program.layers):
            if layer.kind != kind:
                continue
            rng = np.random.default_rng(4)
            inputs = [rng.integers(-128, 128, size=program.tensors[t].shape).astype(program.tensors[t].dtype)
                      for t in program.inputs]
            record = []
            run_program_iss(program, inputs, record)
            rows = [r for r in record if r.layer == index]
            table = derive_tables(program, program.arch)[index]
            wait = family_of(kind).chain_wait(program, layer, program.arch, program.mapping.layers[index].tile,
                                              table.lo, table.hi)
            modelled = sum(r.modelled - float(wait[r.tile]) for r in rows)
            executed = sum(r.cycles for r in rows)
            assert abs(modelled - executed) <= tol * executed, (modelled, executed)
