"""M4F cycles: the timing model's per-tile costs against the cycles of the generated code as
executed in the instruction-set simulator (``tvm_spinn.pe``).

For each op kind, a small program is compiled for ``spinn``, its tiles run as Cortex-M4F code in
``unicorn``, and the executed instructions are priced by the Cortex-M4 TRM's cycle tables
(:mod:`tvm_spinn.pe.cycles`). Printed per op kind: the timing model's cycles (the sum of its
tile costs, which use ``m4f_flops_per_cycle``, ``m4f_elementwise_cycles`` or the MAC array's
rate), the executed cycles (the cycles the M4F waits on the exp/log unit included: its modelled
latency and rate), their ratio and the error of the model, and the executed cycles per element
(element-wise) or per multiply-accumulate (GEMMs).

Calibration and hold-out: the timing model's M4F costs are structural (each family's passes over
the data and instructions per element, priced by the TRM's cycles: :mod:`tvm_spinn.program.ops.m4f`,
:func:`tvm_spinn.program.ops.gemm.geometry.fp32_tile_cycles`); only the overheads of the code
LLVM emits are calibrated: ``m4f_loop_cycles`` and ``m4f_job_cycles`` on the element-wise
``add`` at two shapes, ``m4f_gemm_step_cycles`` and ``m4f_gemm_output_cycles`` on two fp32
``dense`` shapes. Those four rows are marked ``calib``; every other row is ``held-out``. The
bench solves the calibration rows for the four constants (the model is linear in them on fixed
tiles) and prints them beside the values :class:`~tvm_spinn.target.arch.SpinnArch` holds, and
per row the model's error at the SpinnArch values and at the solved ones; the held-out target is
+-10%. For int8 layers the executed cycles are the M4F's share only (driving the array, the
32-bit chunk adds, the operands' row and column sums, the zero-point terms and the
requantization): the MAC array is a modelled peripheral that completes at once, while the
timing model's figure is mostly the array's time (not compared). Usage: ``python bench/iss.py``.
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
    yield "add 150x200", _torch_case(lambda m, a, b: a + b, None, (150, 200), (150, 200))
    yield "add 31x77", _torch_case(lambda m, a, b: a + b, None, (31, 77), (31, 77))
    yield "dense 32x64x48", _torch_case(lambda m, x: m(x), torch.nn.Linear(64, 48, bias=False), (32, 64))
    yield "dense 8x256x64", _torch_case(lambda m, x: m(x), torch.nn.Linear(256, 64, bias=False), (8, 256))
    yield "dense 20x100x36", _torch_case(lambda m, x: m(x), torch.nn.Linear(100, 36, bias=False), (20, 100))
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


#: the calibration rows ``(case, layer kind)`` and the constants they set (see the module docstring)
CALIBRATION = {("add", "add"): "loop, job", ("add 150x200", "add"): "loop, job",
               ("dense 8x256x64", "dense"): "GEMM step, output", ("dense 32x64x48", "dense"): "GEMM step, output"}
#: the calibrated SpinnArch constants
CONSTANTS = ("m4f_loop_cycles", "m4f_job_cycles", "m4f_gemm_step_cycles", "m4f_gemm_output_cycles")
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


def _modelled(program, index: int, rows, arch) -> float:
    from tvm_spinn.mapping.schedule import derive_tables
    cycles = derive_tables(program, arch)[index].cycles
    return float(sum(cycles[r.tile] for r in rows))


def _solve(results, arch):
    """The calibrated constants that zero the calibration rows' error: the model on their
    (fixed) tiles is linear in them, so one model run per constant gives the system."""
    calib = [(program, index, rows) for name, program, index, rows in results
             if (name, layer_kind(program, index)) in CALIBRATION]
    zero = arch.replace(**dict.fromkeys(CONSTANTS, 0.0))
    unit = 1000.0  # large, so the model's rounding up of each tile is negligible
    base = np.array([_modelled(p, i, rows, zero) for p, i, rows in calib])
    coef = np.array([[(_modelled(p, i, rows, zero.replace(**{c: unit})) - b) / unit for c in CONSTANTS]
                     for (p, i, rows), b in zip(calib, base)])
    executed = np.array([sum(r.cycles for r in rows) for _, _, rows in calib], dtype=np.float64)
    # relative errors weigh the rows alike
    solved, *_ = np.linalg.lstsq(coef / executed[:, None], (executed - base) / executed, rcond=None)
    return dict(zip(CONSTANTS, (float(v) for v in solved)))


def main() -> None:
    from tvm_spinn.target.arch import SpinnArch
    arch = SpinnArch()
    results = list(_measure())
    implied = _solve(results, arch)
    calibrated = arch.replace(**{k: max(v, 0.0) for k, v in implied.items()})
    print(f"{'case':24s} {'layer kind':16s} {'set':8s} {'tiles':>6s} {'modelled':>10s} {'executed':>10s} "
          f"{'model err':>9s} {'solved':>8s} {'+-10%':>5s} {'exec/unit':>10s}")
    held, within, seen, kinds = 0, 0, set(), {}
    for name, program, index, rows in results:
        kind, mode = layer_kind(program, index), layer_mode(program, index)
        modelled, executed = sum(r.modelled for r in rows), sum(r.cycles for r in rows)
        if (kind, mode, modelled, executed) in seen:  # a case's leading op, measured before
            continue
        seen.add((kind, mode, modelled, executed))
        recal = _modelled(program, index, rows, calibrated)
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
            within += abs(err) <= TARGET
            ok = "yes" if abs(err) <= TARGET else "no"
            kinds.setdefault(kind, []).append(abs(err) <= TARGET)
        print(f"{name:24s} {mode + ' ' + kind:16s} {'calib' if calib else 'held-out':8s} {len(rows):6d} "
              f"{modelled:10.0f} {executed:10d} {err:+9.1%} {err_cal:+8.1%} {ok:>5s} {executed / units:6.2f}/{unit}")
    print()
    for field in CONSTANTS:
        print(f"calibration: {field} = {getattr(arch, field):.2f} in SpinnArch; the calibration rows solve to "
              f"{implied[field]:.2f} (column 'solved': the model at the solved values, same tiles)")
    print(f"held-out fp32 rows within +-{TARGET:.0%} of the executed cycles at SpinnArch's constants: "
          f"{within} of {held}; op kinds all within: {sum(all(v) for v in kinds.values())} of {len(kinds)} "
          "(int8 rows: the M4F's share only, not compared)")


if __name__ == "__main__":
    main()
