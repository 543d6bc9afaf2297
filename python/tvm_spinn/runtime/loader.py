"""Export and verified loading of libraries (``.so``) holding a spinn build.

``tvm.runtime.load_module`` dlopens a file and then deserializes the VM executable and every
imported module from it; a damaged file makes TVM's loader fault (SIGSEGV, SIGBUS), abort, exit
the process, or allocate gigabytes for a corrupted length field before it fails. No check inside
TVM's formats can prevent that, so the whole artifact is sealed instead:

* :func:`export_library` writes the library (TVM's ``export_library``) and appends an *integrity
  trailer*: a small JSON record and a fixed footer (magic, lengths, format version) with a BLAKE2b
  digest of every byte before it. The dynamic loader ignores bytes after the ELF contents, so the
  file is still an ordinary shared library. With ``tvm_spinn`` imported, ``ex.export_library``
  of an executable that contains spinn modules goes through the same function.
* :func:`load_module` verifies the trailer (lengths against the file size first, then the digest,
  a tree of per-segment digests computed on every core from a memory map: constant memory) and
  the ELF structure *before* TVM sees the file, so a
  corrupted, truncated or foreign file is one :class:`LibraryError` naming the file and the defect.

A library without the trailer (exported by plain TVM, stripped, or any other shared object) is
refused with a :class:`LibraryError` that says so: its contents cannot be verified, and only a
verified file is handed to TVM. ``tvm.runtime.load_module`` still loads trusted plain libraries.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tvm

from ..program.format import ProgramError

__all__ = ["load_module", "export_library", "install_export_hook", "LibraryError", "check_elf",
           "verify_library", "file_mode", "TRAILER_MAGIC"]


class LibraryError(ValueError):
    """An exported library that cannot be loaded or written (names the file and the defect)."""


#: Last 8 bytes of a sealed library.
TRAILER_MAGIC = b"SPNNSEAL"
_VERSION = 2  # 2: segment-tree digest (1 hashed the file sequentially)
# Footer (at the very end of the file): body_len u64, meta_len u32, version u32, digest, magic.
_DIGEST_SIZE = 32
_FOOTER = struct.Struct(f"<QII{_DIGEST_SIZE}s8s")
_MAX_META = 1 << 20  # the JSON record is a few hundred bytes; anything larger is damage
#: Bytes per leaf of the digest tree (see :func:`_digest`).
_SEGMENT = 32 << 20


def _digest(f, length: int, extra: bytes) -> bytes:
    """Digest of the first ``length`` bytes of ``f`` followed by ``extra``: BLAKE2b-256 over the
    BLAKE2b-256 digests of consecutive :data:`_SEGMENT`-byte segments, then ``extra``.

    The file is mapped, not read (constant memory), and the segments are hashed on every core
    (hashlib releases the GIL): a library of hundreds of MB is verified in a fraction of the
    time of one sequential pass."""
    leaves: list[bytes] = []
    if length:
        spans = [(start, min(start + _SEGMENT, length)) for start in range(0, length, _SEGMENT)]
        with mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                def leaf(span: tuple[int, int]) -> bytes:
                    return hashlib.blake2b(view[span[0]:span[1]], digest_size=_DIGEST_SIZE).digest()

                workers = max(1, min(len(spans), os.cpu_count() or 1))
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    leaves = list(pool.map(leaf, spans))
            finally:
                view.release()
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for d in leaves:
        h.update(d)
    h.update(extra)
    return h.digest()


def _seal(path: str, meta: dict[str, Any]) -> None:
    """Append the integrity trailer to the (complete) library at ``path``."""
    body_len = os.path.getsize(path)
    record = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    with open(path, "r+b") as f:
        head = struct.pack("<QII", body_len, len(record), _VERSION)
        digest = _digest(f, body_len, record + head)
        f.seek(body_len)
        f.write(record + _FOOTER.pack(body_len, len(record), _VERSION, digest, TRAILER_MAGIC))
        f.flush()
        os.fsync(f.fileno())


def verify_library(path: str) -> dict[str, Any]:
    """Check the integrity trailer of ``path``; return its JSON record.

    Raises
    ------
    LibraryError
        The file has no trailer (not exported by tvm-spinn), inconsistent lengths (truncated or
        extended), a digest mismatch (any changed byte), or an unreadable record.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size >= _FOOTER.size:
            f.seek(size - _FOOTER.size)
            footer = f.read(_FOOTER.size)
        else:
            footer = b""
        if len(footer) != _FOOTER.size or footer[-8:] != TRAILER_MAGIC:
            raise LibraryError(
                f"{path}: not a library exported by tvm-spinn (no integrity trailer; the file is "
                f"damaged, truncated, or was written by plain TVM or another tool). Export it with "
                f"tvm_spinn.export_library(ex, path) (`ex.export_library` of a spinn build does this)"
            )
        body_len, meta_len, version, digest, _ = _FOOTER.unpack(footer)
        if version != _VERSION:
            raise LibraryError(f"{path}: integrity trailer version {version}, this tvm-spinn reads "
                               f"version {_VERSION}")
        # Lengths are checked against the file size before anything is read or allocated.
        if meta_len > _MAX_META or body_len + meta_len + _FOOTER.size != size:
            raise LibraryError(
                f"{path}: damaged or truncated (the trailer records {body_len} + {meta_len} + "
                f"{_FOOTER.size} bytes, the file has {size})"
            )
        f.seek(body_len)
        record = f.read(meta_len)
        head = struct.pack("<QII", body_len, meta_len, version)
        if _digest(f, body_len, record + head) != digest:
            raise LibraryError(f"{path}: damaged (BLAKE2b digest mismatch: the contents changed "
                               f"after export)")
    try:
        meta = json.loads(record)
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except ValueError as err:
        raise LibraryError(f"{path}: unreadable integrity record: {err}") from None
    return meta


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


def _identity(path: str) -> tuple[int, int, int, int]:
    """(device, inode, size, modification time) of the file at ``path``."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def load_module(path: "str | os.PathLike") -> tvm.runtime.Module:
    """Load a library written by :func:`export_library` after verifying every byte of it.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.so`` written by :func:`export_library` (or ``ex.export_library`` of a spinn build).

    Returns
    -------
    tvm.runtime.Module
        The Relax VM executable; pass it to ``relax.VirtualMachine``.

    Raises
    ------
    ProgramError
        A spinn program inside fails validation (the message names the field).
    LibraryError
        Missing file, no integrity trailer (not exported by tvm-spinn), any damage (digest or
        length mismatch, broken ELF structure), or a library that is not a Relax VM executable.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LibraryError(f"{path}: no such file")
    try:
        before = _identity(path)
        verify_library(path)
        check_elf(path)
    except OSError as err:
        raise LibraryError(f"{path}: cannot read: {err.strerror or err}") from None
    from .executor import sealed_file

    try:
        with sealed_file():  # every byte was just verified: programs skip their own digest pass
            lib = tvm.runtime.load_module(path)
    except ProgramError as err:
        # a sealed library whose spinn program fails validation: keep the type and the field
        raise ProgramError(f"{path}: {err}") from None
    except Exception as err:
        raise LibraryError(f"{path}: cannot load: {str(err).strip().splitlines()[-1]}") from None
    # The verified file must be the one TVM read: a file replaced or rewritten at ``path`` in
    # between (a concurrent export) would otherwise run with its programs' digests unchecked.
    try:
        changed = _identity(path) != before
    except OSError:
        changed = True
    if changed:
        raise LibraryError(f"{path}: the file changed while it was being loaded; load it again")
    if lib.kind != "relax.VMExecutable":
        raise LibraryError(f"{path}: holds a {lib.kind!r} module, not a Relax VM executable")
    return lib


# -- export ---------------------------------------------------------------------------------------

_ORIGINAL_EXPORT = None  # tvm.runtime.Executable.export_library before install_export_hook


def _umask() -> int:
    """The process umask; from /proc where possible (``os.umask`` must set it to read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(executable: bool = False) -> int:
    """The mode the umask gives a new file (``0o777`` for executables such as libraries)."""
    return (0o777 if executable else 0o666) & ~_umask()


def _has_spinn_modules(mod: tvm.runtime.Module) -> bool:
    stack = [mod]  # the import tree is small and acyclic
    while stack:
        m = stack.pop()
        if m.kind == "spinn":
            return True
        stack.extend(m.imports)
    return False


def _metadata() -> dict[str, Any]:
    from .._version import __version__

    return {"exporter": "tvm_spinn.export_library", "tvm_spinn": __version__, "tvm": tvm.__version__}


def export_library(ex: Any, path: "str | os.PathLike", **kwargs: Any) -> None:
    """Write ``ex`` as a sealed shared library that :func:`load_module` verifies before loading.

    The file appears atomically (a temporary file in the same directory is renamed into place,
    nothing is left behind on failure) with the mode the umask gives a new executable file.

    Parameters
    ----------
    ex : tvm.runtime.Executable or tvm.runtime.Module
        What ``relax.build`` returned (or its ``.mod``).
    path : str or os.PathLike
        Output ``.so`` path; its directory must exist.
    **kwargs
        Passed to TVM's ``export_library`` (``fcompile``, ``options``...). The result must be
        an ELF shared library.

    Raises
    ------
    LibraryError
        The output directory does not exist, or the export did not produce an ELF library.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise LibraryError(f"{path}: output directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp.so", dir=directory)
    os.close(fd)
    try:
        if _ORIGINAL_EXPORT is not None and isinstance(ex, tvm.runtime.Executable):
            _ORIGINAL_EXPORT(ex, tmp, **kwargs)
        else:
            ex.export_library(tmp, **kwargs)
        with open(tmp, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise LibraryError(f"{path}: the export did not produce an ELF shared library")
        _seal(tmp, _metadata())
        os.chmod(tmp, file_mode(executable=True))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def install_export_hook() -> None:
    """Route ``ex.export_library(...)`` of spinn builds through :func:`export_library` (idempotent).

    Only executables whose module tree contains a ``spinn`` module and whose output is a shared
    library (not ``.tar``/``.wasm``, default ``fcompile``) are sealed; everything else is exported by
    TVM unchanged.
    """
    global _ORIGINAL_EXPORT
    cls = tvm.runtime.Executable
    if getattr(cls.export_library, "_spinn", False):
        return
    original = cls.export_library
    _ORIGINAL_EXPORT = original

    def export(self, file_name, *, fcompile=None, addons=None, workspace_dir=None, **kwargs):
        name = os.fspath(file_name)
        if (fcompile is None and not name.endswith((".tar", ".wasm"))
                and _has_spinn_modules(self.mod)):
            return export_library(self, name, addons=addons, workspace_dir=workspace_dir, **kwargs)
        return original(self, file_name, fcompile=fcompile, addons=addons,
                        workspace_dir=workspace_dir, **kwargs)

    export._spinn = True
    export.__doc__ = original.__doc__
    cls.export_library = export
