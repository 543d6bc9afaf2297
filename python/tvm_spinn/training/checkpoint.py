"""Checkpoints: parameters + optimizer state + step count in one ``.npz``, written atomically.

The file is written to a temporary file in the destination's directory, flushed and fsynced,
then moved over the destination with :func:`os.replace` (atomic on POSIX): a failed or
interrupted save leaves the previous checkpoint as it was. Values are stored bit for bit, so a
run resumed from a checkpoint continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from .._files import atomic_write
from .errors import CheckpointError

__all__ = ["write_checkpoint", "read_checkpoint", "FORMAT"]

FORMAT = "tvm_spinn.training/1"


def write_checkpoint(path, params: dict, optim_state: list, meta: dict) -> None:
    """Write ``params`` (name -> array), the optimizer state and ``meta`` (str -> str) to ``path``."""
    arrays = {f"param/{k}": np.asarray(v) for k, v in params.items()}
    arrays.update({f"optim/{i:04d}": np.asarray(v) for i, v in enumerate(optim_state)})
    arrays.update({f"meta/{k}": np.array(str(v)) for k, v in meta.items()})
    arrays["meta/format"] = np.array(FORMAT)
    # a file object: numpy does not append ".npz" to the name
    atomic_write(path, lambda f: np.savez(f, **arrays), fsync=True)


def read_checkpoint(path) -> tuple[dict, list, dict]:
    """``(params, optim_state, meta)`` of a checkpoint written by :func:`write_checkpoint`."""
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            files = {k: np.array(data[k]) for k in data.files}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(f"checkpoint {path}: not a readable .npz file ({err})") from None
    meta = {k[5:]: str(v) for k, v in files.items() if k.startswith("meta/")}
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: field meta/format is {meta.get('format')!r}, expected {FORMAT!r}")
    params = {k[6:]: v for k, v in files.items() if k.startswith("param/")}
    optim = [files[k] for k in sorted(k for k in files if k.startswith("optim/"))]
    return params, optim, meta
