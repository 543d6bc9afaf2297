"""M4F cycles: the timing model's per-tile costs against the cycles of the generated code as
executed in the instruction-set simulator (``tvm_spinn.pe``).

For each op kind, a small program is compiled for ``spinn``, its tiles run as Cortex-M4F code in
``unicorn``, and the executed instructions are priced by the Cortex-M4 TRM's cycle tables
(:mod:`tvm_spinn.pe.cycles`). Printed per op kind: the timing model's cycles (the sum of its
tile costs, which use ``m4f_flops_per_cycle``, ``m4f_elementwise_cycles`` or the MAC array's
rate), the executed cycles (the cycles the M4F waits on the exp/log unit included: its modelled
latency and rate), their ratio and the error of the model, and the executed cycles per element
(element-wise) or per multiply-accumulate (GEMMs).

Calibration and hold-out: the M4F constants a calibration would set are
``m4f_elementwise_cycles`` (from the element-wise ``add``) and ``m4f_flops_per_cycle`` (from
``dense 8x256x64``): those rows are marked ``calib``, every other row ``held-out``. The bench
prints the values the calibration rows imply (the constant that would zero their error) and,
per held-out row, whether the model is within the target of +-10%. The timing model's constants
are not changed here. For int8 layers the executed cycles are the M4F's share only (driving the
array, the 32-bit chunk adds, the operands' row and column sums, the zero-point terms and the
requantization): the MAC array is a modelled peripheral that completes at once, while the
timing model's figure is mostly the array's time. Usage: ``python bench/iss.py``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from tvm import relax

import tvm_spinn
from tvm_spinn.pe import PeCodegenError, run_program_iss
from tvm_spinn.pe.view import gemm_view, layer_kind, layer_mode, tensor_shape, layer_output

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "quant"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


class _Op(torch.nn.Module):
    def __init__(self, fn, module=None):
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, *xs):
        return self.fn(self.module, *xs)


def _torch_case(fn, module, *shapes):
    torch.manual_seed(0)
    xs = tuple(torch.randn(*s) for s in shapes)
    mod = tvm_spinn.frontend.from_pytorch(_Op(fn, module).eval(), xs)
    return mod, [x.numpy() for x in xs]


def _cases():
    yield "add", _torch_case(lambda m, a, b: a + b, None, (64, 96), (64, 96))
    yield "multiply", _torch_case(lambda m, a, b: a * b, None, (64, 96), (64, 96))
    yield "relu", _torch_case(lambda m, a: torch.relu(a + 1.0), None, (64, 96))
    yield "dense 32x64x48", _torch_case(lambda m, x: m(x), torch.nn.Linear(64, 48, bias=False), (32, 64))
    yield "dense 8x256x64", _torch_case(lambda m, x: m(x), torch.nn.Linear(256, 64, bias=False), (8, 256))
    yield "matmul 24x40x16", _torch_case(lambda m, a, b: a @ b, None, (24, 40), (40, 16))
    yield "conv2d 3->16 3x3", _torch_case(lambda m, x: m(x), torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), (1, 3, 16, 16))
    yield "softmax 64x96", _torch_case(lambda m, a: torch.softmax(a * 2.0, dim=-1), None, (64, 96))
    yield "layer_norm 64x96", _torch_case(lambda m, a: m(a * 2.0), torch.nn.LayerNorm(96), (64, 96))
    yield "rms_norm 64x96", _torch_case(
        lambda m, a: m * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)), torch.nn.Parameter(torch.ones(96)),
        (64, 96))
    yield "gelu 64x96", _torch_case(lambda m, a: torch.nn.functional.gelu(a * 2.0), None, (64, 96))
    yield "sigmoid 64x96", _torch_case(lambda m, a: torch.sigmoid(a * 2.0), None, (64, 96))
    yield "tanh 64x96", _torch_case(lambda m, a: torch.tanh(a * 2.0), None, (64, 96))
    yield "clip 64x96", _torch_case(lambda m, a: torch.clamp(a * 2.0, -0.5, 0.5), None, (64, 96))
    from test_int8 import qgemm_module
    rng = np.random.default_rng(0)
    x = rng.integers(-128, 128, size=(32, 256)).astype("int8")
    w = rng.integers(-127, 128, size=(256, 64)).astype("int8")
    mod = qgemm_module(x.shape, "int8", w, np.float32(0.003), 0, 0.01, 2, op="dense", out=(0.5, 0, "int8"))
    yield "int8 dense 32x256x64", (mod, [x])
    xc = rng.integers(-128, 128, size=(1, 16, 12, 12)).astype("int8")
    wc = rng.integers(-127, 128, size=(32, 16, 3, 3)).astype("int8")
    mod = qgemm_module(xc.shape, "int8", wc, np.float32(0.003), 0, 0.01, 2, out=(0.5, 0, "int8"),
                       conv_attrs=dict(padding=1))
    yield "int8 conv2d 16->32 3x3", (mod, [xc])


#: the rows a calibration of the M4F constants would use (see the module docstring)
CALIBRATION = {("add", "add"): "m4f_elementwise_cycles", ("dense 8x256x64", "dense"): "m4f_flops_per_cycle"}
#: the target of the model's error on held-out rows
TARGET = 0.10


def _measure():
    """Per layer of every case: ``(case, program, layer index, executed tile runs)``."""
    for name, (mod, inputs) in _cases():
        ex = relax.build(mod, target="spinn")
        for program in tvm_spinn.report(ex).programs:
            feeds = [x if x.dtype == np.dtype(program.tensors[t].dtype) else
                     np.zeros(program.tensors[t].shape, program.tensors[t].dtype)
                     for t, x in zip(program.inputs, inputs)]
            record = []
            try:
                run_program_iss(program, feeds, record)
            except PeCodegenError as err:
                print(f"{name:24s} not lowered: {err}")
                continue
            for index in sorted({r.layer for r in record}):
                yield name, program, index, [r for r in record if r.layer == index]


def main() -> None:
    from tvm_spinn.mapping.schedule import derive_tables
    from tvm_spinn.target.arch import SpinnArch
    arch = SpinnArch()
    results = list(_measure())
    # the calibration rows' implied constants, then the model at them on the very same tiles
    implied = {}
    for name, program, index, rows in results:
        calib = CALIBRATION.get((name, layer_kind(program, index)))
        modelled, executed = sum(r.modelled for r in rows), sum(r.cycles for r in rows)
        if calib == "m4f_elementwise_cycles":
            implied[calib] = arch.m4f_elementwise_cycles * executed / modelled
        elif calib == "m4f_flops_per_cycle":
            implied[calib] = arch.m4f_flops_per_cycle * modelled / executed
    calibrated = arch.replace(**implied)
    print(f"{'case':24s} {'layer kind':16s} {'set':8s} {'tiles':>6s} {'modelled':>10s} {'executed':>10s} "
          f"{'model err':>9s} {'calibrated':>10s} {'+-10%':>5s} {'exec/unit':>10s}")
    held, within, seen = 0, 0, set()
    for name, program, index, rows in results:
        kind, mode = layer_kind(program, index), layer_mode(program, index)
        modelled, executed = sum(r.modelled for r in rows), sum(r.cycles for r in rows)
        if (kind, mode, modelled, executed) in seen:  # a case's leading op, measured before
            continue
        seen.add((kind, mode, modelled, executed))
        recal = float(sum(derive_tables(program, calibrated)[index].cycles[r.tile] for r in rows))
        if kind in ("dense", "matmul", "conv2d"):
            g = gemm_view(program, index)
            units, unit = g.batch * g.m * g.n * g.k, "MAC"
        else:
            units, unit = int(np.prod(tensor_shape(program, layer_output(program, index)))), "elem"
        err, err_cal = (modelled - executed) / executed, (recal - executed) / executed
        calib = CALIBRATION.get((name, kind))
        ok = ""
        if not calib and mode == "fp32":
            held += 1
            within += abs(err_cal) <= TARGET
            ok = "yes" if abs(err_cal) <= TARGET else "no"
        print(f"{name:24s} {mode + ' ' + kind:16s} {'calib' if calib else 'held-out':8s} {len(rows):6d} "
              f"{modelled:10.0f} {executed:10d} {err:+9.0%} {err_cal:+10.0%} {ok:>5s} {executed / units:6.2f}/{unit}")
    print()
    for field, value in sorted(implied.items()):
        print(f"calibration: {field} {getattr(arch, field):.3f} -> {value:.3f} zeroes its row's error "
              "(column 'calibrated': the model at these values, same tiles)")
    print(f"held-out fp32 rows within +-{TARGET:.0%} of the executed cycles at the calibrated constants: "
          f"{within} of {held} (int8 rows: the M4F's share only, not compared)")


if __name__ == "__main__":
    main()
