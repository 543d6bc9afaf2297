"""``rms_norm`` (rows family): Llama's RMSNorm fused from its decomposed import and from
``relax.nn.rms_norm``. The kernel against a numpy float32 reference bit for bit (sum of squares
in blocks of ``LAYER_NORM_BLOCK``, then the graph's operations in order), every tiling and the
native plan with the same bits, the split-row cost chaining block sums, program validation, and
a transformers Llama model whose norms all become ``spinn.rms_norm`` close to PyTorch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_spinn
from tvm_spinn import _lib
from tvm_spinn.mapping import map_program
from tvm_spinn.program import Layer, Program, ProgramError, TensorDesc
from tvm_spinn.program.ops.base import family_of
from tvm_spinn.program.ops.rows import LAYER_NORM_BLOCK
from tvm_spinn.runtime import simulator
from tvm_spinn.runtime.simulator import run_program
from tvm_spinn.target import arch_of

F32 = np.float32


def _bits(a):
    return np.ascontiguousarray(a, dtype=F32).view(np.uint32)


def _blocked_sum(v):
    """layer_norm's blocked order (the kernel tests' reference)."""
    from test_sim_kernels import _blocked_sum as blocked

    return blocked(v, LAYER_NORM_BLOCK)


def _reference(x, weight, eps):
    """numpy float32 per row: q = blocked sum of x * x, m = q / d, v = m + eps, r = 1 / sqrt(v),
    h = x * r, y = weight * h (each one rounding)."""
    x = np.asarray(x, F32)
    d = F32(x.shape[1])
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        q = _blocked_sum((x[r] * x[r]).astype(F32))
        inv = F32(1) / np.sqrt(F32(F32(q / d) + F32(eps)))
        h = (x[r] * inv).astype(F32)
        out[r] = h if weight is None else (weight * h).astype(F32)
    return out


def _kernel(x, weight, eps, threads=0):
    out = np.empty_like(x)
    _lib._func("tvm_spinn.sim.rms_norm_f32")(x, np.zeros(0, F32) if weight is None else weight, float(eps), out,
                                             threads)
    return out


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 64), (2, 300), (2, 1024)])
@pytest.mark.parametrize("weighted", [True, False])
def test_kernel_bits(shape, weighted):
    rng = np.random.default_rng(sum(shape))
    x = (rng.normal(size=shape) * 3).astype(F32)
    x[0, 0] = -0.0
    weight = rng.normal(size=shape[1]).astype(F32) if weighted else None
    ref = _reference(x, weight, 1e-6)
    for threads in (1, 2):
        assert np.array_equal(_bits(_kernel(x, weight, 1e-6, threads)), _bits(ref))


def test_sum_of_squares_is_blocked_not_sequential():
    # 1e4 ** 2 = 1e8 has an fp32 ulp of 8: a sequential sum of it and 63 ones stays 1e8, the
    # blocked order adds the second block's 32 ones as one 32.0
    x = np.ones((1, 64), F32)
    x[0, 0] = 1e4
    sequential = F32(0)
    for v in x[0] * x[0]:
        sequential = F32(sequential + v)
    assert sequential == F32(1e8) and _blocked_sum(x[0] * x[0]) == F32(1e8 + 32)
    got = _kernel(x, None, 0.0)
    assert np.array_equal(_bits(got), _bits(_reference(x, None, 0.0)))
    assert got[0, 1] == F32(1) / np.sqrt(F32(F32(1e8 + 32) / F32(64)))


def test_kernel_rejects_a_weight_of_the_wrong_length():
    with pytest.raises(ValueError, match="weight.shape"):
        _kernel(np.ones((2, 8), F32), np.ones(7, F32), 1e-6)


class _Bare(torch.nn.Module):
    """``x * rsqrt(mean(x ** 2) + eps)`` without a weight (transformers' op order)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def _llama_norm(d):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, d))
    return norm


def _programs(ex):
    return [Program.from_bytes(bytes(m["get_program"]())) for m in tvm_spinn.report_modules(ex)
            if m["get_symbol"]() != "__spinn_manifest__"]


def _run(ex, x):
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("shape", [(2, 3, 64), (1, 300)])
@pytest.mark.parametrize("weighted", [True, False])
def test_decomposed_rmsnorm_fuses_with_the_reference_bits(shape, weighted):
    torch.manual_seed(0)
    model = (_llama_norm(shape[-1]) if weighted else _Bare()).eval()
    x = (torch.randn(*shape) * 2).numpy()
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (torch.from_numpy(x),)), target="spinn")
    offloaded = tvm_spinn.report(ex).offloaded_ops
    assert set(offloaded) == {"spinn.rms_norm" if weighted else "spinn.rms_norm_bare"}, offloaded
    (program,) = _programs(ex)
    assert [layer.kind for layer in program.layers] == ["rms_norm"]
    weight = model.weight.detach().numpy() if weighted else None
    eps = F32(1e-6 if weighted else 1e-5)
    got = _run(ex, x)
    assert np.array_equal(_bits(got), _bits(_reference(x.reshape(-1, shape[-1]), weight, eps).reshape(shape)))
    with torch.no_grad():
        np.testing.assert_allclose(got, model(torch.from_numpy(x)).numpy(), rtol=2e-6, atol=2e-6)


def test_relax_rms_norm_fuses():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 96)).astype(F32)
    w = rng.normal(size=96).astype(F32)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType([4, 96], "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.nn.rms_norm(xv, relax.const(w), axes=[-1], epsilon=1e-5)))
        bb.emit_func_output(y)
    mod = bb.get()
    ex = relax.build(mod, target="spinn")
    assert set(tvm_spinn.report(ex).offloaded_ops) == {"spinn.rms_norm_nn"}
    got = _run(ex, x)
    assert np.array_equal(_bits(got), _bits(_reference(x, w, F32(1e-5))))
    np.testing.assert_allclose(got, _run(relax.build(mod, target="llvm"), x), rtol=2e-6, atol=2e-6)


def _retiled(program: Program, tile) -> Program:
    p = dataclasses.replace(program, mapping=dataclasses.replace(
        program.mapping, layers=(dataclasses.replace(program.mapping.layers[0], tile=tuple(tile)), *program.mapping.layers[1:])))
    return Program.from_bytes(p.to_bytes())


def _one_layer(row: int, target: str, weighted: bool = True) -> Program:
    arch = arch_of(target)
    t = [TensorDesc("x", [1, row], "float32", "input"), TensorDesc("y", [1, row], "float32", "output")]
    consts, constants = {}, {}
    if weighted:
        t.append(TensorDesc("w", [row], "float32", "const"))
        consts, constants = {"weight": 2}, {2: np.linspace(0.5, 1.5, row, dtype=F32)}
    program = Program("main", arch, t, [0], [1], [Layer("rms", "rms_norm", [0], 1, consts, {"epsilon": 1e-5})],
                      constants=constants)
    program = map_program(program, arch)
    return Program.from_bytes(program.to_bytes())  # validated as a runtime reads it


@pytest.mark.parametrize("weighted", [True, False])
def test_split_row_same_bits_every_tiling_and_native(weighted, monkeypatch):
    # a decode step's row on a board: split over PEs (the chosen chunks, chunks of whole
    # blocks, the whole row and chunks straddling blocks all give the same bits)
    program = _one_layer(1024, "spinn/board", weighted)
    tile = list(program.mapping.layers[0].tile)
    assert tile[0] == 1 and tile[1] < 1024, tile
    x = (np.random.default_rng(3).normal(size=(1, 1024)) * 4 + 1).astype(F32)
    ref = _reference(x, program.constants.get(2), F32(1e-5))
    runs = [run_program(program, [x], mode="layers"), run_program(program, [x], mode="tiles"),
            run_program(_retiled(program, [1, 1024]), [x], mode="tiles"),
            run_program(_retiled(program, [1, 2 * LAYER_NORM_BLOCK]), [x], mode="tiles"),  # whole blocks
            run_program(_retiled(program, [1, 100]), [x], mode="tiles")]  # chunks straddling blocks
    monkeypatch.setenv("TVM_SPINN_SIM_NATIVE", "0")
    simulator.forget_plans()
    runs.append(run_program(program, [x], mode="layers"))
    for (got,) in runs:
        assert np.array_equal(_bits(got), _bits(ref))


def test_split_row_chains_block_sums():
    program = _one_layer(1024, "spinn/board")
    arch = arch_of("spinn/board")
    rows = family_of("rms_norm")
    layer = program.layers[0]
    tile = list(program.mapping.layers[0].tile)

    def cycles(t, a=arch):
        lo, hi, _ = rows.expand_regions(program, layer, t)
        return rows.tile_costs(program, layer, a, t, lo, hi)[4]

    chunked, whole = cycles(tile), cycles([1, 1024])
    assert len(chunked) == 1024 // tile[1] > 1 and chunked.max() < whole.max()
    # the chain's terms (what one more cycle per chained add costs): the 32 block sums (and
    # the partials of blocks straddling chunks), far fewer than a chain of the row's 1,024
    # elements (the decomposed graph's sequential mean)
    terms = cycles(tile, arch.replace(m4f_chain_cycles=arch.m4f_chain_cycles + 1)) - chunked
    assert 1024 // LAYER_NORM_BLOCK <= terms.min() and terms.max() < 1024 // 8
    assert 1024 // LAYER_NORM_BLOCK * arch.m4f_chain_cycles <= chunked.min()


def test_split_row_statistic_goes_back_by_multicast():
    # the sum of squares travels the chain one NoC hop per chunk boundary (its adds keep their
    # order); its 1 / sqrt goes back to every chunk as one multicast packet, the routers
    # copying it on: the hops to the farthest chunk's PE, at most twice the chip mesh's radius
    # (Llama-2-70B's 8,192-wide row in 128 chunks), the chain's way back where that is shorter
    program = _one_layer(8192, "spinn/board")
    arch = arch_of("spinn/board")
    rows = family_of("rms_norm")
    layer = program.layers[0]
    radius = arch.noc_hops(arch.pes_per_chip)
    assert 0 < 2 * radius < 127
    for chunk in (64, 2048):
        k = 8192 // chunk
        lo, hi, _ = rows.expand_regions(program, layer, [1, chunk])
        base = rows.tile_costs(program, layer, arch, [1, chunk], lo, hi)[4]
        more = rows.tile_costs(program, layer, arch.replace(noc_hop_cycles=arch.noc_hop_cycles + 1), [1, chunk],
                               lo, hi)[4]
        assert len(base) == k
        # hops per tile: (k - 1) along the chain, then the multicast's
        np.testing.assert_array_equal(more - base, (k - 1) + min(k - 1, 2 * radius))

def test_row_longer_than_a_pe_splits_to_fit():
    # Llama-2-70B's 8,192-wide row (64 KiB of input alone) does not fit one PE's tile SRAM
    # whole: it is chunked in whole blocks that do, even on one chip with rows to spare
    arch = arch_of("spinn")
    assert 2 * 8 * 8192 > arch.tile_sram_bytes
    program = _one_layer(8192, "spinn")
    tile = list(program.mapping.layers[0].tile)
    assert tile[1] < 8192 and tile[1] % LAYER_NORM_BLOCK == 0 and 2 * 8 * tile[1] <= arch.tile_sram_bytes
    x = np.random.default_rng(4).normal(size=(1, 8192)).astype(F32)
    (got,) = run_program(program, [x], mode="tiles")
    assert np.array_equal(_bits(got), _bits(_reference(x, program.constants[2], F32(1e-5))))


@pytest.mark.parametrize("edit,field", [
    (lambda h: h["tensors"][2].update(shape=[7]), "consts.weight"),
    (lambda h: h["layers"][0]["attrs"].update(epsilon=-1.0), "attrs.epsilon"),
    (lambda h: h["layers"][0]["attrs"].pop("epsilon"), "attrs"),
    (lambda h: h["layers"][0]["consts"].update(gamma=2), "consts"),
])
def test_validation_names_the_field(edit, field):
    import json

    from test_program_validation import seal, split

    version, header, blob = split(_one_layer(64, "spinn").to_bytes())
    header = json.loads(json.dumps(header))
    edit(header)
    with pytest.raises(ProgramError, match=rf"layers\[0\]\.{field}"):
        Program.from_bytes(seal(header, blob, version))


@pytest.mark.slow  # ~4 s; the fast variant: test_llm.py::test_llama_rmsnorms_run_fused
def test_llama_norms_fuse_and_match_pytorch():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=128, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights that are not all ones
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.weight.uniform_(0.5, 1.5)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False).logits

    ids = torch.randint(0, 128, (1, 6))
    ex = relax.build(tvm_spinn.frontend.from_pytorch(Logits().eval(), (ids,)), target="spinn")
    kinds = [layer.kind for program in _programs(ex) for layer in program.layers]
    assert kinds.count("rms_norm") == 2 * cfg.num_hidden_layers + 1 and "mean" not in kinds
    assert "spinn.mean" not in tvm_spinn.report(ex).offloaded_ops
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(ids.numpy()))
    got = (got[0] if isinstance(got, (list, tuple)) or hasattr(got, "__getitem__") and not hasattr(got, "numpy") else got).numpy()
    with torch.no_grad():
        ref = Logits()(ids).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
