"""The per-task roofline table: arithmetic checked against hand-computed values."""

import math

import pytest

from tvm_spinn.tune import HostPeaks, TaskResult, TuningResult, roofline_table
from tvm_spinn.tune.roofline import measure_host_peaks, roofline_rows


def _task(name, flop, nbytes, default_us, tuned_us, calls=1):
    return TaskResult(name=name, flop=flop, trials=1, new_trials=1, best_latency_us=tuned_us,
                      status="tuned", default_latency_us=default_us, default_rule="ParallelVectorize",
                      bytes=nbytes, calls=calls)


def test_roofline_rows_and_table():
    peaks = HostPeaks(flops_per_s=1e11, bytes_per_s=1e10)  # 100 GFLOP/s, 10 GB/s
    result = TuningResult(work_dir="w", target="llvm", model_hash="h", tasks=[
        _task("gemm", 2e6, 4e4, default_us=50.0, tuned_us=40.0),            # compute: 20 us
        _task("copy", float("nan"), 1e5, default_us=20.0, tuned_us=None, calls=3),  # memory: 10 us
    ])
    rows = {r["task"]: r for r in roofline_rows(result, peaks)}
    gemm, copy = rows["gemm"], rows["copy"]
    assert gemm["uses"] == "tuned" and gemm["latency_us"] == 40.0 and gemm["bound"] == "compute"
    assert gemm["roofline_us"] == pytest.approx(20.0) and gemm["fraction"] == pytest.approx(0.5)
    assert copy["uses"] == "default" and copy["flop"] == 0.0 and copy["bound"] == "memory"
    assert copy["roofline_us"] == pytest.approx(10.0) and copy["fraction"] == pytest.approx(0.5)
    # shares count calls: 3 x 20 us against 40 us
    assert copy["share"] == pytest.approx(0.6) and gemm["share"] == pytest.approx(0.4)
    assert [r["task"] for r in roofline_rows(result, peaks)] == ["copy", "gemm"]  # slowest first
    table = roofline_table(result, peaks)
    assert "100.0 GFLOP/s" in table and "10.0 GB/s" in table
    assert "% roofline" in table and "compute" in table and "60.0" in table
    # the tuning table's total row: each task once, the faster candidate
    assert "total" in result.table() and "60.0" in result.table()


def test_measured_peaks_are_finite_and_positive():
    peaks = measure_host_peaks(n=64, copy_bytes=1 << 16, repeat=2)
    assert math.isfinite(peaks.flops_per_s) and peaks.flops_per_s > 0
    assert math.isfinite(peaks.bytes_per_s) and peaks.bytes_per_s > 0
