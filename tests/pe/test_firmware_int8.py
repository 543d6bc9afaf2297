"""Firmware of layers that read or write 1-byte and 32-bit integer tensors: quantized models
(``tvm_spinn.quantize``'d MLP and CNN, TFLite's int8 CNN) and an embedding lookup run from the
firmware directory alone with the default simulator's and the ``iss`` mode's bits; words the
host derives from the constants alone (an int8 GEMM's weight column sums) are literal bytes in
the job file; host arithmetic on int8 data (a sign-bit flip) is never exported as a copy; the
new job-file fields are checked on reading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tvm import relax

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

import tvm_spinn  # noqa: E402
from tvm_spinn.pe import FirmwareError, load_firmware, run_firmware  # noqa: E402
from tvm_spinn.pe.firmware import programs_of  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402
from _firmware_edits import rewrite_jobs  # noqa: E402

import models  # noqa: E402


def _inputs(program, seed: int = 0) -> list:
    """Random inputs of the program's dtypes: float32 with NaN, -0.0, inf and a subnormal; every
    value of an integer type."""
    rng = np.random.default_rng(seed)
    out = []
    for t in program.inputs:
        spec = program.tensors[t]
        if np.dtype(spec.dtype).kind == "f":
            x = rng.standard_normal(spec.shape).astype(spec.dtype)
            x.reshape(-1)[:4] = [np.nan, -0.0, np.inf, 1e-40]
        else:
            info = np.iinfo(spec.dtype)
            x = rng.integers(info.min, info.max + 1, spec.shape).astype(spec.dtype)
        out.append(x)
    return out


def _same_bits(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def _check(ex, directory, inputs=_inputs) -> dict:
    """Export ``ex``; every region run from the directory has the default simulator's and the
    iss mode's bits. Returns the manifest."""
    fw = tvm_spinn.export_firmware(ex, directory)
    for r, program in enumerate(programs_of(ex)):
        assert fw.manifest["regions"][r]["host"] == []
        x = inputs(program, r)
        got = run_firmware(directory, x, region=r)
        assert _same_bits(got, run_program(program, x, mode="layers"))
        assert _same_bits(got, run_program(program, x, mode="iss"))
    return fw.manifest


def _quantized(name: str):
    model, x = models.make(name)
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    mod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    return relax.build(mod, target="spinn")


@pytest.fixture(scope="module")
def qmlp(tmp_path_factory):
    d = tmp_path_factory.mktemp("qmlp") / "fw"
    ex = _quantized("mlp")
    return ex, d, _check(ex, d)


def test_quantized_mlp_runs_from_the_directory(qmlp):
    """quantize, int8 dense (int8 and float32 outputs), softmax: no layer left to the host."""
    _, _, manifest = qmlp
    modes = {layer["mode"] for layer in manifest["regions"][0]["layers"]}
    assert "int8" in modes


def test_int8_operands_are_byte_descriptors(qmlp):
    """The int8 GEMMs' operands come from DRAM by byte descriptors (``dram8``) inside the
    weights' and the activations' tensors; their results go out the same way."""
    ex, d, manifest = qmlp
    region = manifest["regions"][0]
    jobs = load_firmware(d).jobs[0]
    tensors = {t["id"]: t for t in region["dram"]["tensors"]}
    program = programs_of(ex)[0]
    for i, layer in enumerate(region["layers"]):
        if layer["mode"] != "int8":
            continue
        w = tensors[program.layers[i].consts["weight"]]
        parts = [p for job in jobs if job["layer"] == i for s in job["steps"] if s[0] == "put" for p in s[2]]
        in_weights = [p for p in parts if p[0] == "dram8" and w["offset"] <= p[1] < w["offset"] + w["bytes"]]
        assert in_weights, layer["name"]
        gets = [p for job in jobs if job["layer"] == i for s in job["steps"] if s[0] == "get" for p in s[2]]
        assert gets and all(p[0] == "dram8" for p in gets)


def test_column_sums_are_literal_words(tmp_path):
    """An int8 dense whose input zero point is not 0 needs its weights' column sums: the host
    computes them from the constants alone, so the job file holds them as literal words (equal
    to the sums of the weights' columns, computed here independently), and the layer runs."""
    ex = _quantized("mlp")
    program = programs_of(ex)[0]
    dense = [i for i, layer in enumerate(program.layers) if layer.kind == "dense" and layer.attrs.get("x_zero")]
    assert dense
    manifest = _check(ex, tmp_path / "fw")
    jobs = load_firmware(tmp_path / "fw").jobs[0]
    for i in dense:
        w = np.asarray(program.constants[program.layers[i].consts["weight"]]).astype(np.int64)
        sums = {int(v) for v in w.sum(axis=0)} | {int(v) for v in w.sum(axis=1)}
        literal = [np.frombuffer(bytes.fromhex(p[1]), "<i4") for job in jobs if job["layer"] == i
                   for s in job["steps"] if s[0] == "put" for p in s[2] if p[0] == "bytes" and len(p[1]) % 8 == 0]
        words = {int(v) for x in literal for v in x}
        assert sums & words, manifest["regions"][0]["layers"][i]["name"]


@pytest.mark.slow  # ~50 s on 2 busy cores: the CNN's tiles in the ISS three times
def test_quantized_cnn_runs_from_the_directory(tmp_path):
    _check(_quantized("cnn"), tmp_path / "fw")


@pytest.mark.slow  # ~80 s on 2 busy cores: TensorFlow's converter, then the model three times
def test_tflite_int8_cnn_runs_from_the_directory(tmp_path):
    """TFLite's int8 CNN (int8 input and outputs; convolutions, depthwise, pools, concat, mean,
    softmax): no layer left to the host."""
    pytest.importorskip("tensorflow")
    import tflite_models as tm
    from tvm_spinn.frontend.tflite import from_tflite, keras_to_tflite
    mod = from_tflite(keras_to_tflite(tm.cnn(), quantize=tm.calibration((16, 16, 3))))
    _check(relax.build(mod, target="spinn"), tmp_path / "fw")


class _Emb(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(10, 8)

    def forward(self, i):
        return self.e(i) * 2.0


@pytest.fixture(scope="module")
def emb(tmp_path_factory):
    torch.manual_seed(0)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(_Emb().eval(), (torch.tensor([[1, 2, 3]]),)), target="spinn")
    d = tmp_path_factory.mktemp("emb") / "fw"
    def ids(program, seed):  # indices within the table
        shape = program.tensors[program.inputs[0]].shape
        return [np.random.default_rng(seed).integers(0, 10, shape).astype(np.int32)]

    return ex, d, _check(ex, d, ids)


def test_embedding_runs_from_the_directory(emb):
    """take (the PE reads the indices and drives its DMA over the table's rows): a ``check``
    step reads the kernel's status words."""
    _, d, manifest = emb
    jobs = load_firmware(d).jobs[0]
    take = [i for i, layer in enumerate(manifest["regions"][0]["layers"]) if layer["kind"] == "take"]
    assert take and all(any(s[0] == "check" for s in job["steps"]) for job in jobs if job["layer"] in take)


def test_embedding_index_out_of_range_is_refused(emb):
    """An index past the table: the loader's check step raises, naming the layer and the index."""
    _, d, _ = emb
    with pytest.raises(IndexError, match=r"layer 'take_0' \(take\): input value 10 is out of range"):
        run_firmware(d, [np.array([1, 10, 3], np.int32)])


def test_sign_flip_of_int8_operands_is_left_to_the_host(qmlp, monkeypatch):
    """A runner that flips the sign bit of its int8 activation on the host (``x ^ 0x80``: what
    a uint8 operand's conversion does) is not a relayout: its layers are left to the host."""
    from tvm_spinn.pe import execute
    from tvm_spinn.pe.images import build_images
    from tvm_spinn.pe.jobs import job_tables
    ex, _, _ = qmlp
    program = programs_of(ex)[0]
    images = build_images(program)
    gemm = [i for i in range(len(program.layers)) if execute.program_role_kind(images, i) == "gemm_i8"]
    assert gemm and not {h["layer"] for h in job_tables(program, images)["host"]} & set(gemm)
    real = execute._RUNNERS["gemm_i8"]

    class Flipped(dict):
        def __init__(self, env, flip):
            super().__init__()
            self.env, self.flip = env, flip

        def __contains__(self, tid):
            return tid in self.env

        def __getitem__(self, tid):
            x = self.env[tid]
            return x ^ np.int8(-128) if tid in self.flip else x

        def get(self, tid, default=None):
            return self[tid]

    def runner(run, index, env, table):
        return real(run, index, Flipped(env, {program.layers[index].inputs[0]}), table)

    monkeypatch.setitem(execute._RUNNERS, "gemm_i8", runner)
    host = job_tables(program, images)["host"]
    assert [h["layer"] for h in host] == gemm
    assert all("computes from the data" in h["reason"] for h in host)


def _step(doc, kind):
    for job in doc["jobs"]:
        for step in job["steps"]:
            if step[0] == kind:
                return step
    raise AssertionError(kind)


def _dram8(doc, kind="put"):
    return next(p for p in _step(doc, kind)[2] if p[0] == "dram8")


@pytest.fixture
def fresh_qdir(qmlp, tmp_path):
    import shutil
    _, d, _ = qmlp
    shutil.copytree(d, tmp_path / "fw")
    return tmp_path / "fw"


@pytest.mark.parametrize("edit,field", [
    (lambda d: _dram8(d)[2].__setitem__(0, 0), r"a descriptor is \[\"dram8\", offset"),
    (lambda d: _dram8(d).__setitem__(1, 1 << 30),
     r"field jobs\[\d+\]\.steps\[\d+\]\[2\]\[\d+\]: addresses .* not within"),
    (lambda d: _dram8(d).__setitem__(1, -1), r"addresses \[-1, .* not within"),
    (lambda d: _dram8(d, "get").__setitem__(1, 0),
     r"field jobs\[\d+\]\.steps\[\d+\]\[2\]\[0\]: addresses .* not within"),
    (lambda d: _dram8(d)[3].pop(), r"a descriptor is \[\"dram8\""),
    (lambda d: d["jobs"][0]["steps"].append(["check", 0]), r"a check is \[\"check\", address\]"),
    (lambda d: d["jobs"][0]["steps"].append(["check"]), r"a check is"),
])
def test_corrupted_byte_fields_are_named(fresh_qdir, edit, field):
    """A byte descriptor or a check step that is malformed or points outside the region's DRAM
    (a get's: inside the constants) or the image's SRAM: one FirmwareError naming the job file."""
    rewrite_jobs(fresh_qdir, edit)
    with pytest.raises(FirmwareError, match=field) as err:
        load_firmware(fresh_qdir)
    assert err.value.path == str(fresh_qdir / "r0.jobs.json")


def test_job_file_declares_the_byte_format(qmlp):
    _, d, _ = qmlp
    doc = json.loads((d / "r0.jobs.json").read_text())
    assert doc["version"] == 3 and any(p[0] == "dram8" for job in doc["jobs"] for s in job["steps"]
                                       if s[0] in ("put", "get") for p in s[2])


def test_quantized_mlp_and_embedding_run_concurrently_over_the_noc(qmlp, emb, tmp_path):
    """The concurrent NoC run follows the byte placements, byte scatters and ``check`` steps too:
    the same bits as the sequential replay; a bad index raises there as well."""
    from tvm_spinn.pe.multi import run_firmware_concurrent

    for name, (ex, d, _), make in (("qmlp", qmlp, _inputs), ("emb", emb, None)):
        noc = tmp_path / name
        tvm_spinn.export_firmware(ex, noc, noc=True)
        for r, program in enumerate(programs_of(ex)):
            shape = program.tensors[program.inputs[0]].shape
            x = _inputs(program, r) if make else [np.array([1, 0, 3], np.int32).reshape(shape)]
            got = run_firmware_concurrent(noc, x, region=r).outputs
            assert _same_bits(got, run_firmware(d, x, region=r))
    with pytest.raises(IndexError, match=r"input value 10 is out of range"):
        run_firmware_concurrent(tmp_path / "emb", [np.array([1, 10, 3], np.int32)])
