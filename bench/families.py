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
    python bench/families.py --models llama-2-70b --profile   # where the planning time goes

``--profile`` runs each plan under cProfile (slower: about 1.3x) and prints, below its row, the
planner's parts as shares of the plan's time (the prompt plan, the decode placements, the
mapping, describing the model) and the functions of ``tvm_spinn`` with the most time of their own.
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
profile = None
if len(sys.argv) > 3 and sys.argv[3] == "profile":
    import cProfile
    import pstats
    profile = cProfile.Profile()
    profile.enable()
t0 = time.perf_counter()
p = plan(config, target=target)
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
parts = None
if profile is not None:
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, callers)
    def cum(file, name):
        return max((v[3] for (f, _, n), v in stats.items() if f.endswith(file) and n == name), default=0.0)
    total = cum("llm/plan.py", "plan") or wall
    parts = dict(shares={k: cum(f, n) / total for k, (f, n) in {
        "prompt plan (llm/prefill/search.py plan_prefill)": ("llm/prefill/search.py", "plan_prefill"),
        "decode search (llm/plan.py search)": ("llm/plan.py", "search"),
        "  board_tp.records": ("llm/board_tp.py", "records"),
        "  experts.records": ("llm/experts.py", "records"),
        "  pipeline records": ("llm/plan.py", "_pipeline_records"),
        "mapping (mapping/planner.py plan_system)": ("mapping/planner.py", "plan_system"),
        "describing (llm/describe.py describe)": ("llm/describe.py", "describe"),
        "board collectives (board_group_all_reduce)": ("timing/collectives/group.py", "board_group_all_reduce"),
    }.items()}, own=sorted(((v[2] / total, f"{f.split('tvm_spinn/')[-1]}:{ln}({n})") for (f, ln, n), v in stats.items()
                            if "tvm_spinn" in f), reverse=True)[:8])
print("RESULT " + json.dumps(dict(
    tokens_s=p.tokens_per_s_per_user, ttft_s=p.ttft_s, placement=p.plan["placement"],
    boards_used=p.plan.get("boards_used"), tp_boards=p.plan.get("tp_boards"), wall_s=wall,
    cpu_s=ru.ru_utime + ru.ru_stime, peak_bytes=ru.ru_maxrss * 1024,
    alternatives={k: 1.0 / v["period_s"] for k, v in p.plan["alternatives"].items()}, profile=parts)))
"""


def run_one(config: str, target: str, profile: bool = False) -> dict:
    """Plan ``config`` on ``target`` in a child process; its result and resource use (and, with
    ``profile``, the shares of its time: see the module docstring)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, config, target] + (["profile"] if profile else []),
                          capture_output=True, text=True,
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
    ap.add_argument("--profile", action="store_true", help="profile each plan (cProfile): where its time goes")
    args = ap.parse_args(argv)
    configs = os.path.join(os.path.dirname(__file__), "..", "python", "tvm_spinn", "llm", "configs")
    print(f"{'model':<16}{'tokens/s':>10}{'no board_tp':>12}{'TTFT s':>9}{'placement':>12}{'boards':>8}{'TP':>4}"
          f"{'wall s':>9}{'CPU s':>8}{'peak GB':>9}  target (<{TARGET_S:.0f} s, <{TARGET_BYTES / 2**30:.0f} GB)")
    rows = {}
    for name in args.models:
        r = run_one(os.path.join(configs, f"{name}.json"), args.target, args.profile)
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
        if r.get("profile"):
            print("    profile (share of the plan's time; cumulative): " + ", ".join(
                f"{k.strip()} {v:.0%}" for k, v in r["profile"]["shares"].items() if v > 0))
            print("    most time of their own: " + ", ".join(f"{name} {share:.1%}" for share, name in r["profile"]["own"]))
        if args.json:  # after every row: a long run stopped early keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"target": args.target, "rows": rows}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
