"""One ELF image per PE role and the table of which PE runs which image."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import view
from .kernels import kernel_object
from .link import link_image
from .roles import layer_role, role_name

__all__ = ["PeImage", "ProgramImages", "build_images", "role_image", "noc_role_image", "self_dma_role_image"]


@dataclass(frozen=True)
class PeImage:
    """A linked PE image: its role's kernel spec, name and ELF bytes."""

    spec: tuple
    name: str
    elf: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.elf).hexdigest()


@dataclass(frozen=True)
class ProgramImages:
    """The images of a program: ``images`` by role name, ``layers[i]`` the role of layer ``i``
    and ``pes[i]`` the PEs that run it (ascending)."""

    images: dict
    layers: tuple
    pes: tuple


def role_image(spec: tuple) -> PeImage:
    """The linked image of kernel ``spec``."""
    return PeImage(spec, role_name(spec), link_image(kernel_object(spec)))


def noc_role_image(spec: tuple) -> PeImage:
    """The image of kernel ``spec`` linked with the NoC driver (:func:`~.noc.link_noc_image`);
    its name is the role's: it stands for the role's image where the NoC is used."""
    from .noc import link_noc_image
    return PeImage(spec, role_name(spec), link_noc_image(kernel_object(spec)))


def self_dma_role_image(spec: tuple, noc: bool = False) -> PeImage:
    """The image of kernel ``spec`` linked with the job-table walker (and the NoC driver with
    ``noc``): :func:`~.walker.link_self_dma_image`; its name is the role's."""
    from .walker import link_self_dma_image
    return PeImage(spec, role_name(spec), link_self_dma_image(kernel_object(spec), noc=noc))


def build_images(program, noc: bool = False, self_dma: bool = False) -> ProgramImages:
    """Every layer's role checked first (a :class:`~.errors.PeCodegenError` names the first
    layer that cannot be lowered, before anything is built), then one image per role (``noc``:
    each linked with the NoC driver, :func:`noc_role_image`; ``self_dma``: with the job-table
    walker, :func:`self_dma_role_image`)."""
    specs = [layer_role(program, i) for i in range(view.layer_count(program))]
    tables = view.placed_tiles(program)
    images = {}
    for spec in specs:
        name = role_name(spec)
        if name not in images:
            if self_dma:
                images[name] = self_dma_role_image(spec, noc=noc)
            elif noc:
                images[name] = noc_role_image(spec)
            else:
                images[name] = role_image(spec)
    pes = tuple(tuple(sorted({int(p) for p in table.pe})) for table in tables)
    return ProgramImages(images=dict(sorted(images.items())), layers=tuple(role_name(s) for s in specs), pes=pes)
