"""Allocations of one machine: rectangular patches of its torus of boards.

A machine of ``bx x by`` boards (:func:`tvm_spinn.target.topology.board_grid`; ``spinn/cloud``:
24 x 30) is shared: a user gets a *patch* of it, ``p x q`` neighbouring boards
(``SpinnArch.allocated_boards``), whose links to the boards around it are someone else's (the
link graph takes them out, :func:`tvm_spinn.target.topology.topology_of`). A patch as wide (or
tall) as the machine keeps that dimension's wrap-around links; a smaller one has none. Every
allocation of a machine therefore shares the machine's wiring. Two patches of the same shape
that span no dimension have the same links up to a translation, but the planners lay their
groups of boards on the machine's torus (:func:`tvm_spinn.llm.board_tp.board_groups`), so a
plan may depend on where the patch lies: the allocations here start at the torus' origin, and
so do the patches inside them, so a larger one holds the smaller ones' very patches.

* :func:`patch_shape`: the most nearly square ``p x q`` patch of ``n`` boards that fits;
* :func:`patch_boards`: the board ids of a patch at an origin;
* :func:`allocation`: a machine's allocation of ``n`` boards as a system (the machine itself
  for all of its boards), at the torus' origin;
* :func:`allocation_shape`: the patch an allocation is, where it is one;
* :func:`sub_allocations`: the allocations of the ladder's smaller sizes inside an allocation,
  one per shape (what a planner may run on, leaving the rest of its boards idle).
"""

from __future__ import annotations

from .arch import ArchError, SpinnArch
from .topology import board_grid

__all__ = ["ALLOCATION_LADDER", "patch_shape", "patch_boards", "allocation", "allocation_shape", "sub_allocations",
           "machine_name", "board_name"]

#: Board counts of the allocations a planner also tries inside the one it is given: one board,
#: the powers of two up to a frame of 8, then about three times larger each step (a 24-board
#: patch, 72, 240). Each is planned on its most nearly square patch (:func:`patch_shape`), so an
#: allocation of one of these sizes plans at least as fast a token as every smaller one.
ALLOCATION_LADDER = (1, 2, 4, 8, 24, 72, 240)


def patch_shape(boards: int, grid: "tuple[int, int]") -> "tuple[int, int]":
    """The most nearly square ``(p, q)`` with ``p * q == boards``, ``p <= grid[0]`` and ``q <= grid[1]``.

    Parameters
    ----------
    boards : int
        Boards in the patch (>= 1).
    grid : tuple of int
        The machine's torus of boards ``(bx, by)``.

    Returns
    -------
    tuple of int
        ``(p, q)``: ``p`` boards along the grid's first axis, ``q`` along its second (ties: the
        smaller ``p``).

    Raises
    ------
    ArchError
        If no rectangle of ``boards`` boards fits the grid (naming both).
    """
    if isinstance(boards, bool) or not isinstance(boards, int) or boards <= 0:
        raise ArchError(f"an allocation needs a positive number of boards, got {boards!r}")
    bx, by = grid
    shapes = sorted((abs(p - boards // p), p, boards // p) for p in range(1, boards + 1)
                    if boards % p == 0 and p <= bx and boards // p <= by)
    if not shapes:
        raise ArchError(f"no rectangular patch of {boards} boards fits a {bx} x {by} torus of boards")
    return shapes[0][1], shapes[0][2]


def patch_boards(grid: "tuple[int, int]", shape: "tuple[int, int]", origin: "tuple[int, int]" = (0, 0)) -> tuple:
    """Board ids of the ``shape`` patch whose first board is ``origin`` (``(a, b)``; board ``a + bx b``).

    Returns
    -------
    tuple of int
        Sorted ids; the patch wraps around the torus where it runs past the grid's end.
    """
    bx, by = grid
    p, q = shape
    if not (1 <= p <= bx and 1 <= q <= by):
        raise ArchError(f"a {p} x {q} patch does not fit a {bx} x {by} torus of boards")
    a0, b0 = origin
    return tuple(sorted(((a0 + a) % bx) + bx * ((b0 + b) % by) for b in range(q) for a in range(p)))


def machine_name(arch: SpinnArch) -> str:
    """The name of the machine ``arch`` is an allocation of: its name without the ``[p x q]`` an
    allocation's name ends with (:func:`allocation`)."""
    return arch.name.split("[")[0] if arch.name.endswith("]") else arch.name


def board_name(arch: SpinnArch) -> str:
    """The name of one board of ``arch`` as a system of its own: the machine's
    (:func:`machine_name`), so every allocation of a machine maps its boards alike (the
    mappings' memo keys read the name)."""
    return f"{machine_name(arch)}[board]"


def _machine(arch: SpinnArch) -> tuple:
    """``(torus of boards, board count)`` of the whole machine ``arch`` is part of."""
    boards = arch.chips // arch.chips_per_board
    if boards < 1 or arch.chips % arch.chips_per_board:
        raise ArchError(f"{arch.name} is not a machine of whole boards ({arch.chips} chips)")
    return board_grid(boards), boards


def allocation(arch: SpinnArch, boards: int, name: "str | None" = None) -> SpinnArch:
    """The allocation of ``boards`` boards of the machine ``arch``: its most nearly square patch
    (:func:`patch_shape`) at the torus' origin, as a system (``allocated_boards``); the machine
    itself for all of its boards.

    Parameters
    ----------
    arch : SpinnArch
        A healthy machine of whole boards (e.g. ``arch_of("spinn/cloud")``).
    boards : int
    name : str, optional
        The system's name (default ``"{arch.name}[p x q]"``).

    Raises
    ------
    ArchError
        For a machine with faults or an allocation already, or a size no patch of it has.
    """
    if arch.has_faults:
        raise ArchError(f"{arch.name} is already an allocation or has faults: allocate from the whole machine")
    grid, total = _machine(arch)
    if boards == total:
        return arch if name is None else arch.replace(name=name)
    shape = patch_shape(boards, grid)
    return arch.replace(name=name or f"{machine_name(arch)}[{shape[0]}x{shape[1]}]",
                        allocated_boards=patch_boards(grid, shape))


def allocation_shape(arch: SpinnArch) -> "tuple[int, int] | None":
    """``(p, q)`` of the patch ``arch`` uses: the whole torus for a healthy machine, the
    allocation's rectangle where ``allocated_boards`` is one (and nothing is dead), else None."""
    grid, total = _machine(arch)
    if not arch.has_faults:
        return grid
    if any(getattr(arch, f) for f in ("dead_chips", "dead_links", "dead_board_links", "dead_boards")):
        return None
    ids = arch.allocated_boards
    bx, by = grid
    cols = sorted({b % bx for b in ids})
    rows = sorted({b // bx for b in ids})
    if len(ids) != len(cols) * len(rows) or any((c - cols[0]) != i for i, c in enumerate(cols)) \
            or any((r - rows[0]) != i for i, r in enumerate(rows)):
        return None  # not one rectangle (a patch across the torus' seam is planned as it is)
    return len(cols), len(rows)


def sub_allocations(arch: SpinnArch) -> "list[tuple[int, SpinnArch]]":
    """The allocations of :data:`ALLOCATION_LADDER`'s sizes smaller than ``arch`` that fit inside
    it, one per distinct shape: ``(boards, system)``, in increasing size.

    Each is the patch the machine allocates for that size (:func:`allocation`'s shape, or the
    most nearly square that fits inside ``arch`` where that one does not), at the corner of
    ``arch`` (for an allocation at the torus' origin: :func:`allocation`'s own patch), named as
    :func:`allocation` names its shape, so plans sharing one memo search each patch once (see
    :func:`tvm_spinn.llm.plan.plan`'s ``searches``). Patches are not enumerated: one per size of the
    ladder stands for the positions inside ``arch``. A system smaller than a board, or not a
    patch (faults, or scattered boards), has none.

    Returns
    -------
    list of (int, SpinnArch)
    """
    if arch.chips < arch.chips_per_board or arch.chips % arch.chips_per_board:
        return []  # part of a board: no patch of boards
    shape = allocation_shape(arch)
    if shape is None or shape[0] * shape[1] < 2:
        return []
    grid, _ = _machine(arch)
    bx = grid[0]
    ids = arch.allocated_boards or (0,)
    origin = (min(b % bx for b in ids), min(b // bx for b in ids))
    out, seen = [], set()
    for n in ALLOCATION_LADDER:
        if n >= shape[0] * shape[1]:
            break
        try:
            p, q = patch_shape(n, grid)
            if p > shape[0] or q > shape[1]:
                p, q = patch_shape(n, shape)
        except ArchError:
            continue
        if (p, q) in seen:
            continue
        seen.add((p, q))
        out.append((n, arch.replace(name=f"{machine_name(arch)}[{p}x{q}]",
                                    allocated_boards=patch_boards(grid, (p, q), origin))))
    return out
