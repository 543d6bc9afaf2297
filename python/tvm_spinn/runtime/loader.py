"""Export and verified loading of libraries (``.so``) holding a spinn build.

``tvm.runtime.load_module`` dlopens a file and then deserializes the VM executable and every
imported module from it; a damaged file makes TVM's loader fault (SIGSEGV, SIGBUS), abort, exit
the process, or allocate gigabytes for a corrupted length field before it fails. No check inside
TVM's formats can prevent that, so the whole artifact is sealed instead:

* :func:`export_library` writes the library (TVM's ``export_library``), then the spinn programs
  (weights included) *after* the ELF contents, then an *integrity trailer*: a small JSON record
  (which also locates each program by its digest) and a fixed footer (magic, lengths, format
  version) with a digest of every byte before it (XXH3-128 per segment under a SHA-256
  root). The dynamic loader ignores bytes after
  the ELF contents, so the file is still an ordinary shared library.
* :func:`load_module` verifies the trailer (lengths against the file size first, then the digest,
  a tree of per-segment digests computed on every core from a memory map: constant memory) and
  the ELF structure *before* TVM sees the file, so a
  corrupted, truncated or foreign file is one :class:`LibraryError` naming the file and the defect.
  The programs are then read in place from that same verified memory map: TVM's loader would
  copy every byte of a module it deserializes twice, and hundreds of MB of weights made those
  copies most of the time to the first result.

The library file must not be rewritten in place while it is loaded (as for any shared library
the process has mapped); :func:`export_library` replaces a file atomically, which is safe.

A library exported by TVM's own ``export_library`` (``ex.export_library(path)``: no trailer,
each spinn module's program inside TVM's module blob) is loaded too, with what can be checked
without a seal: the file must be a complete ELF shared library that ends where its ELF contents
end (a sealed file whose trailer is damaged or cut has bytes after them, and is refused) and
exports TVM's module blob (``__tvm_ffi__library_bin``); every spinn module container then
verifies itself while TVM loads it (a checksum over its framing and the program's digest, and
the program's BLAKE2b digest of its contents), so a damaged spinn module is one error naming
the file. The rest of such a file (the VM bytecode, the fallback's code) has no digest: damage
there is found only in a sealed library. Any other file (no trailer, bytes after the ELF
contents, not a TVM library) is refused with a :class:`LibraryError` that says so.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tvm
import tvm_ffi
import xxhash

from .._files import atomic_output, file_mode
from ..program.format import _READABLE_VERSIONS as _PROGRAM_VERSIONS
from ..program.format import CHECKSUM_BYTES, ProgramError, program_digest

__all__ = ["load_module", "export_library", "has_spinn_modules", "LibraryError", "check_elf",
           "verify_library", "file_mode", "TRAILER_MAGIC"]


class LibraryError(ValueError):
    """An exported library that cannot be loaded or written (names the file and the defect)."""


#: Last 8 bytes of a sealed library.
TRAILER_MAGIC = b"SPNNSEAL"
# 4: XXH3-128 segment digests under a SHA-256 root, programs after the ELF contents;
# 3: SHA-256 segment tree, programs after the ELF contents (located by the record's "programs");
# 2: BLAKE2b-256 segment tree, programs inside TVM's module blob (still read); 1: sequential.
_VERSION = 4
# Leaf hash (over each segment) and root hash (over the leaves and the record) of each version.
# The seal detects damage (truncation, bit rot, a foreign or half-written file), not forgery:
# XXH3-128 (xxhash) hashes about 6x faster than SHA-256 with the CPU's SHA extensions (measured
# 4.5 vs 0.78 GB/s on one core here), and the leaves were most of a large library's load time.
_HASHES = {2: (lambda data=b"": hashlib.blake2b(data, digest_size=_DIGEST_SIZE),) * 2,
           3: (hashlib.sha256, hashlib.sha256),
           4: (xxhash.xxh3_128, hashlib.sha256)}
# Footer (at the very end of the file): body_len u64, meta_len u32, version u32, digest, magic.
_DIGEST_SIZE = 32
#: Alignment of each program in the file (a memory map is page-aligned; constants stay aligned).
_PROGRAM_ALIGN = 64
_FOOTER = struct.Struct(f"<QII{_DIGEST_SIZE}s8s")
_MAX_META = 1 << 20  # the JSON record is a few hundred bytes; anything larger is damage
#: Bytes per leaf of the digest tree (see :func:`_digest`).
_SEGMENT = 32 << 20


def _map(f, length: int) -> "mmap.mmap | None":
    """A private (copy-on-write) map of the first ``length`` bytes of ``f``: writable, so numpy
    views of it can be handed to the C++ module (DLPack exports no read-only arrays); nothing
    writes it, and the views the runtime parses are marked read-only."""
    return mmap.mmap(f.fileno(), length, access=mmap.ACCESS_COPY) if length else None


def _digest(mapped: "mmap.mmap | None", length: int, extra: bytes, version: int = _VERSION) -> bytes:
    """Digest of the first ``length`` bytes of ``mapped`` followed by ``extra``: the version's
    hash (:data:`_HASHES`) over the hashes of consecutive :data:`_SEGMENT`-byte segments, then
    ``extra``.

    The file is mapped, not read (constant memory), and the segments are hashed on every core
    (hashlib releases the GIL; XXH3 is fast enough without it): a library of hundreds of MB is verified in a fraction of the
    time of one sequential pass."""
    new_leaf, new_root = _HASHES[version]
    leaves: list[bytes] = []
    if length:
        spans = [(start, min(start + _SEGMENT, length)) for start in range(0, length, _SEGMENT)]
        view = memoryview(mapped)
        try:
            def leaf(span: tuple[int, int]) -> bytes:
                return new_leaf(view[span[0]:span[1]]).digest()

            workers = max(1, min(len(spans), os.cpu_count() or 1))
            if workers == 1:
                leaves = [leaf(span) for span in spans]
            else:
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    leaves = list(pool.map(leaf, spans))
        finally:
            view.release()
    h = new_root()
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
        mapped = _map(f, body_len)
        try:
            digest = _digest(mapped, body_len, record + head, _VERSION)
        finally:
            if mapped is not None:
                mapped.close()
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
    meta, mapped = _verify(path)
    if mapped is not None:
        mapped.close()
    return meta


def _footer(f, path: str, size: int) -> tuple[int, int, int, bytes]:
    """(body_len, meta_len, version, digest) of the trailer of ``f``, lengths checked."""
    if size >= _FOOTER.size:
        f.seek(size - _FOOTER.size)
        footer = f.read(_FOOTER.size)
    else:
        footer = b""
    if len(footer) != _FOOTER.size or footer[-8:] != TRAILER_MAGIC:
        raise LibraryError(
            f"{path}: not a library exported by tvm-spinn (no integrity trailer; the file is "
            f"damaged or truncated, or was written by another tool). Export it with "
            f"tvm_spinn.export_library(ex, path), which seals it"
        )
    body_len, meta_len, version, digest, _ = _FOOTER.unpack(footer)
    if version not in _HASHES:
        raise LibraryError(f"{path}: integrity trailer version {version}, this tvm-spinn reads "
                           f"versions {', '.join(map(str, _HASHES))}")
    # Lengths are checked against the file size before anything is read or allocated.
    if meta_len > _MAX_META or body_len + meta_len + _FOOTER.size != size:
        raise LibraryError(
            f"{path}: damaged or truncated (the trailer records {body_len} + {meta_len} + "
            f"{_FOOTER.size} bytes, the file has {size})"
        )
    return body_len, meta_len, version, digest


def _programs(meta: dict[str, Any], body_len: int, path: str) -> dict[bytes, tuple[int, int]]:
    """The record's program locations: {digest: (offset, size)}, each inside the body."""
    out: dict[bytes, tuple[int, int]] = {}
    entries = meta.get("programs", [])
    if not isinstance(entries, list):
        raise LibraryError(f"{path}: unreadable integrity record: programs is not a list")
    for entry in entries:
        try:
            digest, offset, size = entry
            key = bytes.fromhex(digest)
            ok = (len(key) == CHECKSUM_BYTES and type(offset) is int and type(size) is int
                  and 0 <= offset and CHECKSUM_BYTES <= size and offset + size <= body_len)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise LibraryError(f"{path}: unreadable integrity record: bad program entry {entry!r:.200}")
        out[key] = (offset, size)
    return out


def _verify(path: str) -> tuple[dict[str, Any], "mmap.mmap | None"]:
    """:func:`verify_library`, also returning the verified memory map of the body (the
    caller closes it), from which the programs are read (see :func:`_locations`)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        body_len, meta_len, version, digest = _footer(f, path, size)
        f.seek(body_len)
        record = f.read(meta_len)
        head = struct.pack("<QII", body_len, meta_len, version)
        mapped = _map(f, body_len)
    try:
        if _digest(mapped, body_len, record + head, version) != digest:
            raise LibraryError(f"{path}: damaged (digest mismatch: the contents changed after "
                               f"export)")
        try:
            meta = json.loads(record)
            if not isinstance(meta, dict):
                raise ValueError("not an object")
        except ValueError as err:
            raise LibraryError(f"{path}: unreadable integrity record: {err}") from None
        _programs(meta, body_len, path)
    except BaseException:
        if mapped is not None:
            mapped.close()
        raise
    return meta, mapped


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


#: Symbol under which TVM's ``export_library`` stores the serialized module tree of a library.
_TVM_BLOB_SYMBOL = b"__tvm_ffi__library_bin"


def _plain_tvm_library(path: str) -> bool:
    """Whether ``path`` (no integrity trailer) is a library as TVM's ``export_library`` writes it:
    a 64-bit little-endian ELF file that ends exactly where its ELF contents end (its headers,
    segments and sections; a sealed file has its programs and trailer after them) and whose
    dynamic symbol names include TVM's module blob. Reads the headers and the dynamic string
    table only; every offset is checked against the file size first."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return False
        phoff, shoff = struct.unpack_from("<QQ", ident, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", ident, 54)
        if phentsize < 56 or shentsize < 64 or shnum == 0 or phoff + phentsize * phnum > size \
                or shoff + shentsize * shnum > size:
            return False
        end = max(64, phoff + phentsize * phnum, shoff + shentsize * shnum)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            _, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            end = max(end, p_offset + p_filesz)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQII", table, i * shentsize) for i in range(shnum)]
        for _, sh_type, _, _, sh_offset, sh_size, _, _ in sections:
            if sh_type != 8:  # SHT_NOBITS occupies no file bytes
                end = max(end, sh_offset + sh_size)
        if end != size:
            return False
        for _, sh_type, _, _, _, _, sh_link, _ in sections:
            if sh_type != 11 or sh_link >= shnum:  # SHT_DYNSYM, whose sh_link is its string table
                continue
            _, _, _, _, str_offset, str_size, _, _ = sections[sh_link]
            if str_size > _MAX_DYNSTR:
                return False
            f.seek(str_offset)
            return b"\0" + _TVM_BLOB_SYMBOL + b"\0" in f.read(str_size)
    return False


#: The dynamic string table of an exported library names a few dozen symbols; larger is damage.
_MAX_DYNSTR = 64 << 20


def _identity(path: str) -> tuple[int, int, int, int]:
    """(device, inode, size, modification time) of the file at ``path``."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _locations(meta: dict[str, Any], mapped: "mmap.mmap | None", path: str):
    """(mapped, {digest: (offset, size)}) of the programs stored after the ELF contents."""
    return mapped, _programs(meta, len(mapped) if mapped is not None else 0, path)


# While tvm_spinn.load_module has TVM load a verified library on this thread: (memory map of
# its body, program locations), for _resolve_program; ``plain`` while it has TVM load a library
# without a trailer (whose programs then cannot be stored after its ELF contents).
_LOADING = threading.local()
# (path, identity, mapped, locations) of the library a plain tvm.runtime.load_module last
# resolved from (its modules are loaded one after another).
_FOUND: list = []


def _mapped_paths() -> list[str]:
    """Files mapped into this process (the libraries dlopen has loaded among them)."""
    paths: dict[str, None] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    paths[fields[5].rstrip("\n")] = None
    except OSError:
        pass
    return list(reversed(paths))


def _holds(mapped, where: tuple[int, int], digest: bytes) -> bool:
    """Whether the program at ``where`` in ``mapped`` is intact and is the one named ``digest``
    (its trailing digest of every other byte, :func:`~tvm_spinn.program.format.program_digest`
    of the program's format version)."""
    offset, size = where
    view = memoryview(mapped)[offset:offset + size]
    try:
        if size < 12 + CHECKSUM_BYTES or bytes(view[size - CHECKSUM_BYTES:]) != digest:
            return False
        version = struct.unpack_from("<I", view, 8)[0]
        return (version in _PROGRAM_VERSIONS
                and program_digest(view[:size - CHECKSUM_BYTES], version) == digest)
    finally:
        view.release()


def _find_mapped(digest: bytes):
    """Locate ``digest`` for a plain ``tvm.runtime.load_module`` (no tvm_spinn.load_module
    verification): in the sealed libraries mapped into the process. Which of them TVM is
    loading is not known here, and another one (an earlier build of the same model: the same
    program, the same digest) may since have been damaged on disk, so a candidate counts only
    if its bytes hash to the digest; the trailer is not verified."""
    if _FOUND:
        path, identity, mapped, locations = _FOUND[0]
        try:
            same = _identity(path) == identity  # a file rewritten since: map it again
        except OSError:
            same = False
        if same and digest in locations and _holds(mapped, locations[digest], digest):
            return mapped, locations
        _FOUND.clear()
    for path in _mapped_paths():
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                body_len, meta_len, version, _ = _footer(f, path, size)
                if version < 3:
                    continue
                f.seek(body_len)
                locations = _programs(json.loads(f.read(meta_len)), body_len, path)
                if digest not in locations:
                    continue
                mapped = _map(f, body_len)
            if not _holds(mapped, locations[digest], digest):
                mapped.close()
                continue
            _FOUND[:] = [(path, _identity(path), mapped, locations)]
            return mapped, locations
        except (OSError, ValueError, AttributeError, TypeError):  # LibraryError is a ValueError
            continue
    raise LibraryError(f"spinn program {digest.hex()[:16]}...: stored after the ELF contents of "
                       f"a sealed library that is not mapped in this process; load the library "
                       f"with tvm_spinn.load_module")


@tvm_ffi.register_global_func("tvm_spinn.runtime.resolve_program", override=True)
def _resolve_program(digest: bytes, size: int) -> tvm_ffi.Tensor:
    """The program of a version-3 spinn module container (called from C++ while TVM loads a
    library): a uint8 tensor over the library's memory map, no copy. The C++ module checks its
    size and trailing digest against the container."""
    from .executor import trust_next

    digest = bytes(digest)
    if getattr(_LOADING, "plain", False):
        # tvm_spinn.load_module found no trailer but a complete ELF file holding a program stored
        # after its ELF contents (TVM's own export stores none there): a sealed library cut at its
        # ELF end. Refused even when another mapped library holds the program: the file is damaged.
        raise LibraryError(f"spinn program {digest.hex()[:16]}...: stored after the ELF contents "
                           f"of a sealed library with its programs and integrity trailer cut off")
    loading = getattr(_LOADING, "programs", None)
    mapped, locations = loading if loading is not None else _find_mapped(digest)
    where = locations.get(digest)
    if where is None or where[1] != size:
        raise LibraryError(f"spinn program {digest.hex()[:16]}...: not in the library's record "
                           f"(or not {size} bytes)")
    view = np.frombuffer(mapped, dtype=np.uint8, count=size, offset=where[0])
    if loading is None:  # _find_mapped hashed these very bytes: the validator need not again
        trust_next(view)
    return tvm_ffi.from_dlpack(view)


def load_module(path: "str | os.PathLike") -> tvm.runtime.Module:
    """Load a library written by :func:`export_library` after verifying every byte of it, or
    one written by TVM's ``ex.export_library`` after checking its structure (its spinn modules
    then verify themselves; see the module docstring).

    Parameters
    ----------
    path : str or os.PathLike
        The ``.so`` written by :func:`export_library` (sealed) or by ``ex.export_library``.

    Returns
    -------
    tvm.runtime.Module
        The Relax VM executable; pass it to ``relax.VirtualMachine``.

    Raises
    ------
    ProgramError
        A spinn program inside fails validation (the message names the field).
    LibraryError
        Missing file, neither sealed nor a complete library as TVM exports it, any damage to a
        sealed library (digest or length mismatch, broken ELF structure) or to a spinn module
        container, or a library that is not a Relax VM executable.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LibraryError(f"{path}: no such file")
    try:
        sealed = _has_trailer(path) or not _plain_tvm_library(path)
    except OSError as err:
        raise LibraryError(f"{path}: cannot read: {err.strerror or err}") from None
    if not sealed:
        return _load_plain(path)
    mapped = None
    try:
        before = _identity(path)
        meta, mapped = _verify(path)
        check_elf(path)
        located = _locations(meta, mapped, path)
    except BaseException as err:
        if mapped is not None:
            mapped.close()
        if isinstance(err, OSError):
            raise LibraryError(f"{path}: cannot read: {err.strerror or err}") from None
        raise
    from .executor import sealed_file

    try:
        # Every byte was just verified: programs skip their own digest pass, and those stored
        # after the ELF contents are read from the verified map itself (_resolve_program).
        _LOADING.programs = located
        with sealed_file():
            lib = tvm.runtime.load_module(path)
    except ProgramError as err:
        # a sealed library whose spinn program fails validation: keep the type and the field
        raise ProgramError(f"{path}: {err}") from None
    except Exception as err:
        raise LibraryError(f"{path}: cannot load: {_last_line(err)}") from None
    finally:
        _LOADING.programs = None
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


def _last_line(err: BaseException) -> str:
    """The last line of ``err``'s message (TVM's errors end with the cause, after a traceback),
    or its type's name when the message is empty."""
    return (str(err).strip().splitlines() or [type(err).__name__])[-1]


def _has_trailer(path: str) -> bool:
    """Whether ``path`` ends with the seal's magic (its trailer is then verified in full)."""
    size = os.path.getsize(path)
    if size < len(TRAILER_MAGIC):
        return False
    with open(path, "rb") as f:
        f.seek(size - len(TRAILER_MAGIC))
        return f.read() == TRAILER_MAGIC


def _load_plain(path: str) -> tvm.runtime.Module:
    """Load a library exported by TVM's own ``export_library`` (see the module docstring): each
    spinn module verifies its container and its program's digest while TVM loads it."""
    try:
        _LOADING.plain = True
        lib = tvm.runtime.load_module(path)
    except ProgramError as err:
        raise ProgramError(f"{path}: {err}") from None
    except Exception as err:
        raise LibraryError(f"{path}: cannot load: {_last_line(err)}") from None
    finally:
        _LOADING.plain = False
    if lib.kind != "relax.VMExecutable":
        raise LibraryError(f"{path}: holds a {lib.kind!r} module, not a Relax VM executable")
    return lib


# -- export ---------------------------------------------------------------------------------------

def has_spinn_modules(mod: tvm.runtime.Module) -> bool:
    """Whether ``mod`` or a module it imports (transitively) is a ``spinn`` module."""
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


def _append_programs(path: str, programs: list) -> list:
    """Append each distinct program (bytes, or a mapped uint8 tensor) to ``path``, aligned to
    :data:`_PROGRAM_ALIGN`; return the record's ``[digest hex, offset, size]`` entries."""
    entries = []
    seen: set[bytes] = set()
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        for program in programs:
            data = program if isinstance(program, bytes) else memoryview(np.from_dlpack(program))
            digest = bytes(data[-CHECKSUM_BYTES:])
            if digest in seen:  # the same program in two modules: stored once
                continue
            seen.add(digest)
            pad = -end % _PROGRAM_ALIGN
            f.write(b"\0" * pad)
            end += pad
            f.write(data)
            entries.append([digest.hex(), end, len(data)])
            end += len(data)
    return entries


def export_library(ex: Any, path: "str | os.PathLike", *, output_names: "list[str] | None" = None,
                   **kwargs: Any) -> None:
    """Write ``ex`` as a sealed shared library that :func:`load_module` verifies before loading.

    The file appears atomically (a temporary file in the same directory is synced and renamed
    into place, nothing is left behind on failure) with the mode the umask gives a new
    executable file. A symbolic link is followed (its target is replaced); a device, FIFO or
    socket is refused (see :func:`tvm_spinn._files.output_destination`).

    Parameters
    ----------
    ex : tvm.runtime.Executable or tvm.runtime.Module
        What ``relax.build`` returned (or its ``.mod``).
    path : str or os.PathLike
        Output ``.so`` path; its directory must exist.
    output_names : list of str, optional
        Names of the model's outputs (as in the source model), kept in the seal's record
        (``verify_library(path)["outputs"]``) so that ``tvm-spinn run`` names its results.
    **kwargs
        Passed to TVM's ``export_library`` (``fcompile``, ``options``...). The result must be
        an ELF shared library.

    Raises
    ------
    LibraryError
        The output directory does not exist, or the export did not produce an ELF library.
    tvm_spinn._files.OutputPathError
        ``path`` is a device, FIFO, socket or directory.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(directory):
        raise LibraryError(f"{path}: output directory {directory} does not exist")
    # checked (no device, FIFO or socket; a link's target is replaced), renamed into place, synced
    with atomic_output(path, what="library", suffix=".tmp.so", executable=True) as tmp:
        # The spinn modules serialized during the export keep only a reference to their program
        # (container version 3); the programs are appended after the ELF contents below.
        tvm_ffi.get_global_func("tvm_spinn.runtime.begin_external_export")()
        try:
            # TVM's Module.export_library (what Executable.export_library delegates to)
            module = ex.mod if isinstance(ex, tvm.runtime.Executable) else ex
            module.export_library(tmp, **kwargs)
        finally:
            moved = list(tvm_ffi.get_global_func("tvm_spinn.runtime.end_external_export")())
        with open(tmp, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise LibraryError(f"{path}: the export did not produce an ELF shared library")
        meta = _metadata()
        if output_names is not None:
            meta["outputs"] = [str(name) for name in output_names]
        meta["programs"] = _append_programs(tmp, moved)
        _seal(tmp, meta)
