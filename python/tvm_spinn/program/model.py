"""The records of a spinn program (tensors, layers, tiles) and its error type.

Tensors and layers are frozen: a stage that changes one builds a new record
(``dataclasses.replace``); codegen fills a :class:`LayerDraft` and freezes it.

A leaf of :mod:`tvm_spinn.program`: :mod:`.format` (the container and its serialization) and
:mod:`.validate` both build on it; :mod:`.format` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ProgramError", "TensorDesc", "Layer", "LayerDraft", "Tile", "ConstantMap", "FrozenMap", "frozen_map"]


class ProgramError(ValueError):
    """A spinn program that cannot be read (truncated, corrupt, wrong version, inconsistent).

    The message starts with the defective field (``version``, ``header``,
    ``layers[3].inputs[0]``...)."""


@dataclass(frozen=True)
class TensorDesc:
    name: str
    shape: list[int]
    dtype: str
    role: str
    offset: int = -1

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class FrozenMap(dict):
    """A read-only ``dict``: a layer's ``consts`` and ``attrs``.

    Every method that would change it raises :class:`TypeError`, so a stage cannot edit the
    layer of a program it was handed (it builds a new layer, ``dataclasses.replace(layer,
    attrs={**layer.attrs, ...})``). A ``dict`` subclass rather than a
    ``types.MappingProxyType`` so that the program's JSON (``json.dumps``) is written exactly
    as from a plain dict and the record can be copied and pickled with its program.
    """

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("a layer's consts and attrs are read-only: build a new layer "
                        "(dataclasses.replace(layer, attrs={**layer.attrs, key: value}))")

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = setdefault = pop = popitem = clear = _refuse

    def __reduce__(self):
        return FrozenMap, (dict(self),)

    def __deepcopy__(self, memo):
        import copy
        return FrozenMap(copy.deepcopy(dict(self), memo))

    def __repr__(self) -> str:
        return f"FrozenMap({dict.__repr__(self)})"


def frozen_map(value) -> FrozenMap:
    """``value`` (a mapping) as a :class:`FrozenMap`, its nested dicts frozen too (a
    :class:`FrozenMap` is returned as it is)."""
    if type(value) is FrozenMap:
        return value
    return FrozenMap((k, frozen_map(v) if isinstance(v, dict) else v) for k, v in value.items())


@dataclass(frozen=True)
class Layer:
    """One layer of a program, a frozen record: ``consts`` (role -> tensor id) and ``attrs``
    are read-only :class:`FrozenMap` (dicts given to the constructor are converted)."""

    name: str
    kind: str
    inputs: list[int]
    output: int
    consts: FrozenMap = field(default_factory=FrozenMap)
    attrs: FrozenMap = field(default_factory=FrozenMap)
    gemm: list[int] | None = None
    flops: int = 0
    mode: str = "fp32"

    def __post_init__(self):
        if type(self.consts) is not FrozenMap:
            object.__setattr__(self, "consts", frozen_map(self.consts))
        if type(self.attrs) is not FrozenMap:
            object.__setattr__(self, "attrs", frozen_map(self.attrs))


@dataclass
class LayerDraft:
    """A :class:`Layer` being lowered: an operator family's ``lower`` fills it in place,
    :meth:`freeze` makes the layer."""

    name: str
    kind: str
    inputs: list[int]
    output: int
    consts: dict[str, int] = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    gemm: list[int] | None = None
    flops: int = 0
    mode: str = "fp32"

    def freeze(self) -> Layer:
        """The layer, a frozen record."""
        return Layer(**vars(self))


class ConstantMap(Mapping):
    """A program's constants, read-only: tensor id -> array.

    A :class:`~.format.Program` holds its constants in one, so no stage adds or replaces a
    constant of a program it was handed (a stage that needs other constants builds a new
    program). Unlike ``types.MappingProxyType`` it can be copied and pickled with the program.
    """

    __slots__ = ("_data",)

    def __init__(self, data=()):
        self._data = dict(data)

    def __getitem__(self, tid):
        return self._data[tid]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ConstantMap({sorted(self._data)})"

    def __reduce__(self):
        return ConstantMap, (self._data,)


@dataclass
class Tile:
    layer: int
    pe: int
    region: list[list[int]]
    k_splits: int = 1
    group: int = -1
    chip: int = 0
    sram_bytes: int = 0
    in_bytes: int = 0
    w_bytes: int = 0
    out_bytes: int = 0
    cycles: int = 0
