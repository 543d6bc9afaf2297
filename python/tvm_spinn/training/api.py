"""``tvm_spinn.training.compile``: a PyTorch module -> a :class:`Trainer` running on spinn."""

from __future__ import annotations

import tvm
from tvm import relax

from .errors import TrainingError
from .graph import build_train_graph
from .trainer import Trainer, _resolve_target

__all__ = ["compile", "Trainer"]


def compile(model, example_inputs, loss: str = "cross_entropy", optimizer=("sgd", {"lr": 0.1}),
            target="spinn", data_parallel: dict | None = None, parallel: dict | None = None) -> Trainer:  # noqa: A001  (the public name asked for: tvm_spinn.training.compile)
    """Compile a training step of a PyTorch model for a target.

    Parameters
    ----------
    model : torch.nn.Module or tvm.IRModule
        A PyTorch model: its parameters with ``requires_grad`` become trainable, buffers and
        frozen parameters constants; or a Relax module imported by ``tvm_spinn.frontend``
        (weights bound as constants): its float32 constants of rank >= 1 become trainable
        parameters ``param_<k>``. The current values are the initial parameters.
    example_inputs : torch.Tensor or tuple of torch.Tensor
        A batch; its shapes are the (static) shapes of every step.
    loss : {"cross_entropy", "mse"}
        Mean-reduced, as PyTorch's ``CrossEntropyLoss()`` / ``MSELoss()``.
    optimizer : (str, dict)
        ``("sgd", {"lr", "momentum", "weight_decay", "nesterov"})``,
        ``("adam", {"lr", "betas", "eps", "weight_decay"})`` (``torch.optim.Adam``: L2 weight
        decay added to the gradient) or ``("adamw", {"lr", "betas", "eps", "weight_decay",
        "amsgrad"})`` (``torch.optim.AdamW``: decoupled weight decay, default 0.01;
        ``amsgrad=False`` only).
    target : str or tvm.target.Target
        ``"spinn"``, ``"spinn/board"``, ... (GEMMs of forward, backward and update on the PEs)
        or ``"llvm"`` (all on the host).
    data_parallel : dict, optional
        ``{"replicas": R, "microbatches": M, "reproducible": True}``: the batch is cut into
        ``M`` micro-batches (default ``R``) run on ``R`` chips of the target system, their
        gradients summed in ascending micro-batch order (a chain over the replicas), so the bits
        depend on ``M`` but not on ``R`` (:mod:`.parallel`); ``reproducible=False`` sums as a
        ring would (bits depend on ``R``). A PyTorch model only.
    parallel : dict, optional
        A parallel plan whose bits depend on none of its numbers: ``{"dp": R, "microbatches":
        M, "zero": Z}``: ``M`` micro-batches (default ``R``; ``M`` must divide the batch) on
        ``R`` data-parallel chips; every sample's gradient is computed on its own and the
        samples' gradients are summed in ascending sample order (a chain over the replicas),
        so the parameters are bitwise identical for every ``M``, ``R`` and ``Z``
        (:mod:`.parallel`). ``Z = 1`` shards the optimizer state over the replicas (ZeRO-1,
        :mod:`.zero`), ``Z = 2`` the reduced gradient too. ``"pp": S`` cuts each replica's
        gradient program into ``S`` pipeline stages by layers (``S``, or ``S - 1`` with a head stage, must divide the
        layers of the model's ``transformers`` configuration; ``R * S`` chips), run in 1F1B micro-batch order,
        with the same bits (:mod:`.pipeline`); ``"head_stage": True`` makes the last of them the
        LM head's own (the layers on ``S - 1`` stages), ``"head_lag": L`` runs its passes ``L``
        micro-batches behind the other stages' (the same bits); ``"zero_bubble": True`` cuts each
        stage's backward into its input- and weight-gradient programs and runs them in ZB-H1
        order, the weight-gradient passes deferred into the fill and drain (the same bits). With
        ``Z = 0`` and ``S > 1`` each stage's gradients are reduced over the replicas and
        updated as the stage's last backward completes them (the same bits). ``"tp": T`` splits every block of a GPT-2 or
        Llama-style model over ``T`` chips as Megatron-LM does (column-parallel QKV and MLP-up,
        row-parallel attention-output and MLP-down projections; ``T`` must divide the attention
        heads and the split features; ``R * S * T`` chips of a spinn target), the partial sums
        over a split axis continued rank after rank in the one-chip GEMM's order, with the same
        bits (:mod:`.tensor_parallel`); the LM head and the loss split by the vocabulary over
        the same ranks (:mod:`.vocab_parallel`). ``"granule": g`` sums granules of ``g``
        samples instead (default 1; ``M`` must cut the batch into whole granules). A model with
        BatchNorm is refused (a granule would change its batch statistics). A PyTorch model only.

    Returns
    -------
    Trainer
        A :class:`~.parallel.DataParallelTrainer` with ``data_parallel`` or ``parallel``.
    """
    name = type(model).__name__ if not isinstance(model, tvm.IRModule) else "IRModule"
    if parallel is not None:
        from .parallel import build_parallel

        if data_parallel is not None:
            raise TrainingError("give data_parallel= or parallel=, not both")
        if isinstance(model, tvm.IRModule):
            raise TrainingError("parallel needs a PyTorch model (an imported Relax module has a fixed batch)")
        return build_parallel(build_train_graph, model, example_inputs, loss, optimizer, target, parallel, name)
    if data_parallel is not None:
        from .parallel import build_data_parallel

        if isinstance(model, tvm.IRModule):
            raise TrainingError("data_parallel needs a PyTorch model (an imported Relax module has a fixed batch; "
                                "import it at the micro-batch size and train it without data_parallel)")
        return build_data_parallel(build_train_graph, model, example_inputs, loss, optimizer, target,
                                   data_parallel, name)
    graph = build_train_graph(model, example_inputs, loss, optimizer)
    tgt = _resolve_target(target)
    executable = relax.build(graph.mod, target=tgt)
    trainer = Trainer(graph, executable, tgt, loss, optimizer, name)
    trainer._set_state(list(graph.init_params), list(graph.init_optim_state))
    return trainer
