"""Training on spinn: compile a training step (forward, loss, backward, optimizer update).

>>> trainer = tvm_spinn.training.compile(model, (x,), loss="cross_entropy",
...                                      optimizer=("sgd", {"lr": 0.1, "momentum": 0.9}))
>>> loss = trainer.step(x, y)

The step is one Relax function built by TVM's ``relax.training`` (loss, ``Gradient`` pass,
optimizer; see :mod:`.graph` for what is replaced, :mod:`.gradients` for the op gradients
added) and compiled with ``relax.build``: the spinn partition offloads its GEMMs (forward,
dX = dY W^T, dW = X^T dY; convolutions with trainable weights as im2col + GEMM; the backward
pass's reductions as GEMMs with a ones column) and element-wise ops, forward and backward, and
the optimizer update, to the PEs; the rest runs on the fallback target
(:func:`op_placement` lists both per phase, :func:`step_time` gives the simulated time per phase).
``data_parallel={"replicas": R, "microbatches": M}`` splits a step over chips
(:mod:`.parallel`; its bits do not depend on ``R``); ``parallel={"dp": R, "microbatches": M,
"zero": Z}`` sums per-sample gradients in ascending sample order, so its bits depend on neither
``M``, ``R`` nor the optimizer-state sharding ``Z`` (:mod:`.zero`); ``"pp": S`` runs each
replica's gradient program as ``S`` pipeline stages in 1F1B order, and ``"tp": T`` splits
each transformer block over ``T`` chips (Megatron's column- and row-parallel projections, the
sums over a split axis in a canonical leaf order every plan runs, :mod:`.tp_chain`), with the
same bits (:mod:`.pipeline`, :mod:`.tensor_parallel`).

Limits: ``BatchNorm`` trains with the batch's statistics like PyTorch's
train mode, but its running statistics are not updated (TVM's importer drops those outputs;
``parameters()`` holds the trainable parameters only); dropout with p > 0 is refused. An imported Relax
module (``tvm_spinn.frontend``: weights bound as constants) trains its float32 constants of rank
>= 1 as ``param_<k>``, in the layout the importer stored them in.

Reproducibility rule
--------------------
Final parameters are bitwise identical across runs, across spinn systems (``spinn``,
``spinn/board``) and across save/load/resume, because:

1. the step is a pure function of (inputs, labels, parameters, optimizer state): no random
   ops (dropout is refused), no global state;
2. every floating-point reduction has a fixed order that does not depend on the machine size:
   the PE kernels are simulated bit-exactly, and a GEMM's reduction runs in ascending k on one
   PE (k-chunks of a tile stay on its PE; docs/design/invariants.md), so the chip's and the
   board's tilings give the same bits; BatchNorm's batch statistics are row means whose sums
   are sequential fp32 in ascending order however the rows are split over PEs (the chunks
   chain their partial sums), and max pooling's gradient adds its windows in TVM's fixed order
   on one PE; the ops left on the host (the loss) are the same llvm code for
   every spinn system (the system changes the PE mapping only) and take no thread-count
   dependent reduction order (bits across *hosts* with different CPU features are not
   promised);
3. the state carried between steps (parameters, optimizer buffers, step count) is all of it,
   and a checkpoint stores it bit for bit (``.npz``, float32 unchanged).

The tests check the rule (``tests/training/test_training_repro.py``); a change to tiling that splits a
K-reduction differently per system would break it there.
"""

from . import gradients as _gradients
from .api import Trainer, compile  # noqa: A004
from .errors import CheckpointError, TrainingError
from .parallel import DataParallelTrainer
from .placement import op_placement
from .planner import TrainingPlan, TrainingPlanError, plan_training
from .timing import step_time

_gradients.register()

__all__ = ["compile", "Trainer", "DataParallelTrainer", "TrainingError", "CheckpointError", "op_placement",
           "step_time", "plan_training", "TrainingPlan", "TrainingPlanError"]
