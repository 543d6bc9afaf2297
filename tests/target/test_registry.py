"""Registering and unregistering spinn systems: a tag names its system until it is unregistered,
and the system's entry goes with its last tag."""

from __future__ import annotations

import pytest
import tvm

import tvm_spinn
from tvm_spinn.target import SYSTEMS, arch_of, get_target, known_targets, register_system, unregister_system


def test_unregister_undoes_register_and_keeps_a_system_another_tag_names():
    before = set(known_targets())
    arch = tvm_spinn.make_system("registry-two-tags", pes_per_chip=4)
    first = register_system(arch)
    second = register_system(arch, tag="spinn/registry-second")
    assert {first, second} <= set(known_targets()) and first == "spinn/registry-two-tags"
    unregister_system(first)
    assert first not in known_targets() and SYSTEMS["registry-two-tags"].pes_per_chip == 4
    assert arch_of(second).pes_per_chip == 4
    unregister_system(second)
    assert set(known_targets()) == before and "registry-two-tags" not in SYSTEMS
    with pytest.raises(ValueError, match="unknown spinn target 'spinn/registry-second'"):
        get_target(second)
    # TVM keeps the tag: the target still parses, but names no system any more
    with pytest.raises(ValueError, match="'registry-two-tags' is not registered"):
        arch_of(tvm.target.Target(second))
    with pytest.raises(ValueError, match="'spinn/registry-second' is not registered; known targets: spinn,"):
        unregister_system(second)
    # registering again restores it, a different system under the same name included
    again = register_system(arch.replace(pes_per_chip=8))
    try:
        assert arch_of(again).pes_per_chip == 8
    finally:
        unregister_system(again)
    assert set(known_targets()) == before


def test_unregistering_one_of_two_tags_of_a_builtin_system_keeps_the_other():
    """``spinn`` and ``spinn/cuda`` share one system: dropping one tag leaves the other working."""
    chip, cuda = arch_of("spinn"), arch_of("spinn/cuda")
    assert chip.name == cuda.name
    unregister_system("spinn/cuda")
    try:
        assert "spinn/cuda" not in known_targets() and arch_of("spinn") == chip
    finally:
        register_system(cuda, tag="spinn/cuda", fallback="cuda")
    assert arch_of("spinn/cuda") == cuda


def test_the_fixture_unregisters_only_what_the_test_added(register_system):
    before = set(known_targets())
    tag = register_system(tvm_spinn.make_system("registry-fixture", pes_per_chip=4))
    assert register_system(SYSTEMS[arch_of("spinn").name], tag="spinn") == "spinn"  # already there
    assert set(known_targets()) == before | {tag}


def test_the_fixture_left_nothing_behind():
    """Runs after the test above (pytest keeps a file's order): its system is gone, spinn stays."""
    assert "spinn/registry-fixture" not in known_targets() and "registry-fixture" not in SYSTEMS
    assert "spinn" in known_targets()


def test_registered_system_is_undone_when_the_block_ends_even_on_an_error():
    from tvm_spinn.target import registered_system

    before = set(known_targets())
    arch = tvm_spinn.make_system("registry-scoped", pes_per_chip=4)
    with registered_system(arch) as tag:
        assert tag == "spinn/registry-scoped" and arch_of(tag).pes_per_chip == 4
        # a nested use of the same system shares the registration: the outer block keeps it
        with registered_system(arch) as inner:
            assert inner == tag
        assert tag in known_targets()
    assert set(known_targets()) == before and "registry-scoped" not in SYSTEMS
    with pytest.raises(RuntimeError, match="inside"):
        with registered_system(arch, tag="spinn/registry-scoped-err"):
            raise RuntimeError("inside")
    assert set(known_targets()) == before and "registry-scoped" not in SYSTEMS


def test_registered_system_never_replaces_or_drops_a_tag_it_did_not_add():
    from tvm_spinn.target import ArchError, registered_system

    chip = arch_of("spinn")
    with registered_system(chip, tag="spinn") as tag:  # a built-in tag, same system: left as it was
        assert tag == "spinn"
    assert arch_of("spinn") == chip and "spinn" in known_targets()
    other = tvm_spinn.make_system("registry-other", pes_per_chip=4)
    with pytest.raises(ArchError, match="'spinn' already names system"):
        with registered_system(other, tag="spinn"):
            pass
    assert arch_of("spinn") == chip and "registry-other" not in SYSTEMS
