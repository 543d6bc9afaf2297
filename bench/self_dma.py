"""PEs that place their own operands: firmware exported with ``self_dma=True`` run with every PE
walking its command table, against the host-driven replay of the same jobs.

Run: ``python bench/self_dma.py [--noc] [--models mlp qmlp cnn block]`` (the block with
``--noc`` takes a few minutes). Printed per model: its jobs and PEs; the host's actions per run
(host-driven: an image load and each step of every job; the walker: per PE start, its image's
load, the start and the status read); the walker's executed cycles (TRM-priced) per transfer's
programming and per command, against ``SpinnArch.dma_setup_cycles``; the images the PEs loaded
themselves; the CPU seconds of both runs; whether both give the default simulator's bits; with
``--noc`` (PEs concurrent, the host-driven side :func:`tvm_spinn.pe.run_firmware_concurrent`)
the slowest PE's cycles and the packets of both.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def _build(name: str):
    import torch
    import tvm_spinn
    from tvm import relax
    if name == "qmlp":
        import models
        model, x = models.make("mlp")
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        rng = np.random.default_rng(0)
        mod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
        return relax.build(mod, target="spinn")
    from test_firmware_loader import _Block, _Cnn, _Mlp
    make, shape = {"mlp": (_Mlp, (4, 16)), "cnn": (_Cnn, (2, 3, 16, 16)), "block": (_Block, (1, 8, 16))}[name]
    torch.manual_seed(3)
    return relax.build(tvm_spinn.frontend.from_pytorch(make().eval(), (torch.randn(*shape),)), target="spinn")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.join(here, "..", "tests", "pe"), os.path.join(here, "..", "tests")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--noc", action="store_true", help="PEs concurrent, dependencies by NoC packets")
    ap.add_argument("--models", nargs="+", default=["mlp", "qmlp", "cnn", "block"],
                    choices=["mlp", "qmlp", "cnn", "block"])
    args = ap.parse_args()
    import tvm_spinn
    from test_firmware_int8 import _inputs
    from tvm_spinn.pe import load_firmware, run_firmware, run_firmware_concurrent
    from tvm_spinn.pe.firmware import programs_of
    from tvm_spinn.pe.loader import run_self_dma
    from tvm_spinn.runtime.simulator import run_program
    from tvm_spinn.pe.walker import ENTRY_WORDS, OP_DMA, OP_NOTIFY, OP_WAIT
    from tvm_spinn.target.arch import SpinnArch
    print(f"SpinnArch.dma_setup_cycles: {SpinnArch().dma_setup_cycles}")
    head = (f"{'model':>6} {'jobs':>5} {'PEs':>4} {'host actions':>13} {'cyc/transfer':>12} {'cyc/command':>11} "
            f"{'boots':>5} {'CPU s':>12} {'bits':>5}")
    if args.noc:
        head += f" {'slowest PE':>16} {'packets':>16}"
    print(head)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            ex = _build(name)
            own, host = os.path.join(tmp, name), os.path.join(tmp, name + "_host")
            tvm_spinn.export_firmware(ex, own, self_dma=True, noc=args.noc)
            tvm_spinn.export_firmware(ex, host, noc=args.noc)
            program = programs_of(ex)[0]
            x = _inputs(program, 0)
            ref = run_program(program, x, mode="layers")
            t0 = time.process_time()
            h = run_firmware_concurrent(host, x) if args.noc else None
            host_out = h.outputs if args.noc else run_firmware(host, x)
            t1 = time.process_time()
            fw = load_firmware(own)
            t2 = time.process_time()
            run = run_self_dma(fw, 0, x)
            t3 = time.process_time()
            rec = fw.manifest["regions"][0]
            steps = sum(1 + len(job["steps"]) for job in fw.jobs[0])
            ops = np.frombuffer(fw.files[rec["self_dma"]["file"]], dtype="<u4",
                                count=ENTRY_WORDS * rec["self_dma"]["entries"]).reshape(-1, ENTRY_WORDS)[:, 0]
            calls = int(np.isin(ops, [OP_DMA, OP_WAIT, OP_NOTIFY]).sum())  # each one sdma_transfer
            bits = all(a.tobytes() == b.tobytes() == c.tobytes() for a, b, c in zip(run.outputs, host_out, ref))
            line = (f"{name:>6} {len(fw.jobs[0]):>5} {len(rec['pe_jobs']):>4} {steps:>6} -> {run.host_actions:<4} "
                    f"{run.transfer_cycles / max(1, calls):>12.1f} "
                    f"{run.walker_cycles / rec['self_dma']['entries']:>11.1f} {run.boots:>5} "
                    f"{t1 - t0:>5.2f} -> {t3 - t2:<4.2f} {str(bits):>5}")
            if args.noc:
                line += (f" {max(h.cycles.values()):>7} -> {max(run.cycles.values()):<7}"
                         f" {h.packets:>7} -> {run.packets:<6}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
