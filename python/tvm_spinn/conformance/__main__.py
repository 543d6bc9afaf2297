"""Command line: ``python -m tvm_spinn.conformance onnx [options]``.

Examples
--------
Run everything with two workers and write a report::

    python -m tvm_spinn.conformance onnx --workers 2 --json report.json

Only convolution and pooling cases, without the ONNX passes in the spinn pipeline::

    python -m tvm_spinn.conformance onnx --cases 'conv|pool' --no-passes

The exit code is 0 when there are no regressions (cases plain TVM matches but spinn does
not), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tvm_spinn.conformance",
                                description="Conformance runs of plain TVM and tvm-spinn.")
    sub = p.add_subparsers(dest="suite", required=True)
    o = sub.add_parser("onnx", help="ONNX backend node tests (regenerated from the onnx package)")
    o.add_argument("--cases", action="append", metavar="PATTERN",
                   help="case name pattern: glob if it has *?[, else a regex searched in the "
                        "name; repeatable (default: all cases)")
    o.add_argument("--limit", type=int, help="run only the first N selected cases (sorted)")
    o.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    o.add_argument("--timeout", type=float, default=60.0,
                   help="seconds per case and pipeline (default 60)")
    o.add_argument("--json", metavar="FILE", help="write the JSON report here (atomically)")
    o.add_argument("--no-passes", action="store_true",
                   help="do not run the ONNX-level passes in the spinn pipeline")
    o.add_argument("--pipelines", default="tvm,spinn",
                   help="comma-separated subset of tvm,spinn (default both)")
    o.add_argument("--cache-dir", help="case cache folder (default: ~/.cache/tvm_spinn/...)")
    o.add_argument("--log-dir", help="worker log folder (default: a temporary folder)")
    o.add_argument("--max-tasks-per-child", type=int, default=50,
                   help="tasks a worker runs before it is replaced (default 50)")
    o.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (default: when stderr is a TTY)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point.

    Parameters
    ----------
    argv : list of str, optional
        Arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 if there are no regressions, 1 otherwise, 2 on usage errors.
    """
    args = _parser().parse_args(argv)
    from .runner import format_summary, run_cases

    progress = sys.stderr.isatty() if args.progress == "auto" else args.progress == "on"
    try:
        if args.json:  # refuse a device, FIFO or directory before the run, not after it
            from .._files import output_destination

            output_destination(args.json, "conformance report")
        report = run_cases(patterns=args.cases, limit=args.limit, workers=args.workers,
                           timeout=args.timeout, passes=not args.no_passes,
                           pipelines=[p.strip() for p in args.pipelines.split(",") if p.strip()],
                           max_tasks_per_child=args.max_tasks_per_child,
                           cache_dir=args.cache_dir, log_dir=args.log_dir, progress=progress)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_summary(report))
    if args.json:
        report.write_json(args.json)
        print(f"report written to {args.json}")
    return 1 if report.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
