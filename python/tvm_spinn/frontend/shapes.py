"""Validation of user-given input shapes (``shape_dict``) against a model's declared inputs."""

from __future__ import annotations

from typing import Sequence

__all__ = ["MAX_DIM", "check_shape"]

#: The largest dim a shape may have: TVM's shapes are int64 (``relax.ShapeExpr``), so a
#: larger Python int cannot be represented and would escape TVM as a raw ``TypeError``.
MAX_DIM = 2**63 - 1


def check_shape(error: type[Exception], where: str, name: str, given,
                declared: Sequence[int | None] | None) -> tuple[int, ...]:
    """Check one ``shape_dict`` entry; return it as a tuple of ints.

    Parameters
    ----------
    error : type of Exception
        The front-end's error class (raised with one message naming the input).
    where : str
        The model (file name or ``"<bytes>"``), for the message.
    name : str
        The input's name.
    given : sequence of int
        The shape the user passed.
    declared : sequence of (int or None), or None
        The input's declared dims (``None`` for a dynamic one), or ``None`` when the model
        does not declare a shape.

    Returns
    -------
    tuple of int
        ``given`` as ints in ``[0, MAX_DIM]``.
    """
    try:
        dims = tuple(given)
        if not all(isinstance(d, int) or hasattr(d, "__index__") for d in dims):
            raise TypeError
        dims = tuple(int(d) for d in dims)
    except TypeError:
        raise error(f"shape_dict['{name}'] for {where} must be a sequence of ints, "
                    f"got {given!r}") from None
    if any(d < 0 for d in dims):
        raise error(f"shape_dict['{name}'] for {where} has a negative dim: {list(dims)}")
    for axis, d in enumerate(dims):
        if d > MAX_DIM:
            raise error(f"shape_dict['{name}'] for {where} gives dim {axis} = {d}, past the "
                        f"largest int64 ({MAX_DIM}) a TVM shape can hold")
    if declared is None:
        return dims
    declared = list(declared)
    if len(dims) != len(declared):
        shown = [d if d is not None else "?" for d in declared]
        raise error(
            f"shape_dict['{name}'] for {where} has rank {len(dims)} ({list(dims)}), but the "
            f"input has rank {len(declared)} ({shown})")
    for axis, (want, got) in enumerate(zip(declared, dims)):
        if want is not None and want != got:
            shown = [d if d is not None else "?" for d in declared]
            raise error(
                f"shape_dict['{name}'] for {where} gives dim {axis} = {got}, but the input's "
                f"dim {axis} is fixed to {want} ({shown})")
    return dims
