"""The seams with TVM: what loading tvm_spinn changes in TVM, and what it must leave alone.

:mod:`tvm_spinn.integration` registers the targets, the codegen, the runtime callback, the error
type and the ``"spinn"`` pipeline, and wraps two TVM objects that have no registry
(``PIPELINE_MAP["default"]``, ``relax.get_default_pipeline``), forwarding every non-spinn use to
TVM's own; ``ex.export_library`` is TVM's method, untouched. These tests check that a plain ``llvm`` build is the
same with and without the plugin (``TVM_DEVICE_BACKEND_AUTOLOAD=0``: TVM 0.27's
``tvm/backend/_autoload_backends.py`` returns before loading any ``tvm.backends`` entry point),
that nothing else of TVM's is replaced (global functions, operator attributes, other pipelines),
and that every module tvm_spinn adds to ``sys.modules`` is a real module file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn import integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model with weights, a reduction, an elementwise chain and a constant-foldable part, built for
# plain llvm; prints the digests of the executable's bytecode text and of the output bytes.
_LLVM_BUILD = textwrap.dedent('''
    import hashlib, json, sys
    import numpy as np
    import tvm
    from tvm import relax

    def model():
        rng = np.random.RandomState(0)
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType([2, 16], "float32"))
        w1 = relax.const(rng.randn(16, 32).astype("float32"))
        w2 = relax.const(rng.randn(32, 8).astype("float32"))
        c = relax.const(rng.randn(32).astype("float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                h = bb.emit(relax.op.matmul(x, w1))
                h = bb.emit(relax.op.add(h, relax.op.multiply(c, c)))  # constant-foldable operand
                h = bb.emit(relax.op.nn.gelu(h))
                y = bb.emit(relax.op.matmul(h, w2))
                o = bb.emit_output(relax.op.nn.softmax(relax.op.sum(y, axis=[0], keepdims=True)))
            bb.emit_func_output(o)
        return bb.get()

    def digests():
        ex = relax.build(model(), target="llvm")
        vm = relax.VirtualMachine(ex, tvm.cpu())
        x = np.random.RandomState(1).randn(2, 16).astype("float32")
        out = vm["main"](tvm.runtime.tensor(x)).numpy()
        return {"text": hashlib.sha256(ex.as_text().encode()).hexdigest(),
                "python": hashlib.sha256(ex.as_python().encode()).hexdigest(),
                "output": hashlib.sha256(out.tobytes()).hexdigest()}
''')


def _run(code: str, autoload: bool) -> dict:
    env = dict(os.environ, TVM_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), os.path.join(ROOT, "tests"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_plain_llvm_build_identical_without_the_plugin():
    # with the plugin loaded (this process: autoload, then a spinn build through the hooks)
    scope: dict = {}
    exec(compile(_LLVM_BUILD, "<llvm build>", "exec"), scope)  # noqa: S102 - the test's own code
    relax.build(scope["model"](), target="spinn")
    loaded = scope["digests"]()
    # without it: autoload off, tvm_spinn never imported
    plain = _run(_LLVM_BUILD + textwrap.dedent('''
        d = digests()
        d["tvm_spinn_imported"] = any(m == "tvm_spinn" or m.startswith("tvm_spinn.") for m in sys.modules)
        d["spinn_pipeline"] = "spinn" in relax.pipeline.PIPELINE_MAP
        print(json.dumps(d))
    '''), autoload=False)
    assert plain.pop("tvm_spinn_imported") is False
    assert plain.pop("spinn_pipeline") is False
    assert loaded == plain


def test_autoload_entry_point():
    """TVM's autoload finds the package through its ``tvm.backends`` entry point."""
    from importlib.metadata import entry_points

    points = [p for p in entry_points(group="tvm.backends") if p.value.startswith("tvm_spinn")]
    assert [p.value for p in points] == ["tvm_spinn:_autoload"]
    assert points[0].load() is tvm_spinn._autoload


# Run with autoload off: capture TVM's objects, import tvm_spinn, build for spinn (partitioning,
# constant folding, codegen), export, then compare identities.
_IDENTITY = textwrap.dedent('''
    import json, os, sys, tempfile, types
    import numpy as np
    import tvm, tvm_ffi
    from tvm import relax
    from tvm.relax import pipeline as P

    OPS = ["relax.add", "relax.matmul", "relax.nn.relu", "relax.reshape", "relax.permute_dims",
           "relax.multiply", "relax.full_like", "relax.nn.softmax"]
    before_modules = set(sys.modules)
    before = {
        "map": dict(P.PIPELINE_MAP),
        "get_default_pipeline": relax.get_default_pipeline,
        "pipeline.get_default_pipeline": P.get_default_pipeline,
        "export_library": tvm.runtime.Executable.__dict__["export_library"],
        "tirx.build": tvm_ffi.get_global_func("tirx.build"),
        "legalize": {name: tvm.ir.Op.get(name).get_attr("FLegalize") for name in OPS},
    }

    import tvm_spinn
    from tvm_spinn import integration
    from tvm_spinn.tune.intrinsics import ensure_intrinsics

    rng = np.random.RandomState(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 16], "float32"))
    w = relax.const(rng.randn(16, 8).astype("float32"))
    b = relax.const(rng.randn(8).astype("float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            y = bb.emit(relax.op.add(y, relax.op.multiply(b, b)))
            o = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(o)
    ex = relax.build(bb.get(), target="spinn")
    with tempfile.TemporaryDirectory() as tmp:
        ex.export_library(os.path.join(tmp, "m.so"))  # TVM's own export
        with open(os.path.join(tmp, "m.so"), "rb") as f:
            sealed = f.read()[-8:] == tvm_spinn.runtime.loader.TRAILER_MAGIC
        x_in = tvm.runtime.tensor(rng.randn(4, 16).astype("float32"))
        outs = [relax.VirtualMachine(lib, tvm.cpu())["main"](x_in).numpy().tobytes()
                for lib in (ex, tvm_spinn.load_module(os.path.join(tmp, "m.so")),
                            tvm.runtime.load_module(os.path.join(tmp, "m.so")))]
    ensure_intrinsics(tvm.target.Target("llvm"))

    after_map = dict(P.PIPELINE_MAP)
    unreal = []
    for name in sorted(set(sys.modules) - before_modules):
        if not name.startswith("tvm"):  # tvm, tvm_ffi, tvm_spinn (others are third-party's)
            continue
        m = sys.modules[name]
        spec = getattr(m, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if type(m) is not types.ModuleType or spec is None or spec.name != name:
            unreal.append(name)
        elif origin not in ("built-in", "frozen", None) and not os.path.isfile(origin):
            unreal.append(name)
        elif origin is None and not getattr(spec, "submodule_search_locations", None):
            unreal.append(name)  # neither a file nor a namespace package
    result = {
        "added_pipelines": sorted(set(after_map) - set(before["map"])),
        "other_pipelines_same": all(after_map[k] is v for k, v in before["map"].items() if k != "default"),
        "default_wraps_tvm": integration.TVM_ORIGINALS["default"] is before["map"]["default"],
        "default_is_tvm": after_map["default"] is before["map"]["default"],
        "get_default_pipeline_wraps_tvm": integration.TVM_ORIGINALS["get_default_pipeline"] is before["get_default_pipeline"],
        "get_default_pipeline_is_tvm": relax.get_default_pipeline is before["get_default_pipeline"],
        "pipeline_module_function_is_tvm": P.get_default_pipeline is before["pipeline.get_default_pipeline"],
        "export_is_tvm": tvm.runtime.Executable.__dict__["export_library"] is before["export_library"],
        "hooks": sorted(integration.TVM_ORIGINALS),
        "reloads_same": outs[1] == outs[0] and outs[2] == outs[0],
        "tirx_build_is_tvm": tvm_ffi.get_global_func("tirx.build").same_as(before["tirx.build"]),
        "legalize_is_tvm": {n: tvm.ir.Op.get(n).get_attr("FLegalize").same_as(f) for n, f in before["legalize"].items()},
        "sealed": sealed,
        "unreal_modules": unreal,
        "intrinsic_package": "tvm.s_tir.tensor_intrin" in sys.modules,
        "intrinsic_modules": sorted(getattr(sys.modules[n], "__file__", None) for n in sys.modules
                                    if n.startswith("tvm.s_tir.tensor_intrin.")),
    }
    print(json.dumps(result))
''')


def test_tvm_objects_after_a_spinn_build():
    """Identities of TVM's objects before ``import tvm_spinn`` and after a spinn build, export
    and the tuner's intrinsics (in a process with autoload off, so "before" is TVM alone)."""
    got = _run(_IDENTITY, autoload=False)
    assert got["added_pipelines"] == ["spinn"]
    assert got["other_pipelines_same"]  # zero, default_build, static_shape_tuning: TVM's
    # the two pipeline hooks wrap exactly TVM's objects (integration.py); nothing else is wrapped
    assert got["hooks"] == ["default", "get_default_pipeline"]
    assert got["default_wraps_tvm"] and not got["default_is_tvm"]
    assert got["get_default_pipeline_wraps_tvm"] and not got["get_default_pipeline_is_tvm"]
    assert got["pipeline_module_function_is_tvm"]  # relax.pipeline.get_default_pipeline untouched
    # ex.export_library is TVM's method: an unsealed library both loaders load to the same bits
    assert got["export_is_tvm"] and not got["sealed"] and got["reloads_same"]
    # constant folding and partitioning leave global functions and operator attributes alone
    assert got["tirx_build_is_tvm"]
    assert all(got["legalize_is_tvm"].values()), got["legalize_is_tvm"]
    # tvm, tvm_ffi and tvm_spinn modules imported since: each a real module file, under its name
    assert got["unreal_modules"] == []
    # the tuner's intrinsics (ensure_intrinsics): TVM's module files for this host, without the
    # package (whose __init__ imports every backend's), and without a stand-in for it
    assert not got["intrinsic_package"]
    import platform

    import tvm.s_tir

    base = os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")
    expected = {"aarch64": ["arm_cpu", "dot_product_common"], "arm64": ["arm_cpu", "dot_product_common"]}
    names = expected.get(platform.machine().lower(),
                         ["riscv_cpu"] if platform.machine().lower().startswith("riscv") else ["x86"])
    assert got["intrinsic_modules"] == sorted(os.path.join(base, f"{n}.py") for n in names)


def test_pipeline_hooks_pass_through_for_plain_targets():
    """Outside ``build_options``, a plain GPU target gets TVM's own pipeline object."""
    target = tvm.target.Target("cuda")
    assert relax.get_default_pipeline(target).info.name == \
        integration.TVM_ORIGINALS["get_default_pipeline"](target).info.name
    assert relax.get_default_pipeline(tvm.target.Target("spinn/cuda")).info.name == "SpinnPipeline"
    assert integration.TVM_ORIGINALS["default"] is relax.pipeline.default_build_pipeline
    assert relax.pipeline.PIPELINE_MAP["default_build"] is relax.pipeline.default_build_pipeline


def test_named_spinn_pipeline_offloads():
    """``relax_pipeline="spinn"`` is the registered pipeline; it takes no options."""
    import numpy as np

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 16], "float32"))
    w = relax.const(np.random.RandomState(0).randn(16, 8).astype("float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            o = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
        bb.emit_func_output(o)
    ex = relax.build(bb.get(), target="spinn", relax_pipeline="spinn")
    assert tvm_spinn.report(ex).offloaded_ops
    with pytest.raises(TypeError, match="takes no options"):
        relax.get_pipeline("spinn", total_trials=1)
