"""The firmware's job tables and the reference host loader: a firmware directory run alone (its
manifest, images, job files and initial DRAM; no program object, no ``iss`` execution module)
gives the default simulator's bits and the ``iss`` mode's; the DMA descriptors reproduce the
addresses they stand for; a corrupted job file or placement field is one FirmwareError naming
the file and the field; a layer left to the host is named when the loader is asked to run it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from tvm import relax

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

import tvm_spinn  # noqa: E402
from tvm_spinn.pe import FirmwareError, load_firmware, run_firmware  # noqa: E402
from tvm_spinn.pe.firmware import MANIFEST, programs_of  # noqa: E402
from tvm_spinn.pe.jobs import descriptors, expand  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402
from _firmware_edits import rewrite_jobs, rewrite_manifest  # noqa: E402


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 24)
        self.fc2 = torch.nn.Linear(24, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc(x))) * 2.0 + 1.0


class _Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 4, 3, stride=2)
        self.fc = torch.nn.Linear(64, 5)

    def forward(self, x):
        h = torch.nn.functional.max_pool2d(torch.relu(self.c(x)), 2)
        h = torch.nn.functional.avg_pool2d(torch.relu(self.c2(torch.nn.functional.pad(h, (0, 1, 0, 1)))), 1)
        return self.fc(h.flatten(1))


class _Block(torch.nn.Module):
    """A pre-norm transformer block: layer norms, q/k/v, softmax attention, GELU MLP, residuals."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ln, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.f1, self.f2 = torch.nn.Linear(d, 32), torch.nn.Linear(32, d)

    def forward(self, x):
        h = self.ln(x)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) * 0.25, dim=-1) @ self.v(h)
        x = x + self.o(a)
        return x + self.f2(torch.nn.functional.gelu(self.f1(self.ln2(x))))


def _export(make, shape, directory):
    """Build ``make()`` (its weights from a fixed seed) for a spinn target and export its firmware."""
    torch.manual_seed(3)
    net = make()
    ex = relax.build(tvm_spinn.frontend.from_pytorch(net.eval(), (torch.randn(*shape),)), target="spinn")
    tvm_spinn.export_firmware(ex, directory)
    return programs_of(ex)


def _inputs(program, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal(program.tensors[t].shape).astype(np.float32) for t in program.inputs]
    x[0].reshape(-1)[:4] = [np.nan, -0.0, np.inf, 1e-40]  # NaN, -0.0, inf and a subnormal travel too
    return x


def _same_bits(a, b) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def _check_model(make, shape, tmp_path) -> dict:
    """Every region of the model run by the loader: the default simulator's and the iss mode's
    bits. Returns the manifest."""
    programs = _export(make, shape, tmp_path / "fw")
    for r, program in enumerate(programs):
        x = _inputs(program, r)
        got = run_firmware(tmp_path / "fw", x, region=r)
        assert _same_bits(got, run_program(program, x, mode="layers"))
        assert _same_bits(got, run_program(program, x, mode="iss"))
    return load_firmware(tmp_path / "fw")


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlp")
    programs = _export(_Mlp, (4, 16), d / "fw")
    return d / "fw", programs


def test_mlp_runs_from_the_directory_alone_in_a_fresh_process(mlp_dir, tmp_path):
    """A fresh process that imports only the loader runs the directory: the outputs are the
    default simulator's and the iss mode's bits, and the iss execution module is never imported."""
    directory, programs = mlp_dir
    x = _inputs(programs[0])
    np.save(tmp_path / "x.npy", x[0])
    code = ("import sys, numpy as np\n"
            "from tvm_spinn.pe.loader import run_firmware\n"
            f"y = run_firmware({str(directory)!r}, [np.load({str(tmp_path / 'x.npy')!r})])\n"
            f"np.save({str(tmp_path / 'y.npy')!r}, y[0])\n"
            "assert 'tvm_spinn.pe.execute' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = [np.load(tmp_path / "y.npy")]
    assert _same_bits(got, run_program(programs[0], x, mode="layers"))
    assert _same_bits(got, run_program(programs[0], x, mode="iss"))


def test_jobs_follow_the_manifest(mlp_dir):
    """Each job's image is its layer's, its PE one of the layer's; the per-PE tables list every
    job once in order; every dependency is an earlier job; a later layer's first job waits for
    the jobs that produced its input."""
    directory, _ = mlp_dir
    fw = load_firmware(directory)
    region, jobs = fw.manifest["regions"][0], fw.jobs[0]
    assert region["host"] == [] and len(jobs) == region["jobs"]["count"] > 0
    for job in jobs:
        layer = region["layers"][job["layer"]]
        assert job["image"] == layer["image"] and job["pe"] in layer["pes"]
        assert all(a <= b < job["id"] for a, b in job["after"])
    assert sorted(j for _, ids in region["pe_jobs"] for j in ids) == list(range(len(jobs)))
    by_layer = {}
    for job in jobs:
        by_layer.setdefault(job["layer"], []).append(job["id"])
    # a job of the second dense layer waits for jobs of the first (the ones that wrote its rows)
    first_of_1 = jobs[by_layer[1][0]]
    waits = {i for a, b in first_of_1["after"] for i in range(a, b + 1)}
    assert waits and waits <= set(by_layer[0])


def test_inputs_of_the_wrong_shape_or_count_are_named(mlp_dir):
    directory, programs = mlp_dir
    with pytest.raises(ValueError, match=r"takes 1 inputs, got 2"):
        run_firmware(directory, _inputs(programs[0]) * 2)
    with pytest.raises(ValueError, match=r"expected float32\[4, 16\], got float32\[16, 4\]"):
        run_firmware(directory, [np.zeros((16, 4), np.float32)])


@pytest.mark.slow
def test_small_cnn_conv_and_pools_from_the_directory(tmp_path):
    """conv2d (im2col panels as DMA descriptors, the padding as fill words), max and average
    pools (padded bands), a reshape (DMA descriptors placed in SRAM) and a dense layer."""
    fw = _check_model(_Cnn, (2, 3, 16, 16), tmp_path)
    kinds = {layer["kind"] for region in fw.manifest["regions"] for layer in region["layers"]}
    assert {"conv2d", "max_pool2d", "avg_pool2d"} <= kinds
    # the padding of the first convolution's im2col is fill words between descriptors
    conv = [job for job in fw.jobs[0] if job["layer"] == 0]
    assert any(part[0] == "fill" for job in conv for step in job["steps"] if step[0] == "put" for part in step[2])
    # another process exports the same bytes (job tables, DRAM image, manifest included)
    code = ("import sys; sys.path.insert(0, " + repr(str(__import__("pathlib").Path(__file__).parent)) + ")\n"
            "from test_firmware_loader import _Cnn, _export\n"
            f"_export(_Cnn, (2, 3, 16, 16), {str(tmp_path / 'again')!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "fw").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    assert all((tmp_path / "fw" / n).read_bytes() == (tmp_path / "again" / n).read_bytes() for n in names)


@pytest.mark.slow
def test_transformer_block_from_the_directory(tmp_path):
    """layer_norm and softmax (rows split over PEs: the statistics handed on through DRAM
    scratch), matmul, gelu, broadcasts, residual adds."""
    fw = _check_model(_Block, (1, 8, 16), tmp_path)
    region, jobs = fw.manifest["regions"][0], fw.jobs[0]
    lo, size = region["dram"]["scratch"]
    assert size > 0  # split rows hand their statistics on through DRAM
    handed = [job for job in jobs for step in job["steps"] if step[0] == "put" for part in step[2]
              if part[0] == "dram" and lo <= part[1] < lo + size]
    assert handed and all(job["after"] for job in handed)


def test_layer_left_to_the_host_is_named(tmp_path, monkeypatch):
    """A layer whose host work computes on its operands (the ``binary`` runner made to add one on
    the host) gets no job table: the manifest names it with its reason, the loader refuses the
    region naming the layer."""
    from tvm_spinn.pe import execute
    real = execute._RUNNERS["binary"]
    monkeypatch.setitem(execute._RUNNERS, "binary",
                        lambda run, index, env, table: real(run, index, _Mapped(env, lambda x: x + 1), table))
    programs = _export(_Mlp, (4, 16), tmp_path / "fw")
    region = load_firmware(tmp_path / "fw").manifest["regions"][0]
    assert region["host"] and all("a word the host computes from the data" in h["reason"] for h in region["host"])
    layer = region["layers"][region["host"][0]["layer"]]
    with pytest.raises(ValueError, match=rf"layer '{layer['name']}' \({layer['kind']}\) is left to the host: "
                                         r"placement \d+: a word the host computes"):
        run_firmware(tmp_path / "fw", _inputs(programs[0]))


@pytest.fixture(scope="module")
def mlp_images(mlp_dir):
    from tvm_spinn.pe.images import build_images
    program = mlp_dir[1][0]
    return program, build_images(program)


def _binary_layers(program, images) -> list:
    from tvm_spinn.pe.execute import program_role_kind
    return [i for i in range(len(program.layers)) if program_role_kind(images, i) == "binary"]


class _Mapped(dict):
    """A runner's tensors with ``f`` applied on the host to each one it reads."""

    def __init__(self, env, f):
        super().__init__()
        self.env, self.f = env, f

    def __contains__(self, tid) -> bool:
        return tid in self.env

    def __getitem__(self, tid):
        return self.f(self.env[tid]).astype(np.float32)


@pytest.mark.parametrize("name,f", [
    ("abs", np.abs), ("plus one", lambda x: x + 1), ("max with zero", lambda x: np.maximum(x, 0)),
    ("times two", lambda x: x * 2), ("negated", np.negative),
])
def test_host_arithmetic_on_the_operands_is_left_to_the_host(mlp_images, monkeypatch, name, f):
    """A runner that computes on its operands on the host (not a relayout) gets no job table: its
    layers are left to the host naming the computed words, never exported as a copy."""
    from tvm_spinn.pe import execute
    from tvm_spinn.pe.jobs import job_tables
    program, images = mlp_images
    binary = _binary_layers(program, images)
    real = execute._RUNNERS["binary"]
    assert binary and not {h["layer"] for h in job_tables(program, images)["host"]} & set(binary)
    monkeypatch.setitem(execute._RUNNERS, "binary",
                        lambda run, index, env, table: real(run, index, _Mapped(env, f), table))
    host = job_tables(program, images)["host"]
    assert [h["layer"] for h in host] == binary
    assert all("a word the host computes from the data" in h["reason"] for h in host)


def test_placement_before_any_load_is_left_to_the_host(mlp_images, monkeypatch):
    """A runner whose first placement comes before it loads an image: its layer is left to the host
    with that reason."""
    from tvm_spinn.pe import jobs
    program, images = mlp_images
    real = jobs._probe

    def unloaded(*args):
        trace, env, out = real(*args)
        trace.ops = [op for op in trace.ops if op[0] != "load"]
        return trace, env, out

    monkeypatch.setattr(jobs, "_probe", unloaded)
    host = jobs.job_tables(program, images)["host"]
    assert [h["layer"] for h in host] == list(range(len(program.layers)))
    assert all(h["reason"].startswith("a placement before any image load") for h in host)


def test_errors_outside_the_runners_propagate(mlp_images, monkeypatch):
    """Only a runner's refusal of the probe words leaves a layer to the host: an error in the job
    tables' own code propagates."""
    from tvm_spinn.pe import jobs
    program, images = mlp_images

    def broken(addr):
        raise IndexError("descriptors: out of range")

    monkeypatch.setattr(jobs, "descriptors", broken)
    with pytest.raises(IndexError, match="descriptors: out of range"):
        jobs.job_tables(program, images)


@pytest.mark.parametrize("addresses", [
    np.arange(12) * 4,  # contiguous
    (np.arange(5)[:, None] * 64 + np.arange(4)[None, :] * 16).T.reshape(-1) * 4,  # a transposed [k, 4] panel
    (np.arange(3)[:, None, None] * 100 + np.arange(3)[None, :, None] * 10 + np.arange(3)[None, None, :]).reshape(-1) * 4,
    np.array([0, 28, 8, 8, 8, 4, 100, 96, 92]) * 4,  # irregular: repeats and negative strides
    np.random.default_rng(1).integers(0, 1000, 50) * 4,
])
def test_descriptors_reproduce_the_addresses(addresses):
    descs = descriptors(addresses)
    got = np.concatenate([expand(d) for d in descs])
    assert np.array_equal(got, addresses)
    assert all(len(c) == 4 and len(s) == 4 for _, c, s in descs)


def test_panel_and_window_patterns_are_one_descriptor():
    """A [k, 4] panel of a transposed row-major operand and an im2col window (3x3 over a 10-wide
    plane, 2 channels) are each one four-dimensional descriptor."""
    k, rows = 5, 16
    panel = (np.arange(k)[:, None] + np.arange(4)[None, :] * rows).reshape(-1) * 4
    assert descriptors(panel) == [[0, [4, 5, 1, 1], [4 * rows, 4, 0, 0]]]
    window = (np.arange(2)[:, None, None] * 100 + np.arange(3)[None, :, None] * 10 + np.arange(3)[None, None, :])
    assert descriptors(window.reshape(-1) * 4) == [[0, [3, 3, 2, 1], [4, 40, 400, 0]]]


@pytest.fixture
def fresh_dir(mlp_dir, tmp_path):
    import shutil
    shutil.copytree(mlp_dir[0], tmp_path / "fw")
    return tmp_path / "fw"


def _step(doc, kind):
    for job in doc["jobs"]:
        for step in job["steps"]:
            if step[0] == kind:
                return step
    raise AssertionError(kind)


def _job_edits():
    def dram_part(doc):
        return next(p for p in _step(doc, "put")[2] if p[0] == "dram")
    return [
        (lambda d: d.update(version=1), r"fields format, version, region"),
        (lambda d: d["jobs"].pop(), r"field jobs: not a list of the manifest's \d+ jobs"),
        (lambda d: d["jobs"][1].update(id=0), r"field jobs\[1\]\.id: not 1"),
        (lambda d: d["jobs"][0].update(layer=99), r"field jobs\[0\]\.layer"),
        (lambda d: d["jobs"][0].update(pe=99999), r"field jobs\[0\]\.pe"),
        (lambda d: d["jobs"][0].update(image="nope"), r"field jobs\[0\]\.image"),
        (lambda d: d["jobs"][0].update(after=[[0, 0]]), r"field jobs\[0\]\.after: not ascending, disjoint ranges"),
        (lambda d: d["jobs"][-1].update(after=[[0, 2], [3, 4]]), r"field jobs\[\d+\]\.after: not ascending, disjoint"),
        (lambda d: _step(d, "put").__setitem__(1, 0), r"field jobs\[\d+\]\.steps\[\d+\]: SRAM .* outside the image's data area"),
        (lambda d: dram_part(d).__setitem__(1, 1 << 30), r"field jobs\[\d+\]\.steps\[\d+\]\[2\]\[\d+\]: addresses .* not word-aligned within"),
        (lambda d: dram_part(d).__setitem__(1, 2), r"not word-aligned"),
        (lambda d: dram_part(d)[2].__setitem__(0, 0), r"a descriptor is \[\"dram\", offset"),
        (lambda d: _step(d, "put")[2].append(["fill", -1, 1]), r"a fill is"),
        (lambda d: _step(d, "put")[2].append(["zap"]), r"not a dram, dram8, fill or bytes part"),
        (lambda d: _step(d, "run")[1][0].append(1 << 32), r"a run is"),
        (lambda d: _step(d, "get")[2][0].__setitem__(1, 0), r"field jobs\[\d+\]\.steps\[\d+\]\[2\]\[0\]: addresses"),
        (lambda d: _step(d, "get").__setitem__(0, "got"), r"not a put, remote, run, check or get step"),
        # a remote placement's size is bounded by the region's DRAM (it holds copies of tensors)
        (lambda d: d["jobs"][0]["steps"].append(["remote", [["fill", 0, 1 << 40]]]),
         r"field jobs\[0\]\.steps\[\d+\]\[1\]: \d+ bytes, more than the region's DRAM"),
        (lambda d: d["jobs"][0]["steps"].append(["remote", [["dram", 0, [1 << 16, 1 << 16, 1 << 8, 1], [0, 0, 0, 0]]]]),
         r"field jobs\[0\]\.steps\[\d+\]\[1\]: \d+ bytes, more than the region's DRAM"),
    ]


@pytest.mark.parametrize("edit,field", _job_edits())
def test_corrupted_job_file_is_named(fresh_dir, edit, field):
    """A job file whose fields are malformed, point outside the image's SRAM or the region's
    DRAM, or contradict the manifest: one FirmwareError naming the job file and the field."""
    rewrite_jobs(fresh_dir, edit)
    with pytest.raises(FirmwareError, match=field) as err:
        load_firmware(fresh_dir)
    assert err.value.path == str(fresh_dir / "r0.jobs.json")


@pytest.mark.parametrize("edit,field", [
    (lambda m: m["regions"][0]["dram"].update(file="nope.dram"), r"field regions\[0\]\.dram\.file"),
    (lambda m: m["regions"][0]["dram"].update(init_bytes=4), r"field regions\[0\]\.dram\.init_bytes"),
    (lambda m: m["regions"][0]["dram"].update(scratch=[0, 1 << 40]), r"field regions\[0\]\.dram\.scratch"),
    (lambda m: m["regions"][0]["dram"]["tensors"][0].update(bytes=3), r"field regions\[0\]\.dram\.tensors\[0\]\.bytes"),
    (lambda m: m["regions"][0]["dram"]["tensors"][0].update(dtype="float99"),
     r"field regions\[0\]\.dram\.tensors\[0\]\.dtype: not a numeric dtype name"),
    (lambda m: m["regions"][0]["dram"]["tensors"][1].update(offset=m["regions"][0]["dram"]["tensors"][0]["offset"]),
     r"field regions\[0\]\.dram\.tensors\[\d\]: overlaps|field regions\[0\]\.dram\.tensors\[1\]\.role"),
    *[(lambda m, name=name: m["regions"][0]["dram"]["tensors"][0].update(dtype=name),
       r"field regions\[0\]\.dram\.tensors\[0\]\.dtype: not a numeric dtype name")
      for name in ("object", "void", "bytes0", "str160", "complex64")],
    (lambda m: m["regions"][0]["dram"].update(inputs=[12345]), r"field regions\[0\]\.dram\.inputs"),
    (lambda m: m["regions"][0].update(jobs={"file": "r0.jobs.json"}), r"field regions\[0\]\.jobs: needs"),
    (lambda m: m["regions"][0]["pe_jobs"][0][1].append(10 ** 6), r"field regions\[0\]\.pe_jobs"),
    (lambda m: m["regions"][0].update(host=[{"layer": 99, "reason": "x"}]), r"field regions\[0\]\.host"),
    (lambda m: m["regions"][0].update(arch=[]), r"field regions\[0\]\.arch: missing"),
    (lambda m: m["regions"][0]["arch"].update(acc_bits=32), r"field regions\[0\]\.arch: differs from the system"),
])
def test_corrupted_placement_field_is_named(fresh_dir, edit, field):
    rewrite_manifest(fresh_dir, edit)
    with pytest.raises(FirmwareError, match=rf"{MANIFEST}: {field}") as err:
        load_firmware(fresh_dir)
    assert err.value.path == str(fresh_dir / MANIFEST)


@pytest.mark.slow
def test_zoo_resnet_from_the_directory(tmp_path):
    """The zoo's ResNet (convolutions, folded BatchNorm, pooling, residual adds): every layer has a
    job table and the loader gives the default simulator's bits."""
    pytest.importorskip("transformers")
    from test_zoo import ZOO
    torch.manual_seed(0)
    model, x = ZOO["resnet"]()
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model.eval(), (x,)), target="spinn")
    fw = tvm_spinn.export_firmware(ex, tmp_path / "fw")
    for r, program in enumerate(programs_of(ex)):
        assert fw.manifest["regions"][r]["host"] == []
        xs = _inputs(program, r)
        assert _same_bits(run_firmware(tmp_path / "fw", xs, region=r), run_program(program, xs, mode="layers"))
