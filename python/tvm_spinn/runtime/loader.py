"""Safe loading of exported libraries.

``tvm.runtime.load_module`` dlopens the file; a truncated shared object makes the dynamic loader
fault (SIGBUS) instead of raising. :func:`load_module` checks the ELF structure first (every
segment and the section table inside the file) and reports a damaged file as a Python error; the
spinn programs inside are then verified by the ``spinn`` module loader (container checksum).
"""

from __future__ import annotations

import os
import struct

import tvm

__all__ = ["load_module", "LibraryError", "check_elf"]


class LibraryError(ValueError):
    """An exported library that cannot be loaded (names the file and the defect)."""


def check_elf(path: str) -> None:
    """Raise :class:`LibraryError` unless ``path`` is a structurally complete ELF file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF":
            raise LibraryError(f"{path}: not an ELF shared library")
        if ident[4] != 2 or ident[5] != 1:
            raise LibraryError(f"{path}: only 64-bit little-endian ELF libraries are supported")
        (phoff, shoff) = struct.unpack_from("<QQ", ident, 32)
        (phentsize, phnum, shentsize, shnum) = struct.unpack_from("<HHHH", ident, 54)
        if phoff + phentsize * phnum > size or shoff + shentsize * shnum > size:
            raise LibraryError(f"{path}: truncated (headers point past the end of the {size}-byte file)")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
            raise LibraryError(
                f"{path}: truncated (segment {i} needs {p_offset + p_filesz} bytes, file has {size})"
            )


def load_module(path: "str | os.PathLike") -> tvm.runtime.Module:
    """Load an exported library (``ex.export_library``) after checking it is intact.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.so`` written by ``export_library``.

    Returns
    -------
    tvm.runtime.Module
        Pass it to ``relax.VirtualMachine``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LibraryError(f"{path}: no such file")
    check_elf(path)
    try:
        return tvm.runtime.load_module(path)
    except Exception as err:
        raise LibraryError(f"{path}: cannot load: {str(err).strip().splitlines()[-1]}") from None
