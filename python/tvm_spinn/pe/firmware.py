"""Firmware: the PE images of a compiled model and a manifest a host loader can follow.

:func:`export_firmware` writes a directory: one ELF image per PE role (``<role>.elf``), each
region's spinn program (``r<i>.spinn``), its initial DRAM (``r<i>.dram``: the constants at the
offsets of the region's DRAM layout), its job table (``r<i>.jobs.json``, :mod:`.jobs`: per job
its PE and image, the jobs it waits for, the DMA descriptors and literal words that place its
operands in SRAM, its argument words, the descriptors that put its results in DRAM), and
``manifest.json`` (which PE runs which image, the memory map, every tile's region and PE, the
static job order, the boot order, the DRAM layout, each PE's ordered jobs, the layers left to
the host, the SHA-256 of every file). :func:`.loader.run_firmware` runs a region from these
files alone. The format is
documented in ``docs/design/pe-code.md``; the bytes are a pure function of the programs.

Every file goes through :func:`tvm_spinn._files.atomic_write`; the manifest is written last,
so a reader that finds a manifest finds every file it names complete. :func:`load_firmware`
checks a directory (manifest fields' types and references, PE ids against the system, every
file's presence, size and hash, every image's ELF header, segments and symbols) and raises one
:class:`FirmwareError` naming the file at fault and the field.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass

from . import memory_map as mm
from . import view
from .images import build_images

__all__ = ["FIRMWARE_FORMAT", "FIRMWARE_VERSION", "MANIFEST", "Firmware", "FirmwareError",
           "build_firmware", "export_firmware", "write_firmware", "load_firmware", "programs_of"]

FIRMWARE_FORMAT = "tvm-spinn-firmware"
FIRMWARE_VERSION = 3
MANIFEST = "manifest.json"
_JOBS_FORMAT = "tvm-spinn-jobs"
#: ELF header fields every image must have: 32-bit, little-endian, ARM executable.
_EM_ARM = "EM_ARM"


class FirmwareError(ValueError):
    """A firmware directory that cannot be loaded: the file at fault and what is wrong."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"firmware file {path}: {reason}")


@dataclass(frozen=True)
class Firmware:
    """A model's firmware: ``files`` (name -> bytes, the manifest excluded) and ``manifest``
    (the parsed JSON)."""

    files: dict
    manifest: dict
    #: per region, its parsed job file's jobs (filled by :func:`load_firmware`)
    jobs: tuple = ()

    def manifest_bytes(self) -> bytes:
        return _dump(self.manifest)


def _dump(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, separators=(",", ": ")) + "\n").encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def memory_map_record() -> dict:
    """The PE's address map as the images assume it (:mod:`.memory_map`)."""
    return {
        "sram_base": mm.SRAM_BASE, "sram_bytes": mm.SRAM_BYTES, "stack_top": mm.STACK_TOP,
        "stack_bytes": mm.STACK_BYTES, "job_block": mm.JOB_ADDR, "job_words": mm.JOB_WORDS,
        "arena_align": mm.ARENA_ALIGN, "arena_end": mm.ARENA_END,
        "mac_array": {"base": mm.MAC_BASE, "bytes": mm.MAC_BYTES, "registers": dict(mm.MAC_REGS),
                      "start": mm.MAC_START},
        "exp_unit": {"base": mm.EXP_BASE, "bytes": mm.EXP_BYTES, "registers": dict(mm.EXP_REGS),
                     "start": mm.EXP_START,
                     "functions": {"exp": mm.EXP_FUNC_EXP, "log": mm.EXP_FUNC_LOG}},
        "dma": {"base": mm.DMA_BASE, "bytes": mm.DMA_BYTES, "registers": dict(mm.DMA_REGS),
                "start": mm.DMA_START, "descriptor_words": mm.DMA_DESC_WORDS, "remote_base": mm.REMOTE_BASE,
                "eb_fields": {"element_bytes": mm.DMA_EB_MASK, "scatter": mm.DMA_SCATTER}},
    }


def _image_record(image) -> dict:
    from .iss import image_symbols
    symbols = image_symbols(image.elf)
    return {"file": f"{image.name}.elf", "kernel": [p if isinstance(p, (str, bool)) else int(p) for p in image.spec],
            "entry": symbols["_start"], "halt": symbols["pe_halt"],
            "arena": mm.arena_start(symbols["_end"])}


def _region_record(index: int, program, images, files: dict, self_dma: bool = False) -> dict:
    tables = view.placed_tiles(program)
    layers, schedule, boot = [], [], []
    loaded: dict[int, str] = {}  # PE -> the image it holds
    for i in range(view.layer_count(program)):
        table, image = tables[i], images.layers[i]
        pe = [int(v) for v in table.pe]
        layers.append({
            "name": view.layer_name(program, i), "kind": view.layer_kind(program, i),
            "mode": view.layer_mode(program, i), "image": image, "pes": list(images.pes[i]),
            "tile_shape": view.layer_tile_shape(program, i),
            # tile t: its PE and its region [lo, hi) in the layer's tile space (docs: tiles)
            "tiles": [[p, lo, hi] for p, lo, hi in zip(pe, table.lo.tolist(), table.hi.tolist())],
        })
        jobs: dict[int, list[int]] = {}
        for t, p in enumerate(pe):
            jobs.setdefault(p, []).append(t)
        load = [[p, image] for p in sorted(jobs) if loaded.get(p) != image]
        for p, _ in load:
            loaded[p] = image
        if load:
            boot.append({"layer": i, "load": load})
        schedule.append({"layer": i, "jobs": [[p, jobs[p]] for p in sorted(jobs)], "barrier": True})
    name = f"r{index}.spinn"
    files[name] = view.program_bytes(program)
    record = {"symbol": view.program_symbol(program), "program": name, "layers": layers,
              "schedule": schedule, "boot": boot}
    record.update(_job_record(index, program, images, files))
    if self_dma:
        from .selfdma import region_record
        record["self_dma"] = region_record(index, record["_jobs"], record["pe_jobs"],
                                           {n: im.elf for n, im in images.images.items()}, record["dram"]["bytes"],
                                           files)
    return record


def _job_record(index: int, program, images, files: dict) -> dict:
    """The region's DRAM layout (its initial contents in ``r<i>.dram``), its jobs (``r<i>.jobs.json``,
    :func:`.jobs.job_tables`), every PE's ordered job table, the PE parameters a loader needs
    (``arch``), and the layers left to the host."""
    from .jobs import dram_init, job_tables
    tables = job_tables(program, images)
    dram = tables["dram"]
    files[f"r{index}.dram"] = dram_init(program, dram)
    files[f"r{index}.jobs.json"] = _jobs_bytes(index, tables["jobs"])
    per_pe: dict[int, list[int]] = {}
    for job in tables["jobs"]:
        per_pe.setdefault(job["pe"], []).append(job["id"])
    return {"arch": view.arch_of(program).to_dict(),
            "dram": {"file": f"r{index}.dram", "init_bytes": dram["init_bytes"], "bytes": dram["bytes"],
                     "scratch": dram["scratch"], "tensors": dram["tensors"],
                     "inputs": [int(t) for t in view.program_inputs(program)],
                     "outputs": [int(t) for t in view.program_outputs(program)]},
            "jobs": {"file": f"r{index}.jobs.json", "count": len(tables["jobs"])},
            "pe_jobs": [[pe, per_pe[pe]] for pe in sorted(per_pe)], "host": tables["host"],
            "_jobs": tables["jobs"]}  # taken out of the record by build_firmware


def _jobs_bytes(region: int, jobs: list) -> bytes:
    """A region's job file: compact JSON, sorted keys (bulk data: one line)."""
    doc = {"format": _JOBS_FORMAT, "version": FIRMWARE_VERSION, "region": region, "jobs": jobs}
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def build_firmware(programs: list, noc: bool = False, self_dma: bool = False) -> Firmware:
    """The firmware of ``programs`` (the spinn programs of a model, in symbol order), in memory;
    ``noc``: the images linked with the NoC driver (:mod:`.noc`, what
    :func:`.multi.run_firmware_concurrent` needs), the job tables placed for them; ``self_dma``:
    the images linked with the job-table walker and each region's command table written
    (:mod:`.selfdma`, a region's ``self_dma`` field).

    Raises
    ------
    PeCodegenError
        For the first layer (of any region) the generator cannot lower; nothing is built.
    """
    from .roles import layer_role
    for program in programs:  # every layer of every region checked before anything is built
        for i in range(view.layer_count(program)):
            layer_role(program, i)
    files: dict = {}
    images: dict = {}
    regions = []
    for r, program in enumerate(programs):
        built = build_images(program, noc=noc, self_dma=self_dma)
        for name, image in built.images.items():
            if name not in images:
                images[name] = _image_record(image)
                files[f"{name}.elf"] = image.elf
        regions.append(_region_record(r, program, built, files, self_dma=self_dma))
    manifest = {
        "format": FIRMWARE_FORMAT, "version": FIRMWARE_VERSION,
        "memory_map": memory_map_record(),
        "images": dict(sorted(images.items())),
        "regions": regions,
        "files": {name: {"bytes": len(data), "sha256": _sha(data)} for name, data in sorted(files.items())},
    }
    jobs = tuple(region.pop("_jobs") for region in regions)
    return Firmware(files=dict(sorted(files.items())), manifest=manifest, jobs=jobs)


def programs_of(ex) -> list:
    """The spinn programs of an executable or loaded library (in symbol order), the model's
    plan manifest excluded."""
    from ..program.format import Program
    from ..program.manifest import MANIFEST_MAGIC
    from ..report.report import find_spinn_modules
    out = []
    for m in find_spinn_modules(ex):
        data = bytes(m["get_program"]())
        if not data.startswith(MANIFEST_MAGIC):
            out.append(Program.from_bytes(data))
    if not out:
        raise ValueError("no spinn programs in this executable: was it built for a spinn target?")
    return out


def export_firmware(ex, directory: "str | os.PathLike", noc: bool = False, self_dma: bool = False) -> Firmware:
    """Write the firmware of a compiled model to ``directory`` (created if missing).

    Parameters
    ----------
    ex : tvm.relax.VMExecutable, tvm.runtime.Module or list of Program
        What ``relax.build(mod, target="spinn")`` returned, a loaded library, or its programs.
    directory : str or os.PathLike
        The firmware directory. Files of the same names are replaced atomically; the manifest
        is written last.
    noc : bool
        Link every image with the PE runtime's NoC driver and barrier (:mod:`.noc`), so the PEs
        can run concurrently and honour the jobs' dependencies by NoC packets
        (:func:`.multi.run_firmware_concurrent`); the job tables are placed for those images.
    self_dma : bool
        Link every image with the job-table walker (:mod:`.selfdma`) and write each region's
        command table (``r<i>.sdma``, the manifest's ``regions[].self_dma``): each PE places
        its own operands with its DMA engine and runs its jobs back to back
        (:func:`.loader.run_firmware`); the job tables are placed for those images.

    Returns
    -------
    Firmware
        What was written.

    Raises
    ------
    PeCodegenError
        For a layer the generator cannot lower (before anything is written).
    tvm_spinn._files.OutputPathError
        For a destination that is not a directory, or a file that must not be replaced.
    """
    programs = list(ex) if isinstance(ex, (list, tuple)) else programs_of(ex)
    firmware = build_firmware(programs, noc=noc, self_dma=self_dma)
    write_firmware(firmware, directory)
    return firmware


def write_firmware(firmware: Firmware, directory: "str | os.PathLike") -> None:
    """Write built firmware to ``directory`` (created if missing), the manifest last."""
    from .._files import OutputPathError, atomic_write
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise OutputPathError(f"firmware directory {directory!r} exists and is not a directory")
    os.makedirs(directory, exist_ok=True)
    for name, data in firmware.files.items():
        atomic_write(os.path.join(directory, name), lambda f, d=data: f.write(d), what="firmware file")
    atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(firmware.manifest_bytes()),
                 what="firmware manifest")


# -- loading -----------------------------------------------------------------------------------
def _need(cond: bool, path: str, reason: str) -> None:
    if not cond:
        raise FirmwareError(path, reason)


def _check_elf(path: str, data: bytes, record: dict, name: str) -> None:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    try:
        elf = ELFFile(io.BytesIO(data))
        _need(elf.elfclass == 32 and elf.little_endian, path, "not a 32-bit little-endian ELF")
        _need(elf["e_machine"] == _EM_ARM and elf["e_type"] == "ET_EXEC", path, "not an ARM executable")
        for seg in elf.iter_segments():
            if seg["p_type"] != "PT_LOAD":
                continue
            lo, size = int(seg["p_paddr"]), int(seg["p_memsz"])
            _need(mm.SRAM_BASE <= lo and lo + size <= mm.ARENA_END, path,
                  f"segment [{lo:#x}, {lo + size:#x}) outside the image area of SRAM")
            _need(int(seg["p_offset"]) + int(seg["p_filesz"]) <= len(data), path, "truncated segment")
            seg.data()
        _need(elf["e_entry"] & ~1 == record["entry"], path, "entry point differs from the manifest's")
        table = elf.get_section_by_name(".symtab")
        _need(table is not None, path, "no symbol table (pe_halt and _end are needed)")
        symbols = {s.name: int(s["st_value"]) & ~1 for s in table.iter_symbols() if s.name}
        _need("pe_halt" in symbols and "_end" in symbols, path, "symbol pe_halt or _end missing")
        _need(symbols["pe_halt"] == record["halt"], path,
              f"the manifest's field images.{name}.halt {record['halt']:#x} differs from the image's "
              f"pe_halt {symbols['pe_halt']:#x}")
        arena = mm.arena_start(symbols["_end"])
        _need(record["arena"] == arena, path,
              f"the manifest's field images.{name}.arena {record['arena']:#x} differs from the image's end "
              f"{symbols['_end']:#x} rounded up to "
              f"{mm.ARENA_ALIGN} bytes ({arena:#x})")
    except (ELFError, ValueError, KeyError, IndexError, OSError) as err:
        if isinstance(err, FirmwareError):
            raise
        raise FirmwareError(path, f"not a valid ELF image ({err})") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _check_manifest(path: str, m) -> None:
    """The manifest's fields: types, and every reference (image, file, layer, tile, PE) resolved
    within the manifest. PE ids against the system are checked once the programs are read
    (:func:`_check_pes`)."""
    _need(isinstance(m, dict), path, "not a JSON object")
    _need(m.get("format") == FIRMWARE_FORMAT, path, f"field format: expected {FIRMWARE_FORMAT!r}, got {m.get('format')!r}")
    _need(m.get("version") == FIRMWARE_VERSION, path, f"field version: expected {FIRMWARE_VERSION}, got {m.get('version')!r}")
    _need(m.get("memory_map") == memory_map_record(), path, "field memory_map: differs from this package's PE memory map")
    for key, kind in (("images", dict), ("regions", list), ("files", dict)):
        _need(isinstance(m.get(key), kind), path, f"field {key}: missing or not a {kind.__name__}")
    for name, rec in m["files"].items():
        _need(isinstance(rec, dict) and _is_int(rec.get("bytes")) and rec["bytes"] >= 0
              and isinstance(rec.get("sha256"), str), path,
              f"field files.{name}: needs a non-negative integer bytes and a sha256 string")
        _need(os.path.basename(name) == name and name not in ("", ".", "..", MANIFEST), path,
              f"field files.{name}: not a plain file name")
    for name, rec in m["images"].items():
        _need(isinstance(rec, dict) and rec.get("file") in m["files"], path,
              f"field images.{name}: its file is not listed in files")
        for key in ("entry", "halt", "arena"):
            _need(_is_int(rec.get(key)), path, f"field images.{name}.{key}: not an integer")
            # code, halt loop and arena all lie in the image area of the PE's SRAM
            _need(mm.SRAM_BASE <= rec[key] <= mm.ARENA_END, path,
                  f"field images.{name}.{key}: {rec[key]:#x} outside [{mm.SRAM_BASE:#x}, {mm.ARENA_END:#x}]")
        _need(rec["arena"] % mm.ARENA_ALIGN == 0, path,
              f"field images.{name}.arena: not a multiple of {mm.ARENA_ALIGN}")
    for r, region in enumerate(m["regions"]):
        _check_region(path, f"regions[{r}]", region, m)


def _check_region(path: str, where: str, region, m) -> None:
    _need(isinstance(region, dict) and region.get("program") in m["files"], path,
          f"field {where}.program: not listed in files")
    for key in ("layers", "schedule", "boot"):
        _need(isinstance(region.get(key), list), path, f"field {where}.{key}: missing or not a list")
    layers = region["layers"]
    for i, layer in enumerate(layers):
        at = f"{where}.layers[{i}]"
        _need(isinstance(layer, dict) and layer.get("image") in m["images"], path,
              f"field {at}.image: not one of images")
        for key in ("name", "kind", "mode"):
            _need(isinstance(layer.get(key), str), path, f"field {at}.{key}: missing or not a string")
        pes = layer.get("pes")
        _need(_int_list(pes) and pes == sorted(set(pes)) and all(p >= 0 for p in pes), path,
              f"field {at}.pes: not a list of distinct non-negative PE ids in ascending order")
        shape = layer.get("tile_shape")
        _need(_int_list(shape) and all(d > 0 for d in shape), path,
              f"field {at}.tile_shape: not a list of positive integers")
        tiles = layer.get("tiles")
        _need(isinstance(tiles, list) and all(isinstance(t, list) and len(t) == 3 and _is_int(t[0])
                                              and _int_list(t[1]) and _int_list(t[2]) for t in tiles), path,
              f"field {at}.tiles: malformed (each tile is [pe, lo, hi])")
        for t, (pe, lo, hi) in enumerate(tiles):
            _need(pe in pes, path, f"field {at}.tiles[{t}]: PE {pe} is not one of the layer's pes")
            _need(len(lo) == len(hi) and all(0 <= a < b for a, b in zip(lo, hi)), path,
                  f"field {at}.tiles[{t}]: region [{lo}, {hi}) is empty, negative or of mismatched rank")
        _need(sorted({t[0] for t in tiles}) == pes, path, f"field {at}.pes: differs from the PEs of its tiles")
    _check_placement(path, where, region, m)
    scheduled = set()
    for s, step in enumerate(region["schedule"]):
        at = f"{where}.schedule[{s}]"
        _need(isinstance(step, dict) and _is_int(step.get("layer")) and 0 <= step["layer"] < len(layers), path,
              f"field {at}.layer: not the index of one of the region's layers")
        _need(isinstance(step.get("barrier"), bool), path, f"field {at}.barrier: not a boolean")
        tiles = layers[step["layer"]]["tiles"]
        jobs = step.get("jobs")
        _need(isinstance(jobs, list) and all(isinstance(j, list) and len(j) == 2 and _is_int(j[0])
                                             and _int_list(j[1]) for j in jobs), path,
              f"field {at}.jobs: malformed (each job is [pe, [tile, ...]])")
        for pe, ts in jobs:
            for t in ts:
                _need(0 <= t < len(tiles), path,
                      f"field {at}.jobs: tile {t} of PE {pe} is not one of the layer's tiles")
                _need(tiles[t][0] == pe, path,
                      f"field {at}.jobs: tile {t} is placed on PE {tiles[t][0]}, the job runs it on PE {pe}")
        done = sorted(t for _, ts in jobs for t in ts)
        _need(done == list(range(len(tiles))), path, f"field {at}.jobs: do not run each of the layer's tiles once")
        scheduled.add(step["layer"])
    _need(scheduled == set(range(len(layers))), path, f"field {where}.schedule: does not run every layer")
    for b, step in enumerate(region["boot"]):
        at = f"{where}.boot[{b}]"
        _need(isinstance(step, dict) and _is_int(step.get("layer")) and 0 <= step["layer"] < len(layers), path,
              f"field {at}.layer: not the index of one of the region's layers")
        load = step.get("load")
        _need(isinstance(load, list) and all(isinstance(x, list) and len(x) == 2 and _is_int(x[0]) and x[0] >= 0
                                             and x[1] in m["images"] for x in load), path,
              f"field {at}.load: malformed (each entry is [pe, image] with an image of images)")


def _check_placement(path: str, where: str, region: dict, m: dict) -> None:
    """The region's DRAM layout, job file reference, per-PE job tables and host layers."""
    import numpy as np
    _need(isinstance(region.get("arch"), dict), path, f"field {where}.arch: missing or not an object")
    dram = region.get("dram")
    _need(isinstance(dram, dict) and dram.get("file") in m["files"], path, f"field {where}.dram.file: not listed in files")
    for key in ("init_bytes", "bytes"):
        _need(_is_int(dram.get(key)) and dram[key] >= 0 and dram[key] % 4 == 0, path,
              f"field {where}.dram.{key}: not a non-negative multiple of 4")
    _need(m["files"][dram["file"]]["bytes"] == dram["init_bytes"] <= dram["bytes"], path,
          f"field {where}.dram.init_bytes: differs from the size of {dram['file']} or exceeds dram.bytes")
    scratch = dram.get("scratch")
    _need(_int_list(scratch) and len(scratch) == 2 and 0 <= scratch[0] and scratch[1] >= 0
          and scratch[0] + scratch[1] <= dram["bytes"], path,
          f"field {where}.dram.scratch: not [offset, bytes] within the region's DRAM")
    tensors = dram.get("tensors")
    _need(isinstance(tensors, list), path, f"field {where}.dram.tensors: missing or not a list")
    spans, ids = [], set()
    for t, rec in enumerate(tensors):
        at = f"{where}.dram.tensors[{t}]"
        _need(isinstance(rec, dict) and all(_is_int(rec.get(k)) and rec[k] >= 0 for k in ("id", "offset", "bytes"))
              and _int_list(rec.get("shape")) and all(d >= 0 for d in rec["shape"])
              and rec.get("role") in ("const", "input", "output", "temp"), path,
              f"field {at}: needs integer id, offset and bytes, a shape and a role (const, input, output, temp)")
        try:
            dtype = np.dtype(rec.get("dtype"))
        except TypeError:
            dtype = None
        # numeric only: the loader reads the tensors' bytes as arrays of this dtype
        _need(dtype is not None and dtype.name == rec.get("dtype") and dtype.kind in "biuf", path,
              f"field {at}.dtype: not a numeric dtype name (bool, integer or float)")
        _need(rec["bytes"] == int(np.prod(rec["shape"], dtype=np.int64)) * dtype.itemsize, path,
              f"field {at}.bytes: differs from its shape and dtype")
        _need(rec["offset"] % 4 == 0 and rec["offset"] + rec["bytes"] <= scratch[0], path,
              f"field {at}.offset: not word-aligned or the tensor runs past the tensors' area")
        _need(rec["id"] not in ids, path, f"field {at}.id: tensor {rec['id']} placed twice")
        _need((rec["role"] == "const") == (rec["offset"] + rec["bytes"] <= dram["init_bytes"] and rec["bytes"] > 0)
              or rec["bytes"] == 0, path,
              f"field {at}.role: constants lie in the initial DRAM ({dram['init_bytes']} bytes), nothing else does")
        ids.add(rec["id"])
        spans.append((rec["offset"], rec["offset"] + rec["bytes"], t))
    spans.sort()
    for (_, hi, a), (lo, _, b) in zip(spans, spans[1:]):
        _need(lo >= hi, path, f"field {where}.dram.tensors[{b}]: overlaps tensors[{a}]")
    for key in ("inputs", "outputs"):
        _need(_int_list(dram.get(key)) and all(t in ids for t in dram[key]), path,
              f"field {where}.dram.{key}: not a list of placed tensor ids")
    jobs = region.get("jobs")
    _need(isinstance(jobs, dict) and jobs.get("file") in m["files"] and _is_int(jobs.get("count"))
          and jobs["count"] >= 0, path, f"field {where}.jobs: needs a file listed in files and an integer count")
    host = region.get("host")
    nlayers = len(region["layers"])
    _need(isinstance(host, list) and all(isinstance(h, dict) and _is_int(h.get("layer")) and 0 <= h["layer"] < nlayers
                                         and isinstance(h.get("reason"), str) for h in host), path,
          f"field {where}.host: not a list of {{layer, reason}} of the region's layers")
    pe_jobs = region.get("pe_jobs")
    _need(isinstance(pe_jobs, list) and all(isinstance(x, list) and len(x) == 2 and _is_int(x[0]) and x[0] >= 0
                                            and _int_list(x[1]) and x[1] == sorted(set(x[1])) for x in pe_jobs), path,
          f"field {where}.pe_jobs: malformed (each entry is [pe, [job id, ...]] in ascending order)")
    listed = sorted(j for _, ids_ in pe_jobs for j in ids_)
    _need(listed == list(range(jobs["count"])) and [x[0] for x in pe_jobs] == sorted({x[0] for x in pe_jobs}), path,
          f"field {where}.pe_jobs: does not list each of the {jobs['count']} jobs once, PEs ascending")


def _span(path: str, at: str, part, lo: int, hi: int) -> int:
    """A ``["dram", offset, counts, strides]`` descriptor's element count, its addresses checked
    to lie word-aligned in ``[lo, hi)``."""
    _need(isinstance(part, list) and len(part) == 4 and _is_int(part[1]) and _int_list(part[2])
          and len(part[2]) == 4 and all(c > 0 for c in part[2]) and _int_list(part[3]) and len(part[3]) == 4, path,
          f"field {at}: a descriptor is [\"dram\", offset, [c0..c3], [s0..s3]] with positive counts")
    first = part[1] + sum(min(0, (c - 1) * s) for c, s in zip(part[2], part[3]))
    last = part[1] + sum(max(0, (c - 1) * s) for c, s in zip(part[2], part[3]))
    _need(part[1] % 4 == 0 and all(s % 4 == 0 for s in part[3]) and lo <= first and last + 4 <= hi, path,
          f"field {at}: addresses [{first}, {last + 4}) not word-aligned within [{lo}, {hi})")
    n = 1
    for c in part[2]:
        n *= c
    return n


def _span8(path: str, at: str, part, lo: int, hi: int) -> int:
    """A ``["dram8", offset, counts, strides]`` descriptor's byte count, its addresses checked to
    lie in ``[lo, hi)`` (1-byte elements: any offset and strides)."""
    _need(isinstance(part, list) and len(part) == 4 and _is_int(part[1]) and _int_list(part[2])
          and len(part[2]) == 4 and all(c > 0 for c in part[2]) and _int_list(part[3]) and len(part[3]) == 4, path,
          f"field {at}: a descriptor is [\"dram8\", offset, [c0..c3], [s0..s3]] with positive counts")
    first = part[1] + sum(min(0, (c - 1) * s) for c, s in zip(part[2], part[3]))
    last = part[1] + sum(max(0, (c - 1) * s) for c, s in zip(part[2], part[3]))
    _need(lo <= first and last + 1 <= hi, path, f"field {at}: addresses [{first}, {last + 1}) not within [{lo}, {hi})")
    n = 1
    for c in part[2]:
        n *= c
    return n


def _put_bytes(path: str, at: str, parts, dram: dict) -> int:
    _need(isinstance(parts, list), path, f"field {at}: parts not a list")
    total = 0
    for q, part in enumerate(parts):
        pat = f"{at}[{q}]"
        kind = part[0] if isinstance(part, list) and part else None
        if kind == "dram":
            total += 4 * _span(path, pat, part, 0, dram["bytes"])
        elif kind == "dram8":
            total += _span8(path, pat, part, 0, dram["bytes"])
        elif kind == "fill":
            _need(len(part) == 3 and _is_int(part[1]) and 0 <= part[1] < 1 << 32 and _is_int(part[2]) and part[2] > 0,
                  path, f"field {pat}: a fill is [\"fill\", word, count]")
            total += 4 * part[2]
        else:
            _need(kind == "bytes" and len(part) == 2 and isinstance(part[1], str) and len(part[1]) % 2 == 0, path,
                  f"field {pat}: not a dram, dram8, fill or bytes part")
            try:
                total += len(bytes.fromhex(part[1]))
            except ValueError:
                raise FirmwareError(path, f"field {pat}: bytes not hexadecimal") from None
    return total


def _check_jobs(directory: str, r: int, region: dict, m: dict, files: dict) -> list:
    """Region ``r``'s job file: each job's layer, PE, image, dependencies and steps (SRAM ranges
    within the image's data area, descriptors within the region's DRAM, argument words)."""
    name = region["jobs"]["file"]
    path = os.path.join(directory, name)
    try:
        doc = json.loads(files[name].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FirmwareError(path, f"not valid JSON ({err})") from None
    _need(isinstance(doc, dict) and doc.get("format") == _JOBS_FORMAT and doc.get("version") == FIRMWARE_VERSION
          and doc.get("region") == r, path,
          f"fields format, version, region: expected {_JOBS_FORMAT!r}, {FIRMWARE_VERSION}, {r}")
    jobs = doc.get("jobs")
    _need(isinstance(jobs, list) and len(jobs) == region["jobs"]["count"], path,
          f"field jobs: not a list of the manifest's {region['jobs']['count']} jobs")
    dram, layers = region["dram"], region["layers"]
    host = {h["layer"] for h in region["host"]}
    on_pe = {j: pe for pe, ids in region["pe_jobs"] for j in ids}
    has_jobs = set()
    for j, job in enumerate(jobs):
        at = f"jobs[{j}]"
        _need(isinstance(job, dict) and job.get("id") == j, path, f"field {at}.id: not {j}")
        _need(_is_int(job.get("layer")) and 0 <= job["layer"] < len(layers) and job["layer"] not in host, path,
              f"field {at}.layer: not a layer of the region with a job table")
        layer = layers[job["layer"]]
        _need(job.get("pe") in layer["pes"] and on_pe.get(j) == job["pe"], path,
              f"field {at}.pe: not one of the layer's PEs, or not the PE pe_jobs lists the job under")
        _need(job.get("image") == layer["image"], path, f"field {at}.image: not the layer's image {layer['image']!r}")
        after = job.get("after")
        _need(isinstance(after, list) and all(_int_list(x) and len(x) == 2 and 0 <= x[0] <= x[1] < j for x in after)
              and all(x[1] + 1 < y[0] for x, y in zip(after, after[1:])), path,
              f"field {at}.after: not ascending, disjoint ranges [first, last] of earlier jobs "
              "(the static schedule runs them first)")
        steps = job.get("steps")
        _need(isinstance(steps, list), path, f"field {at}.steps: not a list")
        arena = m["images"][layer["image"]]["arena"]
        for s, step in enumerate(steps):
            sat = f"{at}.steps[{s}]"
            kind = step[0] if isinstance(step, list) and step else None
            if kind == "put":
                _need(len(step) == 3 and _is_int(step[1]), path, f"field {sat}: a put is [\"put\", address, parts]")
                n = _put_bytes(path, f"{sat}[2]", step[2], dram)
                _need(arena <= step[1] and step[1] + n <= mm.ARENA_END, path,
                      f"field {sat}: SRAM [{step[1]:#x}, {step[1] + n:#x}) outside the image's data area "
                      f"[{arena:#x}, {mm.ARENA_END:#x})")
            elif kind == "remote":
                _need(len(step) == 2, path, f"field {sat}: a remote is [\"remote\", parts]")
                # a remote holds copies of the region's tensors (a DMA layer's inputs, a table)
                n = _put_bytes(path, f"{sat}[1]", step[1], dram)
                _need(n <= dram["bytes"], path,
                      f"field {sat}[1]: {n} bytes, more than the region's DRAM ({dram['bytes']} bytes)")
            elif kind == "run":
                _need(len(step) == 3 and isinstance(step[1], list) and isinstance(step[2], bool)
                      and all(_int_list(w) and len(w) <= mm.JOB_WORDS and all(0 <= x < 1 << 32 for x in w)
                              for w in step[1]), path,
                      f"field {sat}: a run is [\"run\", [[word, ...] (at most {mm.JOB_WORDS} 32-bit words), ...], "
                      "mac_in_flight]")
            elif kind == "check":
                _need(len(step) == 2 and _is_int(step[1]) and arena <= step[1] and step[1] + 8 <= mm.ARENA_END, path,
                      f"field {sat}: a check is [\"check\", address] with its two status words in the image's "
                      "data area of SRAM")
            else:
                _need(kind == "get" and len(step) == 3 and _is_int(step[1]) and isinstance(step[2], list)
                      and all(isinstance(q, list) and q and q[0] in ("dram", "dram8") for q in step[2]), path,
                      f"field {sat}: not a put, remote, run, check or get step")
                # results land in the DRAM past the constants
                n = sum(4 * _span(path, f"{sat}[2][{q}]", part, dram["init_bytes"], dram["bytes"])
                        if part[0] == "dram" else
                        _span8(path, f"{sat}[2][{q}]", part, dram["init_bytes"], dram["bytes"])
                        for q, part in enumerate(step[2]))
                _need(arena <= step[1] and step[1] + n <= mm.ARENA_END, path,
                      f"field {sat}: SRAM [{step[1]:#x}, {step[1] + n:#x}) outside the image's data area")
        has_jobs.add(job["layer"])
    _need(has_jobs | host == set(range(len(layers))), path,
          "field jobs: a layer has neither jobs nor an entry in the manifest's host list")
    return jobs


def _check_pes(path: str, m: dict, files: dict) -> None:
    """Every PE id the manifest names is a PE of the system its region's program was built for."""
    from ..program.format import Program
    for r, region in enumerate(m["regions"]):
        try:
            arch = Program.from_bytes(files[region["program"]]).arch
        except Exception as err:  # noqa: BLE001 - any decoding failure is the file's fault
            raise FirmwareError(os.path.join(os.path.dirname(path), region["program"]),
                                f"not a valid spinn program ({err})") from None
        from ..target.arch import ArchError, SpinnArch
        try:
            own = SpinnArch.from_dict(region["arch"])
        except (ArchError, TypeError, ValueError) as err:
            raise FirmwareError(path, f"field regions[{r}].arch: not a system ({err})") from None
        _need(own == arch, path, f"field regions[{r}].arch: differs from the system of {region['program']}")
        total = arch.total_pes
        named = [(f"layers[{i}].pes", p) for i, layer in enumerate(region["layers"]) for p in layer["pes"]]
        named += [(f"schedule[{s}].jobs", j[0]) for s, step in enumerate(region["schedule"]) for j in step["jobs"]]
        named += [(f"boot[{b}].load", x[0]) for b, step in enumerate(region["boot"]) for x in step["load"]]
        named += [(f"pe_jobs[{q}]", x[0]) for q, x in enumerate(region["pe_jobs"])]
        for field, pe in named:
            _need(pe < total, path, f"field regions[{r}].{field}: PE {pe} does not exist (the system has {total} PEs)")


def load_firmware(directory: "str | os.PathLike") -> Firmware:
    """Read and check a firmware directory written by :func:`export_firmware`.

    Raises
    ------
    FirmwareError
        Naming the file at fault: a missing or unreadable file, a manifest that is not valid
        JSON or has a missing or wrong field (a field of the wrong type, a reference to a layer,
        tile, image or file that does not exist, a PE id outside the system the region's
        program was built for), a file whose size or SHA-256 differs from the manifest's, an
        image that is not a complete ARM ELF executable for the PE's SRAM or whose ``halt`` or
        ``arena`` differs from its symbols; a DRAM layout, ``arch``, ``pe_jobs`` or ``host``
        field that is malformed or contradicts the rest; a job file (``r<i>.jobs.json``) whose
        jobs contradict the manifest, wait for a later job, or place or read outside the image's
        data area of SRAM or the region's DRAM.

    Returns
    -------
    Firmware
        The files, the manifest and, per region, its jobs.
    """
    directory = os.fspath(directory)
    mpath = os.path.join(directory, MANIFEST)

    def read(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as err:
            raise FirmwareError(path, f"cannot be read ({err.strerror or err})") from None

    try:
        manifest = json.loads(read(mpath).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FirmwareError(mpath, f"not valid JSON ({err})") from None
    _check_manifest(mpath, manifest)
    files = {}
    for name, rec in sorted(manifest["files"].items()):
        path = os.path.join(directory, name)
        data = read(path)
        _need(len(data) == rec["bytes"], path, f"{len(data)} bytes, the manifest says {rec['bytes']} (truncated?)")
        _need(_sha(data) == rec["sha256"], path, "SHA-256 differs from the manifest's")
        files[name] = data
    _check_pes(mpath, manifest, files)
    for name, rec in sorted(manifest["images"].items()):
        _check_elf(os.path.join(directory, rec["file"]), files[rec["file"]], rec, name)
    jobs = tuple(_check_jobs(directory, r, region, manifest, files) for r, region in enumerate(manifest["regions"]))
    for r, region in enumerate(manifest["regions"]):
        if "self_dma" in region:
            from .selfdma import check_region
            sdma = region["self_dma"]
            table = sdma.get("file") if isinstance(sdma, dict) and isinstance(sdma.get("file"), str) else ""
            fault = check_region(mpath, os.path.join(directory, table), r, region, jobs[r],
                                 {n: files[rec["file"]] for n, rec in manifest["images"].items()}, files)
            if fault:
                raise FirmwareError(*fault)
    return Firmware(files=files, manifest=manifest, jobs=jobs)

