"""Where the ops of a training step run: on the PEs (offloaded by the spinn partition) or on
the host (fallback), for the forward pass + loss, the backward pass and the optimizer update."""

from __future__ import annotations

from collections import Counter

import tvm

from ..partition import partition_for_spinn, summarize_partition

__all__ = ["op_placement"]


def _counts(func, target) -> tuple[Counter, Counter]:
    func = func.with_attr("global_symbol", "main")
    summary = summarize_partition(partition_for_spinn(tvm.IRModule({"main": func}), target))
    return Counter(summary.offloaded_ops), Counter(summary.fallback_ops)


def op_placement(trainer, target="spinn") -> dict[str, dict[str, dict[str, int]]]:
    """Op counts per phase and place: ``{phase: {"pe": {op: n}, "host": {op: n}}}``.

    Parameters
    ----------
    trainer : Trainer
    target : str
        The spinn system whose partition decides (what fits on a PE).

    Returns
    -------
    dict
        Phases ``forward`` (forward pass and loss), ``backward`` (the adjoint function minus the
        forward part it repeats: the partition matches each op locally, so counts subtract) and
        ``update`` (the optimizer); PE ops are named ``spinn.*``, host ops ``relax.*``.
    """
    phases = trainer._graph.phases
    fwd_pe, fwd_host = _counts(phases["backbone_loss"], target)
    adj_pe, adj_host = _counts(phases["backbone_loss_adjoint"], target)
    upd_pe, upd_host = _counts(phases["optimizer"], target)

    def out(c):
        return dict(sorted((k, v) for k, v in c.items() if v > 0))

    return {
        "forward": {"pe": out(fwd_pe), "host": out(fwd_host)},
        "backward": {"pe": out(adj_pe - fwd_pe), "host": out(adj_host - fwd_host)},
        "update": {"pe": out(upd_pe), "host": out(upd_host)},
    }
