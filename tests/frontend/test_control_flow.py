"""Models with loops (recursive Relax functions) build for spinn and run on the fallback.

A Keras ``LSTM`` converts to a TFLite ``WHILE`` with cond/body subgraphs, imported as recursive
Relax functions (the fast test writes such a loop by hand). TVM's ``RunCodegen`` overflows the
stack (SIGSEGV) on such a module; the spinn pipeline must neither hand it that pass nor
partition it. The builds run in a subprocess so that a crash fails the test instead of killing
the test session.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# ``body`` calls itself until i == 3; ``main`` has an offloadable matmul + ReLU.
_LOOP_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import tvm
    import tvm_spinn
    from tvm import relax
    from tvm.script import ir as I, relax as R

    @I.ir_module
    class Loop:
        @R.function
        def body(i: R.Tensor((), "int32"), x: R.Tensor((4, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Loop
            cond: R.Tensor((), "bool") = R.less(i, R.const(3, "int32"))
            if cond:
                j = R.add(i, R.const(1, "int32"))
                y = R.add(R.multiply(x, R.const(0.5, "float32")), R.const(1.0, "float32"))
                r = cls.body(j, y)
            else:
                r = x
            return r

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")) -> R.Tensor((4, 8), "float32"):
            cls = Loop
            with R.dataflow():
                h = R.nn.relu(R.matmul(x, w))
                R.output(h)
            out = cls.body(R.const(0, "int32"), h)
            return out

    reasons = tvm_spinn.partition_for_spinn(Loop).attrs["spinn_fallback_reasons"]
    assert "recursive Relax functions (loops) ['body']" in str(reasons["<module>"]), reasons
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(4, 8)).astype("float32"), rng.normal(size=(8, 8)).astype("float32")
    outs = {}
    for target in ("llvm", "spinn"):
        # "llvm": the spinn tags' host target (same -mcpu), so the fallback is the same code
        build_target = tvm_spinn.host_target() if target == "llvm" else target
        vm = relax.VirtualMachine(relax.build(Loop, target=build_target), tvm.cpu())
        outs[target] = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy().tolist()
    y = np.maximum(x.astype("float64") @ w, 0)
    for _ in range(3):
        y = y * 0.5 + 1.0
    outs["numpy"] = y.tolist()
    print("RESULT " + json.dumps(outs))
""")

_KERAS_SCRIPT = textwrap.dedent("""
    import json
    import keras
    import numpy as np
    import tvm
    import tvm_spinn
    from tvm import relax
    from tvm_spinn.frontend.tflite import from_keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4)])
    x = np.random.default_rng(0).uniform(-1, 1, (1, 5, 3)).astype("float32")
    mod = from_keras(model)
    reasons = tvm_spinn.partition_for_spinn(mod).attrs["spinn_fallback_reasons"]
    assert "recursive Relax functions" in str(reasons["<module>"]), reasons
    outs = {}
    for target in ("llvm", "spinn"):
        ex = relax.build(mod, target=tvm_spinn.host_target() if target == "llvm" else target)
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
        outs[target] = (out if hasattr(out, "numpy") else out[0]).numpy().tolist()
    outs["keras"] = np.asarray(model(x)).tolist()
    print("RESULT " + json.dumps(outs))
""")


def _run_isolated(script: str, what: str, folder) -> dict:
    """Run ``script`` in a fresh interpreter; a crash (e.g. SIGSEGV, exit -11) fails the test.

    The script is a file (TVMScript's parser reads the source of what it parses)."""
    path = folder / "script.py"
    path.write_text(script)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return {k: np.asarray(v, dtype="float32") for k, v in json.loads(line[7:]).items()}


def test_recursive_relax_loop_builds_for_spinn_and_matches(tmp_path):
    outs = _run_isolated(_LOOP_SCRIPT, "spinn build of a recursive Relax loop", tmp_path)
    np.testing.assert_allclose(outs["llvm"], outs["numpy"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs["spinn"], outs["llvm"])  # all on the fallback: same code


@pytest.mark.slow  # TensorFlow import + TFLite conversion: ~20 s
def test_keras_lstm_builds_for_spinn_and_matches(tmp_path):
    pytest.importorskip("tensorflow")
    pytest.importorskip("tflite")
    outs = _run_isolated(_KERAS_SCRIPT, "spinn build of a Keras LSTM", tmp_path)
    np.testing.assert_allclose(outs["llvm"], outs["keras"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs["spinn"], outs["llvm"])  # same fallback code, same bits
