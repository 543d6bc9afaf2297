"""Edits of an exported firmware directory for the loaders' refusal tests: the manifest, or a
region's job file with its size and hash in the manifest kept consistent."""

from __future__ import annotations

import hashlib
import json

from tvm_spinn.pe.firmware import MANIFEST


def rewrite_manifest(directory, edit) -> None:
    """Edit ``directory``'s manifest in place (``edit(manifest)``)."""
    path = directory / MANIFEST
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def rewrite_jobs(directory, edit, region: int = 0) -> None:
    """Edit region ``region``'s job file (``edit(doc)``), its size and hash updated in the manifest."""
    name = f"r{region}.jobs.json"
    doc = json.loads((directory / name).read_text())
    edit(doc)
    data = json.dumps(doc).encode()
    (directory / name).write_bytes(data)
    rewrite_manifest(directory, lambda m: m["files"][name].update(
        bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
