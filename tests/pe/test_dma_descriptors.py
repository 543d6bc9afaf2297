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


class _Many:
    """A layer of ``n`` inputs (tensors ``0..n-1``) and output ``n``."""

    def __init__(self, kind, attrs, n):
        self.kind, self.attrs, self.name, self.inputs, self.output = kind, attrs, "l", list(range(n)), n


class _Shapes:
    def __init__(self, shapes):
        self.tensors = {i: _Tensor(s) for i, s in enumerate(shapes)}


def _random_scatter(rng):
    """A random concat (1 to 9 inputs, any axis) or pad (zero widths included): layer, program,
    input shapes, output shape."""
    rank = int(rng.integers(1, 6))
    if rng.integers(2):
        shape = tuple(int(d) for d in rng.integers(1, 4, rank))
        width = [int(w) for w in rng.integers(0, 3, 2 * rank)]
        out = tuple(d + width[2 * k] + width[2 * k + 1] for k, d in enumerate(shape))
        return _Many("pad", {"pad_width": width, "value": 0.0}, 1), _Shapes([shape, out]), [shape], out
    axis, base = int(rng.integers(rank)), [int(d) for d in rng.integers(1, 4, rank)]
    shapes = [tuple(base[:axis] + [int(rng.integers(1, 4))] + base[axis + 1:]) for _ in range(int(rng.integers(1, 10)))]
    out = tuple(base[:axis] + [sum(s[axis] for s in shapes)] + base[axis + 1:])
    return _Many("concat", {"axis": axis}, len(shapes)), _Shapes([*shapes, out]), shapes, out


def test_scatter_targets_are_the_simulators_movement():
    """Each input's strided view of the output (``scatter_targets``) puts its elements where the
    simulator's concat or pad does; the views keep row-major order; ``scatter_range`` counts the
    input's elements before every output element as brute force does; and the descriptors of
    any tile's share of an input write exactly those elements to those places."""
    rng = np.random.default_rng(2)
    kinds = set()
    for _ in range(300):
        layer, program, shapes, out = _random_scatter(rng)
        targets = movement.scatter_targets(program, layer)
        xs, first = [], 0
        for s in shapes:
            xs.append(np.arange(first, first + math.prod(s)).reshape(s))
            first += math.prod(s)
        want = (movement.padded(xs[0], layer.attrs["pad_width"], -1) if layer.kind == "pad"
                else moved(layer, xs, out)).reshape(-1)
        got, n = np.full(math.prod(out), -1), math.prod(out)
        e0 = int(rng.integers(0, n))
        e1 = int(rng.integers(e0 + 1, n + 1))
        for x, (dims, strides, offset) in zip(xs, targets):
            pos = np.array([offset + sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(*dims)])
            assert (np.diff(pos) > 0).all()
            got[pos] = x.reshape(-1)
            ends = np.arange(n + 1)
            np.testing.assert_array_equal(movement.scatter_range(dims, strides, offset, ends),
                                          (pos[None, :] < ends[:, None]).sum(1))
            q0, q1 = (int(movement.scatter_range(dims, strides, offset, e)[0]) for e in (e0, e1))
            descs = dma_descriptors(dims, strides, offset - e0, q0, q1)
            placed = _addressed([(s, c, counts, st) for s, c, counts, st in descs])
            np.testing.assert_array_equal(placed, pos[q0:q1] - e0)
            assert all(0 <= p < e1 - e0 for p in placed)
        np.testing.assert_array_equal(got, want)
        kinds.add(layer.kind)
    assert kinds == {"concat", "pad"}


def test_a_scatter_shard_whose_inputs_do_not_fit_is_named_and_counted_on_its_output():
    layer, program = _Many("concat", {"axis": 0}, 2), _Shapes([(2, 3), (2, 4), (4, 3)])
    with pytest.raises(ShapeMismatch, match=r"input 1 \(2, 4\)"):
        movement.scatter_targets(program, layer)
    assert movement._scatter_targets(program, layer) == [((12,), (1,), 0)]
