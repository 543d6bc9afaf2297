"""``tvm_spinn.training.compile``: a PyTorch module -> a :class:`Trainer` running on spinn."""

from __future__ import annotations

import json

import numpy as np
import tvm
from tvm import relax

from .checkpoint import read_checkpoint, write_checkpoint
from .errors import CheckpointError, TrainingError
from .graph import TrainGraph, build_train_graph

__all__ = ["compile", "Trainer"]


def _to_numpy(x, what: str) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray | np.generic | list | tuple | int | float):
        raise TrainingError(f"{what} must be a numpy array or a torch tensor, got {type(x).__name__}")
    return np.asarray(x)


class Trainer:
    """A compiled training step and the state it updates (parameters, optimizer state).

    Built by :func:`compile`. Each :meth:`step` runs forward, loss, backward and the optimizer
    update in one call of the compiled module.
    """

    def __init__(self, graph: TrainGraph, executable, target, loss: str, optimizer, model_name: str):
        self._graph = graph
        self._vm = relax.VirtualMachine(executable, tvm.cpu())
        self._target = target
        self._loss = loss
        self._optimizer_spec = optimizer
        # canonical text of the optimizer (name, options): a checkpoint is loadable when it matches
        name, opts = (optimizer, {}) if isinstance(optimizer, str) else optimizer
        self._optimizer = json.dumps([name, opts], sort_keys=True, default=str)
        self._model_name = model_name
        self.executable = executable
        self._params: list = []
        self._state: list = []

    # -- state ------------------------------------------------------------------------------
    def _set_state(self, params: list[np.ndarray], optim: list[np.ndarray]) -> None:
        # np.array, not np.ascontiguousarray: that one turns the 0-d step counter into 1-d
        self._params = [tvm.runtime.tensor(np.array(p, order="C")) for p in params]
        self._state = [tvm.runtime.tensor(np.array(s, order="C")) for s in optim]

    def parameters(self) -> dict[str, np.ndarray]:
        """Current trainable parameters, by their PyTorch names (copies)."""
        return {n: p.numpy() for n, p in zip(self._graph.param_names, self._params)}

    def optimizer_state(self) -> list[np.ndarray]:
        """Current optimizer state (step count first, then TVM's per-parameter buffers), copies."""
        return [s.numpy() for s in self._state]

    @property
    def steps(self) -> int:
        """Number of steps taken (the optimizer's step counter)."""
        return int(self._state[0].numpy())

    @property
    def module(self) -> tvm.IRModule:
        """The training-step Relax module (before ``relax.build``)."""
        return self._graph.mod

    def build_for(self, target) -> "Trainer":
        """The same training-step module built for another target, starting from this trainer's
        current parameters and optimizer state (e.g. ``"llvm"`` as a reference, or
        ``"spinn/board"``)."""
        tgt = _resolve_target(target)
        trainer = Trainer(self._graph, relax.build(self._graph.mod, target=tgt), tgt, self._loss,
                          self._optimizer_spec, self._model_name)
        trainer._set_state([p.numpy() for p in self._params], [s.numpy() for s in self._state])
        return trainer

    # -- one step ---------------------------------------------------------------------------
    def _check_inputs(self, inputs) -> list[np.ndarray]:
        if not isinstance(inputs, tuple | list):
            inputs = (inputs,)
        if len(inputs) != len(self._graph.input_shapes):
            raise TrainingError(f"step: expected {len(self._graph.input_shapes)} input(s), got {len(inputs)}")
        out = []
        for k, (x, (shape, dtype)) in enumerate(zip(inputs, self._graph.input_shapes)):
            x = _to_numpy(x, f"input {k}")
            if tuple(x.shape) != shape:
                raise TrainingError(f"step: input {k} has shape {tuple(x.shape)}, the model was compiled for {shape}")
            if str(x.dtype) != dtype:
                raise TrainingError(f"step: input {k} has dtype {x.dtype}, the model was compiled for {dtype}")
            out.append(np.ascontiguousarray(x))
        return out

    def _check_labels(self, labels) -> np.ndarray:
        y = _to_numpy(labels, "labels")
        g = self._graph
        if tuple(y.shape) != g.label_shape:
            raise TrainingError(f"step: labels have shape {tuple(y.shape)}, loss {self._loss!r} of a model "
                                f"output {g.output_shape} needs labels of shape {g.label_shape}")
        if g.label_dtype == "int64":
            if not np.issubdtype(y.dtype, np.integer):
                raise TrainingError(f"step: labels have dtype {y.dtype}, loss 'cross_entropy' needs integer "
                                    "class indices")
            if y.size and (y.min() < 0 or y.max() >= g.output_shape[1]):
                bad = int(y.min() if y.min() < 0 else y.max())
                raise TrainingError(f"step: label {bad} is out of range for {g.output_shape[1]} classes")
        elif not np.issubdtype(y.dtype, np.floating):
            raise TrainingError(f"step: labels have dtype {y.dtype}, loss 'mse' needs floating-point targets")
        return np.ascontiguousarray(y.astype(g.label_dtype))

    def step(self, inputs, labels) -> float:
        """Run one training step; returns the loss of the batch (before the update).

        Parameters
        ----------
        inputs : numpy.ndarray or torch.Tensor, or a tuple of them
            A batch, with the shapes and dtypes of the example inputs.
        labels : numpy.ndarray or torch.Tensor
            Class indices (``cross_entropy``) or targets of the output's shape (``mse``).
        """
        xs = self._check_inputs(inputs)
        y = self._check_labels(labels)
        args = [tvm.runtime.tensor(x) for x in xs] + self._params + [tvm.runtime.tensor(y), self._state]
        loss, params, state = self._vm["main"](*args)
        self._params = list(params)
        self._state = list(state)
        return float(loss.numpy())

    # -- checkpoints ------------------------------------------------------------------------
    def _meta(self) -> dict:
        return {"loss": self._loss, "optimizer": self._optimizer, "model": self._model_name}

    def save(self, path) -> None:
        """Save parameters and optimizer state to ``path`` (an ``.npz``), atomically."""
        write_checkpoint(path, self.parameters(), self.optimizer_state(), self._meta())

    def load(self, path) -> None:
        """Restore parameters and optimizer state saved by :meth:`save` (of the same model)."""
        params, optim, meta = read_checkpoint(path)
        g = self._graph
        for name, shape in zip(g.param_names, g.param_shapes):
            if name not in params:
                raise CheckpointError(f"checkpoint {path}: parameter {name} {shape} of this model is missing")
            if tuple(params[name].shape) != shape or params[name].dtype != np.float32:
                raise CheckpointError(f"checkpoint {path}: parameter {name} has shape {tuple(params[name].shape)} "
                                      f"{params[name].dtype}, this model's is {shape} float32")
        extra = [n for n in params if n not in g.param_names]
        if extra:
            raise CheckpointError(f"checkpoint {path}: parameter {extra[0]} {tuple(params[extra[0]].shape)} "
                                  "is not a parameter of this model")
        if meta.get("optimizer") != self._optimizer or meta.get("loss") != self._loss:
            raise CheckpointError(f"checkpoint {path}: saved with loss {meta.get('loss')!r} and optimizer "
                                  f"{meta.get('optimizer')}, this trainer uses {self._loss!r} and {self._optimizer}")
        ref = self.optimizer_state()
        if len(optim) != len(ref) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(optim, ref)):
            raise CheckpointError(f"checkpoint {path}: optimizer state does not match this trainer's")
        self._set_state([params[n] for n in g.param_names], optim)


def _resolve_target(target):
    if isinstance(target, str) and target.split("/")[0] == "spinn":
        from ..target import get_target

        return get_target(target)
    return tvm.target.Target(target)


def compile(model, example_inputs, loss: str = "cross_entropy", optimizer=("sgd", {"lr": 0.1}),
            target="spinn", data_parallel: dict | None = None) -> Trainer:  # noqa: A001  (the public name asked for: tvm_spinn.training.compile)
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
        ``("sgd", {"lr", "momentum", "weight_decay", "nesterov"})`` or
        ``("adam", {"lr", "betas", "eps", "weight_decay"})``.
    target : str or tvm.target.Target
        ``"spinn"``, ``"spinn/board"``, ... (GEMMs of forward, backward and update on the PEs)
        or ``"llvm"`` (all on the host).
    data_parallel : dict, optional
        ``{"replicas": R, "microbatches": M, "reproducible": True}``: the batch is cut into
        ``M`` micro-batches (default ``R``) run on ``R`` chips of the target system, their
        gradients summed in ascending micro-batch order (a chain over the replicas), so the bits
        depend on ``M`` but not on ``R`` (:mod:`.parallel`); ``reproducible=False`` sums as a
        ring would (bits depend on ``R``). A PyTorch model only.

    Returns
    -------
    Trainer
        A :class:`~.parallel.DataParallelTrainer` with ``data_parallel``.
    """
    name = type(model).__name__ if not isinstance(model, tvm.IRModule) else "IRModule"
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
