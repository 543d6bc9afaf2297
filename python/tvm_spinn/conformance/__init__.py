"""ONNX backend node-test conformance runner for plain TVM and the spinn pipeline.

Run ``python -m tvm_spinn.conformance onnx --help``. The modules are:

- :mod:`.cases`: regenerate the ONNX backend node tests into a cache directory and load them;
- :mod:`.worker`: run one case through one pipeline (executed in a worker process);
- :mod:`.runner`: crash-safe subprocess pool, classification, summary and JSON report;
- :mod:`.__main__`: the command line.
"""

from .runner import CaseResult, Report, run_cases, summarize  # noqa: F401

__all__ = ["run_cases", "summarize", "CaseResult", "Report"]
