"""Compile time against system size: the mapping compiler must map and time thousands of chips.

Builds one model (transformers config, random weights) for systems of increasing chip count and
prints, side by side in one run: the whole `relax.build` time, the time spent mapping (tile
shapes, placement, memory plan, timing: `tvm_spinn.mapping.map_program`), the tiles the mapping
cut, the simulated latency and the roofline.

    python bench/scale.py                          # BERT-base s128 on 1, 48, 1152 chips
    python bench/scale.py --model gpt2 --chips 1 48 1152 8640
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tvm import relax

import tvm_spinn
from tvm_spinn import mapping as _mapping
from tvm_spinn.mapping import schedule as _schedule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_zoo import _Field  # noqa: E402


def _model(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "bert":
        return _Field(tf.BertModel(tf.BertConfig()), "last_hidden_state").eval(), torch.randint(0, 1000, (1, 128))
    cfg = tf.GPT2Config()
    cfg._attn_implementation = "eager"
    return _Field(tf.GPT2Model(cfg), "last_hidden_state", use_cache=False).eval(), torch.randint(0, 1000, (1, 128))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("bert", "gpt2"), default="bert")
    ap.add_argument("--chips", type=int, nargs="+", default=[1, 48, 1152])
    args = ap.parse_args()
    model, x = _model(args.model)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    spent = {"map": 0.0, "tiles": 0}
    original = _schedule.map_program

    def timed(program, arch, options=None):
        t0 = time.perf_counter()
        out = original(program, arch, options)
        spent["map"] += time.perf_counter() - t0
        spent["tiles"] += len(program.tiles)
        return out

    print(f"{'chips':>6}{'PEs':>9}{'build s':>9}{'map s':>8}{'tiles':>10}{'latency ms':>12}{'roofline ms':>13}")
    for chips in args.chips:
        arch = tvm_spinn.make_system(f"scale-{chips}", chips=chips)
        tag = tvm_spinn.register_system(arch)
        spent.update(map=0.0, tiles=0)
        _schedule.map_program = _mapping.map_program = timed
        import tvm_spinn.codegen.codegen as codegen

        codegen.map_program = timed
        try:
            t0 = time.perf_counter()
            rep = tvm_spinn.report(relax.build(mod, target=tag))
            build = time.perf_counter() - t0
        finally:
            _schedule.map_program = _mapping.map_program = codegen.map_program = original
        print(f"{chips:>6}{arch.total_pes:>9}{build:>9.2f}{spent['map']:>8.2f}{spent['tiles']:>10}"
              f"{rep.latency_s * 1e3:>12.3f}{rep.roofline_s * 1e3:>13.3f}", flush=True)


if __name__ == "__main__":
    main()
