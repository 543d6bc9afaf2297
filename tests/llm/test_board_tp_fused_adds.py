"""The residual add after each of a slice's all-reduces run on the all-reduce's delivery
(``board_tp.fused_adds``): the same layers in the same order, the add's seconds priced per
part of the row, and the plan's candidate with them no slower than the slice cut alone."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tvm_spinn.llm import board_tp  # noqa: E402
from tvm_spinn.llm.spec import spec_of  # noqa: E402

LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
         "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 512}
GPTJ = {"model_type": "gptj", "n_embd": 256, "n_head": 4, "n_layer": 2, "vocab_size": 100, "n_positions": 64,
        "rotary_dim": 16}


def _cut(cfg):
    from tvm_spinn.llm.describe import describe

    P = importlib.import_module("tvm_spinn.llm.plan")
    spec = spec_of(cfg)
    sub, model = board_tp.slice_block(cfg, spec, 2)
    _, module, args = P._parts(model, sub, 1, 16)[0]
    programs = [d.program for d in describe(module, args, "spinn", "int8")]
    pieces, ends = board_tp.slice_pieces(programs, board_tp.block_all_reduces(spec))
    return spec, programs, pieces, ends


@pytest.mark.parametrize("cfg", [LLAMA, GPTJ], ids=["llama", "gptj"])
def test_the_adds_leave_every_layer_in_its_order(cfg):
    """One residual add taken out per all-reduce, each a plain sum of two of its piece's inputs;
    put back at its all-reduce (after the piece that ends there) the layers are the described
    block's, in its order: every layer still runs after what it reads."""
    from tvm_spinn.program.ops import family_of

    spec, programs, pieces, ends = _cut(cfg)
    got = board_tp.fused_adds(pieces, ends)
    assert got is not None
    fused, fused_ends, adds = got
    assert len(adds) == sum(ends) == board_tp.block_all_reduces(spec)
    assert sum(fused_ends) == sum(ends) and len(fused) == len(fused_ends)
    assert all(family_of(layer.kind).sums_inputs(layer) for _, layer in adds)
    for piece, layer in adds:
        assert sorted(layer.inputs) == sorted(t for t in piece.inputs if t in layer.inputs)
    order, waiting = [], [layer.name for _, layer in adds]
    for piece, end in zip(fused, fused_ends):
        order += [layer.name for layer in piece.layers]
        if end:
            order.append(waiting.pop(0))
    assert not waiting
    assert order == [layer.name for program in programs for layer in program.layers]
    # a slice not cut at its all-reduces has nothing to fuse
    assert board_tp.fused_adds(programs, None) is None
    # the forms the planner times: cut, cut with the adds on the delivery, as described
    forms = board_tp.slice_forms(programs, board_tp.block_all_reduces(spec))
    assert [len(f) for f in forms] == [2, 3, 2] and forms[2][1] is None
    assert [p.symbol for p in forms[1][0]] == [p.symbol for p in fused]


def test_a_piece_after_an_all_reduce_without_its_add_is_not_fused():
    _, _, pieces, ends = _cut(LLAMA)
    k = ends.index(True) + 1
    P = importlib.import_module("tvm_spinn.llm.plan")
    without = list(pieces)
    without[k] = P._slice(pieces[k], 1, len(pieces[k].layers))  # its add already gone
    assert board_tp.fused_adds(without, ends) is None


def test_the_fused_add_costs_a_job_a_part_and_its_elements_on_a_chips_pes():
    """Priced from the board's parameters: per part one job of the PE's loop and the interrupt
    that wakes it, and each PE's share of the row's elements at the add's cycles an element;
    well under the add as a layer of its own (its wake-up, set-up and barrier)."""
    from tvm_spinn.program.ops import family_of
    from tvm_spinn.target import arch_of

    from types import SimpleNamespace

    _, _, pieces, ends = _cut(LLAMA)
    _, _, adds = board_tp.fused_adds(pieces, ends)
    board = arch_of("spinn").replace(chips=48)
    piece, layer = adds[0]
    pes = board.pes_per_chip

    def add_s(elements: int, parts: int) -> float:
        row = SimpleNamespace(tensors={layer.output: SimpleNamespace(shape=(1, elements))})
        return board_tp.fused_add_s(row, layer, board, parts)

    # each part costs the same: a job and its wake-up, more than nothing
    step = add_s(pes, 8) - add_s(pes, 4)
    assert step > 0 and add_s(pes, 12) - add_s(pes, 8) == pytest.approx(step, rel=1e-9)
    assert add_s(0, 4) == pytest.approx(step, rel=1e-9)  # no elements: the four parts' jobs only
    # the elements are shared over the chip's PEs: one each costs what one in all costs, one
    # more on a PE adds as much again, and the row's share grows by whole elements a PE
    one_each = add_s(pes, 4) - add_s(0, 4)
    assert one_each > 0 and add_s(1, 4) - add_s(0, 4) == pytest.approx(one_each, rel=1e-9)
    assert add_s(pes + 1, 4) - add_s(0, 4) == pytest.approx(2 * one_each, rel=1e-9)
    assert add_s(10 * pes, 4) - add_s(0, 4) == pytest.approx(10 * one_each, rel=1e-9)
    # the planner's row: the model's, priced as the same function of its elements
    n = int(np.prod(piece.tensors[layer.output].shape))
    assert board_tp.fused_add_s(piece, layer, board, 4) == pytest.approx(add_s(n, 4), rel=1e-12)
    assert family_of(layer.kind).cycles_per_element(layer, board) > 0


@pytest.mark.slow  # ~30-60 s alone: the slices described, mapped cut and fused on boards
def test_the_fused_form_is_kept_where_it_is_faster_and_its_all_reduce_is_bounded(monkeypatch, register_system):
    """A degree's records with the fused form: its all-reduce lies between the plain one and the
    plain one followed by the whole add, and the kept candidate is the faster of the cut slice
    and the fused one, each timed alone."""
    from tqdm.auto import tqdm

    from test_llm_board_tp import _streaming_boards

    P, cfg, target, arch, spec, seq, described = _streaming_boards(register_system, "fused")
    memo: dict = {}
    forms = board_tp.slice_forms
    monkeypatch.setattr(board_tp, "TP_BOARDS", (2,))

    def kept(pick):
        monkeypatch.setattr(board_tp, "slice_forms", lambda dec, reduces: pick(forms(dec, reduces)))
        out = board_tp.records(cfg, spec, arch, target, "int8", 1, seq, 4, described, spec.params,
                               seq * spec.kv_bytes_per_token(4), tqdm(disable=True), memo=memo)
        assert out
        return min(out.values(), key=lambda r: r["decode_s"])

    cut = kept(lambda f: f[:1])
    both = kept(lambda f: f[:2])
    assert not cut["meta"]["board_add_fused"]
    assert both["decode_s"] <= cut["decode_s"] * (1 + 1e-12)
    # (here the add's layer, with its wake-up and barrier, outweighs its parts on the delivery)
    assert both["meta"]["board_add_fused"] and both["decode_s"] < cut["decode_s"]
    plain = cut["meta"]["board_all_reduce_s"]
    assert plain < both["meta"]["board_all_reduce_s"] < plain + 5e-6
    assert both["meta"]["block_decode_s"] < cut["meta"]["block_decode_s"]
