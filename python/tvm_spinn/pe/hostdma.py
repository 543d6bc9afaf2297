"""The host's side of a firmware region's DRAM: its layout filled from the initial DRAM and the
inputs, the outputs read back, and the DMA transfers a host plays for a job's steps (gathers
by the job's descriptors, scatters, the kernel's status words). Shared by the sequential
loader (:mod:`.loader`) and the concurrent run (:mod:`.multi`)."""

from __future__ import annotations

import numpy as np

from .jobs import expand  # jobs imports the iss execution only inside its functions

__all__: list = []


def _gather(words: np.ndarray, parts: list) -> bytes:
    """The bytes a ``put``/``remote`` step's parts assemble, in order."""
    out = []
    for part in parts:
        if part[0] == "dram":
            out.append(words[expand(part[1:]) // 4].tobytes())
        elif part[0] == "dram8":  # 1-byte elements (the engine's EB = 1)
            out.append(words.view(np.uint8)[expand(part[1:])].tobytes())
        elif part[0] == "fill":
            out.append(np.full(part[2], part[1], dtype="<u4").tobytes())
        else:  # "bytes"
            out.append(bytes.fromhex(part[1]))
    return b"".join(out)


def _scatter(words: np.ndarray, machine, address: int, parts: list) -> None:
    """A ``get`` step: the SRAM bytes from ``address`` on, scattered into DRAM ``words`` by the
    parts' descriptors in order (``dram``: 32-bit words, ``dram8``: bytes)."""
    raw = words.view(np.uint8)
    for part in parts:
        addr = expand(part[1:])
        if part[0] == "dram8":
            raw[addr] = np.frombuffer(machine.read(address, addr.size), dtype=np.uint8)
            address += addr.size
        else:
            words[addr // 4] = np.frombuffer(machine.read(address, 4 * addr.size), dtype="<u4")
            address += 4 * addr.size


def _check_status(machine, address: int, layer: dict) -> None:
    """A ``check`` step: the kernel's two status words at ``address``; a nonzero first word is an
    input the kernel refused (the second word: the value at fault)."""
    bad, value = np.frombuffer(machine.read(address, 8), dtype="<i4")
    if bad:
        raise IndexError(f"layer {layer['name']!r} ({layer['kind']}): input value {int(value)} is out of range "
                         f"(the kernel's status words at {address:#x})")


def _region_dram(fw, region: int, inputs: list) -> tuple:
    """Region ``region``'s manifest record, its tensors by id and its DRAM (32-bit words): the
    initial contents with ``inputs`` written at their offsets (one ``ValueError`` naming what is
    wrong: the region, a layer left to the host, the inputs' number, shape or dtype)."""
    regions = fw.manifest["regions"]
    if not 0 <= region < len(regions):
        raise ValueError(f"region {region}: the firmware has {len(regions)} regions")
    reg = regions[region]
    if reg["host"]:
        first = reg["host"][0]
        layer = reg["layers"][first["layer"]]
        raise ValueError(f"region {region} cannot run from the firmware alone: layer {layer['name']!r} "
                         f"({layer['kind']}) is left to the host: {first['reason']}")
    dram = reg["dram"]
    tensors = {t["id"]: t for t in dram["tensors"]}
    if len(inputs) != len(dram["inputs"]):
        raise ValueError(f"region {region} takes {len(dram['inputs'])} inputs, got {len(inputs)}")
    mem = np.zeros(dram["bytes"] // 4, dtype="<u4")
    raw = mem.view(np.uint8)
    init = fw.files[dram["file"]]
    raw[:len(init)] = np.frombuffer(init, dtype=np.uint8)
    for tid, x in zip(dram["inputs"], inputs):
        rec = tensors[tid]
        x = np.asarray(x)
        if list(x.shape) != rec["shape"] or x.dtype.name != rec["dtype"]:
            raise ValueError(f"input tensor {tid}: expected {rec['dtype']}{rec['shape']}, got {x.dtype.name}"
                             f"{list(x.shape)}")
        raw[rec["offset"]:rec["offset"] + rec["bytes"]] = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)
    return reg, tensors, mem


def _outputs(reg: dict, tensors: dict, mem: np.ndarray) -> list[np.ndarray]:
    """The region's outputs read from DRAM (``dram.outputs`` order)."""
    raw = mem.view(np.uint8)
    out = []
    for tid in reg["dram"]["outputs"]:
        rec = tensors[tid]
        data = raw[rec["offset"]:rec["offset"] + rec["bytes"]].tobytes()
        out.append(np.frombuffer(data, dtype=rec["dtype"]).reshape(rec["shape"]).copy())
    return out
