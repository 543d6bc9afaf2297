"""Spinn programs of a model part whose weights are shape/dtype descriptors, never materialized.

The part (a :class:`torch.nn.Module` on the ``meta`` device, e.g. one transformer block) is
exported with ``torch.export`` with every parameter as an explicit input (meta tensors carry
only shape and dtype), imported by TVM's ``from_exported_program`` and partitioned by the
normal spinn pipeline. The weights then reach the offloaded regions as inputs; this module
turns them back into what the compiler makes of bound weights, in each lowered
:class:`~tvm_spinn.program.Program`:

* a ``matmul`` whose second operand is a weight ``(K, N)``, or the ``permute_dims`` of a weight
  ``(N, K)`` (``nn.Linear``), becomes a ``dense`` layer with that weight as its constant
  (``int8``: a ``quantize`` of the activation, an int8 ``(K, N)`` weight and per-channel
  scales, the layers ``tvm_spinn.quantize`` produces);
* every other weight operand (norm scales, biases) becomes a constant tensor.

A constant is a zero-strided numpy view (``np.broadcast_to`` of one element): it has the
weight's shape and dtype and occupies no memory. The mapper and the timing model read only
shapes, dtypes and roles, so the programs map and time as the real model's would; they are
never serialized or run (the functional simulator would compute with zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

__all__ = ["DescribedProgram", "bind_dims", "describe", "describe_imported", "imported"]


@dataclass(frozen=True)
class DescribedProgram:
    """One offloaded region of a described part, lowered (unmapped) with descriptor weights.

    ``weight_bytes``: bytes of the constants its layers read (GEMM weights as ``dtype``, vectors)."""

    program: object
    weight_bytes: int


def _descriptor(shape, dtype) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(int(d) for d in shape))


def _export(module, args: tuple, dims: "dict | None" = None, derived: bool = False):
    """``torch.export`` of ``module`` with its parameters as trailing inputs (meta tensors);
    ``dims``: argument index -> {axis: name} of the dimensions exported as symbols (``derived``:
    as torch's ``Dim.DYNAMIC``, see :func:`imported`)."""
    import torch

    names = [name for name, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]

    class WeightsAsInputs(torch.nn.Module):
        def forward(self, *flat):
            inputs, weights = flat[:len(args)], flat[len(args):]
            return torch.func.functional_call(module, dict(zip(names, weights)), inputs)

    dynamic = None
    if dims:
        # min 2: torch specializes sizes 0 and 1; a size the trace ties to a constant raises
        symbols = {name: torch.export.Dim.DYNAMIC if derived else torch.export.Dim(name, min=2)
                   for axes in dims.values() for name in axes.values()}
        dynamic = (tuple({axis: symbols[name] for axis, name in dims[i].items()} if i in dims else None
                         for i in range(len(args) + len(params))),)
    with torch.no_grad():
        exported = torch.export.export(WeightsAsInputs(), tuple(args) + tuple(params), dynamic_shapes=dynamic)
    return exported, len(params)


def imported(module, args: tuple, dims: "dict | None" = None, derived: bool = False):
    """``module(*args)`` exported with its parameters as trailing inputs and imported into Relax.

    Parameters
    ----------
    module : torch.nn.Module
        The part; its parameters may live on the ``meta`` device.
    args : tuple of torch.Tensor
        Example inputs (meta tensors are fine).
    dims : dict, optional
        Argument index -> {axis: symbol name}: dimensions kept symbolic (one import serves every
        size of them, see :func:`bind_dims`); the same name on several axes is one size.
    derived : bool
        Let torch derive the symbols' ranges and relations (``Dim.DYNAMIC``: a guard its range
        analysis cannot prove, such as a slice's ``min`` of a symbolic size, does not refuse the
        export) rather than check them against named symbols of ``min=2``; a dimension torch
        makes constant raises.

    Returns
    -------
    tuple of (tvm.IRModule, int)
        The imported module and the number of trailing weight parameters of its ``main``.
    """
    from tvm.relax.frontend.torch import from_exported_program

    from ..frontend.fixups import FixupImported

    exported, n_weights = _export(module, args, dims, derived)
    mod = FixupImported(from_exported_program(exported, keep_params_as_input=False,
                                              unwrap_unit_return_tuple=True))
    return mod, n_weights


def bind_dims(mod, dims: dict, sizes: dict):
    """``mod`` (from :func:`imported` with ``dims``) with its symbolic dimensions bound to
    ``sizes`` (symbol name -> int) and their bounds' attributes dropped: the module that the
    import at those sizes gives."""
    from tvm import relax

    main = mod["main"]
    symbols = {}  # the symbol's text -> (symbol, name)
    for i, axes in dims.items():
        for axis, name in axes.items():
            if name not in sizes:
                raise ValueError(f"bind_dims: no size given for the symbolic dimension {name!r}")
            d = main.params[i].ty.shape[axis]
            if hasattr(d, "value"):  # kept constant by the import: only that size is this module
                if int(d.value) != int(sizes[name]):
                    raise ValueError(f"bind_dims: dimension {name!r} of parameter {i} is the constant "
                                     f"{int(d.value)}, not {int(sizes[name])}")
                continue
            symbols[str(d)] = (d, name)
    bound = relax.transform.BindSymbolicVars({d: int(sizes[n]) for d, n in symbols.values()})(mod)
    main = bound["main"]
    for attr in ("tir_var_lower_bound", "tir_var_upper_bound"):
        if main.attrs is not None and attr in main.attrs:
            main = main.without_attr(attr)
    bound["main"] = main
    return bound


def _region_weights(main, weights: set) -> dict:
    """Region name -> indices of its parameters that main passes a weight to."""
    from tvm import relax

    out = {}
    for block in main.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
                out[value.op.name_hint] = {i for i, a in enumerate(value.args)
                                           if isinstance(a, relax.Var) and a in weights}
    return out


def _rewrite(program, weight_inputs: set, dtype: str):
    """``program`` with its weight inputs as descriptor constants and its weight GEMMs as dense
    layers."""
    from ..program.model import TensorDesc
    from ..program.ops.gemm import fuse_bias, share_quantizes, weight_matmuls_to_dense
    from ..program.ops.movement import dedupe_movement

    tensors, constants = list(program.tensors), dict(program.constants)

    def new_tensor(name, shape, dt, role):
        tensors.append(TensorDesc(name=name, shape=[int(d) for d in shape], dtype=dt, role=role))
        tid = len(tensors) - 1
        if role == "const":
            constants[tid] = _descriptor(shape, dt)
        return tid

    for tid in weight_inputs:
        tensors[tid] = replace(tensors[tid], role="const")
        constants[tid] = _descriptor(tensors[tid].shape, tensors[tid].dtype)
    inputs = [t for t in program.inputs if t not in weight_inputs]
    layers = weight_matmuls_to_dense(program, weight_inputs, dtype, new_tensor,
                                     lambda tid, shape, dt: constants.__setitem__(tid, _descriptor(shape, dt)), tensors)
    draft = replace(program, tensors=tensors, constants=constants, inputs=inputs)
    return replace(draft, layers=fuse_bias(draft, share_quantizes(draft, dedupe_movement(draft, layers))))


def describe(module, args: tuple, target, dtype: str = "fp32") -> list[DescribedProgram]:
    """Lower the offloaded regions of ``module(*args)`` with descriptor weights (unmapped).

    Parameters
    ----------
    module : torch.nn.Module
        The part to describe; its parameters may live on the ``meta`` device.
    args : tuple of torch.Tensor
        Example inputs (meta tensors are fine): only shapes and dtypes are used.
    target : str or tvm.target.Target
        The spinn target whose partitioning rules apply (what fits on a PE).
    dtype : {"fp32", "int8"}
        Arithmetic of the weight GEMMs.

    Returns
    -------
    list of DescribedProgram
        One per offloaded region, in call order; map each with ``tvm_spinn.mapping.map_program``.
    """
    return describe_imported(*imported(module, args), target, dtype)


def describe_imported(mod, n_weights: int, target, dtype: str = "fp32") -> list[DescribedProgram]:
    """:func:`describe` of a part already imported (:func:`imported`, :func:`bind_dims`)."""
    from ..codegen.lower import lower_function
    from ..partition import partition_for_spinn
    from ..target import arch_of

    arch = arch_of(target)
    main_params = list(mod["main"].params)
    weight_params = main_params[len(main_params) - n_weights:]
    # vectors (norm scales, biases: O(hidden) bytes each) are bound as zero constants, as bound
    # weights would be, so the norm and bias patterns apply; matrices stay descriptors
    vectors = {p.name: np.zeros([int(d) for d in p.ty.shape], dtype=str(p.ty.dtype))
               for p in weight_params if len(p.ty.shape) <= 1}
    if vectors:
        from tvm import relax

        mod = relax.transform.BindParams("main", vectors)(mod)
    matrices = {p.name for p in weight_params if p.name not in vectors}
    weights = {p for p in mod["main"].params if p.name in matrices}
    parted = partition_for_spinn(mod, target)
    region_weights = _region_weights(parted["main"], weights)
    out = []
    functions = {gv.name_hint: func for gv, func in parted.functions.items()}
    for name, positions in region_weights.items():  # main's call order
        func = functions[name]
        if not (func.attrs and "Codegen" in func.attrs):
            continue
        program = lower_function(func, name, arch)
        # the program's inputs are the region's parameters, in order
        if [program.tensors[i].name for i in program.inputs] != [p.name for p in func.params]:
            raise RuntimeError(f"{name}: the lowered program's inputs are not the region's parameters")
        weight_inputs = {program.inputs[i] for i in positions}
        program = _rewrite(program, weight_inputs, dtype)
        used = sorted({t for layer in program.layers for t in [*layer.inputs, *layer.consts.values()]
                       if program.tensors[t].role == "const"})
        out.append(DescribedProgram(program, sum(program.tensors[t].nbytes for t in used)))
    return out
