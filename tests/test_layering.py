"""Layering of the package: no import cycles, ``program`` at the bottom, the runtime on top of it.

The import graph is built statically with :mod:`ast` from every ``import`` / ``from ... import``
in ``python/tvm_spinn/**/*.py``, function-level (lazy) imports included: a lazy import still
ties the two modules together. Relative imports are resolved to ``tvm_spinn.*`` names; an import
of a package is an edge to its ``__init__``, and ``from pkg import sub`` to the submodule.
Importing ``a.b.c`` also runs the ``__init__`` of ``a.b``, so an edge to a submodule implies an
edge to each enclosing subpackage; the root ``tvm_spinn/__init__`` (the public re-export hub that
imports every subpackage) is left out of those implied edges, or every module would sit on a
cycle through it. Explicit imports of ``tvm_spinn`` itself are kept.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python"
PKG = "tvm_spinn"

#: Modules that import no tvm_spinn module but other leaves, and that any layer may use.
LEAVES = {"tvm_spinn._env", "tvm_spinn._files", "tvm_spinn._interrupts", "tvm_spinn._lib", "tvm_spinn._quiet", "tvm_spinn._scoped", "tvm_spinn._version", "tvm_spinn.options", "tvm_spinn.target.arch"}

#: Known cycles still to break, as frozensets of their modules. The test fails when one of them
#: is gone (remove it here) and for any cycle not listed. None are left.
#: Compatibility modules that only re-export a moved module under its former name.
SHIMS = {"tvm_spinn.runtime.timing": "tvm_spinn.timing", "tvm_spinn.program.gemm": "tvm_spinn.program.ops.gemm"}

KNOWN_CYCLES: set = set()


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    mods = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _resolve(name: str, mods) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """``(explicit, full)``: module -> {imported module: line}; ``full`` adds implied packages."""
    mods = _modules()
    explicit: dict[str, dict[str, int]] = {}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        out: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    if node.level > 1:
                        base = base[: len(base) - (node.level - 1)]
                    full = ".".join(base) + (f".{node.module}" if node.module else "")
                else:
                    full = node.module or ""
                targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full for a in node.names]
            for name in targets:
                if name == PKG or name.startswith(PKG + "."):
                    target = _resolve(name, mods)
                    if target is not None and target != mod:
                        out.setdefault(target, node.lineno)
        explicit[mod] = out
    full = {}
    for mod, out in explicit.items():
        edges = dict(out)
        for target, line in out.items():
            parts = target.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if parent != mod and not mod.startswith(parent + ".") and parent in mods:
                    edges.setdefault(parent, line)
        full[mod] = edges
    return explicit, full


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle path per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in sccs:  # a concrete path: BFS from the smallest module back to itself in comp
        start = min(comp)
        prev, queue, path = {start: None}, [start], None
        while queue and path is None:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    path = [w]
                    while v is not None:
                        path.append(v)
                        v = prev[v]
                    path.reverse()
                    break
                if w in comp and w not in prev:
                    prev[w] = v
                    queue.append(w)
        cycles.append(path)
    return cycles


def _describe(path, graph):
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def test_graph_sees_lazy_and_relative_imports():
    explicit, full = import_graph()
    assert "tvm_spinn.program.format" in explicit["tvm_spinn.program"]
    assert "tvm_spinn.program.validate" in explicit["tvm_spinn.program.format"]  # function-level
    assert "tvm_spinn.tune" in full["tvm_spinn.tune.tasks"] or "tvm_spinn.pipeline" in full["tvm_spinn.tune.tasks"]
    assert "tvm_spinn.timing" in explicit["tvm_spinn.mapping.schedule"]  # function-level
    assert "tvm_spinn.target" in full["tvm_spinn.mapping.schedule"]  # implied by target.arch


def test_no_import_cycles():
    _, full = import_graph()
    cycles = find_cycles(full)
    found = {frozenset(c): c for c in cycles}
    new = [c for key, c in found.items() if key not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(_describe(c, full) for c in new)
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in found]
    assert not gone, f"known cycles no longer present, remove them from KNOWN_CYCLES: {gone}"


def test_cycle_finder_reports_a_path():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    (path,) = find_cycles(graph)
    assert path[0] == path[-1] and set(path) == {"a", "b", "c"}
    assert _describe(path, graph).startswith("a (line 1) -> b")


def _violations(explicit, prefix, allowed):
    bad = []
    for mod, out in sorted(explicit.items()):
        if mod == prefix or mod.startswith(prefix + "."):
            for target, line in sorted(out.items()):
                if SHIMS.get(mod) and (target == SHIMS[mod] or target.startswith(SHIMS[mod] + ".")):
                    continue
                if not any(target == a or target.startswith(a + ".") for a in allowed):
                    bad.append(f"{mod} imports {target} (line {line})")
    return bad


def test_leaves_import_nothing_of_the_package():
    explicit, _ = import_graph()
    bad = [f"{m} imports {sorted(set(explicit[m]) - LEAVES)}" for m in sorted(LEAVES) if set(explicit[m]) - LEAVES]
    assert not bad, "\n".join(bad)


def test_program_is_the_bottom_layer():
    explicit, _ = import_graph()
    bad = _violations(explicit, "tvm_spinn.program", {"tvm_spinn.program", *LEAVES})
    assert not bad, "tvm_spinn.program may import only itself and " + f"{sorted(LEAVES)}:\n" + "\n".join(bad)


def test_runtime_depends_only_on_program():
    explicit, _ = import_graph()
    bad = _violations(explicit, "tvm_spinn.runtime", {"tvm_spinn.program", "tvm_spinn.runtime", *LEAVES})
    assert not bad, "tvm_spinn.runtime may import only program, runtime and leaves:\n" + "\n".join(bad)


def test_timing_depends_only_on_program():
    explicit, _ = import_graph()
    bad = _violations(explicit, "tvm_spinn.timing", {"tvm_spinn.program", "tvm_spinn.timing", *LEAVES})
    assert not bad, "tvm_spinn.timing may import only program, timing and leaves:\n" + "\n".join(bad)


def test_shims_only_re_export():
    explicit, _ = import_graph()
    for shim, target in SHIMS.items():
        assert all(t == target or t.startswith(target + ".") for t in explicit[shim]), (shim, explicit[shim])


def test_moved_names_stay_importable():
    from tvm_spinn import __version__, _build_options, _tuning_db, program
    from tvm_spinn.codegen import MANIFEST_MAGIC, MANIFEST_SYMBOL
    from tvm_spinn.mapping.tiling import GemmShape, gemm_shape, safe_k_chunk
    from tvm_spinn.program import gemm, manifest
    from tvm_spinn.tune import database, options

    assert __version__
    assert (MANIFEST_MAGIC, MANIFEST_SYMBOL) == (manifest.MANIFEST_MAGIC, manifest.MANIFEST_SYMBOL)
    assert (GemmShape, gemm_shape, safe_k_chunk) == (gemm.GemmShape, gemm.gemm_shape, gemm.safe_k_chunk)
    assert options.current_build_options is _build_options.current_build_options
    assert options.BuildOptions is _build_options.BuildOptions
    assert database.apply_tuning_logs is _tuning_db.apply_tuning_logs
    assert database.TuningLogError is _tuning_db.TuningLogError
    assert database.MANIFEST_FILE == _tuning_db.MANIFEST_FILE
    assert program is not None

    import tvm_spinn.runtime.timing as old_timing
    import tvm_spinn.timing as timing
    from tvm_spinn.runtime import TimingSummary, evaluate, roofline

    assert (TimingSummary, evaluate, roofline) == (timing.TimingSummary, timing.evaluate, timing.roofline)
    assert old_timing.evaluate is timing.evaluate and old_timing.evaluate_traced is timing.evaluate_traced


def test_llm_is_a_top_layer():
    """``tvm_spinn.llm`` drives the compiler (front-end, quantization, partition/codegen, mapping,
    timing, report); nothing but the CLI and the root re-export hub imports it."""
    explicit, _ = import_graph()
    users = sorted(m for m, out in explicit.items() if not (m == "tvm_spinn.llm" or m.startswith("tvm_spinn.llm."))
                   and any(t == "tvm_spinn.llm" or t.startswith("tvm_spinn.llm.") for t in out))
    planner = {m for m in explicit if m == "tvm_spinn.training.planner" or m.startswith("tvm_spinn.training.planner.")}
    assert set(users) <= {"tvm_spinn", "tvm_spinn.cli"} | planner, \
        f"only the CLI may import tvm_spinn.llm: {users}"
    # the training planner reads transformers configs with the config reader, nothing else of llm
    for module in sorted(planner):
        assert set(explicit[module]) & {m for m in explicit if m.startswith("tvm_spinn.llm")} \
            <= {"tvm_spinn.llm.spec"}, module
    allowed = {"tvm_spinn.llm", "tvm_spinn.frontend", "tvm_spinn.quant", "tvm_spinn.partition", "tvm_spinn.codegen",
               "tvm_spinn.mapping", "tvm_spinn.timing", "tvm_spinn.target", "tvm_spinn.report", "tvm_spinn.program",
               "tvm_spinn.runtime", *LEAVES}
    bad = _violations(explicit, "tvm_spinn.llm", allowed)
    assert not bad, "tvm_spinn.llm may import only the compiler's layers:\n" + "\n".join(bad)


def test_training_is_a_top_layer():
    """``tvm_spinn.training`` builds training steps on the front-end, target and (through
    ``relax.build``) the whole compiler, and reads the report and the collectives' costs to time
    them (as ``tvm_spinn.llm`` does), and reads transformers configs with ``tvm_spinn.llm.spec``
    for its training plans; only the root re-export hub and the CLI import it."""
    explicit, _ = import_graph()
    users = sorted(m for m, out in explicit.items()
                   if not (m == "tvm_spinn.training" or m.startswith("tvm_spinn.training."))
                   and any(t == "tvm_spinn.training" or t.startswith("tvm_spinn.training.") for t in out))
    assert set(users) <= {"tvm_spinn", "tvm_spinn.cli"}, \
        f"only the root package and the CLI (plan --train) may import tvm_spinn.training: {users}"
    allowed = {"tvm_spinn.training", "tvm_spinn.frontend", "tvm_spinn.target", "tvm_spinn.partition",
               "tvm_spinn.timing", "tvm_spinn.report", "tvm_spinn.llm.spec",
               *LEAVES}
    bad = _violations(explicit, "tvm_spinn.training", allowed)
    assert not bad, ("tvm_spinn.training may import only the front-end, target, partition, timing and "
                     "report:\n" + "\n".join(bad))


def test_generic_rewrites_sit_below_the_partitioner():
    """The generic Relax rewrites (``tvm_spinn.relax_rewrites``) import only the program layer and
    leaves, and the front-ends and the quantizer reach them without importing the partitioner."""
    explicit, _ = import_graph()
    bad = _violations(explicit, "tvm_spinn.relax_rewrites", {"tvm_spinn.relax_rewrites", "tvm_spinn.program", *LEAVES})
    assert not bad, "tvm_spinn.relax_rewrites may import only itself, program and leaves:\n" + "\n".join(bad)
    users = sorted(m for m, out in explicit.items()
                   if m.startswith(("tvm_spinn.frontend", "tvm_spinn.quant"))
                   and any(t == "tvm_spinn.partition" or t.startswith("tvm_spinn.partition.") for t in out))
    assert not users, f"front-end and quantizer modules import the partitioner: {users}"
