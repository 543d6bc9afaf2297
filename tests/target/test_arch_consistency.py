"""System descriptions: assumed numbers have cited ranges; contradictory numbers are refused."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields

import pytest

import tvm_spinn
from tvm_spinn.target import arch as arch_module
from tvm_spinn.target.arch import ASSUMPTION_RANGES, ArchError, AssumedRange, SpinnArch


def _assumption_fields() -> list[str]:
    """Fields whose definition in SpinnArch is commented as an assumption."""
    source = inspect.getsource(SpinnArch)
    names = {f.name for f in fields(SpinnArch)}
    found = re.findall(r"^\s{4}(\w+): [^=\n]+=[^#\n]*#[^\n]*\bassumption\b", source, flags=re.MULTILINE)
    return sorted(n for n in found if n in names)


def test_every_assumption_has_a_range_around_its_default():
    assumed = _assumption_fields()
    assert {"dma_setup_cycles", "link_hop_s", "link_payload_fraction", "board_serial_links",
            "sram_reserved_bytes"} <= set(assumed)  # the parse finds the marked fields
    default = SpinnArch()
    missing = [name for name in assumed if name not in ASSUMPTION_RANGES]
    assert not missing, f"assumed SpinnArch fields without a range in ASSUMPTION_RANGES: {missing}"
    names = {f.name for f in fields(SpinnArch)}
    for name, span in ASSUMPTION_RANGES.items():
        assert name in names, name
        assert isinstance(span, AssumedRange) and span.source.strip(), name
        assert span.low < span.high, name
        assert span.low <= getattr(default, name) <= span.high, (name, span, getattr(default, name))
        # either end is a valid system (integers stay integers)
        for end in (span.low, span.high):
            assert getattr(default.replace(**{name: end}), name) == end


def test_ranges_are_read_only():
    with pytest.raises(TypeError):
        ASSUMPTION_RANGES["barrier_cycles"] = AssumedRange(1, 2, "x")  # type: ignore[index]
    with pytest.raises(AttributeError):
        ASSUMPTION_RANGES["barrier_cycles"].low = 0  # type: ignore[misc]


@pytest.mark.parametrize("changes, named", [
    (dict(noc_bw_bytes_s=0.5e9), r"noc_bw_bytes_s.*link_bw_bytes_s"),
    (dict(noc_bw_bytes_s=0.6e9, link_bw_bytes_s=0.5e9, board_link_bw_bytes_s=0.7e9),
     r"noc_bw_bytes_s.*board_link_bw_bytes_s"),
    (dict(noc_hop_cycles=0), r"noc_hop_cycles must be > 0"),
    (dict(link_hop_s=0.0), r"link_hop_s must be > 0"),
    (dict(board_link_hop_s=0.0), r"board_link_hop_s must be > 0"),
    (dict(board_link_hop_s=0.2e-6), r"board_link_hop_s.*shorter than.*link_hop_s"),
    (dict(sram_reserved_bytes=128 * 1024), r"(?=.*sram_reserved_bytes)(?=.*SpinnArch.sram_bytes)"),
    (dict(link_payload_fraction=0.0), r"link_payload_fraction"),
    (dict(link_payload_fraction=1.5), r"link_payload_fraction"),
    (dict(board_serial_links=0), r"board_serial_links"),
])
def test_contradictory_numbers_are_refused_and_nothing_is_registered(changes, named):
    before = set(tvm_spinn.known_targets())
    with pytest.raises(ArchError, match=named):
        tvm_spinn.make_system("contradiction", **changes)
    with pytest.raises(ArchError, match=named):
        SpinnArch().replace(**changes)
    with pytest.raises(ArchError, match=named):
        SpinnArch.from_dict({**SpinnArch().to_dict(), **changes})
    assert set(tvm_spinn.known_targets()) == before
    assert "spinn/contradiction" not in tvm_spinn.known_targets()


def test_consistent_edges_are_accepted():
    # equal rates and equal hops are not contradictions
    arch = tvm_spinn.make_system("edges", noc_bw_bytes_s=0.75e9, board_link_hop_s=0.5e-6)
    assert (arch.noc_bw_bytes_s, arch.board_link_hop_s) == (arch.link_bw_bytes_s, arch.link_hop_s)
    for preset in arch_module.CHIPS.values():  # the shipped presets are consistent
        assert preset.replace() == preset
