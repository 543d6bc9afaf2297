"""The smallest system that holds a model's training step, and the error that names it."""

from __future__ import annotations

from .axes import _axes
from .memory import memory_per_chip
from .model import _spec
from .records import Split, TrainingPlanError


def _least_memory(spec, chips: int, axes, global_batch, seq, optimizer, zero, micro_batch, recompute, capacity,
                  sequence_parallel):
    """The split of at most ``chips`` chips with the least memory per chip, or None."""
    tps, pps, dps = axes
    best = None
    for t in tps:
        for p in pps:
            fit = [d for d in dps if t * p * d <= chips]
            if not fit:
                continue
            d = max(fit)
            z = 2 if zero is None else zero
            mb = micro_batch or 1
            if (global_batch // d) % mb:
                continue
            r = True if recompute is None else recompute
            split = Split(t, p, d, z, mb, global_batch // (d * mb), r, sequence_parallel)
            mem = memory_per_chip(spec, split, seq, optimizer, capacity)
            if best is None or mem.total < best[0].total:
                best = (mem, split)
    return best


def smallest_system(spec, arch, global_batch: int, seq: int, optimizer: str, *, tp=None, pp=None, dp=None,
                    zero=None, micro_batch=None, recompute=None,
                    sequence_parallel: bool = True) -> "tuple[int, Split] | None":
    """The fewest chips (part of one board, else whole boards) on which some split of the model
    fits the chips' DRAM, and that split (the one with the least memory per chip); None when no
    number of chips does (e.g. one layer's activations alone exceed a chip)."""
    spec = spec if hasattr(spec, "layers") else _spec(spec)
    axes = _axes(spec, global_batch, tp, pp, dp, micro_batch)
    capacity = arch.dram_bytes

    def fits(chips):
        found = _least_memory(spec, chips, axes, global_batch, seq, optimizer, zero, micro_batch, recompute,
                              capacity, sequence_parallel)
        return found if found and found[0].fits else None

    per_board = arch.chips_per_board
    for chips in range(1, per_board + 1):
        found = fits(chips)
        if found:
            return chips, found[1]
    most = max(axes[0]) * max(axes[1]) * max(axes[2])  # beyond it no split uses more chips
    hi = -(-most // per_board)
    if not fits(hi * per_board):
        return None
    lo = 1  # fits(lo * per_board) is False
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * per_board):
            hi = mid
        else:
            lo = mid
    return hi * per_board, fits(hi * per_board)[1]


def _does_not_fit(model: str, system: str, arch, found, given: str = "") -> TrainingPlanError:
    if found is None:
        return TrainingPlanError(f"{model} does not fit {system} ({arch.chips} chips of {arch.dram_bytes} bytes "
                                 f"DRAM): no split{given} keeps a chip within its DRAM on any number of these "
                                 "chips; fix fewer sizes, or plan a shorter seq or a smaller micro_batch")
    chips, split = found
    boards = -(-chips // arch.chips_per_board)
    where = (f"{chips} chips (part of one board)" if chips < arch.chips_per_board
             else f"{boards} board(s) ({boards * arch.chips_per_board} chips): tvm_spinn.make_system(boards={boards})")
    named = ""
    try:
        from ...target.registry import arch_of, known_targets

        fits = sorted((arch_of(t).chips, t) for t in known_targets()
                      if arch_of(t).chips >= chips and arch_of(t).dram_bytes == arch.dram_bytes
                      and arch_of(t).clock_hz == arch.clock_hz)
        named = f"; smallest registered target that holds it: {fits[0][1]}" if fits else ""
    except ValueError:
        pass
    return TrainingPlanError(f"{model} does not fit {system} ({arch.chips} chips): training it needs at least "
                             f"{where}, e.g. {split.line()}{named}", smallest_chips=chips,
                             smallest_boards=boards)
