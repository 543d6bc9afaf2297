"""Start-up time of the ``tvm-spinn`` command: ``--help`` and a refused argument.

Runs the command as pip's console script does (a file named ``tvm-spinn`` that imports
``tvm_spinn.cli``) in fresh processes and prints the median wall time of each case beside its
goal (``--help`` under 1 s, a refused argument under 2 s) and which heavy modules the process
imported. Usage: ``python bench/cli.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = """\
import atexit, sys
atexit.register(lambda: sys.stderr.write(
    "\\nIMPORTED " + ",".join(m for m in ("torch", "tvm") if m in sys.modules) + "\\n"))
from tvm_spinn.cli import main
sys.exit(main())
"""

CASES = [
    ("--help", ["--help"], 1.0),
    ("compile --help", ["compile", "--help"], 1.0),
    ("missing model file", ["compile", "missing.onnx", "-o", "x.so"], 2.0),
    ("unknown target", ["compile", "m.onnx", "-o", "x.so", "--target", "spinn/nope"], 2.0),
    ("-o /dev/null", ["compile", "m.onnx", "-o", os.devnull], 2.0),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        script = os.path.join(work, "tvm-spinn")
        with open(script, "w") as f:
            f.write(SCRIPT)
        with open(os.path.join(work, "m.onnx"), "wb") as f:
            f.write(b"")  # exists: the refusal under test comes from another argument
        print(f"{'case':<22}{'median s':>10}{'goal s':>8}{'ratio':>8}  imported")
        for name, argv, goal in CASES:
            times, imported = [], ""
            for _ in range(args.repeat):
                start = time.perf_counter()
                proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True,
                                      cwd=work)
                times.append(time.perf_counter() - start)
                imported = proc.stderr.rsplit("IMPORTED ", 1)[-1].strip()
            median = statistics.median(times)
            print(f"{name:<22}{median:>10.2f}{goal:>8.1f}{median / goal:>8.2f}  {imported or '-'}")


if __name__ == "__main__":
    main()
