"""A region's outputs left in the chips' SRAM (``onchip_inputs`` naming an output: a later
region on the same chips, or the links, take it from there) are never written to DRAM.

Reference: the same region planned with no tensor on chip; the DRAM I/O its system timing
counts (the memory bound's bytes less the streamed weights) differs by exactly the bytes of the
output as the region's shard plan lays it out on a chip (its local shape), and nothing else of
the mapping changes the region's inputs it reports gathered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tvm import relax

import tvm_spinn
from tvm_spinn.codegen.lower import lower_function
from tvm_spinn.mapping.planner import plan_system
from tvm_spinn.mapping.system import recorded_plan

#: Two chips of four PEs: a region spans both (its system timing composed from its shard).
ARCH = tvm_spinn.make_system("onchip-out-test", chips=2, pes_per_chip=4, pes_per_qpe=4, sram_bytes=48 * 1024)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(96, 128)

    def forward(self, x):
        return torch.relu(self.fc(x))


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    mod = tvm_spinn.partition_for_spinn(tvm_spinn.frontend.from_pytorch(_Block().eval(), (torch.randn(1, 96),)))
    funcs = [(str(f.attrs["global_symbol"]), f) for _, f in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint)
             if isinstance(f, relax.Function) and f.attrs is not None and f.attrs.get("Codegen") == "spinn"]
    assert len(funcs) == 1
    return lower_function(funcs[0][1], funcs[0][0], ARCH)


def _io_bytes(mapped) -> float:
    st = mapped.timing.system
    return st.memory_bound_s * ARCH.dram_bw_bytes_s - st.streamed_bytes_per_chip


def test_outputs_left_on_chip_are_not_written_to_dram(program):
    out = list(program.outputs)
    base = plan_system([program], ARCH, onchip_inputs=[[]], policy="in_order")
    kept = plan_system([program], ARCH, onchip_inputs=[out], policy="in_order")
    a, b = base.programs[0], kept.programs[0]
    assert a.timing.system is not None and b.timing.system is not None
    shapes = recorded_plan(b).shapes
    local = sum(int(np.prod(shapes[t])) * program.tensors[t].nbytes // int(np.prod(program.tensors[t].shape)) for t in out)
    assert local > 0
    assert _io_bytes(a) - _io_bytes(b) == pytest.approx(local, rel=1e-9)
    # the output's write back does not wait for DRAM: the region is no slower
    assert b.timing.system.latency_s <= a.timing.system.latency_s
    # an output named on chip is not an input the region gathers
    assert kept.regions[0].gathered_inputs == ()
