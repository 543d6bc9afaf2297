"""The first half of the ``rms_norm`` after each all-reduce run on the all-reduce's delivery
(``board_tp.norms_on_delivery``): what a piece sheds is exactly the sums of squares and the
chain its norm's tiles are charged, and the delivery pays it back per part."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_spinn.llm import board_tp  # noqa: E402
from tvm_spinn.program.ops.rows import split_norm_sums  # noqa: E402

from test_board_tp_fused_adds import GPTJ, LLAMA, _cut  # noqa: E402


def _board():
    from tvm_spinn.target import arch_of

    return arch_of("spinn").replace(chips=48)


def _mapped(pieces, tiles: int, pes: int = 152):
    """A stand-in for the slice mapped resident: every piece's layers ``tiles`` tiles each, on
    ``pes`` PEs."""
    return SimpleNamespace(program_layers=tuple(tuple(SimpleNamespace(tiles=tiles, pes=pes) for _ in p.layers)
                                                for p in pieces))


@dataclass(frozen=True)
class _Timed:
    """A stand-in for a stage timed per piece."""

    latency_s: float
    program_s: tuple
    program_streamed: tuple
    program_layers: tuple


def _stage(pieces, tiles: int, each_s: float = 1e-3, streamed: int = 0):
    layers = _mapped(pieces, tiles).program_layers
    return _Timed(each_s * len(pieces), (each_s,) * len(pieces), (streamed,) * len(pieces), layers)


def _fused(cfg):
    _, _, pieces, ends = _cut(cfg)
    return board_tp.fused_adds(pieces, ends)


def test_each_norm_after_an_all_reduce_sheds_its_sums_and_chain():
    board = _board()
    pieces, ends, adds = _fused(LLAMA)
    row = LLAMA["hidden_size"]
    got = board_tp.norms_on_delivery(pieces, ends, [layer for _, layer in adds], _mapped(pieces, 16), board)
    assert got is not None
    saved, consume = got
    norms = [k for k, p in enumerate(pieces) if ends[k - 1] and p.layers[0].kind == "rms_norm"]
    assert len(norms) == 2  # the attention's and the MLP's, each after an all-reduce
    first, chain, hop = split_norm_sums(pieces[norms[0]].layers[0], row, row // 16, board)
    for k, s in enumerate(saved):
        assert s == (pytest.approx((first + chain) / board.clock_hz, rel=1e-12) if k in norms else 0.0)
    # per part: a chunk's add (job, wake-up, its columns), its first pass, the chain through the part
    from tvm_spinn.program.ops import family_of

    add = adds[0][1]
    fam = family_of(add.kind)
    part = (fam.fixed_cycles(add, board) + board.irq_entry_cycles + row // 16 * fam.cycles_per_element(add, board)
            + first + chain / board_tp.FUSED_CHUNKS + hop)
    assert consume == pytest.approx(board_tp.FUSED_CHUNKS * part / board.clock_hz, rel=1e-12)


@pytest.mark.parametrize("tiles", [1, 4, 6])
def test_a_row_not_cut_into_whole_chunks_a_part_sheds_nothing(tiles):
    """Fewer chunks than two a part (the chain has nothing to overlap), or chunks the parts or
    the row do not divide: the norm stays in its piece."""
    pieces, ends, adds = _fused(LLAMA)
    assert board_tp.norms_on_delivery(pieces, ends, [layer for _, layer in adds], _mapped(pieces, tiles),
                                      _board()) is None


def test_chunks_beyond_a_chips_pes_shed_nothing():
    """More chunks than PEs: a PE runs several chunks one after another, not the one chunk a
    part the delivery is charged for."""
    pieces, ends, adds = _fused(LLAMA)
    adds = [layer for _, layer in adds]
    assert board_tp.norms_on_delivery(pieces, ends, adds, _mapped(pieces, 16, pes=16), _board()) is not None
    assert board_tp.norms_on_delivery(pieces, ends, adds, _mapped(pieces, 16, pes=15), _board()) is None


def test_each_stage_sheds_its_own_norms_and_only_on_the_deliverys_tiles():
    board = _board()
    pieces, ends, adds = _fused(LLAMA)
    adds = [layer for _, layer in adds]
    delivery = _mapped(pieces, 16)
    same, other = _stage(pieces, 16), _stage(pieces, 32)
    own, _ = board_tp.norms_on_delivery(pieces, ends, adds, same, board)
    got = board_tp._shed(same, (adds, delivery), pieces, ends, board)
    assert got.program_s == tuple(s - d for s, d in zip(same.program_s, own))
    assert got.latency_s == pytest.approx(same.latency_s - sum(own), rel=1e-12)
    # a stage whose norms are tiled otherwise than the delivery is charged for keeps them
    assert board_tp._shed(other, (adds, delivery), pieces, ends, board) is other
    assert board_tp._shed(same, None, pieces, ends, board) is same


def test_a_streamed_piece_keeps_its_dram_reads():
    """A piece shorter by its norm is never shorter than reading its streamed bytes."""
    board = _board()
    pieces, ends, adds = _fused(LLAMA)
    adds = [layer for _, layer in adds]
    own, _ = board_tp.norms_on_delivery(pieces, ends, adds, _stage(pieces, 16), board)
    each = 3 * max(own)
    floor = each - max(own) / 2
    stage = _stage(pieces, 16, each_s=each, streamed=int(np.ceil(floor * board.dram_bw_bytes_s)))
    got = board_tp._shed(stage, (adds, _mapped(pieces, 16)), pieces, ends, board)
    reads = stage.program_streamed[0] / board.dram_bw_bytes_s
    for k, (s, d) in enumerate(zip(got.program_s, own)):
        assert s == (max(each - d, reads) if d else each)
        assert s >= reads
    assert any(d and s == reads for s, d in zip(got.program_s, own))
    assert got.latency_s == pytest.approx(stage.latency_s - sum(stage.program_s) + sum(got.program_s), rel=1e-12)


def test_a_block_without_rms_norms_sheds_nothing():
    pieces, ends, adds = _fused(GPTJ)  # layer_norm, one all-reduce a block
    assert board_tp.norms_on_delivery(pieces, ends, [layer for _, layer in adds], _mapped(pieces, 16),
                                      _board()) is None
    # nor a slice as described (no pieces) or a mapping not timed per piece
    pieces, ends, adds = _fused(LLAMA)
    assert board_tp.norms_on_delivery(pieces, None, [layer for _, layer in adds], _mapped(pieces, 16), _board()) is None
    assert board_tp.norms_on_delivery(pieces, ends, [layer for _, layer in adds], _mapped(pieces[:-1], 16),
                                      _board()) is None


def test_the_split_norm_sums_are_what_the_norms_tiles_are_charged():
    """The first pass and the chain are the parts of a split row's tile cost
    (``Rows._code_and_wait``) that the delivery takes: with the second pass, the runs and the
    statistic's broadcast they make up a middle chunk's cycles."""
    from tvm_spinn.program.model import Layer
    from tvm_spinn.program.ops import family_of
    from tvm_spinn.program.ops.rows import LAYER_NORM_BLOCK, ROW_CODE, ROW_RUN, _multicast_hops
    from tvm_spinn.program.ops.m4f import mix_cycles

    board = _board()
    row, cols = 8192, 64
    layer = Layer(name="n", kind="rms_norm", inputs=[0], output=1, attrs={"epsilon": 1e-5})
    first, chain, hop = split_norm_sums(layer, row, cols, board)
    chunks = row // cols
    # the chain: the row's block sums at one dependent add each (a chunk's two blocks fit the
    # FPU registers) and one NoC hop per chunk boundary
    assert chain == (row // LAYER_NORM_BLOCK) * board.m4f_chain_cycles + (chunks - 1) * board.noc_hop_cycles
    assert hop == board.noc_hop_cycles
    lo, hi = np.array([[0, cols]]), np.array([[1, 2 * cols]])
    code, wait = family_of("rms_norm")._code_and_wait(layer, board, row, (1, cols), lo, hi)
    second = mix_cycles(ROW_RUN, board) + float(np.asarray(
        ROW_CODE["rms_norm"][1].cycles(np.array([1]), np.array([cols]), board, False, np.array([cols]))).reshape(-1)[0])
    broadcast = _multicast_hops(chunks, board) * board.noc_hop_cycles
    assert float(code[0]) + float(wait[0]) == pytest.approx(first + second + chain + broadcast, rel=1e-12)


@pytest.mark.parametrize("kind, cols, row", [("layer_norm", 64, 8192), ("rms_norm", 8192, 8192), ("rms_norm", 0, 8192)])
def test_bad_input_is_refused(kind, cols, row):
    from tvm_spinn.program.model import Layer

    layer = Layer(name="n", kind=kind, inputs=[0], output=1)
    with pytest.raises(ValueError, match="split_norm_sums"):
        split_norm_sums(layer, row, cols, _board())


@pytest.mark.slow  # ~30-60 s alone: a slice described and mapped on boards, three times from one memo
def test_the_plan_takes_what_the_pieces_shed_where_it_pays(monkeypatch, register_system):
    """The fused form's candidates with the norms' sums on the delivery: the block shorter by
    what its pieces shed, the all-reduce as long as its delivery's work makes it; a norm whose
    delivery would cost more than it sheds is left in its piece (the small model's rows, split
    over a few PEs of 4 a chip, shed nothing that pays)."""
    from tqdm.auto import tqdm

    from test_llm_board_tp import _streaming_boards

    P, cfg, target, arch, spec, seq, described = _streaming_boards(register_system, "norms")
    memo: dict = {}
    forms, real = board_tp.slice_forms, board_tp.norms_on_delivery
    monkeypatch.setattr(board_tp, "TP_BOARDS", (2,))
    monkeypatch.setattr(board_tp, "slice_forms", lambda dec, reduces: forms(dec, reduces)[1:2])  # the fused form
    shed = {}

    def kept(norms):
        monkeypatch.setattr(board_tp, "norms_on_delivery", norms)
        out = board_tp.records(cfg, spec, arch, target, "int8", 1, seq, 4, described, spec.params,
                               seq * spec.kv_bytes_per_token(4), tqdm(disable=True), memo=memo)
        assert out
        return min(out.values(), key=lambda r: r["decode_s"])

    def shedding(pieces, ends, adds, mapped, board, chunks=board_tp.FUSED_CHUNKS):
        saved = tuple(1e-6 * (k + 1) if ends[k - 1] and p.layers[0].kind == "rms_norm" else 0.0
                      for k, p in enumerate(pieces))
        shed["saved"] = saved
        return saved, 0.0  # nothing on the delivery: the block sheds all of it

    plain = kept(lambda *a, **k: None)
    as_real = kept(real)
    assert as_real["decode_s"] == plain["decode_s"]
    cheap = kept(shedding)
    assert sum(shed["saved"]) > 0
    assert cheap["meta"]["board_all_reduce_s"] == plain["meta"]["board_all_reduce_s"]
    # (a streamed block's pieces, shorter, leave its DRAM channels less idle time to fetch the
    # next pieces' weights ahead: it may gain less than all it sheds, never more)
    gained = plain["meta"]["block_decode_s"] - cheap["meta"]["block_decode_s"]
    assert 0 < gained <= sum(shed["saved"]) * (1 + 1e-9)

    def dear(pieces, ends, adds, mapped, board, chunks=board_tp.FUSED_CHUNKS):
        saved, _ = shedding(pieces, ends, adds, mapped, board, chunks)
        return saved, 1.0  # a second a delivery: far more than the pieces shed
    assert kept(dear)["decode_s"] == plain["decode_s"]
