"""Behaviour fingerprint: program bytes, timing figures and outputs of the test models and bench cases.

A restructuring of the compiler claims that it changes nothing a user can observe. This script
makes the claim checkable: it builds a fixed set of models for several spinn systems and records

* the SHA-256 of every spinn program's serialized bytes (the mapping, the tiles, the constants),
* every figure of :func:`tvm_spinn.report` (latency, cycles, bytes, energy, the physical bound),
* the SHA-256 of every output's bytes, for the models that are run on the simulator,
* the LLM planner's figures for configs planned without weights, and
* the modelled value of every case of ``bench/fidelity.py``.

Floats are stored by ``repr`` (exact). Run it at the base commit and after the change, then
compare; an empty comparison is the proof::

    python bench/fingerprint.py --out before.json           # at the base commit
    python bench/fingerprint.py --out after.json            # after the change
    python bench/fingerprint.py --compare before.json after.json

``--quick`` leaves out the transformers models and the large LLM plans (about a minute).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

REPORT_FIELDS = ("system", "chips", "latency_s", "roofline_s", "cycles", "dram_bytes", "noc_bytes",
                 "link_bytes", "energy_j", "pe_utilization", "flops", "regions", "weight_bytes",
                 "resident_weight_bytes", "throughput_inf_s", "physical_bound_s", "physical_binding",
                 "offloaded_ops", "fallback_ops")


def _exact(value):
    """JSON-safe, exact: floats by repr, containers recursively, numpy scalars unwrapped."""
    if isinstance(value, (np.floating, float)):
        return repr(float(value))
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, dict):
        return {str(k): _exact(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_exact(v) for v in value]
    return value


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _built(ex) -> dict:
    import tvm_spinn
    from tvm_spinn.report.report import find_spinn_modules

    programs = [_digest(bytes(m["get_program"]())) for m in find_spinn_modules(ex)]
    rep = tvm_spinn.report(ex)
    out = {"programs": programs}
    for name in REPORT_FIELDS:
        out[name] = _exact(getattr(rep, name))
    out["layers"] = _digest(json.dumps(_exact(rep.layers), sort_keys=True).encode())
    return out


def _outputs(ex, x: np.ndarray) -> list[str]:
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x))
    outs = out if isinstance(out, (list, tuple)) or not hasattr(out, "numpy") else [out]
    return [_digest(np.ascontiguousarray(o.numpy()).tobytes()) for o in outs]


def small_models(record) -> None:
    """The test suite's models (fp32 and int8), built for one chip and a board, and run."""
    from tvm import relax

    import tvm_spinn
    from models import make

    for name in ("cnn", "mlp", "transformer"):
        model, x = make(name)
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        xs = x.numpy()
        variants = {"fp32": mod}
        if name != "transformer":
            variants["int8"] = tvm_spinn.quantize(mod, [xs])
        for dtype, m in variants.items():
            for target in ("spinn", "spinn/board"):
                ex = relax.build(m, target=target)
                row = _built(ex)
                row["outputs"] = _outputs(ex, xs)
                record(f"model/{name}/{dtype}/{target}", row)


def transformers_models(record) -> None:
    """The mapping bench's models (quick configs), built for one chip and a board."""
    from tvm import relax

    import tvm_spinn
    from mapping import models

    for name, model, x in models(quick=True):
        mod = tvm_spinn.frontend.from_pytorch(model, (x,))
        for target in ("spinn", "spinn/board"):
            record(f"bench/{name}/{target}", _built(relax.build(mod, target=target)))


def llm_plans(record, quick: bool) -> None:
    """The LLM planner's figures for configs shipped with the package (no weights)."""
    import importlib.resources

    from tvm_spinn.llm.plan import plan

    configs = importlib.resources.files("tvm_spinn.llm") / "configs"
    cases = [("llama-2-7b", "spinn/board", "int8", 256)]
    if not quick:
        cases += [("gpt2-xl", "spinn/board", "fp32", 1024), ("llama-2-70b", "spinn/board", "int8", 1024),
                  ("llama-2-70b", "spinn/cloud", "int8", 1024)]
    for name, target, dtype, seq in cases:
        p = plan(str(configs / f"{name}.json"), target=target, seq=seq, dtype=dtype)
        row = p.to_dict()
        row.pop("plan_seconds", None)  # wall time of the planner itself
        record(f"llm/{name}/{target}/{dtype}/{seq}", _exact(row))


def fidelity_cases(record) -> None:
    """Every case of bench/fidelity.py: its modelled value."""
    import fidelity

    for case in fidelity.cases():
        value, ratio, note = case.run()
        record(f"fidelity/{case.name}", {"value": _exact(value), "note": note})


def fingerprint(quick: bool) -> dict:
    result = {}

    def record(key, row):
        result[key] = row
        print(f"  {key}", flush=True)

    start = time.time()
    fidelity_cases(record)
    small_models(record)
    if not quick:
        transformers_models(record)
    llm_plans(record, quick)
    print(f"{len(result)} entries in {time.time() - start:.0f} s")
    return result


def compare(a: dict, b: dict) -> list[str]:
    """Human-readable differences between two fingerprints (empty: identical)."""
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            diffs.append(f"{key}: only in {'the first' if key in a else 'the second'}")
            continue
        for field in sorted(set(a[key]) | set(b[key])):
            va, vb = a[key].get(field, "<absent>"), b[key].get(field, "<absent>")
            if va != vb:
                diffs.append(f"{key} {field}: {str(va)[:120]} -> {str(vb)[:120]}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the fingerprint (JSON) here")
    ap.add_argument("--quick", action="store_true", help="leave out the transformers models and large plans")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprints")
    args = ap.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as fa, open(args.compare[1]) as fb:
            diffs = compare(json.load(fa), json.load(fb))
        print("\n".join(diffs) if diffs else "identical")
        return 1 if diffs else 0
    if not args.out:
        ap.error("--out or --compare is required")
    import tvm_spinn  # noqa: F401  (registers the targets)

    result = fingerprint(args.quick)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
