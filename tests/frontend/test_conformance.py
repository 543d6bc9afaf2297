"""Fast subset of the ONNX backend node-test conformance run (plain TVM vs spinn).

The full run is ``python -m tvm_spinn.conformance onnx --workers 2 --json report.json``.
"""

import json
import os

import pytest

pytest.importorskip("onnx")

from tvm_spinn.conformance import runner  # noqa: E402
from tvm_spinn.conformance.worker import STAGES, compare  # noqa: E402

# ~30 representative cases: elementwise, activations, conv/pool, GEMM, normalization, layout.
SUBSET = [
    "test_add", "test_add_bcast", "test_mul_bcast", "test_div", "test_sub_bcast",
    "test_relu", "test_sigmoid", "test_tanh", "test_leakyrelu", "test_clip",
    "test_conv_with_strides_padding", "test_conv_with_autopad_same",
    "test_gemm_default_matrix_bias", "test_gemm_transposeB", "test_gemm_all_attributes",
    "test_matmul_2d", "test_matmul_3d",
    # Every LayerNormalization node test also checks the optional Mean/InvStdDev outputs, which
    # TVM's importer does not produce, so RMS/Group normalization stand in for it.
    "test_softmax_axis_1", "test_rms_normalization_2d_axis1", "test_group_normalization_example",
    "test_batchnorm_example", "test_maxpool_2d_pads", "test_averagepool_2d_strides",
    "test_globalaveragepool", "test_reshape_negative_dim", "test_transpose_default",
    "test_concat_2d_axis_1", "test_gather_0", "test_flatten_axis1", "test_unsqueeze_axis_0",
    "test_reduce_mean_keepdims_example", "test_slice",
    # int8: QLinear expansion onto the MAC path (a unit-extent reduction the default CPU schedule
    # once miscompiled), QDQ round trip, and a bf16 kernel the default schedule must not vectorize.
    "test_qlinearconv", "test_qlinearmatmul_2D_uint8_float32", "test_quantizelinear",
    "test_dequantizelinear", "test_einsum_batch_matmul_bfloat16",
    # a zero-size tensor frozen into a constant must survive the executable's export/reload
    "test_tril_zero",
]

# Plain TVM imports the model as given: Reshape's shape and ReduceMean's axes (opset 18) arrive
# as runtime tensors, which the TVM importer rejects. The spinn pipeline freezes integer
# inputs, so it matches them.
# TVM's importer has no QLinearConv/QLinearMatMul; the spinn ONNX passes expand them.
PLAIN_TVM_KNOWN_FAILURES = {"test_reduce_mean_keepdims_example", "test_reshape_negative_dim",
                            "test_qlinearconv", "test_qlinearmatmul_2D_uint8_float32"}


@pytest.fixture(scope="module")
def subset_report():
    return runner.run_cases(SUBSET, workers=2, timeout=60)


def test_subset_zero_regressions(subset_report):
    rep = subset_report
    assert sorted(rep.results) == sorted(SUBSET)
    bad = {c: rep.results[c]["spinn"].error for c in rep.regressions}
    assert not bad, f"spinn regressions vs plain TVM: {bad}"
    # spinn matches the whole subset; plain TVM all but the known failures.
    spinn_failures = {c: per["spinn"].error for c, per in rep.results.items()
                      if not per["spinn"].matched}
    assert not spinn_failures
    tvm_failures = {c for c, per in rep.results.items() if not per["tvm"].matched}
    assert tvm_failures == PLAIN_TVM_KNOWN_FAILURES
    assert rep.improvements == sorted(PLAIN_TVM_KNOWN_FAILURES)


def test_subset_counts_consistent(subset_report, tmp_path):
    rep = subset_report
    for pipeline, cnt in rep.counts.items():
        assert cnt["cases"] == len(SUBSET)
        assert cnt["cases"] >= cnt["imported"] >= cnt["built"] >= cnt["ran"] >= cnt["matched"]
        assert sum(cnt[s] for s in runner.STATUSES) == cnt["cases"]
        assert cnt["matched"] == sum(r[pipeline].matched for r in rep.results.values())
    out = tmp_path / "report.json"
    rep.write_json(str(out))
    data = json.loads(out.read_text())
    assert data["counts"] == rep.counts
    assert list(data["cases"]) == sorted(SUBSET)
    assert data["regressions"] == []
    text = runner.format_summary(rep)
    assert "regressions (plain TVM matches, spinn does not): 0" in text


def _abort_on_relu(name, path, pipeline, options, progress=None):
    """Test hook: crash the worker process on one case, run the others normally."""
    if name == "test_relu" and pipeline == "spinn":
        progress("imported")
        os.abort()
    if name == "test_sigmoid" and pipeline == "spinn":
        import time

        time.sleep(30)
    return runner.default_worker_fn(name, path, pipeline, options, progress=progress)


def test_crashing_case_is_a_failure_not_a_runner_crash():
    rep = runner.run_cases(["test_relu", "test_sigmoid", "test_add"], workers=2, timeout=6,
                           worker_fn=_abort_on_relu)
    crashed = rep.results["test_relu"]["spinn"]
    assert crashed.status == "crash"
    assert "SIGABRT" in crashed.error
    assert crashed.stage == "imported"  # the last stage the worker reported
    hung = rep.results["test_sigmoid"]["spinn"]
    assert hung.status == "timeout"
    # The other tasks, including those after the crash, still ran.
    assert rep.results["test_relu"]["tvm"].matched
    assert rep.results["test_add"]["tvm"].matched and rep.results["test_add"]["spinn"].matched
    assert rep.regressions == ["test_relu", "test_sigmoid"]
    assert rep.counts["spinn"]["crash"] == 1 and rep.counts["spinn"]["timeout"] == 1


def test_compare_rules():
    import numpy as np

    compare([np.ones(3, "float32")], [np.ones(3, "float32") + 1e-5], 1e-3, 1e-7)
    with pytest.raises(AssertionError, match="dtype"):
        compare([np.ones(3, "float64")], [np.ones(3, "float32")], 1e-3, 1e-7)
    with pytest.raises(AssertionError, match="shape"):
        compare([np.ones(3, "float32")], [np.ones(4, "float32")], 1e-3, 1e-7)
    with pytest.raises(AssertionError, match="outputs"):
        compare([], [np.ones(3)], 1e-3, 1e-7)
    assert STAGES[0] == "none" and STAGES[-1] == "matched"


def test_unknown_case_name_raises():
    with pytest.raises(ValueError, match="unknown ONNX node test case"):
        runner.run_cases(["test_no_such_case_xyz"])
