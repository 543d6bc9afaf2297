"""The mapper, the timing model and the LLM planner never branch on a layer's kind.

What a stage needs to know about an operator is a hook of its family
(:mod:`tvm_spinn.program.ops`): the stages look the family up (``family_of(layer.kind)``) and
ask it. This test parses every module of ``mapping/``, ``timing/`` and ``llm/`` and fails on

* a comparison, membership test, subscript or ``.get`` whose operand is an attribute ``.kind``
  (``layer.kind == ...``, ``x.kind in ...``, ``TABLE[layer.kind]``, ``TABLE.get(layer.kind)``);
* any string constant that is a registered layer kind (a literal, a module constant bound to
  one, a set, tuple or dict key of them: renaming the strings to constants does not pass);
* a name imported from another module of the package whose value is a kind or holds kinds (``GEMM_KINDS``),
  and any read of a family's ``.kinds``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import tvm_spinn
from tvm_spinn.program.ops import layer_kinds

PACKAGE = pathlib.Path(tvm_spinn.__file__).parent
CHECKED = ("mapping", "timing", "llm")


def _holds_kind(value, kinds) -> bool:
    if isinstance(value, str):
        return value in kinds
    if isinstance(value, dict):
        return any(_holds_kind(k, kinds) for k in value)
    if isinstance(value, (tuple, list, set, frozenset)):
        return any(_holds_kind(v, kinds) for v in value)
    return False


def _resolve(module: str | None, level: int, package: str) -> str | None:
    if level == 0:
        return module
    parts = package.split(".")
    base = parts[:len(parts) - level + 1]
    return ".".join(base + ([module] if module else []))


def kind_branches(source: str, package: str = "tvm_spinn.mapping", kinds=None) -> list[str]:
    """``line: what`` of every kind branch in ``source`` (a module of ``package``)."""
    kinds = set(layer_kinds()) if kinds is None else set(kinds)
    tree = ast.parse(source)
    found: list[str] = []

    def is_kind_attr(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "kind"

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            if any(is_kind_attr(x) for x in [node.left, *node.comparators]):
                found.append(f"{node.lineno}: comparison with .kind")
        elif isinstance(node, ast.Subscript) and is_kind_attr(node.slice):
            found.append(f"{node.lineno}: subscript by .kind")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and any(is_kind_attr(a) for a in node.args):
            found.append(f"{node.lineno}: .get(.kind)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in kinds:
            found.append(f"{node.lineno}: kind literal {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr == "kinds" and isinstance(node.ctx, ast.Load):
            found.append(f"{node.lineno}: a family's .kinds")
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module, node.level, package)
            if not target or not target.startswith("tvm_spinn"):
                continue  # third-party tables (e.g. activation names) are not layer kinds
            for alias in node.names:
                try:
                    mod = importlib.import_module(target)
                except ImportError:
                    continue
                value = getattr(mod, alias.name, None)
                if _holds_kind(value, kinds):
                    found.append(f"{node.lineno}: imported kind constant {alias.name}")
    return found


def _modules():
    for sub in CHECKED:
        for path in sorted((PACKAGE / sub).glob("*.py")):
            yield path


@pytest.mark.parametrize("path", list(_modules()), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_kind_branches(path):
    package = f"tvm_spinn.{path.parent.name}"
    found = kind_branches(path.read_text(), package)
    assert not found, f"{path.parent.name}/{path.name} branches on layer kinds:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("source", [
    "def f(layer):\n    return layer.kind == 'dense'\n",
    "def f(layer):\n    return layer.kind in ('reshape', 'permute_dims')\n",
    "DENSE = 'dense'\ndef f(layer):\n    return layer.kind == DENSE\n",
    "def f(layer):\n    kind = layer.kind\n    return kind == 'matmul'\n",
    "_AXIS = {'conv2d': 1}\ndef f(kind):\n    return _AXIS.get(kind)\n",
    "def f(table, layer):\n    return table[layer.kind]\n",
    "def f(table, layer):\n    return table.get(layer.kind)\n",
    "from tvm_spinn.program.ops.gemm import GEMM_KINDS\ndef f(kind):\n    return kind in GEMM_KINDS\n",
    "from tvm_spinn.program.ops.rows import Rows\ndef f(kind):\n    return kind in Rows.kinds\n",
    "def f(x, layer):\n    return x if layer.kind != 'take' else None\n",
])
def test_checker_catches(source):
    assert kind_branches(source), source


@pytest.mark.parametrize("source", [
    "from tvm_spinn.program.ops import family_of\ndef f(layer):\n    return family_of(layer.kind).weight_gemm(layer)\n",
    "def f(layer):\n    return f'layer {layer.name} ({layer.kind})'\n",
    "def f(kind):\n    return kind == 's'\n",  # not a layer kind
])
def test_checker_allows(source):
    assert not kind_branches(source), source
