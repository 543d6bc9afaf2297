"""Where a tuned fallback's time goes: each task against this CPU's FLOP/byte roofline.

The peaks are measured, not looked up: ``numpy`` float32 GEMM (its BLAS is close to the best
this CPU does) for FLOP/s, and a copy of a cache-sized array for bytes/s (the fallback's
tensors are small: they live in L2/L3, so DRAM bandwidth would understate what is reachable).
A task's roofline time is ``max(FLOP / peak FLOP/s, bytes / peak bytes/s)``, its bytes those
of its parameters read and written once; ``roofline %`` is roofline time over measured latency.
On a shared machine the peaks are as noisy as the latencies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["HostPeaks", "measure_host_peaks", "roofline_rows", "roofline_table"]


@dataclass(frozen=True)
class HostPeaks:
    """Measured peaks of this host: FLOP/s (float32 GEMM) and bytes/s (cache-sized copy)."""

    flops_per_s: float
    bytes_per_s: float

    def __str__(self) -> str:
        return (f"{self.flops_per_s / 1e9:.1f} GFLOP/s (numpy float32 GEMM), "
                f"{self.bytes_per_s / 1e9:.1f} GB/s (copy of 2 x 4 MiB)")


def _best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_host_peaks(n: int = 512, copy_bytes: int = 4 << 20, repeat: int = 20) -> HostPeaks:
    """Measure :class:`HostPeaks` (best of ``repeat``: the least disturbed run)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up (BLAS threads, caches)
    flops = 2.0 * n ** 3 / _best_of(lambda: a @ b, repeat)
    src = rng.standard_normal(copy_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    bandwidth = 2.0 * src.nbytes / _best_of(lambda: np.copyto(dst, src), repeat)
    return HostPeaks(flops_per_s=flops, bytes_per_s=bandwidth)


def roofline_rows(result, peaks: HostPeaks) -> list[dict]:
    """One dict per task of a :class:`~tvm_spinn.tune.TuningResult`, slowest total first.

    Keys: ``task``, ``calls``, ``latency_us`` (the schedule the build uses), ``uses``,
    ``flop``, ``bytes``, ``bound`` (``"compute"``/``"memory"``), ``roofline_us``, ``fraction``
    (roofline over latency), ``share`` (of the model's summed task time, calls included).
    """
    rows = []
    for t in result.tasks:
        lat = t.latency_us
        flop = 0.0 if t.flop != t.flop else t.flop  # NaN: no estimate (data movement only)
        compute_us = 1e6 * flop / peaks.flops_per_s
        memory_us = 1e6 * t.bytes / peaks.bytes_per_s if t.bytes == t.bytes else 0.0
        roof = max(compute_us, memory_us)
        rows.append({
            "task": t.name, "calls": t.calls, "latency_us": lat, "uses": t.chosen,
            "flop": flop, "bytes": t.bytes, "bound": "compute" if compute_us >= memory_us else "memory",
            "roofline_us": roof, "fraction": (roof / lat) if lat else None,
        })
    total = sum(r["latency_us"] * r["calls"] for r in rows if r["latency_us"] is not None)
    for r in rows:
        r["share"] = (r["latency_us"] * r["calls"] / total) if total and r["latency_us"] is not None else None
    return sorted(rows, key=lambda r: -(r["share"] or 0.0))


def roofline_table(result, peaks: HostPeaks) -> str:
    """:func:`roofline_rows` as text: kernel, calls, latency, FLOP, bytes, roofline, share."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = [("task", "calls", "latency us", "uses", "FLOP", "bytes", "bound", "roofline us",
             "% roofline", "% time")]
    for r in roofline_rows(result, peaks):
        rows.append((r["task"], str(r["calls"]), num(r["latency_us"], ".2f"), r["uses"] or "-",
                     f"{r['flop']:.3g}", f"{r['bytes']:.3g}", r["bound"], f"{r['roofline_us']:.2f}",
                     num(None if r["fraction"] is None else 100 * r["fraction"], ".1f"),
                     num(None if r["share"] is None else 100 * r["share"], ".1f")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"host peaks: {peaks}\n" + "\n".join(lines)
