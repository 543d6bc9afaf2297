"""Where candidates are measured: locally, or through a TVM RPC tracker and its servers."""

from __future__ import annotations

__all__ = ["parse_tracker", "make_runner", "tracker_servers"]


def parse_tracker(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``, with a ValueError naming the bad address."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad RPC tracker address {address!r} (expected host:port, e.g. 127.0.0.1:9190)")
    return host, int(port)


def tracker_servers(host: str, port: int, key: str) -> int:
    """How many servers registered with ``key`` the tracker at ``host:port`` knows."""
    from tvm.s_tir import meta_schedule as ms

    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key,
                                 session_priority=1, session_timeout_sec=10)
    return config.count_num_servers(allow_missing=True)


def make_runner(runner=None, rpc_tracker: str | None = None, rpc_key: str | None = None,
                timeout_sec: float = 60.0, evaluator: dict | None = None):
    """The MetaSchedule runner for a tuning job.

    Parameters
    ----------
    runner : tvm.s_tir.meta_schedule.runner.Runner, optional
        Use this runner as is (e.g. an ``RPCRunner`` or ``PyRunner`` of your own).
    rpc_tracker : str, optional
        ``host:port`` of a TVM RPC tracker (``python -m tvm.exec.rpc_tracker``); measurement
        then runs on its servers registered with ``rpc_key``
        (``python -m tvm.exec.rpc_server --tracker host:port --key KEY``).
    rpc_key : str, optional
        Device key of the servers; required with ``rpc_tracker``.
    timeout_sec : float
        Per-measurement timeout.
    evaluator : dict, optional
        ``EvaluatorConfig`` fields of a runner made here (default: the search's, 3 runs of at
        least 20 ms in one repeat; the job's default-vs-tuned comparison asks for
        :data:`tvm_spinn.tune.compare.COMPARE_EVALUATOR`).

    Returns
    -------
    Runner
        ``runner``, an ``RPCRunner`` or a ``LocalRunner``.
    """
    from tvm.s_tir import meta_schedule as ms

    if runner is not None:
        if rpc_tracker or rpc_key:
            raise ValueError("pass either runner=... or rpc_tracker/rpc_key, not both")
        if not isinstance(runner, ms.runner.Runner):
            raise TypeError(f"runner must be a meta_schedule Runner, got {type(runner).__name__}")
        return runner
    evaluator = ms.runner.EvaluatorConfig(**(evaluator or dict(number=3, repeat=1, min_repeat_ms=20,
                                                               enable_cpu_cache_flush=False)))
    if rpc_tracker or rpc_key:
        if not (rpc_tracker and rpc_key):
            raise ValueError("RPC measurement needs both rpc_tracker (host:port) and rpc_key")
        host, port = parse_tracker(rpc_tracker)
        config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=rpc_key,
                                     session_priority=1, session_timeout_sec=int(timeout_sec))
        try:
            servers = config.count_num_servers(allow_missing=False)
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"cannot reach RPC tracker {rpc_tracker} with key {rpc_key!r}: {err}") from None
        return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator,
                                   max_workers=max(1, servers))
    return ms.runner.LocalRunner(evaluator_config=evaluator, timeout_sec=timeout_sec)
