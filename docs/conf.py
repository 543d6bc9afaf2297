"""Sphinx configuration of the tvm-spinn documentation.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (the ``docs`` extra installs
what it needs; ``tests/test_docs.py`` runs the same build). The tutorials are rendered as they
are stored, never executed here: the test suite executes them.
"""

import os
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "python"))  # document this tree, not another installed copy
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "_ext"))

project = "tvm-spinn"
author = "tvm-spinn contributors"
copyright = "tvm-spinn contributors, Apache-2.0"  # noqa: A001  (Sphinx's name)

try:
    from tvm_spinn._version import __version__ as release
except ImportError:  # pragma: no cover - the package is importable wherever the docs build
    release = "0.1.0"
version = release

extensions = [
    "myst_nb",  # Markdown pages (MyST) and the tutorials' notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # numpydoc-style docstrings
    "sphinx.ext.viewcode",
    "cli_help",  # docs/_ext: the command's --help texts, from its parser
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**/.ipynb_checkpoints"]

# Notebooks are shown as stored: executing them needs minutes of simulation (tests do that).
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"tvm-spinn {release}"
