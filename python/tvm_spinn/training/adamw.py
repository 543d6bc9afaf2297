"""AdamW (decoupled weight decay) as a Relax optimizer function, in the style of TVM's
``relax.training.optimizer`` (an :class:`~tvm.relax.training.optimizer.Optimizer` whose
``get_function`` builds ``(params, gradients, optim_states) -> (params, optim_states)``).

TVM 0.27 has no AdamW, and its ``Adam`` cannot be reused with the decay taken out of the
gradient: it keeps the bias corrections as running float32 products of float32 betas
(``beta2 = 0.999`` is ``0.99900001`` in float32, so ``1 - beta2`` at step 1 is off by 1.3e-5
relative), where ``torch.optim.AdamW`` computes ``1 - beta ** t`` in float64 from the step
count. This function follows ``torch.optim.AdamW``'s single-tensor update (its default on a
CPU) operation by operation, each a float32 rounding::

    t = t + 1                                      # int64 step count
    bc1 = 1 - beta1 ** t,  bc2 = 1 - beta2 ** t    # float64, 0-d (host)
    neg_step = float32(-lr / bc1)                  # float64, then one rounding to float32
    bc2_sqrt = float32(sqrt(bc2))
    p = p * float32(1 - lr * weight_decay)         # decoupled decay first (skipped if 0)
    m = m + float32(1 - beta1) * (g - m)           # torch's lerp (weight < 0.5 branch;
                                                   #   g - (g - m) * float32(beta1) otherwise)
    v = v * float32(beta2) + (float32(1 - beta2) * g) * g       # mul_ then addcmul_
    denom = sqrt(v) / bc2_sqrt + float32(eps)
    p = p + (neg_step * m) / denom                 # addcdiv_

The per-element operations are float32 ``multiply``/``add``/``subtract``/``divide``/``sqrt``,
which the spinn partition runs on the PEs (correctly rounded on the M4F; bit-exact in the
simulator); the 0-d step arithmetic runs on the host. PyTorch's vectorized ``lerp`` uses a fused
multiply-add, so the two agree to rounding (an ulp or so per step), not bit for bit.

State: ``(num_steps, m_0, ..., m_{n-1}, v_0, ..., v_{n-1})``: the int64 step count, then the
first and second moments of each parameter (float32, the parameter's shape): two float32 words
per parameter, as the training planner counts it.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.training.optimizer import Optimizer

__all__ = ["AdamW"]


def _shape(var: relax.Var) -> list[int]:
    return [int(d) for d in var.ty.shape]


class AdamW(Optimizer):
    """``torch.optim.AdamW`` (``amsgrad=False``) as a Relax optimizer function.

    Parameters
    ----------
    lr : float
        Learning rate (>= 0).
    betas : (float, float)
        Decay rates of the first and second moments, each in [0, 1).
    eps : float
        Added to the bias-corrected ``sqrt`` of the second moment (> 0).
    weight_decay : float
        Decoupled weight decay: each step first scales the parameter by ``1 - lr * weight_decay``.

    Notes
    -----
    The options are taken as checked (:func:`tvm_spinn.training.graph.make_optimizer` checks
    them and names a bad one).
    """

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__("AdamW")
        self.lr = float(lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def init(self, params) -> "AdamW":
        """Set the parameters (float32 Vars) and the initial state: step 0, zero moments."""
        if not isinstance(params, list):
            params = [params]
        self._set_params_and_dtype(params)
        # TVM keeps the dtype as a type object; the constants and np.zeros need its name
        self.dtype = str(getattr(self.dtype, "dtype", self.dtype))
        moments = [tvm.runtime.tensor(np.zeros(_shape(p), self.dtype)) for _ in "mv" for p in self.param_list]
        self.state = (tvm.runtime.tensor(np.zeros((), "int64")), *moments)
        return self

    def get_function(self) -> relax.Function:
        """The update ``(params, gradients, optim_states) -> (params, optim_states)``."""
        self._check_init()
        op = relax.op
        plist = self.param_list
        n = len(plist)
        dtype = self.dtype
        param_var = relax.Var("params", relax.TupleType([p.ty for p in plist]))
        grad_var = relax.Var("gradients", relax.TupleType([p.ty for p in plist]))
        state_var = relax.Var("optim_states", relax.TupleType(
            [relax.TensorType((), "int64"), *(p.ty for p in plist), *(p.ty for p in plist)]))

        def f32(value: float) -> relax.Constant:
            # the Python (float64) value rounded once to float32, as torch casts a scalar
            return relax.const(np.float32(value), dtype)

        def f64(value: float) -> relax.Constant:
            return relax.const(np.float64(value), "float64")

        # torch's lerp(m, g, w) with w = float32(1 - beta1): m + w (g - m) for w < 0.5, else
        # g - (g - m) (1 - w), 1 - w in float32
        weight = np.float32(1.0 - self.beta1)
        small = weight < 0.5
        w1 = relax.const(weight if small else np.float32(1.0) - weight, dtype)
        beta2, w2, eps = f32(self.beta2), f32(1.0 - self.beta2), f32(self.eps)
        decay = f32(1.0 - self.lr * self.weight_decay)

        bb = relax.BlockBuilder()
        with bb.function(self.name, [param_var, grad_var, state_var]):
            with bb.dataflow():
                steps = bb.emit(relax.TupleGetItem(state_var, 0), "num_steps")
                steps_new = bb.emit(op.add(steps, relax.const(1, "int64")), "num_steps_new")
                t = bb.emit(op.astype(steps_new, "float64"), "t")
                bc1 = bb.emit(op.subtract(f64(1.0), op.power(f64(self.beta1), t)), "bias_correction1")
                bc2 = bb.emit(op.subtract(f64(1.0), op.power(f64(self.beta2), t)), "bias_correction2")
                neg_step = bb.emit(op.astype(op.divide(f64(-self.lr), bc1), dtype), "neg_step_size")
                bc2_sqrt = bb.emit(op.astype(op.sqrt(bc2), dtype), "bias_correction2_sqrt")
                new_params, new_m, new_v = [], [], []
                for i, var in enumerate(plist):
                    name = var.name
                    p = bb.emit(relax.TupleGetItem(param_var, i), name)
                    g = bb.emit(relax.TupleGetItem(grad_var, i), name + "_grad")
                    m = bb.emit(relax.TupleGetItem(state_var, 1 + i), name + "_m")
                    v = bb.emit(relax.TupleGetItem(state_var, 1 + n + i), name + "_v")
                    if self.weight_decay != 0.0:
                        p = bb.emit(op.multiply(p, decay), name + "_decayed")
                    if small:
                        m = bb.emit(op.add(m, op.multiply(w1, op.subtract(g, m))), name + "_m_new")
                    else:
                        m = bb.emit(op.subtract(g, op.multiply(op.subtract(g, m), w1)), name + "_m_new")
                    v = bb.emit(op.add(op.multiply(v, beta2), op.multiply(op.multiply(w2, g), g)), name + "_v_new")
                    denom = bb.emit(op.add(op.divide(op.sqrt(v), bc2_sqrt), eps), name + "_denom")
                    p = bb.emit(op.add(p, op.divide(op.multiply(neg_step, m), denom)), name + "_new")
                    new_params.append(p)
                    new_m.append(m)
                    new_v.append(v)
                params_new = bb.emit_output(relax.Tuple(new_params), "params_new")
                states_new = bb.emit_output(relax.Tuple([steps_new, *new_m, *new_v]), "optim_states_new")
            bb.emit_func_output((params_new, states_new))
        return bb.get()[self.name]
