"""Regenerate and load the ONNX backend node test cases.

The node tests are not shipped in the ``onnx`` wheel; they are produced by
``onnx.backend.test.case.node.collect_testcases()`` (about 1,900 cases, ~12 s). This module
writes them once into a cache directory (never into the repository), one folder per case with
``model.onnx`` and ``data.pkl`` (a list of ``(inputs, outputs)`` data sets as numpy values), so
that worker processes only read the case they run.

The cache lives in ``$TVM_SPINN_CACHE/onnx-node-<onnx version>`` if that variable is set, else
``$XDG_CACHE_HOME/tvm_spinn/...`` (``~/.cache/tvm_spinn/...``), falling back to the system
temporary directory if the home cache is not writable.
"""

from __future__ import annotations

import fnmatch
import os
import pickle
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

from .._env import env

DEFAULT_RTOL = 1e-3
"""Relative tolerance of the ONNX backend test runner (``onnx.backend.test.case.TestCase``)."""
DEFAULT_ATOL = 1e-7
"""Absolute tolerance of the ONNX backend test runner."""

_DONE = ".complete"


@dataclass(frozen=True)
class CaseInfo:
    """One cached ONNX node test case.

    Attributes
    ----------
    name : str
        Test name, e.g. ``test_add_bcast``.
    path : str
        Folder holding ``model.onnx`` and ``data.pkl`` (tolerances are in ``data.pkl``).
    """

    name: str
    path: str


def default_cache_dir() -> Path:
    """Cache folder for the regenerated cases of the installed onnx version.

    Returns
    -------
    pathlib.Path
    """
    import onnx

    tag = f"onnx-node-{onnx.__version__}"
    cache = env("TVM_SPINN_CACHE")
    if cache:
        return Path(cache) / tag
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tvm_spinn"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base / tag
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "tvm_spinn_cache" / tag


def _to_numpy(value: Any) -> Any:
    """Turn a data-set value (ndarray, numpy scalar, TensorProto, list, None) into numpy form."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    if value is None:
        return None
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, (list, tuple)):
        return [_to_numpy(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    return np.asarray(value)


def regenerate(cache_dir: Optional[Path] = None, force: bool = False) -> Path:
    """Write every ONNX backend node test case into ``cache_dir`` (once).

    Parameters
    ----------
    cache_dir : pathlib.Path, optional
        Target folder; :func:`default_cache_dir` if omitted.
    force : bool
        Regenerate even if a complete cache exists.

    Returns
    -------
    pathlib.Path
        The cache folder (complete when this returns).
    """
    import onnx
    from onnx.backend.test.case import node

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (cache / _DONE).exists() and not force:
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".tmp-", dir=cache.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cases = node.collect_testcases()
        for case in cases:
            if case.model is None or not case.data_sets:
                continue
            folder = tmp / case.name
            folder.mkdir()
            (folder / "model.onnx").write_bytes(case.model.SerializeToString())
            data = [([_to_numpy(v) for v in ins], [_to_numpy(v) for v in outs])
                    for ins, outs in case.data_sets]
            meta = {"rtol": float(case.rtol if case.rtol is not None else DEFAULT_RTOL),
                    "atol": float(case.atol if case.atol is not None else DEFAULT_ATOL),
                    "onnx": onnx.__version__}
            with open(folder / "data.pkl", "wb") as f:
                pickle.dump({"meta": meta, "data_sets": data}, f, protocol=4)
        (tmp / _DONE).write_text(onnx.__version__)
        if cache.exists():
            shutil.rmtree(cache)
        os.replace(tmp, cache)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


def list_cases(patterns: Optional[Sequence[str]] = None, cache_dir: Optional[Path] = None,
               limit: Optional[int] = None) -> List[CaseInfo]:
    """List the cached cases, sorted by name, regenerating the cache if needed.

    Parameters
    ----------
    patterns : sequence of str, optional
        Keep cases whose name matches any pattern: a glob if it contains ``*?[``, else a
        regular expression searched in the name (so ``conv`` matches ``test_conv_...``).
        An exact case name always matches itself.
    cache_dir : pathlib.Path, optional
        Cache folder (see :func:`default_cache_dir`).
    limit : int, optional
        Keep only the first ``limit`` cases (after sorting and filtering).

    Returns
    -------
    list of CaseInfo
    """
    cache = regenerate(cache_dir)
    names = sorted(p.name for p in cache.iterdir() if p.is_dir() and (p / "data.pkl").exists())
    if patterns:
        wanted = set(patterns)
        compiled = [re.compile(p) for p in patterns if not any(ch in p for ch in "*?[")]
        globs = [p for p in patterns if any(ch in p for ch in "*?[")]
        names = [n for n in names if n in wanted or any(r.search(n) for r in compiled)
                 or any(fnmatch.fnmatchcase(n, g) for g in globs)]
    if limit is not None:
        names = names[:limit]
    out = []
    for n in names:
        out.append(CaseInfo(name=n, path=str(cache / n)))
    return out


def load_case(path: str):
    """Load one cached case.

    Parameters
    ----------
    path : str
        Case folder from :class:`CaseInfo`.

    Returns
    -------
    tuple of (onnx.ModelProto, list, dict)
        The model, its data sets ``[(inputs, expected_outputs), ...]`` and the metadata
        (``rtol``, ``atol``).
    """
    import onnx

    model = onnx.load_model_from_string(Path(path, "model.onnx").read_bytes())
    with open(Path(path, "data.pkl"), "rb") as f:
        blob = pickle.load(f)
    return model, blob["data_sets"], blob["meta"]
