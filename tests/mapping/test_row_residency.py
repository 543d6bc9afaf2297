"""Row-parallel weight GEMMs for residency (``shard.ROW_ALWAYS``, ``system._row_always_sibling``).

A column-parallel GEMM keeps whole columns (the full reduction, ``k`` weights each) on a PE:
with a long ``k`` a chip's few columns are too coarse for its PEs' SRAM (one PE holding two of
them is over the ledger's cap) and the layer streams from DRAM every call. Run row-parallel,
each chip holds ``k / tp`` rows of every column (its input arrives split along ``k``), which
the layout spreads finely; the partial sums are all-reduced. The mapper tries that variant of
its best plan when that plan streams a weight GEMM, and keeps it when the timing model finds it
faster. References: numpy's exact int64 sums (the integer partial sums are exact in any
order under the MAC array's chunked 24-bit accumulators) and the one-chip build (bits).
"""

from __future__ import annotations

import numpy as np
import pytest

import tvm_spinn
from tvm_spinn import _lib
from tvm_spinn.mapping import MappingOptions, derive_tables, system
from tvm_spinn.mapping.memory import LEDGER_RESIDENT_SHARE
from tvm_spinn.mapping.planner import plan_system
from tvm_spinn.mapping.schedule import map_program
from tvm_spinn.mapping.shard import ROW_ALWAYS, plan_shards
from tvm_spinn.mapping.tiling import layer_work
from tvm_spinn.program import Layer, Program, TensorDesc
from tvm_spinn.program.ops.gemm import chunk_length, safe_k_chunk
from tvm_spinn.runtime.simulator import run_program



@pytest.fixture(autouse=True)
def _reductions_on_one_pe():
    """Each output's reduction on one PE: these tests are about the row-parallel shards (with
    the reduction split over PEs, tests/mapping/test_k_split.py, the column plan's blocks spread over
    the PEs' SRAM too and win here)."""
    with MappingOptions(split_k=False):
        yield


# 4 chips of 8 PEs: a 36-column GEMM gives each chip 9 columns, one PE two of them
ARCH = tvm_spinn.make_system("rowres-4x8", chips=4, pes_per_chip=8)
K, N = 32768, 36


def _down_projection(k: int = K, n: int = N) -> Program:
    """``x`` (int8, one row: a decode step) through one int8 dense ``k -> n`` (requantizing)."""
    tensors = [TensorDesc("x", [1, k], "int8", "input"), TensorDesc("w", [k, n], "int8", "const")]
    consts = {"weight": 1}
    for role in ("bias_q", "multiplier", "shift"):
        consts[role] = len(tensors)
        tensors.append(TensorDesc(role, [n], "int32", "const"))
    tensors.append(TensorDesc("y", [1, n], "int8", "output"))
    layer = Layer(name="down", kind="dense", inputs=[0], output=len(tensors) - 1, consts=consts,
                  attrs=dict(x_zero=0, x_flip=False, relu=False, out="int8", y_zero=0, y_min=-128, y_max=127),
                  mode="int8")
    rng = np.random.default_rng(0)
    program = Program("main", ARCH, tensors, [0], [len(tensors) - 1], [layer],
                      constants={1: rng.integers(-128, 128, (k, n), dtype=np.int8),
                                 2: rng.integers(-1000, 1000, n, dtype=np.int32),
                                 3: rng.integers(1 << 29, 1 << 30, n, dtype=np.int32), 4: np.full(n, 20, dtype=np.int32)})
    return layer_work(program, 0, ARCH)


def _mapped(monkeypatch=None):
    program = _down_projection()
    if monkeypatch is not None:
        monkeypatch.setattr(system, "_row_always_sibling", lambda *args: None)
    (mapped,) = plan_system([program], ARCH, MappingOptions(weights="auto", split_k=False)).programs
    return mapped


def test_row_always_plan_splits_the_input_and_the_weight_rows():
    program = _down_projection()
    default = plan_shards(program, 4, 1, True)
    always = plan_shards(program, 4, 1, ROW_ALWAYS)
    assert default.splits == ("col",) and always.splits == ("row",)
    assert default.shapes[1] == (K, N // 4) and always.shapes[1] == (K // 4, N)
    assert always.shapes[0] == (1, K // 4)  # the input arrives split along the reduction
    assert [(c.op, c.exact) for c in always.collectives] == [("all_reduce", True)]  # int32 sums
    with pytest.raises(ValueError, match="row must be"):
        plan_shards(program, 4, 1, "sometimes")


def test_streaming_column_plan_gives_way_to_resident_rows(monkeypatch):
    cap = LEDGER_RESIDENT_SHARE * ARCH.tile_sram_bytes
    assert 2 * K > cap  # two of a chip's 9 columns on one of its 8 PEs: over the cap
    rows = _mapped()
    info = rows.mapping.system
    assert info.tp == 4 and info.row == ROW_ALWAYS
    assert rows.mapping.resident_layers == (0,) and dict(info.splits) == {"row": 1}
    assert rows.memory.resident_bytes_total >= K * N  # every chip's rows in its PEs' SRAM
    assert rows.timing.system.streamed_bytes_per_chip == 0
    # without the variant the best plan streams its columns, slower
    cols = _mapped(monkeypatch)
    assert cols.mapping.system.row is True and cols.mapping.resident_layers == ()
    assert cols.timing.system.streamed_bytes_per_chip > 0
    assert rows.timing.latency_s < cols.timing.latency_s
    # both are among the candidates the mapper timed
    timed = {(c.tp, c.row) for c in info.candidates}
    assert (4, ROW_ALWAYS) in timed and (4, True) in timed
    # the records rebuild the same plan (retime: a loaded program's timing)
    again = system.retime(rows, ARCH, derive_tables)
    assert again.latency_s == pytest.approx(rows.timing.latency_s)
    # bits: the functional program is the one-chip program's, whatever the plan
    x = np.random.default_rng(1).integers(-128, 128, (1, K), dtype=np.int8)
    one = _down_projection()
    with MappingOptions(weights="auto", split_k=False):
        one = map_program(one, ARCH.replace(chips=1))
    (ref,) = run_program(one, [x], mode="layers")
    for program in (rows, cols):
        (got,) = run_program(program, [x], mode="layers")
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("tp", [2, 3, 48])
def test_row_partial_sums_are_exact_under_chunked_24_bit_accumulators(tp):
    """The all-reduced int32 partial sums of ``tp`` row blocks, each accumulated by the MAC
    array in its own chunks of at most ``safe_k_chunk`` products (24-bit accumulators), equal
    the one-chip accumulation of the whole reduction and numpy's exact sum."""
    arch = tvm_spinn.make_system("rowres-acc", chips=1)
    assert arch.acc_bits == 24
    k, n = 28672, 8
    rng = np.random.default_rng(tp)
    a = rng.integers(-128, 128, (1, 1, k), dtype=np.int8)
    a[0, 0, :600] = -128  # the extreme products too
    b = rng.integers(-128, 128, (1, k, n), dtype=np.int8)
    b[0, :600] = -128
    safe = safe_k_chunk(arch)
    whole = np.zeros((1, 1, n), dtype=np.int32)
    assert _lib.gemm_i8_batched(a, b, whole, chunk_length(k, safe), arch.acc_bits) == 0
    summed = np.zeros((1, 1, n), dtype=np.int32)
    for lo in range(0, k, -(-k // tp)):
        hi = min(k, lo + -(-k // tp))
        part = np.zeros((1, 1, n), dtype=np.int32)
        assert _lib.gemm_i8_batched(np.ascontiguousarray(a[:, :, lo:hi]), np.ascontiguousarray(b[:, lo:hi]), part,
                                    chunk_length(hi - lo, safe), arch.acc_bits) == 0
        summed += part
    exact = a[0].astype(np.int64) @ b[0].astype(np.int64)
    np.testing.assert_array_equal(whole[0], exact)
    np.testing.assert_array_equal(summed, whole)


def test_pipeline_stage_takes_a_row_parallel_input_without_gathering_it(monkeypatch):
    """A pipeline stage whose first GEMM runs row-parallel reads the hand-over split: each chip
    keeps the share its counterpart sent, no all-gather on arrival (a column plan gathers it)."""
    from tvm_spinn.llm.plan import _map_stage

    rows = _map_stage([_down_projection()], ARCH, set())
    assert rows.handoff_in_bytes == K and rows.handoff_gather_bytes == 0
    assert rows.resident_bytes >= K * N and rows.streamed_bytes_per_chip == 0
    monkeypatch.setattr(system, "_row_always_sibling", lambda *args: None)
    cols = _map_stage([_down_projection()], ARCH, set())
    assert cols.handoff_in_bytes == cols.handoff_gather_bytes == K
    assert cols.latency_s > rows.latency_s
