"""The TFLite integer softmax's cost model (:data:`~tvm_spinn.program.ops.rows.TFLITE_SOFTMAX_CODE`):
its components are regression coefficients, some negative, so each component's price is
checked to be non-negative under the architectures the model is used with."""

from __future__ import annotations

import dataclasses

import pytest

from tvm_spinn.program.ops.m4f import mix_cycles
from tvm_spinn.program.ops.rows import TFLITE_SOFTMAX_CODE, TfliteSoftmaxPhase
from tvm_spinn.target.arch import SpinnArch

#: the constants ``bench/iss.py`` calibrates, at the values its calibration rows solve to
CALIBRATED = {"m4f_loop_cycles": 0.52, "m4f_job_cycles": 93.25}


@pytest.mark.parametrize("arch", [SpinnArch(), SpinnArch().replace(**CALIBRATED)], ids=["default", "calibrated"])
def test_every_component_price_is_nonnegative(arch):
    fields = [f.name for f in dataclasses.fields(TfliteSoftmaxPhase)]
    assert len(TFLITE_SOFTMAX_CODE) == 3
    for phase, code in enumerate(TFLITE_SOFTMAX_CODE):
        for name in fields:
            price = mix_cycles(getattr(code, name), arch)
            assert price >= 0, f"phase {phase} {name}: {price:.2f} cycles"
