"""Programs of the same structure are mapped once per build, with the same bytes as alone."""

import torch
from tvm import relax

import tvm_spinn
from tvm_spinn.codegen.codegen import _with_native_section, compile_function
from tvm_spinn.codegen.lower import lower_function
from tvm_spinn.mapping.planner import plan_system
from tvm_spinn.mapping import schedule
from tvm_spinn.target.arch import SpinnArch
import transformers as tf
from test_zoo import _Field, _tokens


def _regions():
    torch.manual_seed(0)
    # four encoder layers: the regions between the first and the last one repeat
    model = _Field(tf.BertModel(tf.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=32)), "last_hidden_state")
    x = _tokens()
    mod = tvm_spinn.partition_for_spinn(tvm_spinn.frontend.from_pytorch(model.eval(), (x,)))
    return [(str(f.attrs["global_symbol"]), f) for _, f in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint)
            if isinstance(f, relax.Function) and f.attrs is not None and f.attrs.get("Codegen") == "spinn"]


def test_shared_mappings_same_bytes_and_reused(monkeypatch):
    arch = SpinnArch()
    regions = _regions()
    alone = [compile_function(f, name, arch)[1] for name, f in regions]
    mapped = []
    real = schedule._map
    monkeypatch.setattr(schedule, "_map", lambda *a: mapped.append(1) or real(*a))
    programs = [lower_function(f, name, arch) for name, f in regions]
    # codegen adds each mapped program's native section (its plan for the C++ module) before writing it
    shared = [_with_native_section(p).to_bytes() for p in plan_system(programs, arch).programs]
    assert shared == alone
    assert len(mapped) < len(regions)  # the encoder layers share one mapping
