"""A tensor-parallel LLM block's critical path on a group of boards, as the ``board_tp`` plan times it.

Plans Llama-2-70B int8 (batch 1, 2,048-slot cache) with :func:`tvm_spinn.llm.plan.plan` and
prints, for the kept candidate, the block's pieces one after another as one token runs them
(:func:`tvm_spinn.llm.board_tp.slice_pieces`, and the adds run on the all-reduces' delivery,
:func:`~tvm_spinn.llm.board_tp.fused_adds`): each piece's seconds as the plan charges it (a
streamed piece less what fetching its weights ahead saves it), its layers' seconds (each from
the end of the layer before: the wait for its collectives included) and its collectives, and
the two all-reduces between. Every step reads what the one before wrote (the norm the row, the
projections the quantized row, the attention q and the cache, the output projection the
context, the all-reduce the projection's sums), so the path is a chain; the bench names, per
step, what it waits for, and prints what is left of 50 tokens/s once the all-reduces take
their share.

The pieces are read where the planner times them (its own objects: ``board_tp._ahead_gains``'s
arguments, one call per form of the slice, in the order of
:func:`~tvm_spinn.llm.board_tp.slice_forms`), so what is printed is what
the plan adds up.

    python bench/block_path.py                  # spinn/boards24 (a 4 x 6 torus of boards)
    python bench/block_path.py --target spinn/cloud
    python bench/block_path.py --target spinn/cloud --degree 4 2   # those degrees' kept candidates

``--degree`` prints the kept candidate of each degree named (boards a block) instead of the
plan's kept one, and with it the token's whole sum as that candidate charges it: its blocks, its
all-reduces, its hand-overs between groups, the head and the token's loop (return, step
synchronisation, host I/O).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import tvm_spinn
from tvm_spinn.llm import board_tp
from tvm_spinn.llm.plan import plan
from tvm_spinn.target import registered_system

CONFIG = "python/tvm_spinn/llm/configs/llama-2-70b.json"


@contextlib.contextmanager
def _captured():
    """The planner's slice forms and the stages it times them with, per degree: ``stages[g]``
    maps ``(form, tiling)`` (the form's index in ``forms[g]``; ``""`` the mapper's tiles, ``"r"``
    the MAC-high row tiles of :func:`board_tp._mac_high`) to ``(on chip, streamed, reduce_s,
    (gains, buffer), shed)`` (``shed``: what each piece sheds onto the all-reduces' delivery,
    :func:`board_tp.norms_on_delivery`, or None)."""
    seen = {"g": None, "forms": {}, "stages": {}, "records": {}, "shed": None}
    block, forms, gains, recs = board_tp.slice_block, board_tp.slice_forms, board_tp._ahead_gains, board_tp.records
    mac_high, shed = board_tp._mac_high, board_tp._shed
    inside = []  # non-empty while _mac_high times a slice

    def records(*args, **kwargs):
        # each call plans afresh: keep only the last call's forms and stages, both alike
        seen["g"], seen["forms"], seen["stages"] = None, {}, {}
        seen["records"] = recs(*args, **kwargs)
        return seen["records"]

    def slice_block(cfg, spec, g):
        seen["g"] = g
        return block(cfg, spec, g)

    def slice_forms(programs, reduces):
        out = forms(programs, reduces)
        seen["forms"][seen["g"]] = list(out)
        return out

    def ahead_gains(on_chip, streamed, reduce_s, *args, **kwargs):
        out = gains(on_chip, streamed, reduce_s, *args, **kwargs)
        _record_stage(seen["stages"].setdefault(seen["g"], {}), "r" if inside else "",
                      (on_chip, streamed, reduce_s, out, seen["shed"]))
        return out

    def shed_of(stage, *args):
        # the seconds each piece of the stage sheds onto the all-reduces' delivery (the last call
        # before the stage's ahead_gains: the form's, on its stage with the weights on chip)
        out = shed(stage, *args)
        seen["shed"] = tuple(a - b for a, b in zip(stage.program_s, out.program_s)) if out is not stage else None
        return out

    def mac_high_tiles(*args, **kwargs):
        inside.append(True)
        try:
            return mac_high(*args, **kwargs)
        finally:
            inside.pop()

    board_tp.slice_block, board_tp.slice_forms, board_tp._ahead_gains = slice_block, slice_forms, ahead_gains
    board_tp.records, board_tp._mac_high, board_tp._shed = records, mac_high_tiles, shed_of
    try:
        yield seen
    finally:
        board_tp.slice_block, board_tp.slice_forms, board_tp._ahead_gains = block, forms, gains
        board_tp.records, board_tp._mac_high, board_tp._shed = recs, mac_high, shed


def _record_stage(stages: dict, tiling: str, stage) -> None:
    """File ``stage`` under ``(form, tiling)`` in one degree's ``stages``: the planner times each
    form with the mapper's tiles first (the next form's index), then, where it has one, the same
    form's MAC-high block (``tiling`` ``"r"``)."""
    forms = sum(1 for _, t in stages if t == "")
    stages[(forms if tiling == "" else forms - 1, tiling)] = stage


def _form_of(key: str, forms: int) -> tuple:
    """``(form index, tiling)`` of candidate ``key`` (``board_tp:g<g>m<n><tag><form><tiling>``)
    among a degree's ``forms`` slice forms: the tiling ``"r"`` (MAC-high row tiles) or ``""``,
    the form ``f`` (the residual adds fused, the second form), ``u`` (the slice uncut, the last)
    or neither (the first)."""
    tag = key.split("m", 1)[1].lstrip("0123456789")
    tiling = "r" if tag.endswith("r") else ""
    tag = tag[:-1] if tiling else tag
    form = 1 if tag.endswith("f") else -1 if tag.endswith("u") else 0
    return form % forms, tiling


def _waits(piece, k: int, ends) -> str:
    """What piece ``k`` of the block waits for (its inputs), in words."""
    from tvm_spinn.mapping.state import resident_state

    before = "the all-reduce's row" if ends[k - 1] else "the piece before's outputs"
    return before + (" and the KV cache" if resident_state(piece, range(len(piece.layers))) else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="spinn/boards24")
    ap.add_argument("--degree", type=int, nargs="*", default=None,
                    help="print these degrees' kept candidates (boards a block), not the plan's kept one")
    args = ap.parse_args()
    ctx = (registered_system(tvm_spinn.make_system("spinn2-24-boards", boards=24), tag="spinn/boards24")
           if args.target == "spinn/boards24" else contextlib.nullcontext())
    with ctx, _captured() as seen:
        result = plan(CONFIG, target=args.target, batch=1, seq=2048, dtype="int8")
    p = result.plan
    if args.degree:
        for g in args.degree:
            mine = [k for k in seen["records"] if k.startswith(f"board_tp:g{g}m")]
            if not mine:
                print(f"{args.target}: no board_tp candidate over {g} boards was mapped")
                continue
            _candidate(args.target, result, seen, mine[0], g)
        return
    if p.get("placement") != "board_tp":
        print(f"{args.target}: the kept placement is {p.get('placement')}, not board_tp")
        return
    alts = p["alternatives"]
    key = min((k for k in alts if k.startswith("board_tp")), key=lambda k: alts[k]["decode_s"])
    _path(args.target, result, seen, key, p["tp_boards"], result.decode_latency_s, p["boards_used"])


def _candidate(target, result, seen, key, g) -> None:
    """Candidate ``key`` (degree ``g``): the token's sum as it charges it, then its block's path."""
    rec = seen["records"][key]
    m = rec["meta"]
    with open(CONFIG) as f:
        blocks = json.load(f)["num_hidden_layers"]
    parts = [("blocks (pieces)", m["block_decode_s"] * blocks), ("all-reduces", m["board_all_reduces_decode_s"]),
             (f"hand-overs ({m['groups']} groups)", m["handoff_decode_s"]), ("head", m["head_decode_s"]),
             ("loop (return, sync, host I/O)", m["token_return_s"] + m["step_sync_s"] + m["host_io_decode_s"])]
    print(f"\n{key}: {1 / rec['decode_s']:.2f} tokens/s ({rec['decode_s'] * 1e3:.2f} ms), {m['boards_used']} boards, "
          f"{m['blocks_per_stage']} block(s) a group, {rec['resident'] / (rec['resident'] + rec['streamed']):.1%} "
          f"of the weights resident; a token:")
    for name, seconds in parts:
        print(f"  {name:32} {seconds * 1e3:8.3f} ms   {seconds / blocks * 1e6:7.1f} us a block")
    print(f"  one all-reduce over {g} boards {m['board_all_reduce_s'] * 1e6:.1f} us; a hand-over "
          f"{m['handoff_decode_s'] / m['groups'] * 1e6:.1f} us")
    _path(target, result, seen, key, g, rec["decode_s"], m["boards_used"])


def _path(target, result, seen, key, g, decode_s, used) -> None:
    """Candidate ``key``'s block (degree ``g``): its pieces, layers and collectives, as a chain."""
    tag = key.split("m", 1)[1].lstrip("0123456789")
    form, tiling = _form_of(key, len(seen["forms"][g]))
    pieces, ends = seen["forms"][g][form][:2]
    on_chip, streamed, reduce_s, (gains, buffer), shed = seen["stages"][g][(form, tiling)]
    print(f"{target}: {1 / decode_s:.2f} tokens/s ({decode_s * 1e3:.2f} ms), "
          f"kept {key}: a group of {g} boards, {used} used")
    if ends is None:
        print("the slice runs as one program (not cut): no pieces to print")
        return
    streamed_blocks = tag[:1] in ("p", "s")
    chain, total = [], 0.0
    for k, piece in enumerate(pieces):
        charged = streamed.program_s[k] - (gains[k] if gains else 0.0) if streamed_blocks else on_chip.program_s[k]
        t = on_chip.program_timings[k]
        print(f"\npiece {k} ({len(piece.layers)} layers, {t.chips} chips): {charged * 1e6:.1f} us as charged "
              f"(streaming {streamed.program_s[k] * 1e6:.1f}, its weights on chip {on_chip.program_s[k] * 1e6:.1f}); "
              f"waits for {_waits(piece, k, ends)}")
        if t is streamed.program_timings[k] and streamed.program_s[k] != on_chip.program_s[k]:
            # its weights on chip, it runs the streaming mapping's shard plan: the layers are that
            # mapping's (each weight read from DRAM), the charge the plan's time with them on chip
            print("    (its layers as the streaming mapping times them: each weight read from DRAM)")
        for i, layer in enumerate(piece.layers):
            if t.layer_s[i] == 0.0:
                continue
            cs = [f"{c.op} {c.algorithm} {c.nbytes} B {c.seconds * 1e6:.2f} us" for c in t.collectives if c.layer == i]
            print(f"    {layer.kind:16} {t.layer_s[i] * 1e6:7.2f} us" + (f"   (after {'; '.join(cs)})" if cs else ""))
        row = int(sum(piece.tensors[o].nbytes for o in piece.outputs)) if ends[k] else -1
        tail = [f"{c.op} {c.algorithm} {c.nbytes} B {c.seconds * 1e6:.2f} us"
                + (" (the all-reduce's: not charged)" if c.op == "all_gather" and c.nbytes == row else "")
                for c in t.collectives if c.layer >= len(piece.layers)]
        if tail:
            print(f"    after its last layer: {'; '.join(tail)}")
        if shed and shed[k] > 0:
            print(f"    its {piece.layers[0].kind}'s sums of squares and their chain run on the all-reduce's delivery: "
                  f"{shed[k] * 1e6:.2f} us off the piece (the all-reduce's charge takes the last part's)")
        chain.append((f"piece {k}", charged))
        total += charged
        if ends[k]:
            chain.append(("all-reduce", reduce_s))
            total += reduce_s
    print("\nthe block's chain (each waits for the one before):")
    at = 0.0
    for name, seconds in chain:
        at += seconds
        print(f"  {name:11} {seconds * 1e6:7.1f} us   ends at {at * 1e6:7.1f} us")
    with open(CONFIG) as f:
        blocks = json.load(f)["num_hidden_layers"]
    rest = decode_s - blocks * total
    budget = (1 / 50 - rest) / blocks
    work = total - sum(s for n, s in chain if n == "all-reduce")
    print(f"a block {total * 1e6:.1f} us: its pieces {work * 1e6:.1f} us, its all-reduces "
          f"{(total - work) * 1e6:.1f} us; the token's rest (hand-overs, head, loop) {rest * 1e3:.2f} ms")
    print(f"50 tokens/s leaves {budget * 1e6:.1f} us a block: {(total - budget) * 1e6:.1f} us "
          f"({(total - budget) / total:.0%}) to take off")


if __name__ == "__main__":
    main()
