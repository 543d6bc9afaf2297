"""``tvm_spinn.llm.plan``: time a language model on a spinn system from its config alone.

No weight is materialized and the functional simulator never runs: the model is built on the
``meta`` device, one transformer block (decode over a ``seq``-slot KV cache, and prefill of a
``seq``-token prompt) and the head are described with shape/dtype-only weights
(:mod:`.describe`), mapped by the normal mapping compiler and timed by its timing model. The
blocks of a model are identical, so the block is planned once and scaled by the layer count
(``plan["scaled_from_one_layer"]``).

Two placements are compared and the faster one is kept (both are in ``plan["alternatives"]``):

* ``shared``: every block on the same chips (the whole system, at most :data:`SHARED_MAX_CHIPS`),
  one after another, streaming its weights from those chips' DRAM (weights and KV cache striped
  over every chip's DRAM): their weights together do not fit the SRAM;
* ``groups`` (systems with more chips than blocks): the chips are split into ``layers + 1``
  equal groups (whole boards once a group is larger than a board), one per block and one for
  the head, so each group's SRAM serves one block and the mapper keeps as many of its weights
  resident as pays off; a token passes through the groups in order, the hidden state handed
  over between consecutive groups on the link graph
  (:func:`tvm_spinn.timing.collectives.point_to_point`).

Bounds (per-user decode steps per second): compute (GEMM operations at the chips' peak), DRAM
(bytes that must cross DRAM per token over the DRAM bandwidth of the chips used), SRAM (resident
weights read once per token at the PEs' DMA bandwidth, an assumption of the timing model) and
links (the hand-overs); ``binding`` names the largest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass

from .spec import LLMError, ModelSpec, spec_of

__all__ = ["Plan", "plan", "DTYPES"]

DTYPES = {"fp32": 4, "int8": 1}
#: Largest chip count a block is mapped over in the shared placement (24 boards)
SHARED_MAX_CHIPS = 24 * 48


@dataclass(frozen=True)
class Plan:
    """Planned LLM inference on a spinn system (timing model; no weights, no simulation)."""

    model: str
    system: str
    chips: int
    batch: int
    seq: int
    dtype: str
    tokens_per_s_per_user: float
    tokens_per_s: float
    ttft_s: float
    decode_latency_s: float
    energy_per_token_j: float
    chips_used: int
    sram_bytes_per_chip: int
    dram_bytes_per_chip: int
    weight_bytes: int
    kv_cache_bytes: int
    bound_tokens_per_s: float
    binding: str
    bounds_s: dict
    plan: dict
    plan_seconds: float

    @property
    def bound_ratio(self) -> float:
        """Achieved per-user tokens/s over the bound."""
        return self.tokens_per_s_per_user / self.bound_tokens_per_s if self.bound_tokens_per_s else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["bound_ratio"] = self.bound_ratio
        return out

    def table(self) -> str:
        rows = [
            ("model", self.model), ("system", f"{self.system} ({self.chips} chips)"),
            ("batch / seq / dtype", f"{self.batch} / {self.seq} / {self.dtype}"),
            ("placement", f"{self.plan['placement']}: {self.plan['description']}"),
            ("chips used", f"{self.chips_used}"),
            ("tokens/s per user", f"{self.tokens_per_s_per_user:.3f}"),
            ("tokens/s (aggregate)", f"{self.tokens_per_s:.3f}"),
            ("decode latency", f"{self.decode_latency_s * 1e3:.3f} ms/token"),
            ("time to first token", f"{self.ttft_s * 1e3:.3f} ms"),
            ("energy per token", f"{self.energy_per_token_j:.4g} J"),
            ("bound (per user)", f"{self.bound_tokens_per_s:.3f} tokens/s, {self.binding}-bound "
                                 f"({self.bound_ratio:.2f} of it reached)"),
            ("SRAM per chip", f"{self.sram_bytes_per_chip / 2**20:.2f} MiB"),
            ("DRAM per chip", f"{self.dram_bytes_per_chip / 2**30:.3f} GiB"),
            ("weights / KV cache", f"{self.weight_bytes / 1e9:.3f} GB / {self.kv_cache_bytes / 1e9:.3f} GB"),
            ("planned", f"one layer scaled by {self.plan['layers']} layers, in {self.plan_seconds:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def __str__(self) -> str:
        return self.table()


def _config_dict(config) -> dict:
    from .spec import _as_dict

    return _as_dict(config)


def _meta_model(cfg: dict, spec: ModelSpec):
    """The model with one block, on the meta device (no weight memory)."""
    import torch
    import transformers

    one = dict(cfg)
    one["num_hidden_layers" if spec.family == "llama" else "n_layer"] = 1
    one.pop("architectures", None)
    model_type = one.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **one)
    config._attn_implementation = "eager"
    cls = transformers.LlamaForCausalLM if spec.family == "llama" else transformers.GPT2LMHeadModel
    with torch.device("meta"):
        return cls(config).eval()


def _parts(model, spec: ModelSpec, batch: int, seq: int):
    """(name, module, example args) of the decode block, the prefill block and the head."""
    import torch

    from .graphs import Head, LayerStep

    b, s, h, d, kvh = batch, seq, spec.hidden, spec.head_dim, spec.kv_heads
    rope = spec.family == "llama"
    with torch.device("meta"):
        dec_args = [torch.zeros(b, 1, h), torch.zeros(b * kvh, d, s), torch.zeros(b * kvh, s, d),
                    torch.zeros(s, dtype=torch.bool), torch.zeros(s)]
        pre_args = [torch.zeros(b, s, h), torch.zeros(s, s)]
        if rope:
            dec_args += [torch.zeros(b, 1, d), torch.zeros(b, 1, d)]
            pre_args += [torch.zeros(b, s, d), torch.zeros(b, s, d)]
        head_args = [torch.zeros(b, 1, h)]
    return [("decode", LayerStep(model, spec, s).eval(), tuple(dec_args)),
            ("prefill", LayerStep(model, spec, s, prompt_len=s).eval(), tuple(pre_args)),
            ("head", Head(model, spec, s).eval(), tuple(head_args))]


def _clone(program):
    """A copy to map once more (descriptor constants shared: they hold no data)."""
    return dataclasses.replace(
        program, tensors=[dataclasses.replace(t) for t in program.tensors],
        layers=[dataclasses.replace(layer, consts=dict(layer.consts), attrs=dict(layer.attrs)) for layer in program.layers],
        inputs=list(program.inputs), outputs=list(program.outputs), constants=dict(program.constants),
        timing={}, mapping={}, memory={}, tiles=None)


@dataclass(frozen=True)
class _Timed:
    latency_s: float
    energy_j: float
    weight_bytes: int
    resident_bytes: int
    peak_pe_bytes: int
    chips: int


def _map(described, arch, weights: str) -> _Timed:
    from ..mapping import MappingOptions
    from ..mapping.schedule import map_program

    lat = energy = 0.0
    wbytes = resident = peak = chips = 0
    for d in described:
        program = _clone(d.program)
        program.arch = arch.to_dict()
        with MappingOptions(weights=weights):
            map_program(program, arch)
        t = program.timing
        lat += t["latency_s"]
        energy += t["energy_j"]
        wbytes += d.weight_bytes
        resident += int(program.memory.get("resident_bytes_total", 0))
        peak = max(peak, int(program.memory.get("peak_bytes_max", 0)))
        chips = max([chips] + [int(row["chips"]) for row in t["layers"]])
    return _Timed(lat, energy, wbytes, resident, peak, chips)


def _smallest_fitting(need: int, arch) -> str:
    from ..target import arch_of, known_targets

    per_board = arch.chips_per_board * arch.dram_bytes
    fits = sorted((arch_of(t).chips, t) for t in known_targets()
                  if arch_of(t).chips * arch_of(t).dram_bytes >= need and arch_of(t).clock_hz == arch.clock_hz)
    boards = math.ceil(need / per_board)
    named = f"; smallest registered target that fits: {fits[0][1]}" if fits else ""
    return f"it needs at least {boards} board(s) (tvm_spinn.make_system(boards={boards})){named}"


def plan(config, target="spinn/board", batch: int = 1, seq: int = 2048, dtype: str = "int8",
         progress: bool = False) -> Plan:
    """Plan greedy decoding of a transformers model (config only) on a spinn system.

    Parameters
    ----------
    config : str, dict, transformers config or model
        A ``config.json`` path (``model_type`` ``llama`` or ``gpt2``), its dict, or a config object.
    target : str or tvm.target.Target
        The spinn system (``spinn``, ``spinn/board``, ``spinn/cloud``, a registered system).
    batch : int
        Users decoding together.
    seq : int
        Context length: the prompt prefilled for the time to first token, and the KV-cache
        slots each decode step attends over.
    dtype : {"int8", "fp32"}
        Arithmetic and storage of the weight GEMMs (attention and KV cache stay fp32).
    progress : bool
        Show a progress bar (tqdm) over the planning steps.

    Returns
    -------
    Plan

    Raises
    ------
    LLMError
        Unknown ``model_type`` or a bad config field, ``seq`` beyond the model's positions,
        bad ``batch`` / ``dtype``, or a model (weights + KV cache) too large for the system's
        DRAM (the message names the smallest system that fits).
    """
    from ..target import arch_of, get_target
    from .describe import describe

    start = time.perf_counter()
    cfg = _config_dict(config)
    spec = spec_of(cfg)
    import os

    model_name = (os.path.splitext(os.path.basename(os.fspath(config)))[0] if isinstance(config, (str, os.PathLike))
            else str(cfg.get("_name_or_path") or spec.family))
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LLMError(f"{name} must be an integer >= 1, got {value!r}")
    if seq > spec.max_positions:
        raise LLMError(f"seq={seq} is longer than the model's position table (config max positions "
                       f"{spec.max_positions})")
    if dtype not in DTYPES:
        raise LLMError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    target = get_target(target)
    arch = arch_of(target)
    weight_bytes = spec.params * DTYPES[dtype]
    kv_bytes = batch * seq * spec.kv_bytes_per_token(4)
    if weight_bytes + kv_bytes > arch.chips * arch.dram_bytes:
        raise LLMError(
            f"model too large for target {arch.name} ({arch.chips} chips, {arch.chips * arch.dram_bytes / 1e9:.1f} GB "
            f"DRAM): {dtype} weights {weight_bytes / 1e9:.1f} GB + KV cache {kv_bytes / 1e9:.2f} GB (batch={batch}, "
            f"seq={seq}); {_smallest_fitting(weight_bytes + kv_bytes, arch)}")

    from tqdm.auto import tqdm

    steps = tqdm(total=5, desc=f"plan {model_name} on {arch.name}",
                 disable=not progress, leave=False)
    model = _meta_model(cfg, spec)
    described = {}
    for name, module, args in _parts(model, spec, batch, seq):
        steps.set_postfix_str(f"describe {name}")
        described[name] = describe(module, args, target, dtype)
        steps.update()

    L = spec.layers
    candidates = []
    if arch.chips >= L + 1:
        # one group of chips per block (and one for the head), whole boards once larger than a
        # board: each group's SRAM holds only its block, so the mapper may keep its weights resident
        group = arch.chips // (L + 1)
        if group > arch.chips_per_board:
            group -= group % arch.chips_per_board
        candidates.append(("groups", group, L + 1, "auto"))
    # every block on the same chips: their weights together exceed the SRAM, so they stream from
    # DRAM; at most SHARED_MAX_CHIPS chips (mapping one block over more is not practical yet)
    shared = min(arch.chips, SHARED_MAX_CHIPS)
    if shared * arch.dram_bytes >= weight_bytes + kv_bytes:
        candidates.append(("shared", shared, 1, "stream"))
    results = {}
    for placement, group, groups, weights_mode in candidates:
        steps.set_postfix_str(f"map: {placement} on {group} chips")
        sub = arch if group == arch.chips else arch.replace(chips=group, name=f"{arch.name}[{group} chips]")
        dec, pre, head = (_map(described[k], sub, weights_mode) for k in ("decode", "prefill", "head"))
        handoff_dec = handoff_pre = 0.0
        if placement == "groups":
            from ..target.topology import topology_of
            from ..timing.collectives import point_to_point

            topo = topology_of(arch)

            def handoff(nbytes):  # the hidden state from each group to the next, one after another
                return sum(point_to_point(topo, [i * group], [(i + 1) * group], nbytes).seconds for i in range(L))

            handoff_dec = handoff(batch * spec.hidden * 4)
            handoff_pre = handoff(batch * seq * spec.hidden * 4)
        results[placement] = dict(
            decode_s=L * dec.latency_s + head.latency_s + handoff_dec,
            ttft_s=L * pre.latency_s + head.latency_s + handoff_pre, dec=dec, pre=pre, head=head, group=group,
            groups=groups, weights_mode=weights_mode, handoff_dec=handoff_dec)
        steps.update()
    steps.close()
    placement = min(results, key=lambda k: (results[k]["decode_s"], k))
    best = results[placement]
    decode_s, ttft_s, dec, pre, head = (best[k] for k in ("decode_s", "ttft_s", "dec", "pre", "head"))
    group, groups, weights_mode, handoff_dec = (best[k] for k in ("group", "groups", "weights_mode", "handoff_dec"))
    used = group * groups
    resident = L * dec.resident_bytes + head.resident_bytes
    streamed = max(0, weight_bytes - resident) if placement == "groups" else weight_bytes
    weights_in = ("sram" if streamed == 0 else "dram" if resident == 0 else
                  f"sram+dram ({resident / weight_bytes:.0%} resident)")
    # bounds on one decode step over the chips used
    gemm_ops = 2 * batch * (spec.params - (spec.vocab * spec.hidden if not spec.tied_embeddings else 0)
                            - (spec.max_positions * spec.hidden if spec.family == "gpt2" else 0))
    attn_flops = 2 * 2 * batch * L * spec.heads * spec.head_dim * seq
    # a token visits the groups one after another: each block has only its group's resources
    share = used if placement == "shared" else group
    peak = arch.peak_int8_ops_s if dtype == "int8" else arch.peak_fp32_flops_s
    bounds = {
        "compute": (gemm_ops / peak + attn_flops / arch.peak_fp32_flops_s) * arch.chips / share,
        "dram": (streamed + kv_bytes) / (arch.dram_bw_bytes_s * share),
        "sram": resident / (share * arch.pes_per_chip * arch.dma_bw_bytes_per_cycle * arch.clock_hz),
        "links": handoff_dec,
    }
    binding = max(bounds, key=bounds.get)
    bound_s = max(bounds["compute"], bounds["dram"], bounds["sram"]) + bounds["links"]
    described_groups = (f"{L} blocks + head on {groups} groups of {group} chips, a token passing through "
                        "them in order (hidden state handed over on the links)" if placement == "groups" else
                        f"all {L} blocks and the head on all {group} chips, one after another")
    meta = {
        "placement": placement, "description": f"{described_groups}; weights in {weights_in}, KV cache in DRAM",
        "layers": L, "scaled_from_one_layer": True, "chips_per_group": group, "groups": groups,
        "weights_in": weights_in, "resident_weight_bytes": resident, "kv_cache_in": "dram",
        "attention_dtype": "fp32", "mapping_weights": weights_mode,
        "block_decode_s": dec.latency_s, "block_prefill_s": pre.latency_s, "head_decode_s": head.latency_s,
        "handoff_decode_s": handoff_dec,
        "alternatives": {k: {"decode_s": v["decode_s"], "ttft_s": v["ttft_s"], "chips": v["group"] * v["groups"]}
                         for k, v in sorted(results.items())},
        "timing": "tvm_spinn timing model of the mapped programs (no simulation, no weights)",
    }
    return Plan(
        model=model_name, system=arch.name, chips=arch.chips, batch=batch, seq=seq, dtype=dtype,
        tokens_per_s_per_user=1.0 / decode_s, tokens_per_s=batch / decode_s, ttft_s=ttft_s,
        decode_latency_s=decode_s, energy_per_token_j=(L * dec.energy_j + head.energy_j) / batch,
        chips_used=used, sram_bytes_per_chip=int(max(dec.peak_pe_bytes, pre.peak_pe_bytes, head.peak_pe_bytes)
                                                  * arch.pes_per_chip),
        dram_bytes_per_chip=int(math.ceil((streamed + kv_bytes) / used)), weight_bytes=weight_bytes,
        kv_cache_bytes=kv_bytes, bound_tokens_per_s=1.0 / bound_s, binding=binding, bounds_s=bounds, plan=meta,
        plan_seconds=time.perf_counter() - start)


def write_json(result: Plan, path: str) -> None:
    """Write ``result.to_dict()`` to ``path`` atomically (a temporary file renamed into place)."""
    from .._files import atomic_write

    text = json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
