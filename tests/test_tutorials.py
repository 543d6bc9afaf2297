"""Execute the tutorial notebooks: a tutorial that breaks fails CI."""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

TUTORIALS = sorted((pathlib.Path(__file__).parent.parent / "tutorials").glob("*.ipynb"))
# two training-step builds (chip and board): ~25 s of CPU, ~45 s on a loaded machine; a short
# tuning job (~35 s) and a quantization walk-through (~30 s) whose steps test_tune*.py and
# test_quant*.py cover one by one: the default run keeps its 15-minute budget. Also slow: the LLM
# walk-through (~45 s: a GPT-2 compiled and 32 tokens generated, then Llama-2-70B plans; its steps are
# test_llm.py's tokens-match-transformers and test_llm_plan.py / test_physical_bounds.py) and the
# front-ends one (~15 s, mostly importing TensorFlow; PyTorch, ONNX and Keras each have default
# tests in test_e2e.py and test_frontend_tflite.py)
# The mapping walk-through (~12 s: partitions, mappings and reports that test_mapping*.py and
# test_partition_only.py check one by one) is slow too.
SLOW = {"07_training.ipynb", "03_tuning.ipynb", "05_quantization.ipynb", "06_llm.ipynb", "02_frontends.ipynb",
        "04_mapping.ipynb"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p
                                  for p in TUTORIALS], ids=lambda p: p.name)
def test_tutorial_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
