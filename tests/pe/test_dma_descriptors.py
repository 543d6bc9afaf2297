"""The strided DMA descriptors of a movement tile (``program.ops.movement``) against numpy: the
elements they address, in order, are the tile's elements of the strided view; and the strided
view of each strided kind is numpy's own result of the layer's movement."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvm_spinn.program.ops import movement
from tvm_spinn.program.ops.movement import (DMA_DIMS, ShapeMismatch, dma_descriptor_count, dma_descriptors, moved,
                                            strided_source)


def _addressed(descs) -> list[int]:
    """The source elements the descriptors read, in the order they write them."""
    out, at = [], 0
    for src, dst, counts, strides in descs:
        assert dst == at and len(counts) == len(strides) == DMA_DIMS
        for idx in np.ndindex(*counts[::-1]):
            out.append(src + sum(i * s for i, s in zip(idx, strides[::-1])))
        at += math.prod(counts)
    return out


def test_descriptors_address_the_tile_in_output_order():
    rng = np.random.default_rng(0)
    ranks = set()
    for _ in range(400):
        rank = int(rng.integers(1, 8))
        dims = tuple(int(d) for d in rng.integers(1, 5, rank))
        strides = tuple(int(s) for s in rng.integers(-9, 10, rank))
        offset, n = int(rng.integers(0, 40)), math.prod(dims)
        e0 = int(rng.integers(0, n))
        e1 = int(rng.integers(e0 + 1, n + 1))
        want = [offset + sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(*dims)][e0:e1]
        descs = dma_descriptors(dims, strides, offset, e0, e1)
        assert _addressed(descs) == want, (dims, strides, e0, e1)
        assert dma_descriptor_count(dims, e0, e1)[0] == len(descs)
        if rank <= DMA_DIMS:  # boxes only: at most 2 * rank - 1
            assert len(descs) <= 2 * rank - 1
        ranks.add(rank)
    assert ranks == set(range(1, 8))


class _Layer:
    def __init__(self, kind, attrs):
        self.kind, self.attrs, self.name, self.inputs, self.output = kind, attrs, "l", [0], 1


class _Tensor:
    def __init__(self, shape):
        self.shape = shape


class _Program:
    def __init__(self, ishape, oshape):
        self.tensors = {0: _Tensor(ishape), 1: _Tensor(oshape)}


@pytest.mark.parametrize("kind,ishape,oshape,attrs", [
    ("permute_dims", (2, 3, 4, 5), (5, 3, 2, 4), {"axes": [3, 1, 0, 2]}),
    ("permute_dims", (4, 1, 6), (6, 1, 4), {"axes": [2, 1, 0]}),
    ("broadcast_to", (1, 4, 1, 5), (3, 4, 2, 5), {}),
    ("strided_slice", (5, 8, 6), (2, 3, 6), {"axes": [0, 1], "begin": [1, 7], "strides": [2, -3]}),
    ("reshape", (4, 6), (2, 3, 4), {}),
])
def test_strided_source_is_the_simulators_movement(kind, ishape, oshape, attrs):
    layer, program = _Layer(kind, attrs), _Program(ishape, oshape)
    dims, strides, offset = strided_source(program, layer)
    x = np.arange(math.prod(ishape)).reshape(ishape)
    want = np.ascontiguousarray(moved(layer, [x], oshape)).reshape(-1)
    got = [offset + sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(*dims)]
    np.testing.assert_array_equal(got, want)
    assert all(d > 1 for d in dims) or dims == (1,)


def test_concat_and_pad_are_not_strided_views():
    assert strided_source(_Program((2, 3), (4, 3)), _Layer("concat", {"axis": 0})) is None
    assert strided_source(_Program((2, 3), (4, 5)), _Layer("pad", {"pad_width": [1, 1, 1, 1], "value": 0.0})) is None


def test_a_copy_is_not_read_as_a_view(monkeypatch):
    """A movement that returned a copy (its own strides, not the input's element map) is refused,
    and the descriptor count does not hide it behind the shard fallback."""
    layer, program = _Layer("permute_dims", {"axes": [1, 0]}), _Program((2, 3), (3, 2))
    assert strided_source(program, layer)[0] == (3, 2)
    monkeypatch.setattr(movement, "moved", lambda layer, xs, shape: np.zeros(shape, np.uint8))
    with pytest.raises(ValueError, match="returned a copy"):
        strided_source(program, layer)
    with pytest.raises(ValueError, match="returned a copy"):
        movement._strided_dims(program, layer)


def test_a_shard_whose_input_does_not_fit_falls_back_to_its_output():
    """A shard's output cut but not its input: the mismatch is named, and the descriptor count
    falls back to the output's non-unit extents."""
    layer, program = _Layer("reshape", {}), _Program((4, 6), (1, 5, 4))
    with pytest.raises(ShapeMismatch, match="does not move to its output"):
        strided_source(program, layer)
    assert movement._strided_dims(program, layer) == (5, 4)
