"""PyTorch front-end: ``torch.export`` -> ``relax.frontend.torch.from_exported_program``."""

from __future__ import annotations

import tvm
from tvm import relax

from .fixups import FixupImported

__all__ = ["from_pytorch", "from_exported_file", "PyTorchImportError"]


class PyTorchImportError(TypeError):
    """A PyTorch model whose outputs cannot be imported (the message names the output type)."""


def _elu(node, importer):
    """``aten.elu(x, alpha, scale, input_scale)``; TVM's converter drops ``scale`` and
    ``input_scale``, which ``F.selu`` (exported as ``elu(x, 1.673..., 1.0507...)``) needs."""
    args = list(node.args) + [None] * (4 - len(node.args))
    alpha, scale, input_scale = (
        float(args[k] if args[k] is not None else node.kwargs.get(name, 1.0))
        for k, name in ((1, "alpha"), (2, "scale"), (3, "input_scale"))
    )
    if scale == 1.0 and input_scale == 1.0:
        return importer._elu(node)
    x = importer.env[node.args[0]]
    dtype = str(x.ty.dtype)

    def const(v):
        return relax.const(v, dtype)

    # torch: scale * (x if x > 0 else alpha * (exp(input_scale * x) - 1))
    negative = relax.op.multiply(
        const(alpha), relax.op.subtract(relax.op.exp(relax.op.multiply(x, const(input_scale))), const(1.0)))
    picked = relax.op.where(relax.op.greater(x, const(0.0)), x, negative)
    return importer.block_builder.emit(relax.op.multiply(picked, const(scale)))


#: aten ops whose TVM conversion is wrong, converted here instead
_CONVERT_FIXES = {"elu.default": _elu}


def _cache_configs(model) -> list:
    """The distinct configs of ``model`` and its submodules that have ``use_cache`` on."""
    configs: list = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and not any(c is config for c in configs):
            configs.append(config)
    return configs


def from_pytorch(model, example_args, dynamic_shapes=None) -> tvm.IRModule:
    """Import a PyTorch module into Relax with its weights bound as constants.

    Parameters
    ----------
    model : torch.nn.Module
        The model; it is exported in eval mode (the caller's module keeps its own mode).
    example_args : tuple of torch.Tensor
        Example inputs (their shapes become the static input shapes).
    dynamic_shapes : optional
        Passed to ``torch.export.export``.

    Returns
    -------
    tvm.IRModule
        Relax module whose ``main`` takes the model inputs, named as in ``forward``.
    """
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    # exported in eval mode; the caller's module (and each submodule) gets its mode back below
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    # transformers models default to use_cache=True and then also build and return a
    # DynamicCache, whose size grows per call and which no static-shape importer takes (nor its
    # concat with an empty past); the forward outputs are the same without it (generation with
    # a KV cache: tvm_spinn.llm). Also for transformers models inside a wrapper module.
    cached = _cache_configs(model)
    try:
        for config in cached:
            config.use_cache = False
        with torch.no_grad():
            exported = torch.export.export(model, example_args, dynamic_shapes=dynamic_shapes)
    except RuntimeError as err:
        if "in output, which is not a known type" not in str(err):
            raise
        kind = str(err).split(" in output")[0].removeprefix("Found ")
        raise PyTorchImportError(
            f"from_pytorch: the model returns {kind}, which cannot be imported: return tensors "
            "(or tuples/lists/dicts of tensors); for generation with a KV cache use tvm_spinn.llm.compile"
        ) from None
    finally:
        for config in cached:
            config.use_cache = True
        for module, training in modes:
            module.training = training
    mod = from_exported_program(exported, keep_params_as_input=False, unwrap_unit_return_tuple=True,
                                custom_convert_map=_CONVERT_FIXES)
    mod = FixupImported(mod)
    return mod.with_attr("spinn_source", {"framework": "pytorch", "version": torch.__version__})


def from_exported_file(path) -> tuple:
    """Import a ``torch.export`` program saved with :func:`torch.export.save` (a ``.pt2`` file).

    Parameters
    ----------
    path : str or os.PathLike
        The saved program.

    Returns
    -------
    (tvm.IRModule, list of str)
        The Relax module (``main`` takes the program's user inputs) and the names of the
        program's user outputs.

    Raises
    ------
    PyTorchImportError
        The file is missing or is not a saved ``torch.export`` program.
    """
    import os

    import torch
    from tvm.relax.frontend.torch import from_exported_program

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PyTorchImportError(f"torch.export program {path!r} does not exist")
    try:
        exported = torch.export.load(path)
    except Exception as err:  # noqa: BLE001  (zip, pickle and version errors of torch.export.load)
        text = str(err).strip().splitlines()
        raise PyTorchImportError(f"{path!r} is not a torch.export program that torch "
                                 f"{torch.__version__} can load: {text[-1] if text else type(err).__name__}") from None
    mod = from_exported_program(exported, keep_params_as_input=False, unwrap_unit_return_tuple=True,
                                custom_convert_map=_CONVERT_FIXES)
    mod = FixupImported(mod).with_attr("spinn_source", {"framework": "pytorch", "file": path,
                                                        "version": torch.__version__})
    return mod, [str(name) for name in exported.graph_signature.user_outputs]
