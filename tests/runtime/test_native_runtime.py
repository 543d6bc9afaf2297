"""A runtime without Python: compiled programs carry their execution plan (the native section,
format version 6), which the C++ ``spinn`` module runs itself when the package is not there.

* per region, the module's native plan gives the bits of the Python simulator on every layer
  kind family with a native description (fp32 GEMMs and convolutions, pools, rows, element-wise,
  data movement, int8 GEMMs and quantize/dequantize);
* an exported library runs in a fresh process where ``tvm_spinn`` cannot be imported and only
  ``libtvm_spinn.so`` is loaded, with the bits of the Python API; a region with a layer that
  needs Python fails there with one error naming the layer;
* a damaged section is an error when the module is created, never an out-of-bounds read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax

import tvm_spinn
from tvm_spinn import _lib
from tvm_spinn.program import Program, ProgramError
from tvm_spinn.program import format as fmt
from tvm_spinn.program.native_section import section_status
from tvm_spinn.program.ops import family_of
from tvm_spinn.runtime.simulator import run_program

import models
from test_sim_modes import _KindsNet


class _Rows(torch.nn.Module):
    """Row kernels and element-wise kinds: layer norm, softmax, GELU, mean, square root."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(12)
        self.fc = torch.nn.Linear(12, 12)

    def forward(self, x):
        y = torch.nn.functional.gelu(self.fc(self.ln(x)))
        return torch.softmax(y, dim=-1) * torch.sqrt(torch.abs(y) + 1.0) + y.mean(dim=-1, keepdim=True)


def _softmax_not_native(monkeypatch):
    """While active, the rows family has no native description of softmax layers (as for
    TFLite's integer softmax): programs with one carry a section naming it."""
    family = family_of("softmax")
    native = type(family).native

    def without_softmax(self, program, layer, nb, clip=None):
        return False if layer.kind == "softmax" else native(self, program, layer, nb, clip)

    monkeypatch.setattr(type(family), "native", without_softmax)


class _Movement(torch.nn.Module):
    """Gather (an embedding), concat, pad, strided slice, broadcast, RMS norm."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, ids):
        x = self.emb(ids)
        y = torch.cat([x, x * 2.0], dim=-1)
        y = torch.nn.functional.pad(self.fc(y), (1, 2))[:, 1:, 2:]
        y = y + torch.ones(1, 1, 9).expand(2, 4, 9)
        return torch.nn.functional.rms_norm(y, (9,), eps=1e-6)


def _build(model, x, quantize=False):
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    if quantize:
        rng = np.random.default_rng(1)
        mod = tvm_spinn.quantize(mod, [rng.normal(size=tuple(x.shape)).astype("float32") for _ in range(4)])
    return relax.build(mod, target="spinn")


def _regions(ex):
    return [m for m in tvm_spinn.report_modules(ex) if m["get_symbol"]() != "__spinn_manifest__"]


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(-1)


def _native_same_bits(ex, seed=0):
    """Every region's native plan against the Python simulator (on inputs with NaN, inf, -0.0);
    returns the number of layers covered natively."""
    rng = np.random.default_rng(seed)
    covered = 0
    for module in _regions(ex):
        assert module["native_status"]() == "", module["native_status"]()
        program = Program.from_bytes(bytes(module["get_program"]()))
        assert program.version == 6 and section_status(program.native_section).runnable
        inputs = []
        for tid in program.inputs:
            desc = program.tensors[tid]
            if desc.dtype == "float32":
                x = (rng.normal(size=desc.shape) * 3).astype("float32")
                flat = x.reshape(-1)
                flat[::17] = np.nan
                flat[3::29] = np.inf
                flat[5::31] = -0.0
            elif desc.dtype == "int32":  # indices of a gather (tables of >= 10 rows here)
                x = rng.integers(0, 10, size=desc.shape).astype(desc.dtype)
            else:
                info = np.iinfo(desc.dtype)
                x = rng.integers(info.min, info.max, size=desc.shape, endpoint=True).astype(desc.dtype)
            inputs.append(x)
        want = run_program(program, inputs, mode="layers")
        outs = [np.empty(program.tensors[t].shape, program.tensors[t].dtype) for t in program.outputs]
        _call_native(module, inputs, outs)
        for got, ref in zip(outs, want):
            np.testing.assert_array_equal(_bits(got), _bits(ref))
        covered += len(program.layers)
    return covered


def _call_native(module, inputs, outs):
    run = module["native_run"]
    args = [_lib._input(x) for x in inputs] + [tvm_ffi.from_dlpack(o) for o in outs]
    run(*args)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_zoo_models_native_same_bits(name):
    model, x = models.make(name)
    assert _native_same_bits(_build(model, x)) > 0


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_more_kinds_native_same_bits(quantized):
    torch.manual_seed(0)
    model, x = _KindsNet().eval(), torch.randn(1, 4, 15, 13)
    assert _native_same_bits(_build(model, x, quantize=quantized)) > 0


def test_rows_native_same_bits():
    torch.manual_seed(0)
    model, x = _Rows().eval(), torch.randn(3, 5, 12)
    assert _native_same_bits(_build(model, x)) > 0


def test_movement_native_same_bits():
    torch.manual_seed(0)
    ex = _build(_Movement().eval(), torch.randint(0, 10, (2, 5), dtype=torch.int32))
    assert _native_same_bits(ex) > 0


def test_non_native_layer_is_named(monkeypatch):
    _softmax_not_native(monkeypatch)
    ex = _build(*models.make("mlp"))
    statuses = [m["native_status"]() for m in _regions(ex)]
    named = [s for s in statuses if s]
    assert named, statuses
    program = Program.from_bytes(bytes(_regions(ex)[statuses.index(named[0])]["get_program"]()))
    status = section_status(program.native_section)
    assert not status.runnable and status.layer == program.layers[status.layer_index].name
    assert program.layers[status.layer_index].kind == "softmax" and "softmax" in status.reason
    assert f"layer `{status.layer}` needs the Python runtime" in named[0]
    # with the package, the module runs it (the Python simulator)
    x = models.make("mlp")[1].numpy()
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert out.shape == (4, 10) and np.allclose(out.sum(axis=-1), 1.0, atol=1e-5)


def test_damaged_section_is_refused():
    model, x = models.make("mlp")
    (module,) = _regions(_build(model, x))
    data = bytearray(bytes(module["get_program"]()))
    program = Program.from_bytes(bytes(data))
    start = len(data) - 32 - len(program.native_section)
    create = _lib._func("tvm_spinn.runtime.create_module")
    for where in (start + 24, start + 100, len(data) - 40):  # counts, code, the section's CRC
        bad = bytearray(data)
        bad[where] ^= 0x5A
        # the program digest catches it in Python; the C++ decoder refuses it before that
        with pytest.raises(ValueError, match="native section"):
            create(program.symbol, bytes(bad))
    with pytest.raises(ProgramError):
        Program.from_bytes(bytes(bad))


def test_damaged_blob_is_refused_before_the_native_run():
    """A blob whose bytes differ from those the plan was compiled with (the program's digest made
    to match again, so the package accepts it) is refused by the native runner, not used."""
    model, x = models.make("mlp")
    (module,) = _regions(_build(model, x))
    data = bytearray(bytes(module["get_program"]()))
    program = Program.from_bytes(bytes(data))
    hlen = int.from_bytes(data[16:24], "little")
    blob_at = 24 + hlen + (-(24 + hlen) % 64) + 8
    data[blob_at + 5] ^= 0x01  # one bit of the first constant
    data[-32:] = fmt.program_digest(bytes(data[:-32]), 6)
    bad = _lib._func("tvm_spinn.runtime.create_module")(program.symbol, bytes(data))
    out = np.empty(program.tensors[program.outputs[0]].shape, "float32")
    with pytest.raises(ValueError, match="constant blob is damaged"):
        _call_native(bad, [x.numpy()], [out])


def test_program_changed_after_compiling_has_no_runnable_plan():
    """A program edited and written again keeps its section, which no longer matches its header:
    the module reports that instead of running a stale plan (the package still runs it)."""
    model, x = models.make("mlp")
    (module,) = _regions(_build(model, x))
    program = Program.from_bytes(bytes(module["get_program"]()))
    program = dataclasses.replace(program, layers=(*program.layers[:-1],
                                                   dataclasses.replace(program.layers[-1], name="renamed")))
    edited = _lib._func("tvm_spinn.runtime.create_module")(program.symbol, program.to_bytes())
    assert "changed after its plan was compiled" in edited["native_status"]()
    with pytest.raises(AttributeError):
        edited["native_run"]


_CHILD = textwrap.dedent("""
    import ctypes, importlib.abc, json, sys
    import numpy as np

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "tvm_spinn" or name.startswith("tvm_spinn."):
                raise ImportError("tvm_spinn is blocked in this process")
            return None

    sys.meta_path.insert(0, Block())
    try:
        import tvm_spinn  # noqa: F401
        raise SystemExit("tvm_spinn was importable")
    except ImportError:
        pass
    job = json.loads(sys.argv[1])
    import tvm
    from tvm import relax
    ctypes.CDLL(job["lib"], mode=ctypes.RTLD_GLOBAL)  # registers the spinn module loader
    assert "tvm_spinn" not in sys.modules
    result = {}
    for name, path in job["models"].items():
        vm = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
        x = np.load(path + ".npy")
        try:
            out = vm["main"](tvm.runtime.tensor(x))
            out = out[0] if isinstance(out, (list, tuple)) or type(out).__name__ == "Array" else out
            np.save(path + ".out.npy", out.numpy())
            result[name] = "ok"
        except Exception as err:
            result[name] = f"{type(err).__name__}: {err}"
    assert "tvm_spinn" not in sys.modules
    print(json.dumps(result))
""")


def _iss_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("unicorn", "elftools", "ziglang"))


def test_exported_library_runs_without_python(tmp_path, monkeypatch):
    jobs, want = {}, {}
    # qcnn: the CNN quantized by tvm_spinn.quantize (int8 GEMMs with requantizing and
    # dequantizing epilogues, quantize/dequantize)
    cases = {"mlp": models.make("mlp"), "cnn": models.make("cnn"), "qcnn": models.make("cnn"),
             "not_native": models.make("mlp")}
    for name, (model, x) in cases.items():
        if name == "not_native":
            _softmax_not_native(monkeypatch)
        ex = _build(model, x, quantize=name == "qcnn")
        if name == "qcnn":
            assert any(layer.mode == "int8" and layer.attrs["out"] == "float32"
                       for p in tvm_spinn.report(ex).programs for layer in p.layers)
        path = str(tmp_path / f"{name}.so")
        ex.mod.export_library(path)  # TVM's own export: the programs inside the library's modules
        rng = np.random.default_rng(3)
        data = rng.normal(size=tuple(x.shape)).astype("float32")
        data.reshape(-1)[::13] = np.nan
        np.save(path + ".npy", data)
        jobs[name] = path
        if name != "not_native":
            out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(data))
            want[name] = out.numpy()
        if name == "qcnn" and _iss_available():  # the same bits again from the PE code in the ISS
            with tvm_spinn.SpinnOptions(iss=True):
                out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(data))
            np.testing.assert_array_equal(_bits(out.numpy()), _bits(want[name]))
    env = dict(os.environ, TVM_DEVICE_BACKEND_AUTOLOAD="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not os.path.isdir(os.path.join(p, "tvm_spinn")))
    job = json.dumps({"lib": str(_lib.LIBRARY_PATH), "models": jobs})
    proc = subprocess.run([sys.executable, "-c", _CHILD, job], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, ref in want.items():
        assert result[name] == "ok", result[name]
        got = np.load(jobs[name] + ".out.npy")
        np.testing.assert_array_equal(_bits(got), _bits(ref))
    assert "needs the Python runtime" in result["not_native"] and "layer `" in result["not_native"], result
