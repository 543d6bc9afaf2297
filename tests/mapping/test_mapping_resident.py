"""Weight GEMMs laid out for residency under a build's SRAM ledger (``schedule._resident_layout``).

A decode step's int8 GEMM (one row) takes MAC-array-wide column tiles holding the whole
reduction: a few more tiles than PEs put two weight blocks on some PEs, over the ledger's cap
(half a PE's tile SRAM), and the whole layer streams; two such layers both start at PE 0.
Under a ledger the mapper also tries wider/narrower column tiles that balance the blocks and
tiles that start past the PEs already holding residents, keeping them when the timing model
finds them faster. The outputs are bit-identical (every output still sums its reduction on one
PE, in ascending k).
"""

from __future__ import annotations

import numpy as np

import tvm_spinn
from tvm_spinn.mapping import MappingOptions, derive_tables
from tvm_spinn.mapping.memory import LEDGER_RESIDENT_SHARE
from tvm_spinn.mapping import schedule
from tvm_spinn.mapping.schedule import _map
from tvm_spinn.mapping.tiling import layer_work, program_work
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.runtime.simulator import run_program

# A 4 x 4 MAC array: a decode row takes one array pass per 4 columns whichever side holds it, so
# the column tiles below are MAC-array wide at 4 (on the 16 x 4 array a row sits on the 4-wide
# side and a pass covers 16 columns).
ARCH = tvm_spinn.make_system("resident-8pe", pes_per_chip=8, mac_rows=4, mac_cols=4)
K = 8192


def _decode_program(widths: list[int]) -> Program:
    """One int8 row ``x`` (a decode step) through int8 dense layers ``K -> n`` (requantizing),
    each reading ``x``, each output a program output."""
    tensors = [TensorDesc("x", [1, K], "int8", "input")]
    layers, outputs = [], []
    for j, n in enumerate(widths):
        consts = {"weight": len(tensors)}
        tensors.append(TensorDesc(f"w{j}", [K, n], "int8", "const"))
        for role in ("bias_q", "multiplier", "shift"):
            consts[role] = len(tensors)
            tensors.append(TensorDesc(f"{role}{j}", [n], "int32", "const"))
        tensors.append(TensorDesc(f"y{j}", [1, n], "int8", "output"))
        outputs.append(len(tensors) - 1)
        layers.append(Layer(name=f"dense{j}", kind="dense", inputs=[0], output=len(tensors) - 1, consts=consts,
                            attrs=dict(x_zero=0, x_flip=False, relu=False, out="int8", y_zero=0,
                                                                 y_min=-128, y_max=127), mode="int8"))
    rng = np.random.default_rng(0)
    consts = {}
    for tid, t in enumerate(tensors):
        if t.role != "const":
            continue
        if t.name.startswith("w"):
            consts[tid] = rng.integers(-128, 128, t.shape, dtype=np.int8)
        elif t.name.startswith("bias"):
            consts[tid] = rng.integers(-1000, 1000, t.shape, dtype=np.int32)
        elif t.name.startswith("multiplier"):
            consts[tid] = rng.integers(1 << 29, 1 << 30, t.shape, dtype=np.int32)
        else:
            consts[tid] = np.full(t.shape, 14, dtype=np.int32)
    return program_work(Program("main", ARCH, tensors, [0], outputs, layers, constants=consts), ARCH)


def _mapped(widths, reserved):
    """The mapped program and its resident weight bytes per PE."""
    return _map(_decode_program(widths), ARCH, "sequential", MappingOptions(weights="auto"), reserved)


def test_unbalanced_decode_gemm_becomes_resident_and_keeps_its_bits(monkeypatch):
    # the resident layout alone (the reduction split over PEs is the next test's)
    monkeypatch.setattr(schedule, "_split_layout", lambda *args: None)
    pes = ARCH.pes_per_chip
    # 10 MAC-wide tiles of 32 KiB on 8 PEs: two PEs would hold 64 KiB, over the ledger's cap.
    alone, _ = _mapped([40], None)
    assert alone.mapping.layers[0].tile[1] == 4
    assert 2 * K * 4 > LEDGER_RESIDENT_SHARE * ARCH.tile_sram_bytes
    ledger, ledger_resident = _mapped([40], np.zeros(pes, dtype=np.int64))
    assert ledger.mapping.resident_layers == (0,)
    assert ledger.mapping.layers[0].tile[1] == 5  # 8 balanced blocks of 5 columns
    assert max(ledger_resident.values()) <= LEDGER_RESIDENT_SHARE * ARCH.tile_sram_bytes
    # without the layout the same ledger streams the weights, slower
    monkeypatch.setattr(schedule, "_resident_layout", lambda *args: None)
    default, _ = _mapped([40], np.zeros(pes, dtype=np.int64))
    assert default.mapping.resident_layers == () and default.mapping.layers[0].tile[1] == 4
    assert ledger.timing.cycles < default.timing.cycles
    # bits: the tiles of either layout, executed tile by tile, equal the whole layer's
    x = np.random.default_rng(1).integers(-128, 128, (1, K), dtype=np.int8)
    (ref,) = run_program(alone, [x], mode="layers")
    for program in (alone, ledger, default):
        (got,) = run_program(program, [x], mode="tiles")
        np.testing.assert_array_equal(got, ref)


def test_resident_decode_gemm_splits_its_reduction_when_faster(monkeypatch):
    """Laid out for residency, 40 columns on 8 PEs take 8 tiles of 5 columns: two MAC-array
    passes of the whole 8,192-long reduction each. Split into 4 parts of 20 columns (a quarter
    of the reduction each), a PE holds about as many weight bytes and streams a quarter of the
    reduction through 5 passes: faster, still resident under the cap, and the same bits (int32
    partial sums are exact in any order)."""
    pes = ARCH.pes_per_chip
    split, split_resident = _mapped([40], np.zeros(pes, dtype=np.int64))
    tile = split.mapping.layers[0].tile
    assert len(tile) == 4 and tile[3] > 1  # [tm, tn, tk, parts]
    assert split.mapping.resident_layers == (0,)
    assert max(split_resident.values()) <= LEDGER_RESIDENT_SHARE * ARCH.tile_sram_bytes
    monkeypatch.setattr(schedule, "_split_layout", lambda *args: None)
    whole, _ = _mapped([40], np.zeros(pes, dtype=np.int64))
    assert whole.mapping.layers[0].tile == (ARCH.mac_rows, 5, 511) and whole.mapping.resident_layers == (0,)
    assert split.timing.cycles < whole.timing.cycles
    x = np.random.default_rng(2).integers(-128, 128, (1, K), dtype=np.int8)
    (ref,) = run_program(whole, [x], mode="layers")
    for program in (whole, split):
        (got,) = run_program(program, [x], mode="tiles")
        np.testing.assert_array_equal(got, ref)


def test_attention_matmul_tiles_run_in_one_round_when_faster(monkeypatch):
    """A slot-split decode score matmul on one chip of a Llama-2-70B board (8 KV heads x 8
    query rows x 128, 43 slots). The tile chooser, costing the M4F's 4 x 4 register blocks and
    the NoC as the timing model does, cuts 88 tiles of 4 slots (one round), faster than 344
    tiles of 1 slot (three rounds) or one round of 3-slot tiles. Where the chosen tiles are 176
    of 2 slots for 148 PEs (28 PEs run two), under a
    ledger the mapper also times 120 tiles of 3 slots (one round) and keeps them, faster, with
    the same bits (each output sums its reduction on one PE, ascending k)."""
    from tvm_spinn.program.ops.gemm import family as gemm_family  # where the family looks the chooser up

    chip = tvm_spinn.make_system("one-chip-148")
    b, m, k, n = 8, 8, 128, 43
    tensors = [TensorDesc("q", [b, m, k], "float32", "input"), TensorDesc("kt", [b, k, n], "float32", "input"),
               TensorDesc("s", [b, m, n], "float32", "output")]

    def mapped():
        program = Program("main", chip, [TensorDesc(t.name, list(t.shape), t.dtype, t.role) for t in tensors],
                          [0, 1], [2], [Layer(name="scores", kind="matmul", inputs=[0, 1], output=2)])
        program = layer_work(program, 0, chip)
        return _map(program, chip, "sequential", MappingOptions(weights="auto"),
                    np.zeros(chip.pes_per_chip, dtype=np.int64))[0]

    best = mapped()
    assert best.mapping.layers[0].tile[1] == 4 and np.bincount(best.tiles.tables[0].pe).max() == 1
    monkeypatch.setattr(gemm_family, "choose_gemm_tile", lambda *args, **kwargs: (16, 1, 128))
    slot = mapped()
    assert np.bincount(slot.tiles.tables[0].pe).max() == 3 and best.timing.cycles < slot.timing.cycles
    monkeypatch.setattr(gemm_family, "choose_gemm_tile", lambda *args, **kwargs: (16, 2, 128))
    one = mapped()
    monkeypatch.setattr(schedule, "_one_round_layout", lambda *args: None)
    two = mapped()
    assert two.mapping.layers[0].tile[1] == 2 and np.bincount(two.tiles.tables[0].pe).max() == 2
    assert one.mapping.layers[0].tile[1] == 3 and np.bincount(one.tiles.tables[0].pe).max() == 1
    assert best.timing.cycles < one.timing.cycles < two.timing.cycles
    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, m, k)).astype(np.float32)
    kt = rng.standard_normal((b, k, n)).astype(np.float32)
    ref = np.zeros((b, m, n), np.float32)
    for j in range(k):  # fl(acc + fl(a * b)), k ascending: the kernels' order
        ref = ref + q[:, :, j, None] * kt[:, None, j, :]
    for program in (best, one, two):
        (got,) = run_program(program, [q, kt], mode="tiles")
        np.testing.assert_array_equal(got, ref)


def test_layers_start_past_earlier_residents_and_reload_from_records():
    with MappingOptions(split_k=False):  # the layout of whole-reduction column tiles
        _layers_start_past_earlier_residents()


def _layers_start_past_earlier_residents():
    pes = ARCH.pes_per_chip
    # Two 4-column layers: one 32 KiB tile each, both on PE 0 by default (64 KiB, over the cap);
    # laid out, one column per PE, the second starting where the first ends.
    ledger, _ = _mapped([4, 4], np.zeros(pes, dtype=np.int64))
    assert ledger.mapping.resident_layers == (0, 1)
    first, second = (set(t.pe.tolist()) for t in ledger.tiles.tables)
    assert not first & second
    assert ledger.mapping.layers[1].rotate == 4
    # the records alone rebuild the same placement (what a loaded program's timeline uses) ...
    for a, b in zip(derive_tables(ledger, ARCH), ledger.tiles.tables):
        np.testing.assert_array_equal(a.pe, b.pe)
    # ... and the validated header carries them
    loaded = Program.from_bytes(ledger.to_bytes())
    assert loaded.mapping.layers[1].rotate == 4
    # earlier programs' residents (the reserved bytes) push the first layer past them too
    reserved = np.zeros(pes, dtype=np.int64)
    reserved[:4] = 40 * 1024
    after, _ = _mapped([4], reserved)
    assert after.mapping.resident_layers == (0,)
    assert set(after.tiles.tables[0].pe.tolist()) == {4, 5, 6, 7}


def test_a_whole_reduction_layout_may_take_two_rounds(monkeypatch):
    """Two fp32 decode GEMMs ``[1, 1024] x [1024, 22]`` on a chip of 4 PEs (a column shard of
    a 1024-wide layer on 48 chips). Their default 4-column tiles are 6 a layer, so PEs 0 and 1
    hold two blocks each (8 columns, 32 KiB): the two layers' 64 KiB on PE 0 are over the
    ledger's cap (56 KiB) and one layer streams. One round of 6-column tiles would hold 6
    columns a PE but its working set is over a tile's budget; 3-column tiles (8 a layer, two
    rounds, an unsplit reduction) hold 6 columns (24 KiB) a PE too: both layers stay resident,
    faster, with the same bits (each output sums its whole reduction on one PE, ascending k)."""
    chip = tvm_spinn.make_system("fp32-4pe", pes_per_chip=4)
    k, n = 1024, 22
    rng = np.random.default_rng(4)
    tensors = [TensorDesc("x", [1, k], "float32", "input"),
               TensorDesc("w0", [k, n], "float32", "const"), TensorDesc("w1", [k, n], "float32", "const"),
               TensorDesc("y0", [1, n], "float32", "output"), TensorDesc("y1", [1, n], "float32", "output")]
    layers = [Layer(name=f"fc{j}", kind="dense", inputs=[0], output=3 + j, consts={"weight": 1 + j},
                    attrs={"relu": False}) for j in range(2)]
    consts = {1 + j: rng.standard_normal((k, n)).astype(np.float32) for j in range(2)}
    program = program_work(Program("main", chip, tensors, [0], [3, 4], layers, constants=consts), chip)
    cap = LEDGER_RESIDENT_SHARE * chip.tile_sram_bytes
    assert 2 * 8 * k * 4 > cap >= 2 * 6 * k * 4  # two layers' 8 columns a PE over it, 6 columns not

    def mapped():
        return _map(program, chip, "sequential", MappingOptions(weights="auto"),
                    np.zeros(chip.pes_per_chip, dtype=np.int64))

    laid, laid_resident = mapped()
    assert laid.mapping.resident_layers == (0, 1)
    for table, record in zip(laid.tiles.tables, laid.mapping.layers):
        assert record.tile[1] == 3 and len(record.tile) == 3  # whole reductions, 8 tiles a layer
        assert np.bincount(table.pe).tolist() == [2, 2, 2, 2]
    assert max(laid_resident.values()) == 2 * 6 * k * 4
    # the default 4-column tiles, as the chooser picks them for the layer alone
    alone, _ = _map(program, chip, "sequential", MappingOptions(weights="auto"), None)
    assert [r.tile[1] for r in alone.mapping.layers] == [4, 4]
    assert np.bincount(alone.tiles.tables[0].pe).tolist() == [2, 2, 1, 1]
    monkeypatch.setattr(schedule, "_resident_layout", lambda *args: None)  # the ledger without the layout
    default, _ = mapped()  # one layer streams
    assert len(default.mapping.resident_layers) == 1 and laid.timing.cycles < default.timing.cycles
    x = rng.standard_normal((1, k)).astype(np.float32)
    ref = [np.zeros((1, n), np.float32) for _ in range(2)]
    for j in range(k):  # fl(acc + fl(a * b)), k ascending: the kernels' order
        ref = [r + x[:, j, None] * consts[1 + i][None, j, :] for i, r in enumerate(ref)]
    for mapped_program in (alone, laid, default):
        got = run_program(mapped_program, [x], mode="tiles")
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(g, r)
