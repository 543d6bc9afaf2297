"""The live hardware of a system with faults or a partial allocation, as planners see it.

A :class:`~tvm_spinn.target.arch.SpinnArch` names what does not work (``dead_chips``,
``dead_links``, ``dead_board_links``, ``dead_boards``) and which boards of the machine the system
may use (``allocated_boards``); the link graph (:func:`tvm_spinn.target.topology.topology_of`)
takes them out of its links and routes around them. This module answers the planners'
questions from the same fields: which boards and chips they may place work on
(:func:`usable_boards`, :func:`live_chips`), which boards are whole (:func:`whole_boards`: every
chip and on-board link working, what a tensor-parallel group over several boards needs) and
how one board of the system looks on its own (:func:`board_view`, mapped by the planners like
any board). A healthy system answers with every board and chip, so planners that ask take the
same decisions as before on it.

The system may also be described in a JSON file (:func:`load_system`), the form the command
line's ``--system`` option reads::

    {"base": "spinn/cloud", "allocated_boards": [[0, 23]], "dead_boards": [3],
     "dead_chips": [1200], "dead_links": [[52, 0]], "dead_board_links": [[7, 1]]}

``base`` names a registered target (or ``"boards": N`` builds ``make_system(boards=N)``); a
``[first, last]`` pair in a list of ids stands for the range.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .arch import FAULT_FIELDS, ArchError, SpinnArch
from .topology import topology_of

__all__ = ["usable_boards", "whole_boards", "live_chips", "board_view", "chain_boards", "health", "load_system",
           "parse_ids"]


def usable_boards(arch: SpinnArch) -> tuple[int, ...]:
    """Boards the system may place work on: allocated, not dead, with a live chip.

    Parameters
    ----------
    arch : SpinnArch

    Returns
    -------
    tuple of int
        Board ids in increasing order (``0 .. boards - 1`` on a healthy system).
    """
    if not arch.has_faults:
        return tuple(range(arch.boards))
    live = topology_of(arch).live_chips()
    return tuple(int(b) for b in np.unique(live // arch.chips_per_board))


def live_chips(arch: SpinnArch, board: "int | None" = None) -> np.ndarray:
    """Ids of the chips that work, of the whole system or of one board.

    Parameters
    ----------
    arch : SpinnArch
    board : int, optional
        Only this board's chips (system-wide ids).

    Returns
    -------
    numpy.ndarray
        int64 chip ids in increasing order.
    """
    if not arch.has_faults:
        ids = np.arange(arch.chips, dtype=np.int64)
    else:
        ids = topology_of(arch).live_chips()
    if board is not None:
        per = arch.chips_per_board
        ids = ids[(ids >= board * per) & (ids < (board + 1) * per)]
    return ids


def _board_links(arch: SpinnArch, board: int) -> tuple:
    """The dead on-board links of ``board`` as ``(local chip, direction)`` pairs."""
    per = arch.chips_per_board
    topo = topology_of(arch)
    return tuple((c - board * per, d) for c, d in arch.dead_links
                 if c // per == board and not topo.board_link[c, d])


def whole_boards(arch: SpinnArch) -> tuple[int, ...]:
    """Usable boards with every chip and every on-board link working.

    Parameters
    ----------
    arch : SpinnArch

    Returns
    -------
    tuple of int
    """
    per = min(arch.chips, arch.chips_per_board)
    return tuple(b for b in usable_boards(arch) if live_chips(arch, b).size == per and not _board_links(arch, b))


def chain_boards(arch: SpinnArch) -> tuple[int, ...]:
    """The usable boards in the order a pipeline of board stages takes them: the whole boards
    (:func:`whole_boards`) in id order, then those with dead chips or links, so a chain shorter
    than the whole boards uses only whole ones.

    Parameters
    ----------
    arch : SpinnArch

    Returns
    -------
    tuple of int
        ``0 .. boards - 1`` on a healthy system.
    """
    whole = whole_boards(arch)
    return whole + tuple(b for b in usable_boards(arch) if b not in set(whole))


def board_view(arch: SpinnArch, board: int) -> SpinnArch:
    """One board of the system as a system of its own: its dead chips and on-board links, ids
    relative to the board (chip ``c`` of the system is chip ``c - 48 board`` of the view).

    A whole board gives the same description as ``arch.replace(chips=chips_per_board,
    name=board_name(arch))`` (:func:`tvm_spinn.target.allocation.board_name`: the machine's
    name, the same for every allocation of it), so its mappings are shared with every other whole board's.

    Parameters
    ----------
    arch : SpinnArch
    board : int
        A board of :func:`usable_boards`.

    Returns
    -------
    SpinnArch

    Raises
    ------
    ArchError
        For a board the system may not use.
    """
    if board not in usable_boards(arch):
        raise ArchError(f"board {board} of {arch.name} is dead or outside the allocation "
                        f"(usable boards: {list(usable_boards(arch))[:16]})")
    per = arch.chips_per_board
    chips = min(arch.chips, per)
    from .allocation import board_name

    template = arch.replace(chips=chips, name=board_name(arch), **dict.fromkeys(FAULT_FIELDS, ()))
    dead = tuple(int(c) - board * per for c in arch.dead_chips if int(c) // per == board)
    links = _board_links(arch, board) if arch.dead_links else ()
    if not dead and not links:
        return template
    return template.replace(dead_chips=dead, dead_links=links)  # boards faulty alike share mappings


def health(arch: SpinnArch) -> dict:
    """A summary of the system's faults for reports (JSON-serialisable).

    Returns
    -------
    dict
        ``boards``, ``usable_boards`` (count), ``whole_boards`` (count), ``live_chips`` (count)
        and the fault fields as lists.
    """
    out = {"boards": arch.boards, "usable_boards": len(usable_boards(arch)),
           "whole_boards": len(whole_boards(arch)), "live_chips": int(live_chips(arch).size)}
    out.update({name: [list(v) if isinstance(v, tuple) else v for v in getattr(arch, name)]
                for name in FAULT_FIELDS})
    return out


def parse_ids(value, what: str) -> list:
    """Ids from a command-line list (``"3,7,10-12"``) or a JSON list (ints, ``[first, last]``
    ranges, or pairs for links when ``what`` names one).

    Parameters
    ----------
    value : str or list
    what : str
        The field, for messages; a field ending in ``links`` reads ``chip:direction`` /
        ``board:edge`` pairs (``"52:0,7:1"``, or ``[[52, 0], [7, 1]]`` in JSON).

    Returns
    -------
    list
        Ints, or ``(int, int)`` pairs for links.

    Raises
    ------
    ArchError
        For text that is not such a list (naming ``what``).
    """
    pairs = what.endswith("links")
    if isinstance(value, str):
        out = []
        for item in (x.strip() for x in value.split(",") if x.strip()):
            try:
                if pairs:
                    a, b = item.split(":")
                    out.append((int(a), int(b)))
                elif "-" in item.lstrip("-"):
                    first, last = item.split("-")
                    out.extend(range(int(first), int(last) + 1))
                else:
                    out.append(int(item))
            except ValueError:
                form = "chip:direction or board:edge pairs" if pairs else "ids or first-last ranges"
                raise ArchError(f"{what}: expected comma-separated {form}, got {item!r}") from None
        return out
    if not isinstance(value, list):
        raise ArchError(f"{what}: expected a list, got {value!r}")
    out = []
    for item in value:
        if pairs or not isinstance(item, list):
            out.append(tuple(item) if isinstance(item, list) else item)
        elif len(item) == 2 and all(isinstance(x, int) for x in item):
            out.extend(range(item[0], item[1] + 1))
        else:
            raise ArchError(f"{what}: a range must be [first, last], got {item!r}")
    return out


def load_system(path: "str | os.PathLike") -> tuple[SpinnArch, str]:
    """A system description from a JSON file (see the module docstring).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    (SpinnArch, str)
        The system and its name (``name`` in the file, else the file's stem).

    Raises
    ------
    ArchError
        For a file that cannot be read, an unknown key, a bad base or ids out of range (naming
        the file and the key).
    """
    from .arch import make_system
    from .registry import arch_of, known_targets

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ArchError(f"system description {os.fspath(path)!r}: {err}") from None
    if not isinstance(data, dict):
        raise ArchError(f"system description {os.fspath(path)!r}: expected a JSON object")
    known = {"base", "boards", "name", *FAULT_FIELDS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ArchError(f"system description {os.fspath(path)!r}: unknown key(s) {unknown}; known: {sorted(known)}")
    name = data.get("name") or os.path.splitext(os.path.basename(os.fspath(path)))[0]
    if ("base" in data) == ("boards" in data):
        raise ArchError(f"system description {os.fspath(path)!r}: give exactly one of 'base' (a registered "
                        f"target: {', '.join(known_targets())}) or 'boards' (a number of boards)")
    try:
        if "base" in data:
            if data["base"] not in known_targets():
                raise ArchError(f"'base' must be a registered target ({', '.join(known_targets())}), "
                                f"got {data['base']!r}")
            base = arch_of(data["base"])
        else:
            base = make_system(name, boards=data["boards"])
        faults = {k: parse_ids(data[k], k) for k in FAULT_FIELDS if k in data}
        return base.replace(name=name, **faults), name
    except ArchError as err:
        raise ArchError(f"system description {os.fspath(path)!r}: {err}") from None
