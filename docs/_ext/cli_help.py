"""A ``cli-help`` directive: the ``--help`` text of ``tvm-spinn`` and of each of its commands,
taken from the command's own parser at build time so the page always matches the program."""

import argparse
import os

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

_WIDTH = "100"  # argparse wraps to $COLUMNS: fixed, so the page does not depend on the terminal


def _help(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _WIDTH
    try:
        return parser.format_help()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _title(command: str) -> nodes.rubric:
    # a literal, so that smart quotes leave the "--" alone
    return nodes.rubric("", "", nodes.literal(text=command))


class CliHelp(SphinxDirective):
    """Render ``tvm-spinn --help`` and ``tvm-spinn COMMAND --help`` as literal blocks."""

    has_content = False

    def run(self):
        from tvm_spinn.cli import build_parser

        parser = build_parser()
        out = [_title("tvm-spinn --help"),
               nodes.literal_block(text=_help(parser), language="text")]
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, sub in subs.choices.items():  # the order of --help
            out += [_title(f"tvm-spinn {name} --help"),
                    nodes.literal_block(text=_help(sub), language="text")]
        return out


def setup(app):
    app.add_directive("cli-help", CliHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
