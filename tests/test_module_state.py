"""No module-level mutable state but the registries filled at import.

Every module of ``python/tvm_spinn`` is parsed with :mod:`ast`. A *module-level name* is one a
module binds at its top level (an assignment, an import, a ``def`` or ``class``). Inside any
function or method, the test records each write to state reached from such a name:

* a ``global`` statement (rebinding a module-level name);
* a store or ``del`` through a subscript or an attribute whose root is the name
  (``_CACHE[key] = v``, ``_TLS.value = v``, ``tvm.tirx.build = f``, ``Options.stack = s``);
* a call of a mutating method on it (``.append``, ``.update``, ``.setdefault``, ``.clear``,
  ``.pop``, ...), or ``setattr`` on it;
* the same through a local alias of such state (``entries = _CACHE`` or
  ``entries = _CACHE.get(key)``, then ``entries.append(v)``);
* the same through ``cls`` in a class method or ``__init_subclass__`` (class-level state).

A name the function binds itself (parameter, assignment, loop or ``with`` target, comprehension
variable, ``nonlocal``) is local and not recorded. Writes at module level run once, at import,
and are not recorded. Each module-level name some function writes must be in :data:`ALLOWED`
with the reason its state is allowed; an entry nothing writes any more fails the test too, so the
list stays exact.

What is allowed: registries filled at import (the ops' families, the named systems, the TVM
hooks), once-per-process handles (the native library), per-thread stacks of ``with`` scopes, and
the runtime's cache of parsed programs, keyed by the C++ module's own key. Other caches belong to
an object with a lifetime (a Program, a Topology, a pass run), keyed by values, or are memos of
pure functions on hashable values (:func:`functools.lru_cache`), which the test does not flag.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python" / "tvm_spinn"

MUTATORS = frozenset({
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
    "add", "discard", "sort", "reverse", "move_to_end", "appendleft", "extendleft", "popleft",
    "difference_update", "intersection_update", "symmetric_difference_update",
    "__setitem__", "__delitem__", "__setattr__", "__delattr__",
})

#: (module, module-level name) -> why a function may write it.
ALLOWED: dict[tuple[str, str], str] = {
    # registries filled at import (and by the explicit register_* calls that extend them)
    ("tvm_spinn.program.ops.base", "_FAMILIES"): "registry of operator families, filled as the op modules are imported",
    ("tvm_spinn.runtime.simulator", "_MODE_RUNNERS"): "registry of simulator modes run by packages above the runtime (iss), filled when tvm_spinn initializes",
    ("tvm_spinn.runtime.simulator", "_MODE_CHECKS"): "registry of those modes' compile-time checks (iss), filled when tvm_spinn initializes",
    ("tvm_spinn.target.registry", "SYSTEMS"): "registry of named systems (register_system), beside TVM's target tags",
    ("tvm_spinn.target.registry", "TAGS"): "the target tags of those systems, registered with TVM alongside",
    ("tvm_spinn.integration", "TVM_ORIGINALS"): "install() records the TVM objects its hooks wrap, once, at import",
    ("tvm_spinn.integration", "_relax_pipeline"): "install() registers the spinn pipeline hook at import (integration docstring)",
    ("tvm_spinn.integration", "relax"): "install() hooks relax.get_default_pipeline at import (integration docstring)",
    # once per process
    ("tvm_spinn", "_initialized"): "guard of the idempotent import-time registration (_initialize)",
    ("tvm_spinn._lib", "_handle"): "the native library, loaded once per process (the OS keeps it loaded)",
    ("tvm_spinn._lib", "_loaded_path"): "path of that library, set with it",
    ("tvm_spinn.cli", "_INTERRUPTS"): "Ctrl-C guard of the command process (signal handlers are per process); main() resets it",
    ("tvm_spinn.cli", "sys"): "sys.unraisablehook silenced as the interrupted command process exits",
    ("tvm_spinn.tune.intrinsics", "sys"): "sys.modules entry for a module loaded from a file, as the import system makes",
    # per-thread scopes of a with-block (like TVM's PassContext), reset on exit
    ("tvm_spinn._scoped", "ScopedOptions"): "per-class, per-thread stack of `with options:` scopes",
    ("tvm_spinn.options", "SpinnOptions"): "the same stack, popped by a part's `with`",
    ("tvm_spinn.runtime.executor", "_COMPILED"): "per-thread `with compiled(...)`/`sealed_file()`: bytes the caller just verified",
    ("tvm_spinn.runtime.loader", "_LOADING"): "per-thread: the verified library tvm_spinn.load_module is loading, for the C++ callback",
    # runtime caches TVM's module loader gives no object to hang on
    ("tvm_spinn.runtime.executor", "_CACHE"): "parsed programs by module key (unique per C++ module object, never reused), "
                                              "bounded by bytes; the C++ module gives Python no handle to own them",
    ("tvm_spinn.runtime.executor", "_SIZES"): "byte sizes of those entries",
    ("tvm_spinn.runtime.simulator", "_PLANS"): "execution plans by program digest and native setting (equal programs "
                                               "share one), bounded by count and constant bytes; frozen programs hold none",
    ("tvm_spinn.runtime.loader", "_FOUND"): "the one library a plain tvm.runtime.load_module last resolved programs from, "
                                            "keyed by the file's identity (device, inode, size, mtime)",
}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imported_names(tree: ast.Module) -> set[str]:
    """Top-level names bound by imports (modules and their members)."""
    return {(alias.asname or alias.name).split(".")[0] for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names bound by top-level statements (inside top-level if/try/with/for too)."""
    names: set[str] = set()

    def visit(stmts):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names.add((alias.asname or alias.name).split(".")[0])
            else:
                for sub in ast.walk(node) if not isinstance(node, (ast.If, ast.Try, ast.With, ast.For)) else ():
                    if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        names.add(sub.id)
                if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                    for field in ("body", "orelse", "finalbody"):
                        visit(getattr(node, field, []))
                    for handler in getattr(node, "handlers", []):
                        visit(handler.body)
                    if isinstance(node, ast.With):
                        for item in node.items:
                            if item.optional_vars is not None:
                                names.update(n.id for n in ast.walk(item.optional_vars) if isinstance(n, ast.Name))
                    if isinstance(node, ast.For):
                        names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    visit(tree.body)
    return names


def _local_names(func) -> set[str]:
    """Names a function (or lambda) binds itself, nested functions' own bindings excluded."""
    args = func.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    names.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    declared_global: set[str] = set()
    stack = list(func.body) if isinstance(func.body, list) else [func.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # its body is its own scope
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Global):
            declared_global.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        stack.extend(ast.iter_child_nodes(node))
    return names - declared_global


def _root(expr) -> ast.Name | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr if isinstance(expr, ast.Name) else None


def _aliases(func, top: set[str], local: set[str]) -> dict[str, str]:
    """Local names a function binds (``x = NAME``, ``x = NAME.get(k)``, ``x = NAME[k]``) to
    module-level state ``NAME`` or a part of it: writes through them write that state."""
    out: dict[str, str] = {}
    stack = list(func.body) if isinstance(func.body, list) else [func.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                    and value.func.attr in ("get", "setdefault"):
                value = value.func.value
            root = _root(value) if isinstance(value, (ast.Name, ast.Subscript)) else None
            if root is not None and root.id in top and root.id not in local - {node.targets[0].id}:
                out[node.targets[0].id] = root.id
        stack.extend(ast.iter_child_nodes(node))
    return out


def _class_alias(func) -> str | None:
    """The first parameter of a class method / ``__init_subclass__``: it names the class."""
    is_cls = func.name == "__init_subclass__" or any(
        isinstance(d, ast.Name) and d.id == "classmethod" for d in func.decorator_list)
    params = (*func.args.posonlyargs, *func.args.args)
    return params[0].arg if is_cls and params else None


def writes(module: str, tree: ast.Module) -> dict[tuple[str, str], int]:
    """(module, module-level name) -> first line where a function writes it."""
    top = _top_level_names(tree)
    imported = _imported_names(tree)
    found: dict[tuple[str, str], int] = {}

    def note(name, line):
        found.setdefault((module, name), line)

    def scan(func, outer_locals: set[str], owner: str | None):
        local = _local_names(func) | outer_locals
        alias = _class_alias(func) if owner is not None and not isinstance(func, ast.Lambda) else None
        aliases = _aliases(func, top, local)

        def target_name(expr) -> str | None:
            if not isinstance(expr, (ast.Attribute, ast.Subscript)):
                return None
            root = _root(expr)
            if root is None:
                return None
            if alias is not None and root.id == alias:
                return owner
            if root.id in top and root.id not in local:
                return root.id
            return aliases.get(root.id)

        stack = list(func.body) if isinstance(func.body, list) else [func.body]
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                scan(node, local, owner)  # closures see this function's locals
                continue
            if isinstance(node, ast.ClassDef):
                _scan_class(node, local)
                continue
            if isinstance(node, ast.Global):
                for name in node.names:
                    note(name, node.lineno)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                name = target_name(node)
                if name:
                    note(name, node.lineno)
            elif isinstance(node, ast.Call):
                fn = node.func
                receiver = _root(fn.value) if isinstance(fn, ast.Attribute) else None
                if receiver is not None and receiver.id in imported and receiver.id not in local:
                    pass  # a library's function (``np.add``, ``relax.op.add``), not a container's method
                elif isinstance(fn, ast.Attribute) and fn.attr in MUTATORS:
                    name = target_name(fn.value) or (
                        fn.value.id if isinstance(fn.value, ast.Name) and fn.value.id in top
                        and fn.value.id not in local else None) or (
                        aliases.get(fn.value.id) if isinstance(fn.value, ast.Name) else None) or (
                        owner if isinstance(fn.value, ast.Name) and alias is not None and fn.value.id == alias else None)
                    if name:
                        note(name, node.lineno)
                elif isinstance(fn, ast.Name) and fn.id in ("setattr", "delattr") and node.args:
                    target = node.args[0]
                    name = target.id if isinstance(target, ast.Name) and target.id in top and target.id not in local \
                        else target_name(target)
                    if alias is not None and isinstance(target, ast.Name) and target.id == alias:
                        name = owner
                    if name:
                        note(name, node.lineno)
            stack.extend(ast.iter_child_nodes(node))

    def _scan_class(cls: ast.ClassDef, outer_locals: set[str]):
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scan(node, outer_locals, cls.name)
            elif isinstance(node, ast.ClassDef):
                _scan_class(node, outer_locals)

    for node in tree.body:
        for sub in [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else [
                s for s in ast.walk(node) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]:
            if isinstance(sub, ast.ClassDef):
                _scan_class(sub, set())
            else:
                scan(sub, set(), None)
    # lambdas at module level (e.g. a default factory) run later, like functions
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Lambda):
                    scan(sub, set(), None)
    return found


def package_writes() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for module, path in _modules():
        found.update(writes(module, ast.parse(path.read_text(), str(path))))
    return found


def test_no_module_state_but_the_allowed_registries():
    found = package_writes()
    unexpected = sorted(f"{m}.{n} (line {line})" for (m, n), line in found.items() if (m, n) not in ALLOWED)
    assert not unexpected, "module-level state written by functions:\n  " + "\n  ".join(unexpected)


def test_allow_list_is_exact():
    found = package_writes()
    stale = sorted(f"{m}.{n}" for (m, n) in ALLOWED if (m, n) not in found)
    assert not stale, f"allowed but no longer written (drop from ALLOWED): {stale}"


@pytest.mark.parametrize("source, name", [
    ("_C = {}\ndef f(k, v):\n    _C[k] = v\n", "_C"),
    ("_C = []\ndef f(v):\n    _C.append(v)\n", "_C"),
    ("import threading\n_T = threading.local()\ndef f(v):\n    _T.value = v\n", "_T"),
    ("import tvm\ndef f(g):\n    tvm.tirx.build = g\n", "tvm"),
    ("_N = 0\ndef f():\n    global _N\n    _N += 1\n", "_N"),
    ("class K:\n    @classmethod\n    def f(cls, v):\n        cls.state = v\n", "K"),
    ("_C = {}\nclass K:\n    def f(self, k):\n        return lambda: _C.setdefault(k, 1)\n", "_C"),
    ("_C = {}\ndef f(k):\n    setattr(_C, k, 1)\n", "_C"),
    ("import sys\ndef f(m):\n    sys.modules['m'] = m\n", "sys"),
    ("_C = {}\ndef f(k, v):\n    entries = _C.get(k)\n    entries.append(v)\n", "_C"),
    ("_C = {}\ndef f(k, v):\n    table = _C\n    table[k] = v\n", "_C"),
    ("_C = {}\ndef f(k, v):\n    row = _C[k]\n    row[0] = v\n", "_C"),
])
def test_scanner_catches(source, name):
    assert ("m", name) in writes("m", ast.parse(source))


@pytest.mark.parametrize("source", [
    "_C = {}\ndef f(_C, k):\n    _C[k] = 1\n",           # a parameter shadows the module name
    "def f(k):\n    c = {}\n    c[k] = 1\n    return c\n",  # local container
    "_C = {}\n_C['a'] = 1\n",                            # written at import
    "_C = {}\ndef f(k):\n    return _C.get(k)\n",         # read only
    "class K:\n    def f(self, v):\n        self.v = v\n",  # instance state
    "import numpy as np\ndef f(a, b):\n    return np.add(a, b)\n",  # a library function named add
    "_C = {}\ndef f(k):\n    entries = list(_C.get(k, ()))\n    entries.append(1)\n    return entries\n",  # a copy
])
def test_scanner_passes(source):
    assert not writes("m", ast.parse(source))
