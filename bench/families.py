"""Every model family's decode plan on one system: tokens/s, placement, planning CPU time and memory.

Each shipped config (the largest of each family by default) is planned with
:func:`tvm_spinn.llm.plan` in a process of its own, so that its CPU seconds (user + system) and its
peak resident memory (``ru_maxrss``) are the plan's alone. Side by side: tokens/s/user (and that
of the fastest placement other than ``board_tp``), time to first token, the placement chosen, the boards it uses, the wall and CPU seconds and the peak memory
against the planning targets (60 s, 4 GB).

Examples::

    python bench/families.py                          # the cloud, every family
    python bench/families.py --target spinn/boards24 --models gpt-j-6b falcon-7b
    python bench/families.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

#: The largest shipped config of each family (model type), in the order of the table
MODELS = ("llama-2-70b", "llama-3.1-70b", "mistral-7b", "qwen2-7b", "gemma-2-9b", "phi-3-mini-4k", "gpt2-xl",
          "gpt-j-6b", "falcon-7b", "mixtral-8x7b")
#: Planning targets: CPU seconds and peak bytes
TARGET_S, TARGET_BYTES = 60.0, 4 * 2**30

_CHILD = r"""
import json, resource, sys, time
import tvm_spinn
from tvm_spinn.llm.plan import plan
from tvm_spinn.target import make_system, register_system
config, target = sys.argv[1], sys.argv[2]
if target.startswith("spinn/boards"):
    n = int(target[len("spinn/boards"):])
    register_system(make_system(f"spinn2-{n}-boards", boards=n), tag=target)
t0 = time.perf_counter()
p = plan(config, target=target)
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps(dict(
    tokens_s=p.tokens_per_s_per_user, ttft_s=p.ttft_s, placement=p.plan["placement"],
    boards_used=p.plan.get("boards_used"), tp_boards=p.plan.get("tp_boards"), wall_s=wall,
    cpu_s=ru.ru_utime + ru.ru_stime, peak_bytes=ru.ru_maxrss * 1024,
    alternatives={k: 1.0 / v["period_s"] for k, v in p.plan["alternatives"].items()})))
"""


def run_one(config: str, target: str) -> dict:
    """Plan ``config`` on ``target`` in a child process; its result and resource use."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, config, target], capture_output=True, text=True,
                          env=dict(os.environ))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="spinn/cloud", help="spinn/cloud (default), spinn/board or spinn/boardsN")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="shipped config names (llm/configs)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    configs = os.path.join(os.path.dirname(__file__), "..", "python", "tvm_spinn", "llm", "configs")
    print(f"{'model':<16}{'tokens/s':>10}{'no board_tp':>12}{'TTFT s':>9}{'placement':>12}{'boards':>8}{'TP':>4}"
          f"{'wall s':>9}{'CPU s':>8}{'peak GB':>9}  target (<{TARGET_S:.0f} s, <{TARGET_BYTES / 2**30:.0f} GB)")
    rows = {}
    for name in args.models:
        r = run_one(os.path.join(configs, f"{name}.json"), args.target)
        rows[name] = r
        if "error" in r:
            print(f"{name:<16}  error: {r['error']}", flush=True)
            continue
        ok = r["cpu_s"] < TARGET_S and r["peak_bytes"] < TARGET_BYTES
        # the fastest placement other than blocks tensor-parallel over boards
        others = max((v for k, v in r["alternatives"].items() if not k.startswith("board_tp")), default=0.0)
        print(f"{name:<16}{r['tokens_s']:>10.2f}{others:>12.2f}{r['ttft_s']:>9.2f}{r['placement']:>12}{r['boards_used'] or '-':>8}"
              f"{r['tp_boards'] or '-':>4}{r['wall_s']:>9.1f}{r['cpu_s']:>8.1f}{r['peak_bytes'] / 2**30:>9.2f}  "
              f"{'met' if ok else 'missed'}", flush=True)
        if args.json:  # after every row: a long run stopped early keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"target": args.target, "rows": rows}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
