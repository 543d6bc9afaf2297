"""PEs that place their own operands: a firmware exported with ``self_dma`` runs with every PE
walking its command table with its DMA engine (:mod:`tvm_spinn.pe.selfdma`, :mod:`tvm_spinn.pe.walker`). Its outputs are the
default simulator's bits and the host-driven run's on the same directory; the default export is
unchanged; a corrupted command table or ``self_dma`` field is one FirmwareError naming the file
and the job; a fault on the walker's DMA path is an IssFault naming the PE, the image and the
program counter."""

from __future__ import annotations

import hashlib
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
from tvm_spinn.pe import FirmwareError, IssFault, load_firmware, run_firmware  # noqa: E402
from tvm_spinn.pe.firmware import Firmware, build_firmware, programs_of  # noqa: E402
from tvm_spinn.pe.iss import image_symbols  # noqa: E402
from tvm_spinn.pe.memory_map import DMA_SCATTER, DRAM_BASE  # noqa: E402
from tvm_spinn.pe.loader import run_self_dma  # noqa: E402
from tvm_spinn.pe.selfdma import encode_region  # noqa: E402
from tvm_spinn.pe.walker import (ENTRY_WORDS, OP_BOOT, OP_CHECK, OP_DMA, OP_JOB, OP_NOTIFY, OP_RUN, OP_WAIT,  # noqa: E402
                                 SELF_DMA_HALT, SELF_DMA_ROUTINE, SLOTS_ADDR, walker_span)
from tvm_spinn.runtime.simulator import run_program  # noqa: E402
from _firmware_edits import rewrite_manifest  # noqa: E402
from test_firmware_loader import _Block, _Cnn, _inputs, _Mlp, _same_bits  # noqa: E402


def _build(make, shape):
    torch.manual_seed(3)
    return relax.build(tvm_spinn.frontend.from_pytorch(make().eval(), (torch.randn(*shape),)), target="spinn")


def _check(ex, directory, inputs=_inputs):
    """Export ``ex`` with ``self_dma``; every region walked by its PEs gives the default
    simulator's bits and the host-driven run's; the run's host actions are fewer than the
    host-driven run's steps. Returns the loaded firmware and the runs."""
    tvm_spinn.export_firmware(ex, directory, self_dma=True)
    fw = load_firmware(directory)
    runs = []
    for r, program in enumerate(programs_of(ex)):
        x = inputs(program, r)
        run = run_self_dma(fw, r, x)
        assert _same_bits(run.outputs, run_program(program, x, mode="layers"))
        assert _same_bits(run.outputs, run_firmware(directory, x, region=r, self_dma=False))
        assert _same_bits(run.outputs, run_firmware(directory, x, region=r))  # the walker: the manifest says so
        host_steps = sum(1 + len(job["steps"]) for job in fw.jobs[r])  # an image load and each step
        assert run.host_actions < host_steps
        assert sorted(j for _, seg in run.segments for j in seg) == list(range(len(fw.jobs[r])))
        runs.append(run)
    return fw, runs


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    d = tmp_path_factory.mktemp("sdma") / "fw"
    ex = _build(_Mlp, (4, 16))
    fw, runs = _check(ex, d)
    return ex, d, fw, runs


def _before(fw, j: int) -> list:
    """The jobs job ``j``'s PE runs before it."""
    ids = next(ids for pe, ids in fw.manifest["regions"][0]["pe_jobs"] if j in ids)
    return ids[:ids.index(j)]


def test_mlp_walks_its_own_jobs(mlp):
    """Every transfer of the job table is one DMA command of the walker, every run one kernel
    call; each job's commands start with its OP_JOB."""
    _, _, fw, runs = mlp
    rec = fw.manifest["regions"][0]["self_dma"]
    rows = np.frombuffer(fw.files[rec["file"]], dtype="<u4", count=rec["entries"] * ENTRY_WORDS).reshape(-1, ENTRY_WORDS)
    for j, job in enumerate(fw.jobs[0]):
        first, n = rec["jobs"][j]
        ops = rows[first:first + n, 0].tolist()
        assert ops[0] == OP_JOB and rows[first, 1] == j
        puts = sum(len(s[2]) for s in job["steps"] if s[0] in ("put", "get")) + sum(
            len(s[1]) for s in job["steps"] if s[0] == "remote")
        # a job whose PE ran another image before boots its own: the vector table and the slots,
        # then the code after the walker (the images have no .bss)
        assert ops.count(OP_BOOT) == int(any(job["image"] != fw.jobs[0][i]["image"] for i in _before(fw, j)[-1:]))
        assert ops.count(OP_DMA) == puts + 2 * ops.count(OP_BOOT)
        assert ops.count(OP_RUN) == sum(len(s[1]) for s in job["steps"] if s[0] == "run")
        # a get scatters from SRAM into DRAM; a put gathers from DRAM (or the pool) into SRAM
        for row in rows[first:first + n]:
            if row[0] == OP_DMA and row[3] & DMA_SCATTER:
                assert row[2] >= DRAM_BASE and row[1] < DRAM_BASE
    assert runs[0].transfers == int((rows[:, 0] == OP_DMA).sum())
    assert runs[0].walker_cycles > 0 and runs[0].transfer_cycles > 0


def test_default_export_is_unchanged_and_walker_is_shared(mlp, tmp_path):
    """Without ``self_dma`` the firmware has no command tables nor the walker; with it, every
    image holds the walker's slots at SLOTS_ADDR and the same walker code after them, at the
    same addresses, so a PE can load another image under its running walker."""
    import io

    from elftools.elf.elffile import ELFFile
    ex, _, fw, _ = mlp
    plain = build_firmware(programs_of(ex))
    assert not any(name.endswith(".sdma") for name in plain.files)
    assert all("self_dma" not in region for region in plain.manifest["regions"])
    codes = set()
    for name, rec in fw.manifest["images"].items():
        elf = fw.files[rec["file"]]
        own, base = image_symbols(elf), image_symbols(plain.files[rec["file"]])
        assert SELF_DMA_ROUTINE in own and SELF_DMA_ROUTINE not in base
        lo, hi = walker_span(elf)
        assert lo == SLOTS_ADDR and lo < own[SELF_DMA_ROUTINE] < hi and lo < own[SELF_DMA_HALT] < hi
        assert own["pe_kernel"] >= hi and own["pe_halt"] >= hi
        data = [s for s in ELFFile(io.BytesIO(elf)).iter_segments() if s["p_type"] == "PT_LOAD"][0].data()
        assert int.from_bytes(data[SLOTS_ADDR:SLOTS_ADDR + 4], "little") & ~1 == own["pe_kernel"]
        codes.add((own[SELF_DMA_ROUTINE], data[SLOTS_ADDR + 12:hi]))
    assert len(codes) == 1


def test_export_is_deterministic(mlp):
    ex, d, fw, _ = mlp
    again = build_firmware(programs_of(ex), self_dma=True)
    assert again.files == fw.files and again.manifest == fw.manifest


@pytest.mark.slow  # ~40 s on 2 busy cores: the CNN built, exported and run three ways
def test_small_cnn_walks_its_own_jobs(tmp_path):
    """conv2d (im2col with fill words from the table's pool), pools, a reshape (a DMA kernel:
    its remote window assembled by the walker) and a dense layer."""
    fw, _ = _check(_build(_Cnn, (2, 3, 16, 16)), tmp_path / "fw")
    steps = {s[0] for job in fw.jobs[0] for s in job["steps"]}
    parts = {p[0] for job in fw.jobs[0] for s in job["steps"] if s[0] == "put" for p in s[2]}
    assert {"put", "run", "get"} <= steps and {"dram", "fill", "bytes"} <= parts


def test_mlp_pes_walk_concurrently_over_the_noc(tmp_path):
    """With the NoC driver every PE is started once: its walker loads each job's image itself,
    waits for the ready packets of the jobs each job names and sends its own; the outputs are
    the default simulator's bits and the host-driven concurrent run's, with the same packets."""
    from tvm_spinn.pe.multi import run_firmware_concurrent
    ex = _build(_Mlp, (4, 16))
    tvm_spinn.export_firmware(ex, tmp_path / "fw", self_dma=True, noc=True)
    tvm_spinn.export_firmware(ex, tmp_path / "host", noc=True)
    fw = load_firmware(tmp_path / "fw")
    program = programs_of(ex)[0]
    x = _inputs(program)
    run = run_self_dma(fw, 0, x)
    host = run_firmware_concurrent(tmp_path / "host", x)
    assert _same_bits(run.outputs, run_program(program, x, mode="layers"))
    assert _same_bits(run.outputs, host.outputs) and run.packets == host.packets
    region = fw.manifest["regions"][0]
    assert region["self_dma"]["noc"]
    assert sorted(tuple(seg) for _, seg in run.segments) == sorted(tuple(ids) for _, ids in region["pe_jobs"])
    assert run.host_actions == 3 * len(region["pe_jobs"]) and run.boots > 0
    rows = np.frombuffer(fw.files["r0.sdma"], dtype="<u4", count=region["self_dma"]["entries"] * ENTRY_WORDS)
    ops = rows.reshape(-1, ENTRY_WORDS)[:, 0]
    assert (ops == OP_WAIT).any() and (ops == OP_NOTIFY).any()
    with pytest.raises(ValueError, match="no command table"):
        run_firmware(tmp_path / "host", x, self_dma=True)


@pytest.mark.slow  # ~4 min on 2 busy cores: the block run three ways and concurrently
def test_transformer_block_walks_its_own_jobs(tmp_path):
    """Split rows hand their statistics on through DRAM scratch; a PE runs consecutive jobs of
    one image back to back."""
    ex = _build(_Block, (1, 8, 16))
    fw, runs = _check(ex, tmp_path / "fw")
    assert any(len(seg) > 1 for _, seg in runs[0].segments) and runs[0].boots > 0
    assert fw.manifest["regions"][0]["dram"]["scratch"][1] > 0
    # every PE started once, its jobs' order kept by ready packets: the same bits
    tvm_spinn.export_firmware(ex, tmp_path / "noc", self_dma=True, noc=True)
    x = _inputs(programs_of(ex)[0])
    run = run_self_dma(load_firmware(tmp_path / "noc"), 0, x)
    assert _same_bits(run.outputs, run_program(programs_of(ex)[0], x, mode="layers"))
    assert len(run.segments) == len(fw.manifest["regions"][0]["pe_jobs"])


def test_quantized_mlp_walks_its_own_jobs(tmp_path):
    """int8 GEMMs (byte descriptors, the MAC array in flight from one run into the next),
    quantize and dequantize."""
    import models
    from test_firmware_int8 import _inputs as int_inputs
    model, x = models.make("mlp")
    mod = tvm_spinn.frontend.from_pytorch(model, (x,))
    rng = np.random.default_rng(0)
    mod = tvm_spinn.quantize(mod, [rng.normal(size=x.shape).astype("float32") for _ in range(4)])
    fw, _ = _check(relax.build(mod, target="spinn"), tmp_path / "fw", int_inputs)
    parts = {p[0] for job in fw.jobs[0] for s in job["steps"] if s[0] in ("put", "get") for p in s[2]}
    assert "dram8" in parts


def test_embedding_check_stops_the_walk(tmp_path):
    """take's status words (an OP_CHECK): an index in range gives the simulator's bits, one past
    the table stops the walk and is named with the layer and the value."""
    from test_firmware_int8 import _Emb
    torch.manual_seed(0)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(_Emb().eval(), (torch.tensor([[1, 2, 3]]),)), target="spinn")

    def ids(program, seed):
        shape = program.tensors[program.inputs[0]].shape
        return [np.random.default_rng(seed).integers(0, 10, shape).astype(np.int32)]

    fw, _ = _check(ex, tmp_path / "fw", ids)
    rec = fw.manifest["regions"][0]["self_dma"]
    rows = np.frombuffer(fw.files[rec["file"]], dtype="<u4", count=rec["entries"] * ENTRY_WORDS).reshape(-1, ENTRY_WORDS)
    assert (rows[:, 0] == OP_CHECK).any()
    with pytest.raises(IndexError, match=r"layer 'take_0' \(take\): input value 10 is out of range"):
        run_firmware(tmp_path / "fw", [np.array([1, 10, 3], np.int32)])


# -- refusals ----------------------------------------------------------------------------------
@pytest.fixture
def fresh(mlp, tmp_path):
    _, d, _, _ = mlp
    out = tmp_path / "fw"
    out.mkdir()
    for p in d.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    return out


def _rewrite_table(directory, edit) -> None:
    """Edit ``r0.sdma``'s commands (``edit(rows)``), its size and hash updated in the manifest."""
    path = directory / "r0.sdma"
    data = bytearray(path.read_bytes())
    rows = np.frombuffer(data, dtype="<u4", count=len(data) // 4 // ENTRY_WORDS * ENTRY_WORDS).reshape(-1, ENTRY_WORDS)
    edit(rows)
    path.write_bytes(bytes(data))
    rewrite_manifest(directory, lambda m: m["files"]["r0.sdma"].update(
        bytes=len(data), sha256=hashlib.sha256(bytes(data)).hexdigest()))


def test_corrupted_command_table_names_the_file_and_job(fresh):
    """A command table that is not the job file's steps (its hash consistent) names the table
    file and the first job whose commands differ."""
    rec = load_firmware(fresh).manifest["regions"][0]["self_dma"]
    first, _ = rec["jobs"][5]

    def edit(rows):
        rows[first + 1, 2] += 4  # job 5's first transfer lands one word further on

    _rewrite_table(fresh, edit)
    with pytest.raises(FirmwareError, match=r"r0\.sdma: differs from the job file's steps at job 5 "):
        load_firmware(fresh)


def test_table_file_changed_behind_the_manifest_is_named(fresh):
    data = bytearray((fresh / "r0.sdma").read_bytes())
    data[100] ^= 1
    (fresh / "r0.sdma").write_bytes(bytes(data))
    with pytest.raises(FirmwareError, match=r"r0\.sdma: SHA-256 differs"):
        load_firmware(fresh)


_FIELD = r"manifest\.json: field regions\[0\]\.self_dma"


@pytest.mark.parametrize("edit,message", [
    (lambda r: r["self_dma"]["jobs"].__setitem__(3, [0, 1]), _FIELD + r"\.jobs\[3\]: not job 3's commands"),
    (lambda r: r["self_dma"].update(entries=r["self_dma"]["entries"] + 1), _FIELD + r"\.entries: "),
    (lambda r: r["self_dma"].update(dram_base=0), _FIELD + ": malformed"),
    (lambda r: r["self_dma"].pop("table"), _FIELD + ": malformed"),
    (lambda r: r.update(self_dma=[]), _FIELD + ": malformed"),
])
def test_corrupted_self_dma_field_is_named(fresh, edit, message):
    rewrite_manifest(fresh, lambda m: edit(m["regions"][0]))
    with pytest.raises(FirmwareError, match=message):
        load_firmware(fresh)


def _plain_image(ex, fw, name: str) -> tuple:
    """Image ``name`` of ``ex``'s firmware exported without ``self_dma`` (no walker): its bytes
    and its manifest record."""
    plain = build_firmware(programs_of(ex))
    rec = plain.manifest["images"][name]
    assert rec["file"] == fw.manifest["images"][name]["file"]
    return plain.files[rec["file"]], rec


def test_image_without_the_walker_is_named(mlp, fresh):
    """A self-DMA region whose job runs an image linked without the walker (its file, size,
    hash and symbols consistent) is one FirmwareError naming the manifest's field and the image."""
    ex, _, fw, _ = mlp
    name = fw.jobs[0][0]["image"]
    elf, rec = _plain_image(ex, fw, name)
    (fresh / rec["file"]).write_bytes(elf)

    def edit(m):
        m["images"][name] = rec
        m["files"][rec["file"]].update(bytes=len(elf), sha256=hashlib.sha256(elf).hexdigest())

    rewrite_manifest(fresh, edit)
    with pytest.raises(FirmwareError, match=_FIELD + rf": image '{name}': no job-table walker: not linked by "
                       "link_self_dma_image"):
        load_firmware(fresh)


def test_images_no_job_runs_need_no_walker(mlp):
    """The command table reads only the images the region's jobs run: an extra image without the
    walker leaves it as it is."""
    ex, _, fw, _ = mlp
    region = fw.manifest["regions"][0]
    images = {n: fw.files[rec["file"]] for n, rec in fw.manifest["images"].items()}
    name = fw.jobs[0][0]["image"]
    extra, _ = _plain_image(ex, fw, name)
    args = (fw.jobs[0], region["pe_jobs"], images, region["dram"]["bytes"])
    with_extra = encode_region(fw.jobs[0], region["pe_jobs"], {**images, "~unused": extra}, region["dram"]["bytes"])
    assert with_extra == encode_region(*args)
    assert with_extra["data"] == fw.files[region["self_dma"]["file"]]
    with pytest.raises(ValueError, match=rf"image '{name}': no job-table walker"):
        encode_region(fw.jobs[0], region["pe_jobs"], {**images, name: extra}, region["dram"]["bytes"])
    with pytest.raises(ValueError, match="no job-table walker"):
        walker_span(extra)


def test_walker_path_needs_a_command_table(mlp, tmp_path):
    ex, _, _, _ = mlp
    tvm_spinn.export_firmware(ex, tmp_path / "plain")
    x = _inputs(programs_of(ex)[0])
    with pytest.raises(ValueError, match="region 0 has no command table"):
        run_firmware(tmp_path / "plain", x, self_dma=True)


def _with_rows(fw, edit) -> Firmware:
    """``fw`` with its command table's rows edited in memory (past the directory's checks)."""
    rec = fw.manifest["regions"][0]["self_dma"]
    data = bytearray(fw.files[rec["file"]])
    edit(np.frombuffer(data, dtype="<u4", count=rec["entries"] * ENTRY_WORDS).reshape(-1, ENTRY_WORDS))
    return Firmware(files={**fw.files, rec["file"]: bytes(data)}, manifest=fw.manifest, jobs=fw.jobs)


def test_dma_fault_names_pe_image_and_pc(mlp):
    """A transfer reading outside mapped memory faults in the engine: the IssFault names the PE,
    the image and a program counter in the walker's transfer routine."""
    ex, _, fw, _ = mlp
    rec = fw.manifest["regions"][0]["self_dma"]
    first, n = rec["jobs"][0]
    job = fw.jobs[0][0]

    def edit(rows):
        dma = first + 1 + int(np.argmax(rows[first + 1:first + n, 0] == OP_DMA))
        rows[dma, 1] = 0x7000_0000  # unmapped

    x = _inputs(programs_of(ex)[0])
    with pytest.raises(IssFault) as err:
        run_self_dma(_with_rows(fw, edit), 0, x)
    e = err.value
    assert e.pe == job["pe"] and e.image == job["image"] and "DMA transfer" in str(e)
    elf = fw.files[fw.manifest["images"][job["image"]]["file"]]
    symbols = image_symbols(elf)
    assert symbols["sdma_transfer"] <= e.pc < symbols["sdma_transfer"] + 0x100


def test_unknown_command_is_a_trap_naming_pe_image_and_pc(mlp):
    ex, _, fw, _ = mlp
    rec = fw.manifest["regions"][0]["self_dma"]
    first, _ = rec["jobs"][0]
    job = fw.jobs[0][0]

    def edit(rows):
        rows[first, 0] = 99

    with pytest.raises(IssFault) as err:
        run_self_dma(_with_rows(fw, edit), 0, _inputs(programs_of(ex)[0]))
    e = err.value
    symbols = image_symbols(fw.files[fw.manifest["images"][job["image"]]["file"]])
    assert e.pe == job["pe"] and e.image == job["image"] and "emulation fault" in str(e)
    assert symbols[SELF_DMA_ROUTINE] <= e.pc < symbols[SELF_DMA_ROUTINE] + 0x400


def test_cli_compile_self_dma_firmware(tmp_path):
    """``tvm-spinn compile --firmware DIR --self-dma`` writes the command tables; ``--self-dma``
    alone is refused before anything is written."""
    from tvm_spinn import cli
    torch.manual_seed(3)
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval(), (torch.randn(4, 16),),
                      str(onnx_path), dynamo=False, input_names=["x"], output_names=["y"])
    assert cli.main(["compile", str(onnx_path), "-o", str(tmp_path / "m.so"), "--firmware", str(tmp_path / "fw"),
                     "--self-dma"]) == 0
    fw = load_firmware(tmp_path / "fw")
    assert all("self_dma" in region for region in fw.manifest["regions"])
    assert cli.main(["compile", str(onnx_path), "-o", str(tmp_path / "m2.so"), "--self-dma"]) == 2
    assert not (tmp_path / "m2.so").exists()


def test_walker_runs_in_a_fresh_process_without_the_iss_execution(mlp, tmp_path):
    """The walker's run needs the directory alone: a fresh process that imports only the loader
    gets the default simulator's bits and never imports the iss execution module."""
    ex, d, _, _ = mlp
    program = programs_of(ex)[0]
    x = _inputs(program)
    np.save(tmp_path / "x.npy", x[0])
    code = ("import sys, numpy as np\n"
            "from tvm_spinn.pe.loader import run_firmware\n"
            f"y = run_firmware({str(d)!r}, [np.load({str(tmp_path / 'x.npy')!r})])\n"
            f"np.save({str(tmp_path / 'y.npy')!r}, y[0])\n"
            "assert 'tvm_spinn.pe.execute' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _same_bits([np.load(tmp_path / "y.npy")], run_program(program, x, mode="layers"))
