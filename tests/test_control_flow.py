"""Models with loops (recursive Relax functions) build for spinn and run on the fallback.

A Keras ``LSTM`` converts to a TFLite ``WHILE`` with cond/body subgraphs, imported as recursive
Relax functions. TVM's ``RunCodegen`` overflows the stack (SIGSEGV) on such a module; the spinn
pipeline must neither hand it that pass nor partition it. The build runs in a subprocess so that
a crash fails this test instead of killing the test session.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tflite")

_SCRIPT = textwrap.dedent("""
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
        ex = relax.build(mod, target=target)
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
        outs[target] = (out if hasattr(out, "numpy") else out[0]).numpy().tolist()
    outs["keras"] = np.asarray(model(x)).tolist()
    print("RESULT " + json.dumps(outs))
""")


def test_keras_lstm_builds_for_spinn_and_matches():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, (
        f"spinn build of a Keras LSTM exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    outs = {k: np.asarray(v, dtype="float32") for k, v in json.loads(line[7:]).items()}
    np.testing.assert_allclose(outs["llvm"], outs["keras"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs["spinn"], outs["llvm"])  # same fallback code, same bits
