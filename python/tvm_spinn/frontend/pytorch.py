"""PyTorch front-end: ``torch.export`` -> ``relax.frontend.torch.from_exported_program``."""

from __future__ import annotations

import tvm

from .fixups import FixupImported

__all__ = ["from_pytorch"]


def from_pytorch(model, example_args, dynamic_shapes=None) -> tvm.IRModule:
    """Import a PyTorch module into Relax with its weights bound as constants.

    Parameters
    ----------
    model : torch.nn.Module
        The model; it is exported in eval mode.
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
    model = model.eval()
    with torch.no_grad():
        exported = torch.export.export(model, example_args, dynamic_shapes=dynamic_shapes)
    mod = from_exported_program(exported, keep_params_as_input=False, unwrap_unit_return_tuple=True)
    mod = FixupImported(mod)
    return mod.with_attr("spinn_source", {"framework": "pytorch", "version": torch.__version__})
