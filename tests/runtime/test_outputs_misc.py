"""Report files (Perfetto trace, timeline plot, conformance JSON) go through the package's
checked atomic writer: devices, FIFOs and directories are refused by name, like ``-o`` of the CLI,
and a regular path is written whole (no temporary file left beside it)."""

import json
import os

import pytest

from tvm_spinn._files import OutputPathError
from tvm_spinn.conformance.runner import Report as ConformanceReport


@pytest.fixture(scope="module")
def report():
    """The timeline of a small compiled MLP (one build, shared by the tests here)."""
    import torch
    import tvm
    from tvm import relax

    import tvm_spinn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn")
    relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    rep = tvm_spinn.report(ex)
    assert rep.programs, "no offloaded region: nothing to draw"
    return rep


def _refusals(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return [(os.devnull, "it is a character device"), (str(fifo), "it is a FIFO"),
            (str(tmp_path), "it is a directory")]


def test_perfetto_and_plot_refuse_devices_fifos_and_directories(report, tmp_path):
    for path, kind in _refusals(tmp_path):
        for write, what in ((report.to_perfetto, "Perfetto trace"), (report.plot, "timeline plot")):
            with pytest.raises(OutputPathError, match=f"refusing to write {what} '{path}': {kind}"):
                write(path)
    with pytest.raises(OutputPathError, match=r"/dev/null is refused too"):
        report.to_perfetto(os.devnull)
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
    assert sorted(os.listdir(tmp_path)) == ["fifo"]  # no temporary file left behind


def test_perfetto_and_plot_write_whole_files(report, tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(trace)
    assert report.to_perfetto(str(link)) == str(link)
    assert link.is_symlink()  # the link's target is replaced, never the link
    doc = json.loads(trace.read_text())
    assert any(e["ph"] == "X" for e in doc["traceEvents"])
    png = tmp_path / "p.png"
    report.plot(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["link.json", "p.png", "t.json"]


def test_conformance_json_is_checked_and_atomic(tmp_path):
    rep = ConformanceReport(results={}, counts={"spinn": {"cases": 0}}, regressions=[], improvements=[])
    for path, kind in _refusals(tmp_path):
        with pytest.raises(OutputPathError, match=f"refusing to write conformance report '{path}': {kind}"):
            rep.write_json(path)
    out = tmp_path / "r.json"
    rep.write_json(str(out))
    assert json.loads(out.read_text())["counts"] == {"spinn": {"cases": 0}}
    assert sorted(os.listdir(tmp_path)) == ["fifo", "r.json"]


def test_conformance_cli_refuses_the_json_path_before_running(tmp_path, capsys):
    from tvm_spinn.conformance.__main__ import main

    assert main(["onnx", "--json", os.devnull, "--limit", "1"]) == 2
    assert "refusing to write conformance report '/dev/null'" in capsys.readouterr().err
