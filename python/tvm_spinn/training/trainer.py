"""The :class:`Trainer`: a compiled training step and the state it updates (a module of its
own so that :mod:`.api` and :mod:`.parallel` both build on it without importing each other)."""

from __future__ import annotations

import json

import numpy as np
import tvm
from tvm import relax

from .checkpoint import read_checkpoint, write_checkpoint
from .errors import CheckpointError, TrainingError
from .graph import TrainGraph

__all__ = ["Trainer"]


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
        """Current optimizer state, copies: the int64 step count first, then the optimizer's
        buffers (SGD with momentum: one per parameter; Adam: the betas' running powers, then
        the first and second moments; AdamW: the first moments, then the second moments)."""
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
    @property
    def granule(self) -> int:
        """Samples whose gradient one program computes before the gradients are summed (the
        fused step: the whole batch). It fixes the order of the batch's gradient sum, so two
        trainers of the same granule give the same bits."""
        shape = self._graph.input_shapes[0][0]
        return int(shape[0]) if shape else 1

    def _meta(self) -> dict:
        return {"loss": self._loss, "optimizer": self._optimizer, "model": self._model_name,
                "granule": str(self.granule)}

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
        saved = meta.get("granule")
        if saved is not None and saved != str(self.granule):
            raise CheckpointError(
                f"checkpoint {path}: saved by a plan summing gradients in granules of {saved} sample(s), this "
                f"trainer's granule is {self.granule} sample(s), so the resumed run would have the bits of "
                "neither; resume under a plan of the same granule (parallel= plans: 1 sample; data_parallel=: "
                "one micro-batch; the fused step: the batch)")
        ref = self.optimizer_state()
        if len(optim) != len(ref) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(optim, ref)):
            raise CheckpointError(f"checkpoint {path}: optimizer state does not match this trainer's")
        self._set_state([params[n] for n in g.param_names], optim)


def _resolve_target(target):
    if isinstance(target, str) and target.split("/")[0] == "spinn":
        from ..target import get_target

        return get_target(target)
    return tvm.target.Target(target)
