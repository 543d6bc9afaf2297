"""Seeded fuzzing of the inputs a user hands the compiler: damaged ONNX and TFLite bytes,
mutated LLM config fields, extreme ``--shape`` values.

Every case runs in a subprocess with an address-space limit and a timeout (a batch of cases per
subprocess: importing TVM takes seconds). A case passes when it gives a correct result
(compiled and run, matching onnxruntime where onnxruntime takes the same bytes) or a clean
refusal: a ``ValueError``/``OSError`` with a message (what ``tvm-spinn`` prints as one
``error:`` line). Anything else fails: another exception, a crash (signal), a hang, a memory
blow-up (``MemoryError`` under the limit). A failure names its seed and the command that
reproduces it. The default run has a fixed small number of cases; ``-m slow`` runs many more.
Real ``tvm-spinn`` commands are fuzzed too: one line on stderr, no traceback, no signal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fuzz_inputs

pytest.importorskip("onnxruntime")

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(os.path.dirname(HERE), "python")
#: address space of a fuzz subprocess (TVM, torch and onnxruntime mapped, plus what a case may use)
LIMIT_BYTES = 6 * 2**30


def _env() -> dict:
    paths = [PYTHON_DIR if os.path.isdir(PYTHON_DIR) else None, HERE, os.environ.get("PYTHONPATH")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


def _reproduce(case: dict) -> str:
    what = fuzz_inputs.case_input(case)[1]
    return (f"case {case['id']} ({what}); reproduce: cd tests && "
            f"python -c \"import fuzz_inputs; fuzz_inputs.reproduce({case!r})\"")


def _run_batch(cases: list[dict], workdir, timeout: float) -> tuple[dict, str]:
    """Run ``cases`` in one subprocess: ``({id: result}, problem)``; ``problem`` names the
    case running when the subprocess crashed or hung (its seed and how to reproduce), or is ''."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "cases.json")
    with open(path, "w") as f:
        json.dump(cases, f)
    code = f"import fuzz_inputs; fuzz_inputs.drive({path!r}, {str(workdir)!r}, {LIMIT_BYTES})"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env=_env(), cwd=str(workdir))
        out, rc, err, hung = proc.stdout, proc.returncode, proc.stderr, False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, err, hung = None, "", True
    results, running = {}, None
    for line in out.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "start" in row:
            running = row["start"]
        else:
            results[row["id"]] = row
            running = None
    by_id = {c["id"]: c for c in cases}
    problem = ""
    if running is not None:
        problem = f"{'hung (timeout)' if hung else f'crashed (rc {rc})'}: {_reproduce(by_id[running])}\n{err[-1500:]}"
    elif rc not in (0, None):
        problem = f"driver exited {rc}: {err[-3000:]}"
    return results, problem


def _check(batch: tuple[dict, str], cases: list[dict]) -> dict:
    """The results of ``cases`` from ``batch``; fails on a crash, hang or failed case."""
    results, problem = batch
    ids = {c["id"] for c in cases}
    assert not any(f"case {i} (" in problem for i in ids), problem  # a case of these crashed or hung
    by_id = {c["id"]: c for c in cases}
    failed = [f"{_reproduce(by_id[i])}\n  {r['detail']}" for i, r in results.items()
              if i in ids and r["status"] == "FAIL"]
    assert not failed, "\n".join(failed)
    missing = ids - set(results)
    assert not missing, (sorted(missing), problem)
    return {i: results[i] for i in ids}


def _cases(kind: str, seeds, **extra) -> list[dict]:
    out = []
    for seed in seeds:
        case = {"kind": kind, "seed": seed, **extra}
        case["id"] = f"{kind}:{extra.get('model', '')}:{seed}" if "shape" not in extra else f"shape:{extra['shape']}"
        out.append(case)
    return out


def _onnx_cases(per_model: int, first: int = 0) -> list[dict]:
    return [c for model in ("mlp", "cnn", "dynamic") for c in
            _cases("onnx", range(first, first + per_model), model=model)]


def _config_cases(seeds, plans: int, other_plans: int = 0) -> list[dict]:
    """Config cases; the first ``plans`` of them that only add an unknown key (a valid config)
    and the first ``other_plans`` others are planned too, not only read."""
    cases = _cases("config", seeds)
    valid = [c for c in cases if " added" in fuzz_inputs.case_input(c)[1] and "extra_" in fuzz_inputs.case_input(c)[1]]
    others = [c for c in cases if c not in valid]
    for case in valid[:plans] + others[:other_plans]:
        case["plan"] = True
    return cases


def _shape_cases(shapes) -> list[dict]:
    return [dict(_cases("shape", [0], shape=s)[0]) for s in shapes]


# ------------------------------------------------------------------------------ default run
DEFAULT = {
    "onnx": _onnx_cases(3),
    "tflite": _cases("tflite", range(24)),
    "config": _config_cases(range(60), plans=0),  # planning: the slow run (and test_llm_config_validation)
    "shape": _shape_cases(fuzz_inputs.SHAPES),
}


@pytest.fixture(scope="module")
def default_batch(tmp_path_factory):
    """All default cases in one subprocess (one import of TVM)."""
    cases = [c for group in DEFAULT.values() for c in group]
    return _run_batch(cases, tmp_path_factory.mktemp("fuzz"), timeout=300)


def test_fuzz_onnx_bytes(default_batch):
    results = _check(default_batch, DEFAULT["onnx"])
    assert any(r["status"] == "refused" for r in results.values())


def test_fuzz_tflite_bytes(default_batch):
    results = _check(default_batch, DEFAULT["tflite"])
    assert {r["status"] for r in results.values()} == {"ok", "refused"}
    assert any("matches numpy" in r["detail"] for r in results.values())


def test_fuzz_config_fields(default_batch):
    results = _check(default_batch, DEFAULT["config"])
    assert sum(r["status"] == "refused" for r in results.values()) > 20
    assert sum(r["status"] == "ok" for r in results.values()) > 5


def test_fuzz_extreme_shapes(default_batch):
    results = _check(default_batch, DEFAULT["shape"])
    assert results["shape:x=3,16"]["status"] == "ok"
    assert results["shape:x=-1,16"]["status"] == "refused"
    assert results[f"shape:x={2**63},16"]["status"] == "refused"  # not a TypeError inside TVM
    # 64 TB of input on one chip: refused (the mapper's capacity check) before any per-tile array
    assert results[f"shape:x={2**40},16"]["status"] == "refused"


@pytest.mark.parametrize("dims", [(2**63, 16), (3, 2**64 + 5)])
def test_shape_past_int64_refused_by_name(dims):
    """A dim TVM's int64 shapes cannot hold: one error naming the input, the axis and the value."""
    from tvm_spinn.frontend.shapes import MAX_DIM, check_shape

    assert check_shape(ValueError, "m.onnx", "x", (MAX_DIM, 16), [None, 16]) == (MAX_DIM, 16)
    axis = 0 if dims[0] > MAX_DIM else 1
    with pytest.raises(ValueError, match=rf"shape_dict\['x'\] for m.onnx gives dim {axis} = {dims[axis]}, "
                                         r"past the largest int64"):
        check_shape(ValueError, "m.onnx", "x", dims, [None, None])


def _cli_ok(args: list[str], why: str) -> None:
    """A real ``tvm-spinn`` command: exit 0, or a nonzero exit with one ``tvm-spinn`` line on
    stderr and no traceback; never a signal."""
    proc = subprocess.run([sys.executable, "-m", "tvm_spinn.cli", *args], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode >= 0 and proc.returncode not in (134, 139), (why, proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, (why, proc.stderr[-3000:])
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("tvm-spinn")]
        assert len(errors) == 1, (why, proc.stderr[-2000:])


def test_fuzz_cli_compile(tmp_path):
    data, what = fuzz_inputs.mutate_bytes(fuzz_inputs.onnx_models()["mlp"], np.random.default_rng(7))
    model = tmp_path / "damaged.onnx"
    model.write_bytes(data)
    _cli_ok(["compile", str(model), "-o", str(tmp_path / "out.so")], what)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_fuzz_cli_plan(seed, tmp_path):
    cfg, what = fuzz_inputs.mutate_config(np.random.default_rng(seed))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    _cli_ok(["plan", str(config), "--no-progress", "--seq", "16"], what)


# ------------------------------------------------------------------------------ slow: many more
@pytest.mark.slow
def test_fuzz_onnx_bytes_many(tmp_path):
    cases = _onnx_cases(60, first=1000)
    _check(_run_batch(cases, tmp_path, timeout=1800), cases)


@pytest.mark.slow
def test_fuzz_tflite_bytes_many(tmp_path):
    cases = _cases("tflite", range(1000, 1500))
    _check(_run_batch(cases, tmp_path, timeout=1800), cases)


@pytest.mark.slow
def test_fuzz_config_fields_many(tmp_path):
    cases = _config_cases(range(1000, 1600), plans=5, other_plans=25)
    _check(_run_batch(cases, tmp_path, timeout=1800), cases)
