"""The sizes each parallel axis may take, and the planner's argument checks."""

from __future__ import annotations

import math

import numpy as np

from .records import TrainingPlanError


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _positive(name: str, value, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TrainingPlanError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _axes(spec, global_batch: int, tp, pp, dp, micro_batch):
    """The sizes each axis may take; a given size that does not divide is an error naming the
    axis, what it must divide and the sizes that would work."""
    from ..tp_chain import admissible_tp, canonical_leaves

    # the widths the compiled step builds (one rule for both: :func:`.tp_chain.admissible_tp`)
    tp_ok = admissible_tp(spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim)
    _, qkv_leaves = canonical_leaves(spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim)
    pp_ok = _divisors(spec.layers)
    dp_ok = _divisors(global_batch)
    for name, value, ok, what in (
            ("tp", tp, tp_ok, f"the attention heads ({spec.heads}) and the intermediate size "
                              f"({spec.intermediate}), or is neither a divisor nor a multiple of the key/value "
                              f"heads ({spec.kv_heads}), or does not divide the {qkv_leaves} leaves of the "
                              f"query/key/value input gradient (of {spec.kv_heads} x {spec.head_dim} key/value "
                              "features)"),
            ("pp", pp, pp_ok, f"the layers ({spec.layers})"),
            ("dp", dp, dp_ok, f"the global batch ({global_batch} sequences)")):
        if value is not None and value not in ok:
            raise TrainingPlanError(f"{name}={value} does not divide {what}; {name} may be one of {ok}")
    if micro_batch is not None and dp is not None and (global_batch // dp) % micro_batch:
        raise TrainingPlanError(
            f"micro_batch={micro_batch} does not divide the batch per replica ({global_batch} / dp {dp} = "
            f"{global_batch // dp} sequences); micro_batch may be one of {_divisors(global_batch // dp)}")
    return ([tp] if tp else tp_ok), ([pp] if pp else pp_ok), ([dp] if dp else dp_ok)


def _arch_of(system):
    from ...target.arch import SpinnArch

    if isinstance(system, SpinnArch):
        return system, system.name
    from ...target.registry import arch_of

    return arch_of(system), str(system)
