"""Firmware export: the images and manifest of a compiled model, written atomically with the same
bytes in every process, read back and checked; a corrupted directory or an unlowerable layer
gives one error naming the file or the layer."""

from __future__ import annotations

import hashlib
import json
import os
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
from tvm_spinn.pe import FirmwareError, PeCodegenError, load_firmware  # noqa: E402
from tvm_spinn.pe.firmware import MANIFEST, programs_of  # noqa: E402
from tvm_spinn.pe.images import build_images  # noqa: E402
from tvm_spinn.pe.iss import image_symbols  # noqa: E402
from _firmware_edits import rewrite_jobs, rewrite_manifest  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 24)
        self.fc2 = torch.nn.Linear(24, 8)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return self.fc2(h) * 2.0 + 1.0


def _ex():
    torch.manual_seed(3)
    return relax.build(tvm_spinn.frontend.from_pytorch(_Net().eval(), (torch.randn(4, 16),)), target="spinn")


@pytest.fixture(scope="module")
def ex():
    return _ex()


@pytest.fixture
def firmware_dir(ex, tmp_path):
    tvm_spinn.export_firmware(ex, tmp_path / "fw")
    return tmp_path / "fw"


def _read_dir(directory) -> dict:
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_manifest_describes_images_tiles_schedule_and_boot(ex, firmware_dir):
    fw = load_firmware(firmware_dir)
    m = fw.manifest
    assert m["format"] == "tvm-spinn-firmware" and m["version"] == 3
    assert sorted(os.listdir(firmware_dir)) == sorted([*m["files"], MANIFEST])  # nothing else written
    for name, rec in m["files"].items():
        data = (firmware_dir / name).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    programs = programs_of(ex)
    assert [r["symbol"] for r in m["regions"]] == [p.symbol for p in programs]
    for region, program in zip(m["regions"], programs):
        # the region's program file is the program itself (the data the host places)
        assert fw.files[region["program"]] == program.to_bytes()
        built = build_images(program)
        assert len(region["layers"]) == len(program.layers)
        loaded = {}
        boot = {step["layer"]: step["load"] for step in region["boot"]}
        for i, (layer, rec) in enumerate(zip(program.layers, region["layers"])):
            image = m["images"][rec["image"]]
            assert rec["name"] == layer.name and rec["kind"] == layer.kind
            assert fw.files[image["file"]] == built.images[rec["image"]].elf
            symbols = image_symbols(fw.files[image["file"]])
            assert image["entry"] == symbols["_start"] and image["halt"] == symbols["pe_halt"]
            assert image["arena"] >= symbols["_end"] and image["arena"] % 64 == 0
            # every tile on a PE of the layer; tiles cover the output exactly once per element
            pes = sorted({t[0] for t in rec["tiles"]})
            assert pes == rec["pes"] == list(built.pes[i])
            step = region["schedule"][i]
            assert step["layer"] == i and step["barrier"]
            assert sorted(t for _, ts in step["jobs"] for t in ts) == list(range(len(rec["tiles"])))
            assert all(rec["tiles"][t][0] == pe for pe, ts in step["jobs"] for t in ts)
            # boot: a PE loads the layer's image unless it already holds it
            for pe in pes:
                if loaded.get(pe) != rec["image"]:
                    assert [pe, rec["image"]] in boot[i]
                    loaded[pe] = rec["image"]
    assert m["memory_map"]["sram_bytes"] == 128 * 1024


def test_tiles_cover_each_elementwise_output_once(firmware_dir, ex):
    m = load_firmware(firmware_dir).manifest
    (program,) = programs_of(ex)
    for layer, rec in zip(program.layers, m["regions"][0]["layers"]):
        if layer.kind in ("add", "multiply", "relu"):
            size = int(np.prod(program.tensors[layer.output].shape))
            spans = sorted((lo[0], hi[0]) for _, lo, hi in rec["tiles"])
            assert spans[0][0] == 0 and spans[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_export_is_deterministic_in_process(ex, firmware_dir, tmp_path):
    """The same model built again and exported again in this process: identical bytes."""
    tvm_spinn.export_firmware(_ex(), tmp_path / "again")
    assert _read_dir(tmp_path / "again") == _read_dir(firmware_dir)


@pytest.mark.slow
def test_export_is_deterministic_across_processes(ex, firmware_dir, tmp_path):
    """The model's exported library loaded in a fresh process: identical firmware bytes."""
    lib = tmp_path / "m.so"
    tvm_spinn.export_library(ex, str(lib))
    code = ("import sys, tvm, tvm_spinn; "
            "tvm_spinn.export_firmware(tvm.runtime.load_module(sys.argv[1]), sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(lib), str(tmp_path / "other")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _read_dir(tmp_path / "other") == _read_dir(firmware_dir)


def _elf_name(directory) -> str:
    return sorted(n for n in os.listdir(directory) if n.endswith(".elf"))[0]


def test_missing_file_is_named(firmware_dir):
    name = _elf_name(firmware_dir)
    (firmware_dir / name).unlink()
    with pytest.raises(FirmwareError, match=rf"firmware file .*{name}: cannot be read") as err:
        load_firmware(firmware_dir)
    assert err.value.path == str(firmware_dir / name)
    (firmware_dir / MANIFEST).unlink()
    with pytest.raises(FirmwareError, match=rf"{MANIFEST}: cannot be read"):
        load_firmware(firmware_dir)


def test_wrong_hash_is_named(firmware_dir):
    name = _elf_name(firmware_dir)
    data = bytearray((firmware_dir / name).read_bytes())
    data[200] ^= 0x01
    (firmware_dir / name).write_bytes(bytes(data))
    with pytest.raises(FirmwareError, match=rf"{name}: SHA-256 differs"):
        load_firmware(firmware_dir)


def test_truncated_elf_is_named(firmware_dir):
    """Truncated: the size check names it; with a manifest that agrees, the ELF check does."""
    name = _elf_name(firmware_dir)
    data = (firmware_dir / name).read_bytes()[:300]
    (firmware_dir / name).write_bytes(data)
    with pytest.raises(FirmwareError, match=rf"{name}: 300 bytes, the manifest says \d+ \(truncated\?\)"):
        load_firmware(firmware_dir)

    def agree(m):
        m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    rewrite_manifest(firmware_dir, agree)
    with pytest.raises(FirmwareError, match=rf"{name}: (not a valid ELF image|truncated segment)"):
        load_firmware(firmware_dir)


@pytest.mark.parametrize("edit,field", [
    (lambda m: m.update(version=99), "field version"),
    (lambda m: m.update(format="other"), "field format"),
    (lambda m: m.pop("regions"), "field regions"),
    (lambda m: m["memory_map"].update(sram_bytes=1), "field memory_map"),
    (lambda m: m["regions"][0]["layers"][0].update(image="nope"), r"field regions\[0\]\.layers\[0\]\.image"),
    (lambda m: m["files"].update({"../x": {"bytes": 0, "sha256": ""}}), r"field files\.\.\./x: not a plain file name"),
])
def test_bad_manifest_field_is_named(firmware_dir, edit, field):
    rewrite_manifest(firmware_dir, edit)
    with pytest.raises(FirmwareError, match=rf"{MANIFEST}: {field}"):
        load_firmware(firmware_dir)


def _move_pe(m, new_pe: int) -> None:
    """Renumber region 0's first layer's first PE to ``new_pe`` everywhere the manifest names it
    (pes, tiles, jobs, boot), so the manifest stays consistent in itself."""
    region = m["regions"][0]
    old = region["layers"][0]["pes"][0]
    for layer in region["layers"]:
        layer["pes"] = sorted(new_pe if p == old else p for p in layer["pes"])
        for tile in layer["tiles"]:
            tile[0] = new_pe if tile[0] == old else tile[0]
    for step in region["schedule"]:
        step["jobs"] = sorted([new_pe if p == old else p, ts] for p, ts in step["jobs"])
    for step in region["boot"]:
        step["load"] = sorted([new_pe if p == old else p, i] for p, i in step["load"])
    region["pe_jobs"] = sorted([new_pe if p == old else p, ids] for p, ids in region["pe_jobs"])
    return old


def _move_pe_everywhere(directory, new_pe: int) -> None:
    """:func:`_move_pe` in the manifest and in region 0's job file."""
    moved = []
    rewrite_manifest(directory, lambda m: moved.append(_move_pe(m, new_pe)))

    def edit(doc):
        for job in doc["jobs"]:
            job["pe"] = new_pe if job["pe"] == moved[0] else job["pe"]
    rewrite_jobs(directory, edit)


def _first_image(m) -> str:
    return m["regions"][0]["layers"][0]["image"]


@pytest.mark.parametrize("edit,field", [
    (lambda m: m["regions"][0]["layers"][0].update(pes="0,1"), r"field regions\[0\]\.layers\[0\]\.pes"),
    (lambda m: m["regions"][0]["layers"][0].update(pes=[-1]), r"field regions\[0\]\.layers\[0\]\.pes"),
    (lambda m: m["regions"][0]["layers"][0].update(tile_shape=[0]),
     r"field regions\[0\]\.layers\[0\]\.tile_shape"),
    (lambda m: m["regions"][0]["layers"][0]["tiles"][0][2].__setitem__(0, -5),
     r"field regions\[0\]\.layers\[0\]\.tiles\[0\]: region .* empty"),
    (lambda m: m["regions"][0]["layers"][0]["tiles"][0].__setitem__(1, "lo"),
     r"field regions\[0\]\.layers\[0\]\.tiles: malformed"),
    (lambda m: m["regions"][0]["schedule"][0]["jobs"].append([999999, [0]]),
     r"field regions\[0\]\.schedule\[0\]\.jobs: tile 0 is placed on PE \d+, the job runs it on PE 999999"),
    (lambda m: m["regions"][0]["schedule"][0]["jobs"][0][1].append(10 ** 6),
     r"field regions\[0\]\.schedule\[0\]\.jobs: tile 1000000 .* not one of the layer's tiles"),
    (lambda m: m["regions"][0]["schedule"][0].update(layer=99), r"field regions\[0\]\.schedule\[0\]\.layer"),
    (lambda m: m["regions"][0]["schedule"].pop(), r"field regions\[0\]\.schedule: does not run every layer"),
    (lambda m: m["regions"][0]["boot"][0]["load"][0].__setitem__(1, "nope"),
     r"field regions\[0\]\.boot\[0\]\.load: malformed"),
    (lambda m: m["regions"][0]["boot"][0].update(layer="0"), r"field regions\[0\]\.boot\[0\]\.layer"),
    (lambda m: m["images"][_first_image(m)].update(halt="0x100"), r"field images\.\w+\.halt: not an integer"),
    (lambda m: m["images"][_first_image(m)].update(arena=2 ** 40), r"field images\.\w+\.arena: .* outside"),
    (lambda m: m["images"][_first_image(m)].update(arena=m["images"][_first_image(m)]["arena"] + 4),
     r"field images\.\w+\.arena: not a multiple of 64"),
    (lambda m: _move_pe(m, 999999), r"field regions\[0\]\.layers\[0\]\.pes: PE 999999 does not exist"),
])
def test_corrupted_manifest_field_is_named(firmware_dir, edit, field):
    """A manifest whose fields have the wrong type, refer to a layer, tile, image or PE that does
    not exist, or contradict each other: one FirmwareError naming the manifest and the field."""
    rewrite_manifest(firmware_dir, edit)
    with pytest.raises(FirmwareError, match=rf"{MANIFEST}: {field}") as err:
        load_firmware(firmware_dir)
    assert err.value.path == str(firmware_dir / MANIFEST)


def test_pe_ids_within_the_system_load(firmware_dir, ex):
    """The last PE of the system is a valid PE id (the range check is not off by one)."""
    total = programs_of(ex)[0].arch.total_pes
    _move_pe_everywhere(firmware_dir, total - 1)
    load_firmware(firmware_dir)
    _move_pe_everywhere(firmware_dir, total)
    with pytest.raises(FirmwareError, match=rf"PE {total} does not exist \(the system has {total} PEs\)"):
        load_firmware(firmware_dir)


@pytest.mark.parametrize("key,symbol", [("halt", "pe_halt"), ("arena", "_end")])
def test_image_halt_and_arena_checked_against_the_elf(firmware_dir, key, symbol):
    """``halt`` is the image's ``pe_halt``; ``arena`` its ``_end`` rounded up to 64 bytes: a
    manifest that says otherwise names the image file and the manifest's field."""
    m = json.loads((firmware_dir / MANIFEST).read_text())
    name = _first_image(m)
    symbols = image_symbols((firmware_dir / m["images"][name]["file"]).read_bytes())
    assert m["images"][name]["halt"] == symbols["pe_halt"]
    assert m["images"][name]["arena"] == -(-symbols["_end"] // 64) * 64
    rewrite_manifest(firmware_dir, lambda m: m["images"][name].update({key: m["images"][name][key] + 64}))
    with pytest.raises(FirmwareError, match=rf"images\.{name}\.{key} .* differs from the image's") as err:
        load_firmware(firmware_dir)
    assert err.value.path == str(firmware_dir / m["images"][name]["file"])


def test_memory_map_names_both_exp_unit_functions(firmware_dir):
    """The exp/log unit's FUNC codes in the manifest are every code the PE runtime's drivers
    write to the FUNC register (pe_exp and pe_log; the cross-entropy images call pe_log)."""
    import re

    from tvm_spinn.pe import memory_map as mm
    from tvm_spinn.pe.runtime import RUNTIME_C
    functions = load_firmware(firmware_dir).manifest["memory_map"]["exp_unit"]["functions"]
    assert functions == {"exp": 0, "log": 1}
    written = {int(v) for v in re.findall(rf"EXPU\({mm.EXP_REGS['FUNC']:#x}\) = (\d+)u;", RUNTIME_C)}
    assert written == set(functions.values())


def test_manifest_not_json_is_named(firmware_dir):
    (firmware_dir / MANIFEST).write_bytes(b'{"format": ')
    with pytest.raises(FirmwareError, match=rf"{MANIFEST}: not valid JSON"):
        load_firmware(firmware_dir)


def test_unlowerable_layer_named_at_export_and_nothing_written(tmp_path, monkeypatch):
    from test_int8 import qgemm_module
    from tvm_spinn.pe import roles

    # every layer of the pattern table has PE code: the role check refusing the int8 dense
    # stands in for a layer without a kernel
    real = roles.layer_role

    def refuse_dense(program, index):
        if program.layers[index].kind == "dense":
            roles._fail(program, index, "no PE kernel")
        return real(program, index)

    monkeypatch.setattr(roles, "layer_role", refuse_dense)
    w = np.random.default_rng(0).integers(-127, 128, size=(16, 8)).astype("int8")
    ex = relax.build(qgemm_module((4, 16), "int8", w, np.float32(0.01), 0, 0.02, 3, op="dense"), target="spinn")
    with pytest.raises(PeCodegenError, match=r"layer \S+ \(dense\): cannot generate PE code"):
        tvm_spinn.export_firmware(ex, tmp_path / "fw")
    assert not (tmp_path / "fw").exists()


def test_cli_compile_writes_firmware(tmp_path):
    from tvm_spinn import cli

    torch.manual_seed(3)
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(_Net().eval(), (torch.randn(4, 16),), str(onnx_path), dynamo=False,
                      input_names=["x"], output_names=["y"])
    fw = tmp_path / "fw"
    assert cli.main(["compile", str(onnx_path), "-o", str(tmp_path / "m.so"), "--firmware", str(fw)]) == 0
    m = load_firmware(fw).manifest
    assert {layer["kind"] for r in m["regions"] for layer in r["layers"]} >= {"dense"}
    (tmp_path / "file").write_text("x")
    assert cli.main(["compile", str(onnx_path), "-o", str(tmp_path / "m2.so"), "--firmware",
                     str(tmp_path / "file")]) == 2
    assert not (tmp_path / "m2.so").exists()
