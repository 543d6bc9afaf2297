"""Tuning logs on disk: validation, the manifest, opening and applying MetaSchedule's database.

A work directory holds MetaSchedule's JSON database (``database_workload.json``,
``database_tuning_record.json``, one JSON document per line), its ``logs/`` and our
``tvm_spinn_tuning.json`` manifest (format, TVM version, target, model hashes). Every file is
validated line by line *before* MetaSchedule opens it, so a corrupt or foreign file raises
:class:`TuningLogError` naming the file and line, and records are never rewritten: MetaSchedule
only appends. The one repair: when a tuning job resumes, a half-written last line left by a
killed job (no newline, not JSON) is moved to ``<file>.partial`` so that appending can go on.
"""

from __future__ import annotations

import json
import os

import tvm
import tvm_ffi

__all__ = [
    "TuningLogError", "WORKLOAD_FILE", "RECORD_FILE", "MANIFEST_FILE", "DEFAULTS_DIR", "validate_logs",
    "read_manifest", "update_manifest", "open_database", "apply_tuning_logs", "exhausted_tasks",
    "mark_exhausted", "task_choices", "record_choices", "record_fingerprint", "choice_key",
]

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
MANIFEST_FILE = "tvm_spinn_tuning.json"
#: sub-directory with each task's measured default schedule (see tvm_spinn.tune.defaults)
DEFAULTS_DIR = "defaults"
MANIFEST_FORMAT = "tvm-spinn-tuning/1"


@tvm_ffi.register_error
class TuningLogError(ValueError):
    """A tuning log is missing, corrupt or belongs to another target; names the file (and line)."""


def _lines(path: str):
    with open(path, "rb") as f:
        data = f.read()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            yield number, raw


def _parse(path: str, number: int, raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TuningLogError(
            f"{path}:{number}: corrupt tuning log line (not JSON: {err}); the file was not "
            "modified: fix or remove that line, or tune into a new work_dir"
        ) from None


def _target_kind(target_json, path: str, number: int) -> str:
    if isinstance(target_json, dict) and isinstance(target_json.get("kind"), str):
        return target_json["kind"]
    if isinstance(target_json, str) and target_json:
        return target_json.split()[0]
    raise TuningLogError(f"{path}:{number}: tuning record has no valid target")


def _set_aside_partial_tail(path: str) -> None:
    """A killed job may leave a half-written last line (no newline, not JSON): move it aside.

    Only that incomplete fragment is removed (saved to ``<file>.partial``); complete records are
    never touched.
    """
    with open(path, "rb") as f:
        data = f.read()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:].decode("utf-8"))
        return  # complete record, just no newline
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    with open(path + ".partial", "ab") as f:
        f.write(data[cut:] + b"\n")
    with open(path, "r+b") as f:
        f.truncate(cut)


def validate_logs(work_dir: str, target_kind: str | None = None, require: bool = True) -> dict:
    """Check a work directory's database files line by line.

    Parameters
    ----------
    work_dir : str
        Tuning work directory.
    target_kind : str, optional
        Expected target kind (``"llvm"``, ``"cuda"``); records for another kind are foreign.
    require : bool
        Raise when the database files are missing (build time); ``False`` accepts an empty or
        new directory (tuning time).

    Returns
    -------
    dict
        ``{"workloads": int, "records": int}``.

    Raises
    ------
    TuningLogError
        Naming the file (and line) of the first defect.
    """
    wl_path = os.path.join(work_dir, WORKLOAD_FILE)
    rec_path = os.path.join(work_dir, RECORD_FILE)
    present = [os.path.exists(p) for p in (wl_path, rec_path)]
    if not all(present):
        if require or any(present):
            missing = wl_path if not present[0] else rec_path
            raise TuningLogError(
                f"{missing}: tuning log file is missing; {work_dir!r} is not a complete "
                "tvm_spinn.tune work directory"
            )
        return {"workloads": 0, "records": 0}
    n_workloads = 0
    seen: dict[bytes, int] = {}
    for number, raw in _lines(wl_path):
        item = _parse(wl_path, number, raw)
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise TuningLogError(
                f"{wl_path}:{number}: not a MetaSchedule workload entry ([hash, module] expected)"
            )
        # one job never writes a workload twice; two jobs appending at once do, and then their
        # records' workload indices point at each other's lines: the records cannot be trusted
        key = raw.strip()
        if key in seen:
            raise TuningLogError(
                f"{wl_path}:{number}: repeats the workload of line {seen[key]}: two tuning jobs wrote "
                "this directory at once, so its records may belong to other workloads; these logs "
                "cannot be used: tune into a new work_dir"
            )
        seen[key] = number
        n_workloads += 1
    n_records = 0
    for number, raw in _lines(rec_path):
        item = _parse(rec_path, number, raw)
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                and isinstance(item[1], list) and len(item[1]) >= 3):
            raise TuningLogError(
                f"{rec_path}:{number}: not a MetaSchedule tuning record "
                "([workload index, [trace, run_secs, target, ...]] expected)"
            )
        if not 0 <= item[0] < n_workloads:
            raise TuningLogError(
                f"{rec_path}:{number}: record refers to workload {item[0]}, but {wl_path} has "
                f"{n_workloads} workloads (files from different jobs?)"
            )
        kind = _target_kind(item[1][2], rec_path, number)
        if target_kind is not None and kind != target_kind:
            raise TuningLogError(
                f"{rec_path}:{number}: tuning record is for target kind {kind!r}, not "
                f"{target_kind!r}: these logs belong to another target"
            )
        n_records += 1
    return {"workloads": n_workloads, "records": n_records}


def read_manifest(work_dir: str) -> dict | None:
    """The manifest of a work directory, or None when there is none.

    Raises
    ------
    TuningLogError
        If the manifest is not valid JSON or not a tvm-spinn tuning manifest.
    """
    path = os.path.join(work_dir, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TuningLogError(f"{path}:{getattr(err, 'lineno', 1)}: corrupt manifest ({err})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise TuningLogError(f"{path}:1: not a tvm-spinn tuning manifest (format {MANIFEST_FORMAT!r})")
    return data


def check_manifest_target(work_dir: str, target: tvm.target.Target) -> None:
    """Refuse a work directory whose manifest names another target kind."""
    manifest = read_manifest(work_dir)
    if manifest is not None and manifest.get("target_kind") != target.kind.name:
        raise TuningLogError(
            f"{os.path.join(work_dir, MANIFEST_FILE)}:1: logs were tuned for "
            f"{manifest.get('target')!r} ({manifest.get('target_kind')}), not for {str(target)!r}"
        )


def update_manifest(work_dir: str, target: tvm.target.Target, model_hash: str, tasks: list[str]) -> dict:
    """Add a model to the manifest (atomic rewrite of the small manifest only)."""
    manifest = read_manifest(work_dir) or {
        "format": MANIFEST_FORMAT, "tvm_version": tvm.__version__, "target": str(target),
        "target_kind": target.kind.name, "models": {},
    }
    manifest["tvm_version"] = tvm.__version__
    manifest["models"][model_hash] = {"tasks": sorted(tasks)}
    _write_manifest(work_dir, manifest)
    return manifest


def _write_manifest(work_dir: str, manifest: dict) -> None:
    """Atomic rewrite: a killed job leaves the old manifest or the new one, never half of one."""
    from ._files import atomic_write

    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    atomic_write(os.path.join(work_dir, MANIFEST_FILE), lambda f: f.write(text.encode()),
                 what="tuning manifest")


def exhausted_tasks(work_dir: str) -> dict[str, int]:
    """Tasks whose search ran out of new candidates: ``{task key: trials}`` from the manifest.

    MetaSchedule ends a task early when its search yields no new candidate (a tiny design space,
    e.g. an elementwise op with one schedule). Asking again would only re-measure known
    schedules, so such a task counts as finished whatever its budget.
    """
    manifest = read_manifest(work_dir) or {}
    found = manifest.get("exhausted", {})
    return dict(found) if isinstance(found, dict) else {}


def mark_exhausted(work_dir: str, key: str, trials: int) -> None:
    """Record in the manifest that task ``key`` has no candidates left (after ``trials``)."""
    manifest = read_manifest(work_dir)
    if manifest is None:
        raise TuningLogError(f"{os.path.join(work_dir, MANIFEST_FILE)}: manifest is missing")
    manifest.setdefault("exhausted", {})[key] = int(trials)
    _write_manifest(work_dir, manifest)


def record_fingerprint(record) -> str:
    """A stable fingerprint of a tuning record's schedule: its trace as text, hashed."""
    import hashlib

    return hashlib.sha256(str(record.trace).encode()).hexdigest()[:16]


def choice_key(task_mod: tvm.IRModule) -> str:
    """The manifest key of a task's choice: its module's structural hash."""
    return f"{tvm_ffi.structural_hash(task_mod):x}"


def task_choices(work_dir: str) -> tuple[dict, dict]:
    """The recorded per-task choices and end-to-end checks of a work directory's manifest.

    Returns
    -------
    (dict, dict)
        ``{task key: entry}`` (``use``: ``"default"`` or ``"tuned"``, ``tuned_record``: the
        fingerprint of the compared record, the per-round figures) and
        ``{model hash: end-to-end entry}``; both empty for logs written before choices existed.
    """
    manifest = read_manifest(work_dir) or {}
    choices, e2e = manifest.get("choices", {}), manifest.get("end_to_end", {})
    return (dict(choices) if isinstance(choices, dict) else {},
            dict(e2e) if isinstance(e2e, dict) else {})


def record_choices(work_dir: str, choices: dict, end_to_end: dict | None = None) -> None:
    """Merge per-task choices (and a model's end-to-end check) into the manifest (atomic)."""
    manifest = read_manifest(work_dir)
    if manifest is None:
        raise TuningLogError(f"{os.path.join(work_dir, MANIFEST_FILE)}: manifest is missing")
    manifest.setdefault("choices", {}).update(choices)
    if end_to_end:
        manifest.setdefault("end_to_end", {}).update(end_to_end)
    _write_manifest(work_dir, manifest)


def open_database(work_dir: str, target: tvm.target.Target, require: bool):
    """Validate then open the JSON database of ``work_dir`` for ``target``.

    Parameters
    ----------
    work_dir : str
        Tuning work directory (created when ``require`` is False).
    target : tvm.target.Target
        Records must be for this target's kind.
    require : bool
        Whether the database must already exist.

    Returns
    -------
    tvm.s_tir.meta_schedule.database.JSONDatabase
    """
    from tvm.s_tir import meta_schedule as ms

    if require and not os.path.isdir(work_dir):
        raise TuningLogError(f"{work_dir}: tuning log directory does not exist")
    if os.path.isdir(work_dir):
        check_manifest_target(work_dir, target)
        if not require:  # resuming a tuning job that may have been killed mid-write
            for name in (WORKLOAD_FILE, RECORD_FILE):
                if os.path.exists(os.path.join(work_dir, name)):
                    _set_aside_partial_tail(os.path.join(work_dir, name))
        validate_logs(work_dir, target.kind.name, require=require)
    os.makedirs(work_dir, exist_ok=True)
    try:
        return ms.database.JSONDatabase(work_dir=work_dir, allow_missing=not require)
    except Exception as err:  # noqa: BLE001  (MetaSchedule's own parse error)
        raise TuningLogError(
            f"{os.path.join(work_dir, RECORD_FILE)}: MetaSchedule cannot load the logs: "
            f"{str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}"
        ) from None


def _fallback_tasks(mod: tvm.IRModule, target: tvm.target.Target) -> list:
    from tvm.s_tir import meta_schedule as ms

    return [t for t in ms.relax_integration.extract_tasks(mod, target)
            if not (t.dispatched[0].attrs and t.dispatched[0].attrs.get("tirx.is_scheduled", False))]


def _check_covers_model(tasks: list, db, work_dir: str) -> None:
    """Refuse logs that tuned none of the model's fallback functions: another model's logs.

    Logs that cover some of the functions (a model changed since tuning) are applied to those;
    logs that cover none would silently leave the whole fallback untuned."""
    if not db.get_all_tuning_records():
        return  # an empty work directory (a job that measured nothing yet): nothing to apply
    if tasks and not any(db.has_workload(t.dispatched[0]) for t in tasks):
        names = ", ".join(sorted(t.task_name for t in tasks)[:4])
        manifest = read_manifest(work_dir) or {}
        raise TuningLogError(
            f"{os.path.join(work_dir, WORKLOAD_FILE)}: these tuning logs cover none of this "
            f"model's {len(tasks)} fallback functions ({names}{', ...' if len(tasks) > 4 else ''}): "
            f"they were tuned for another model (models in the manifest: "
            f"{sorted(manifest.get('models', {}))}); tune this model into that work_dir or another one"
        )


def _mean_secs(record) -> float:
    return sum(float(v) for v in record.run_secs) / len(record.run_secs)


def _top(db, func):
    """The fastest valid record of ``func`` in ``db`` (None: none; MetaSchedule skips failed
    records and records with an empty trace, e.g. a default that no rule scheduled)."""
    if db is None or not db.has_workload(func):
        return None
    top = db.get_top_k(db.commit_workload(func), 1)
    return top[0] if top else None


def _applied_records(tasks: list, search, defaults, work_dir: str, target: tvm.target.Target):
    """A database with at most one record per task: the one the build applies.

    A task with a choice recorded by the tuning job gets exactly that record (a default with no
    record, i.e. one no rule schedules, gets none: the build's own default pass handles it);
    any other task the faster of the search's best and its measured default."""
    from tvm.s_tir import meta_schedule as ms

    choices, _ = task_choices(work_dir)
    memory = ms.database.MemoryDatabase()
    for task in tasks:
        func = task.dispatched[0]
        entry = choices.get(choice_key(func))
        if isinstance(entry, dict) and entry.get("use") == "default":
            record = _top(defaults, func)
        elif isinstance(entry, dict) and entry.get("use") == "tuned":
            wanted, record = entry.get("tuned_record"), None
            if search.has_workload(func):
                workload = search.commit_workload(func)
                for rec in search.get_all_tuning_records():
                    if (rec.workload.same_as(workload) or tvm_ffi.structural_equal(rec.workload.mod, func)) \
                            and record_fingerprint(rec) == wanted:
                        record = rec
                        break
            if record is None:
                raise TuningLogError(
                    f"{os.path.join(work_dir, MANIFEST_FILE)}:1: the manifest chose tuned record "
                    f"{wanted!r} for {task.task_name}, but {os.path.join(work_dir, RECORD_FILE)} "
                    "has no such record (logs edited, or mixed from different jobs)")
        else:  # logs written before choices were recorded: the lower single measurement
            found = [r for r in (_top(search, func), _top(defaults, func)) if r is not None]
            record = min(found, key=_mean_secs) if found else None
        if record is None:
            continue
        memory.commit_tuning_record(ms.database.TuningRecord(
            record.trace, memory.commit_workload(func), record.run_secs, target, record.args_info))
    return memory


def apply_tuning_logs(mod: tvm.IRModule, work_dir: str, target: tvm.target.Target) -> tvm.IRModule:
    """Schedule the PrimFuncs of ``mod`` that ``work_dir``'s records cover (inside the target).

    Parameters
    ----------
    mod : tvm.IRModule
        Legalized, fused module (see :func:`tvm_spinn.fallback.prepare_fallback`).
    work_dir : str
        Tuning work directory.
    target : tvm.target.Target
        Build target.

    Returns
    -------
    tvm.IRModule
        The module with matched PrimFuncs scheduled. A task with a choice recorded by the tuning
        job (the manifest's ``choices``: default or tuned, decided by repeated interleaved
        measurement, see :mod:`tvm_spinn.tune.compare`) gets exactly that record; any other
        covered task gets the record with the lowest measured latency among the search's and
        the measured default's (``work_dir/defaults``; older logs have neither).
    """
    from tvm import relax

    db = open_database(work_dir, target, require=True)
    tasks = _fallback_tasks(mod, target)
    _check_covers_model(tasks, db, work_dir)
    defaults_dir = os.path.join(work_dir, DEFAULTS_DIR)
    defaults = open_database(defaults_dir, target, require=True) if os.path.isdir(defaults_dir) else None
    db = _applied_records(tasks, db, defaults, work_dir, target)
    with target, db:
        return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
