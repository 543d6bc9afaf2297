"""Tile placement (``tvm_spinn.mapping.placement.place_tiles``): tile groups that cannot be
balanced whole are cut into contiguous runs, so no PE takes a second group while others idle.

The references are counted here from the tables, independently of the placement's own cost.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvm_spinn.mapping import MappingOptions, map_program
from tvm_spinn.mapping.placement import place_tiles
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.tiles import TileTable
from tvm_spinn.target.arch import CHIPS

ARCH = CHIPS["production"]


def _table(groups: int, per_group: int, cycles: float = 1000.0, w_bytes: int = 1024) -> TileTable:
    """``groups`` weight groups of ``per_group`` equal tiles, listed row-major as the tiler lists
    a dense layer's tiles (the group is the column block; tiles of one group lie ``groups``
    apart)."""
    n = groups * per_group
    group = np.tile(np.arange(groups, dtype=np.int64), per_group)
    zeros = np.zeros(n, dtype=np.int64)
    lo = np.stack([np.repeat(np.arange(per_group), groups), group], axis=1).astype(np.int64)
    return TileTable(layer=0, k_splits=1, lo=lo, hi=lo + 1, group=group, pe=zeros - 1, chip=zeros - 1,
                     sram_bytes=zeros + 4096, in_bytes=zeros + 256, w_bytes=zeros + w_bytes,
                     out_bytes=zeros + 64, cycles=np.full(n, cycles))


def _fetches_per_pe(t: TileTable) -> np.ndarray:
    """Distinct weight groups each PE holds (one block fetch each)."""
    pairs = np.unique(np.stack([t.pe, t.group], axis=1), axis=0)
    return np.bincount(pairs[:, 0])


def test_groups_just_above_the_pes_are_cut_into_even_runs():
    # 150 groups of 4 on 148 PEs: whole groups put 8 tiles on two PEs, twice everyone else's
    t = place_tiles(_table(150, 4), 0, 148, ARCH)
    per_pe = np.bincount(t.pe, minlength=148)
    assert per_pe.sum() == 600 and (per_pe > 0).all()
    assert per_pe.max() == math.ceil(600 / 148) == 5
    # a run is contiguous within the group order: each PE holds at most two groups' blocks
    assert _fetches_per_pe(t).max() == 2
    # and a group spans at most two neighbouring PEs
    for g in range(150):
        pes = np.unique(t.pe[t.group == g])
        assert len(pes) <= 2 and pes.max() - pes.min() <= 1


def test_groups_that_balance_stay_whole():
    # 296 groups on 148 PEs: two whole groups each, every block fetched by one PE
    t = place_tiles(_table(296, 4), 0, 148, ARCH)
    assert (np.bincount(t.pe, minlength=148) == 8).all()
    assert all(len(np.unique(t.pe[t.group == g])) == 1 for g in range(296))
    # many groups per PE: whole groups are within a block's fetch of a cut, so they stay whole
    t = place_tiles(_table(1000, 2), 0, 148, ARCH)
    assert all(len(np.unique(t.pe[t.group == g])) == 1 for g in range(1000))


def test_cut_pays_for_its_extra_weight_fetch():
    # 200 groups of 4 on 148 PEs: whole groups put 8 tiles on 52 PEs; runs of 5-6 tiles may touch
    # three groups. Cheap blocks: the runs win; a block dearer to fetch than two tiles: whole
    light = place_tiles(_table(200, 4, cycles=1000.0, w_bytes=1024), 0, 148, ARCH)
    assert np.bincount(light.pe).max() == math.ceil(800 / 148)
    heavy = place_tiles(_table(200, 4, cycles=100.0, w_bytes=64 * 1024), 0, 148, ARCH)
    assert all(len(np.unique(heavy.pe[heavy.group == g])) == 1 for g in range(200))
    assert np.bincount(heavy.pe).max() == 8 and _fetches_per_pe(heavy).max() == 2


def test_rotate_starts_the_runs_at_the_given_pe():
    t = place_tiles(_table(150, 4), 10, 148, ARCH, rotate=5)
    assert set(np.unique(t.pe).tolist()) == set(range(10, 158))
    first = np.lexsort((np.arange(len(t)), t.group))[0]
    assert t.pe[first] == 15


def _dense(m: int, k: int, n: int) -> Program:
    x = TensorDesc("x", [m, k], "int8", "input")
    tensors = [x, TensorDesc("w", [k, n], "int8", "const"), TensorDesc("b", [n], "int32", "const"),
               TensorDesc("mul", [n], "int32", "const"), TensorDesc("sh", [n], "int32", "const"),
               TensorDesc("y", [m, n], "int8", "output")]
    layer = Layer(name="fc", kind="dense", inputs=[0], output=5,
                  consts={"weight": 1, "bias_q": 2, "multiplier": 3, "shift": 4},
                  attrs=dict(x_zero=0, x_flip=False, relu=False, out="int8"), mode="int8")
    return Program("main", ARCH, tensors, [0], [5], [layer])


@pytest.mark.parametrize("double_buffer", [True, False])
def test_streamed_dense_busiest_pe_is_its_share(double_buffer):
    # [64, 1024] @ [1024, 1200] streamed from DRAM: the tiler's 16 x 8 tiles make 150 column
    # groups; the busiest PE computes its share of the tiles, not two groups
    p = map_program(_dense(64, 1024, 1200), ARCH, MappingOptions(weights="stream", double_buffer=double_buffer))
    t = p.tiles.tables[0]
    pes = len(np.unique(t.pe))
    busiest = np.bincount(t.pe, weights=t.cycles).max()
    assert busiest <= math.ceil(len(t) / pes) * t.cycles.max()
    # every weight byte still crosses DRAM once (later PEs of a cut group get it by multicast)
    weights = 1024 * 1200 + 3 * 4 * 1200
    acts = 64 * 1024 + 64 * 1200
    assert p.timing.layers[0].dram_bytes == weights + acts
