"""Target tags for spinn systems and the table mapping a target to its :class:`SpinnArch`.

TVM tags cannot carry custom attributes, so a spinn target is an ``llvm`` (or ``cuda``) target
whose ``keys`` contain ``"spinn"`` and whose ``model`` names an entry of the system table below.
The fallback (non-offloaded) part of a model is compiled for that llvm/cuda target.
"""

from __future__ import annotations

import contextlib
import os
import threading

import tvm

from .._env import env
from .arch import CHIPS, ArchError, SpinnArch

__all__ = [
    "SYSTEMS", "TAGS", "register_system", "unregister_system", "registered_system", "arch_of", "is_spinn_target", "get_target",
    "known_targets", "register_default_tags", "HOST_MCPU_ENV", "host_mcpu", "host_target",
]

#: environment variable naming the LLVM CPU the host fallback is compiled for, read when the tags
#: are registered: a CPU name (``znver3``, ``skylake-avx512``), or empty for LLVM's generic CPU
#: (baseline SSE2 on x86-64: portable code for another machine). Default: this host's CPU.
HOST_MCPU_ENV = "TVM_SPINN_HOST_MCPU"

#: name (target ``model``) -> architecture
SYSTEMS: dict[str, SpinnArch] = {}
#: tag name -> (system name, fallback kind)
TAGS: dict[str, tuple[str, str]] = {}
_LOCK = threading.Lock()


def host_mcpu() -> str:
    """The LLVM CPU of the host fallback: ``$TVM_SPINN_HOST_MCPU`` if set, else this host's CPU.

    Without ``-mcpu`` LLVM compiles for its generic x86-64 CPU (SSE2, no FMA): about 2x slower
    fallback kernels here. The host's CPU name is what LLVM detects (deterministic on one
    machine), so artifacts stay bit-identical run to run; code built for it runs on that CPU
    family and newer. ``""`` means LLVM's generic CPU.

    Raises
    ------
    ValueError
        If the name is not a CPU that LLVM knows for this host's triple.
    """
    from tvm.target.codegen import llvm_get_system_cpu, llvm_get_system_triple, llvm_is_valid_cpu

    value = env(HOST_MCPU_ENV)
    cpu = (llvm_get_system_cpu() if value is None else value).strip()
    if cpu in ("", "generic"):
        return ""
    if not llvm_is_valid_cpu(cpu, llvm_get_system_triple()):
        source = f"${HOST_MCPU_ENV}" if value is not None else "llvm_get_system_cpu()"
        raise ValueError(f"{source} names CPU {cpu!r}, which LLVM does not know for "
                         f"{llvm_get_system_triple()} (set {HOST_MCPU_ENV}='' for the generic CPU)")
    return cpu


def _host_config(mcpu: str | None = None) -> dict:
    # num-cores describes the *host* CPU that runs the fallback, never the simulated PEs.
    config = {"kind": "llvm", "num-cores": max(1, os.cpu_count() or 1)}
    mcpu = host_mcpu() if mcpu is None else mcpu
    if mcpu:
        config["mcpu"] = mcpu
    return config


def host_target(mcpu: str | None = None) -> tvm.target.Target:
    """The llvm target the spinn tags compile the host fallback for (see :func:`host_mcpu`).

    Build a reference for "the same fallback code" with it: plain ``llvm`` is another CPU
    (generic x86-64, no FMA), so its float results can differ in the last bits.
    """
    return tvm.target.Target(_host_config(mcpu))


def register_system(arch: SpinnArch, tag: str | None = None, fallback: str = "llvm",
                    host_mcpu: str | None = None) -> str:
    """Register a system so that ``tvm.target.Target(tag)`` selects it.

    Parameters
    ----------
    arch : SpinnArch
        The system description (see :func:`tvm_spinn.make_system`); its fault fields
        (``dead_boards``, ``allocated_boards``...) describe a machine as it is, e.g.
        ``arch_of("spinn/cloud").replace(name="cloud-part", allocated_boards=range(24), dead_boards=(3,))``.
    tag : str, optional
        Target tag to register; defaults to ``"spinn/<arch.name>"``.
    fallback : {"llvm", "cuda"}
        Where operators that are not offloaded run.
    host_mcpu : str, optional
        LLVM CPU of the host code (``""``: LLVM's generic CPU); default :func:`host_mcpu`.

    Returns
    -------
    str
        The tag name, usable as ``relax.build(mod, target=tag)``.
    """
    if fallback not in ("llvm", "cuda"):
        raise ArchError(f"fallback must be 'llvm' or 'cuda', got {fallback!r}")
    tag = tag or f"spinn/{arch.name}"
    arch = arch.replace(host_fallback=fallback)
    if arch.has_faults:  # dead links that lead nowhere, live chips cut apart: refused here
        from .topology import topology_of

        topology_of(arch)
    host = _host_config(host_mcpu)
    if fallback == "llvm":
        config = dict(host, keys=["spinn", "cpu"], model=arch.name)
    else:
        config = {
            # MetaSchedule's GPU rules read these limits from the target (sm_80 and later).
            "kind": "cuda", "arch": "sm_80", "keys": ["spinn", "cuda", "gpu"],
            "max_num_threads": 1024, "max_threads_per_block": 1024, "thread_warp_size": 32,
            "max_shared_memory_per_block": 49152, "registers_per_block": 65536,
            "model": arch.name, "host": host,
        }
    with _LOCK:
        previous = SYSTEMS.get(arch.name)
        if previous is not None and previous.replace(host_fallback=arch.host_fallback) != arch:
            raise ArchError(
                f"a different system named {arch.name!r} is already registered; choose another name"
            )
        SYSTEMS[arch.name] = arch
        TAGS[tag] = (arch.name, fallback)
        tvm.target.register_tag(tag, config, override=True)
    return tag



def unregister_system(tag: str) -> None:
    """Undo :func:`register_system`: ``tag`` no longer names a spinn target.

    The system's entry in ``SYSTEMS`` goes with its last tag (``spinn`` and ``spinn/cuda``
    share one system). TVM has no way to remove a tag, so ``tvm.target.Target(tag)`` still
    parses; :func:`get_target` refuses the name like any unknown spinn target, and
    :func:`arch_of` refuses a target whose system is gone. Registering the tag again replaces
    TVM's entry.

    Parameters
    ----------
    tag : str
        A tag :func:`register_system` returned.

    Raises
    ------
    ValueError
        If ``tag`` is not a registered spinn target (the message lists those that are).
    """
    with _LOCK:
        if tag not in TAGS:
            raise ValueError(f"spinn target {tag!r} is not registered; known targets: {', '.join(sorted(TAGS))}")
        name, _ = TAGS.pop(tag)
        if all(other != name for other, _ in TAGS.values()):
            del SYSTEMS[name]


@contextlib.contextmanager
def registered_system(arch: SpinnArch, tag: str | None = None, fallback: str = "llvm",
                      host_mcpu: str | None = None):
    """:func:`register_system` for the duration of a ``with`` block, undone when it ends.

    A tag that already names this system (same name and numbers) is left as it was, so nested
    or repeated uses of one system share its registration and the outermost owner keeps it.

    Parameters
    ----------
    arch, tag, fallback, host_mcpu
        As :func:`register_system`.

    Yields
    ------
    str
        The tag name.

    Raises
    ------
    ArchError
        If ``tag`` already names another system (it is not replaced), or as :func:`register_system`.
    """
    tag = tag or f"spinn/{arch.name}"
    with _LOCK:
        owned = TAGS.get(tag)
        if owned is not None and (owned[0] != arch.name or owned[1] != fallback
                                  or SYSTEMS[owned[0]].replace(host_fallback=fallback) != arch.replace(host_fallback=fallback)):
            raise ArchError(f"target tag {tag!r} already names system {owned[0]!r} ({owned[1]} fallback); "
                            f"registered_system does not replace it")
    if owned is not None:
        yield tag
        return
    register_system(arch, tag, fallback=fallback, host_mcpu=host_mcpu)
    try:
        yield tag
    finally:
        if tag in TAGS:
            unregister_system(tag)

def register_default_tags() -> None:
    """Register the built-in tags.

    ``spinn`` (one production chip), ``spinn/board`` (48 of them), ``spinn/cloud`` (720 boards,
    34,560 chips: SpiNNcloud's ~720 boards [Systems-S in :mod:`tvm_spinn.target.arch`]),
    ``spinn/cuda`` (one chip, CUDA fallback), and ``spinn/testchip``, ``spinn/testchip/board`` with the test chip's numbers
    (:data:`tvm_spinn.target.arch.CHIPS`).
    """
    chip = CHIPS["production"]
    register_system(chip, tag="spinn")
    register_system(chip.replace(name="spinn2-board", chips=48), tag="spinn/board")
    register_system(chip.replace(name="spinn2-cloud", chips=720 * chip.chips_per_board), tag="spinn/cloud")
    register_system(chip.replace(host_fallback="cuda"), tag="spinn/cuda", fallback="cuda")
    test = CHIPS["testchip"]
    register_system(test, tag="spinn/testchip")
    register_system(test.replace(name="spinn2-testchip-board", chips=48), tag="spinn/testchip/board")


def known_targets() -> list[str]:
    """Sorted list of registered spinn target tags."""
    return sorted(TAGS)


def is_spinn_target(target: tvm.target.Target | None) -> bool:
    """Whether ``target`` is a spinn system (its keys contain ``"spinn"``)."""
    return target is not None and "spinn" in list(target.keys)


def get_target(target: "str | tvm.target.Target") -> tvm.target.Target:
    """Resolve a target name, raising a ValueError that lists the known spinn targets."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str) and target.startswith("spinn") and target not in TAGS:
        raise ValueError(
            f"unknown spinn target {target!r}; known targets: {', '.join(known_targets())} "
            "(register more with tvm_spinn.register_system)"
        )
    try:
        return tvm.target.Target(target)
    except Exception as err:  # TVM raises ValueError/TVMError with a long message
        raise ValueError(
            f"unknown target {target!r} ({err}); known spinn targets: {', '.join(known_targets())}"
        ) from None


def arch_of(target: "str | tvm.target.Target") -> SpinnArch:
    """The :class:`SpinnArch` of a spinn target."""
    target = get_target(target)
    if not is_spinn_target(target):
        raise ValueError(f"target {target} is not a spinn target (its keys lack 'spinn')")
    model = str(target.attrs.get("model", ""))
    if model not in SYSTEMS:
        raise ValueError(
            f"spinn target model {model!r} is not registered; known systems: {sorted(SYSTEMS)}"
        )
    arch = SYSTEMS[model]
    fallback = "cuda" if target.kind.name == "cuda" else "llvm"
    return arch if arch.host_fallback == fallback else arch.replace(host_fallback=fallback)
