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
    means = [(p, layer) for p in programs for layer in p.layers if layer.kind == "mean"]
    assert means and all(layer.attrs.get("rounding") == "tflite" for _, layer in means)
    rng = np.random.default_rng(3)
    for program, _ in means:
        inputs = [rng.integers(-128, 128, size=program.tensors[t].shape).astype(program.tensors[t].dtype)
                  if program.tensors[t].dtype == "int8" else
                  rng.integers(0, 256, size=program.tensors[t].shape).astype(program.tensors[t].dtype)
                  for t in program.inputs]
        want = run_program(program, inputs)
        got = run_program_iss(program, inputs)
        for w, g in zip(want, got):
            assert w.dtype == g.dtype and w.shape == g.shape
            np.testing.assert_array_equal(g, w)
        assert len({int(v) for w in want for v in w.reshape(-1)}) > 3  # not a constant output
