"""``tvm_spinn.llm.compile``: greedy generation with a KV cache on a spinn system.

A model is compiled into two Relax executables from the wrappers of :mod:`.graphs`: a prefill
per prompt length (built on first use, then kept) and one decode step. The KV cache is a
pair of fixed-size tensors that stay on the device between calls: each step takes the cache
the previous one returned, so shapes are static and the offloaded GEMMs and softmaxes run on
the simulated PEs. Timing comes from the simulator's timing model (:func:`tvm_spinn.report`)
of the offloaded programs: the time to first token is the prefill's latency, a decode step's
latency the time per output token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .spec import CAUSAL_LM, LLMError, ModelSpec, spec_of

__all__ = ["compile", "CompiledLLM", "GenerationReport"]


@dataclass(frozen=True)
class GenerationReport:
    """Simulated timing of generation (the offloaded programs; host fallback time excluded)."""

    system: str
    chips: int
    batch: int
    max_seq_len: int
    prompt_len: int
    dtype: str
    ttft_s: float
    decode_latency_s: float
    tokens_per_s_per_user: float
    tokens_per_s: float
    energy_per_token_j: float
    prefill_energy_j: float

    def __str__(self) -> str:
        return (f"generation on {self.system} ({self.chips} chip{'s' if self.chips != 1 else ''}), "
                f"batch {self.batch}, {self.dtype}, prompt {self.prompt_len}, cache {self.max_seq_len}: "
                f"TTFT {self.ttft_s * 1e3:.3f} ms, decode {self.decode_latency_s * 1e3:.3f} ms/token, "
                f"{self.tokens_per_s_per_user:.1f} tokens/s per user, {self.tokens_per_s:.1f} tokens/s in all, "
                f"{self.energy_per_token_j * 1e3:.4f} mJ/token")


def _ids_array(input_ids) -> np.ndarray:
    if hasattr(input_ids, "detach"):  # torch
        input_ids = input_ids.detach().cpu().numpy()
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise LLMError(f"input_ids must have shape (batch, n), got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise LLMError(f"input_ids must be integers, got dtype {ids.dtype}")
    return ids.astype(np.int64)


class CompiledLLM:
    """A transformers decoder compiled for a spinn target with a fixed-size KV cache.

    Build it with :func:`compile`. ``generate`` is greedy decoding;
    ``report`` the simulated timing of the last prompt length used (or of ``prompt_len``).
    """

    def __init__(self, model, spec: ModelSpec, target, max_seq_len: int, batch: int,
                 quantize: "str | None", calibration_prompt_len: int, seed: int, verbose: bool = False):
        self.model = model
        self.spec = spec
        self.target = target
        self.max_seq_len = max_seq_len
        self.batch = batch
        self.dtype = "int8" if quantize else "fp32"
        self._scheme = quantize
        self._calib_len = calibration_prompt_len
        self._seed = seed
        self._verbose = verbose
        self._prefill: dict[int, tuple] = {}
        #: the steps' concatenated q/k/v and gate/up weights, shared by every prefill and the decode step
        self._fused: dict = {}
        self._decode = None
        self._last_prompt_len = None

    # -- building ---------------------------------------------------------------------------
    def _fuses(self) -> bool:
        """Whether the steps run the projections that read one input as one GEMM each
        (:class:`~tvm_spinn.llm.graphs.Decode`'s ``fuse``): their outputs' bits are the separate
        GEMMs' in float32 and with per-channel int8 weights, but a per-tensor weight scale would
        be one for the concatenated weights, so such a scheme keeps them apart."""
        if not self._scheme:
            return True
        from ..quant.scheme import as_scheme

        return as_scheme(None if self._scheme is True else self._scheme).per_channel

    def _extra(self, positions: np.ndarray) -> list[np.ndarray]:
        import torch

        if self.spec.family == "gpt2":
            return [positions.astype(np.int64)]
        from .graphs import rotary_tables

        cos, sin = rotary_tables(self.model, torch.from_numpy(positions.astype(np.int64)))
        return [cos.numpy().astype(np.float32), sin.numpy().astype(np.float32)]

    def _calibration(self, make_args, count: int = 4) -> list:
        """Inputs for int8 calibration: prompts of random tokens (seeded) run through the step."""
        rng = np.random.default_rng(self._seed)
        return [make_args(rng) for _ in range(count)]

    def _build(self, wrapper, args: list, calib=None):
        import torch
        import tvm
        from tvm import relax

        from .. import frontend

        from .._quiet import quiet

        tensors = tuple(torch.from_numpy(a) for a in args)
        with quiet(self._verbose):  # torch's per-export warnings, per-op partition notes
            mod = frontend.from_pytorch(wrapper, tensors)
            if self._scheme:
                mod = _quantize_weights(mod, calib, self._scheme)
            ex = relax.build(mod, target=self.target)
        return ex, relax.VirtualMachine(ex, tvm.cpu())

    def _prefill_args(self, ids: np.ndarray) -> list[np.ndarray]:
        b, n = ids.shape
        positions = np.broadcast_to(np.arange(n, dtype=np.int64), (b, n))
        return [ids, *self._extra(positions)]

    def _decode_args(self, tok: np.ndarray, position: int) -> list[np.ndarray]:
        b = tok.shape[0]
        S = self.spec.cache_slots(self.max_seq_len)
        # position p lives in slot p % S (a ring when a sliding window keeps fewer slots than
        # positions); the slots written so far are the keys the query attends to
        write = np.arange(S) == position % S
        seen = np.arange(S) <= position
        if self.spec.sliding_window is not None and self.spec.global_layers:
            # global and windowed layers over one cache of every position (slot = position): a
            # mask per kind, the windowed one admitting the last `sliding_window` positions
            seen = np.stack([seen, seen & (np.arange(S) > position - self.spec.sliding_window)])
        mask = np.where(seen, np.float32(0), np.finfo(np.float32).min).astype(np.float32)
        return [tok, write, mask, *self._extra(np.full((b, 1), position, dtype=np.int64))]

    def _cache_shapes(self) -> tuple:
        """K^T and V cache shapes (see :mod:`.graphs`): ``max_seq_len`` slots, or the sliding window's."""
        s = self.spec
        rows = self.batch * s.kv_heads
        slots = s.cache_slots(self.max_seq_len)
        return (s.layers, rows, s.head_dim, slots), (s.layers, rows, slots, s.head_dim)

    def prefill_executable(self, prompt_len: int):
        """The (executable, VM) of the prefill for ``prompt_len`` tokens, built on first use."""
        if prompt_len not in self._prefill:
            from .graphs import Prefill

            wrapper = Prefill(self.model, self.spec, self.max_seq_len, prompt_len, fuse=self._fuses(), fused_cache=self._fused).eval()
            ids = np.zeros((self.batch, prompt_len), dtype=np.int64)
            calib = None
            if self._scheme:
                calib = self._calibration(lambda rng: self._prefill_args(
                    rng.integers(0, self.spec.vocab, (self.batch, prompt_len))))
            self._prefill[prompt_len] = self._build(wrapper, self._prefill_args(ids), calib)
        return self._prefill[prompt_len]

    def decode_executable(self):
        """The (executable, VM) of one decode step, built on first use."""
        if self._decode is None:
            from .graphs import Decode

            wrapper = Decode(self.model, self.spec, self.max_seq_len, fuse=self._fuses(), fused_cache=self._fused).eval()
            tok = np.zeros((self.batch, 1), dtype=np.int64)
            k_zeros, v_zeros = (np.zeros(shape, dtype=np.float32) for shape in self._cache_shapes())
            calib = None
            if self._scheme:
                calib = self._calibration_decode()

            def args(a):
                return [a[0], k_zeros, v_zeros, *a[1:]]

            self._decode = self._build(wrapper, args(self._decode_args(tok, 0)), calib)
        return self._decode

    def _calibration_decode(self) -> list:
        """Decode calibration samples with real caches: a random prompt prefilled in torch."""
        import torch

        from .graphs import Prefill

        rng = np.random.default_rng(self._seed + 1)
        n = min(self._calib_len, self.max_seq_len - 1)
        samples = []
        for _ in range(4):
            ids = rng.integers(0, self.spec.vocab, (self.batch, n))
            # (torch's own arithmetic: the model's projections as they are)
            pre = Prefill(self.model, self.spec, self.max_seq_len, n, fuse=False).eval()
            with torch.no_grad():
                logits, k, v = pre(*(torch.from_numpy(a) for a in self._prefill_args(ids)))
            tok = logits.argmax(-1, keepdim=True).numpy()
            a = self._decode_args(tok, n)
            samples.append([a[0], k.numpy(), v.numpy(), *a[1:]])
        return samples

    # -- generation -------------------------------------------------------------------------
    def check_prompt(self, ids: np.ndarray, max_new_tokens: int) -> None:
        """Raise :class:`LLMError` when ``ids`` / ``max_new_tokens`` do not fit this compile."""
        b, n = ids.shape
        if b != self.batch:
            raise LLMError(f"input_ids has batch {b}, but the KV cache was compiled for batch={self.batch}")
        if n < 1:
            raise LLMError("input_ids is empty: give at least one prompt token")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise LLMError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if n + max_new_tokens - 1 > self.max_seq_len:
            raise LLMError(f"prompt of {n} tokens + max_new_tokens={max_new_tokens} needs a cache of "
                           f"{n + max_new_tokens - 1} positions, longer than max_seq_len={self.max_seq_len}")
        if ids.min() < 0 or ids.max() >= self.spec.vocab:
            raise LLMError(f"input_ids holds token ids outside [0, vocab_size={self.spec.vocab})")

    def generate(self, input_ids, max_new_tokens: int):
        """Greedy decoding: the prompt followed by ``max_new_tokens`` new tokens.

        Parameters
        ----------
        input_ids : numpy.ndarray or torch.Tensor
            Integer token ids of shape ``(batch, n)`` (``batch`` as compiled).
        max_new_tokens : int
            Number of tokens to generate (no early stop at an end-of-sequence token).

        Returns
        -------
        numpy.ndarray or torch.Tensor
            ``(batch, n + max_new_tokens)`` int64, the type of ``input_ids``.
        """
        is_torch = hasattr(input_ids, "detach")
        ids = _ids_array(input_ids)
        self.check_prompt(ids, max_new_tokens)
        self._last_prompt_len = ids.shape[1]
        tokens = [ids]

        def greedy(step, logits):
            tokens.append(np.argmax(logits, axis=-1).astype(np.int64)[:, None])
            return tokens[-1] if step < max_new_tokens - 1 else None

        self._decode_loop(ids, greedy)
        result = np.concatenate(tokens, axis=1)
        if is_torch:
            import torch

            return torch.from_numpy(result)
        return result

    def score(self, input_ids, prefill: int) -> np.ndarray:
        """Logits at positions ``prefill - 1 .. n - 1`` of ``input_ids`` ``(batch, n)``: a prefill
        of the first ``prefill`` tokens, then one decode step per further token, each fed the
        given token (teacher forcing) rather than the predicted one; ``(batch, n - prefill + 1,
        vocab)`` float32."""
        ids = _ids_array(input_ids)
        n = ids.shape[1]
        if not 1 <= prefill <= n:
            raise LLMError(f"prefill must be in [1, {n}] (the sequence's length), got {prefill}")
        self.check_prompt(ids[:, :prefill], n - prefill + 1)
        steps = []

        def given(step, logits):
            steps.append(logits)
            return ids[:, prefill + step:prefill + step + 1] if prefill + step < n else None

        self._decode_loop(ids[:, :prefill], given)
        return np.stack(steps, axis=1).astype(np.float32)

    def _decode_loop(self, prompt: np.ndarray, feed) -> None:
        """Prefill ``prompt``, then decode while ``feed(step, logits)`` returns the next tokens
        ``(batch, 1)`` (None ends). The cache goes back in as the tensors the last step
        returned: it stays on the device."""
        import tvm

        n = prompt.shape[1]
        _, prefill = self.prefill_executable(n)
        _, decode = self.decode_executable()
        dev = tvm.cpu()
        out = prefill["main"](*(tvm.runtime.tensor(a, dev) for a in self._prefill_args(prompt)))
        logits, k_cache, v_cache = out[0], out[1], out[2]
        step = 0
        while (tok := feed(step, logits.numpy())) is not None:
            args = self._decode_args(tok, n + step)
            out = decode["main"](tvm.runtime.tensor(args[0], dev), k_cache, v_cache,
                                 *(tvm.runtime.tensor(a, dev) for a in args[1:]))
            logits, k_cache, v_cache = out[0], out[1], out[2]
            step += 1

    def report(self, prompt_len: "int | None" = None) -> GenerationReport:
        """Simulated timing: time to first token (prefill), decode latency, tokens/s, energy.

        ``prompt_len`` defaults to the last prompt length generated (building that prefill if
        needed); the decode step is the same for every position (it attends over the whole
        fixed-size cache, masked), so its latency is that of any token.
        """
        from ..report import report as spinn_report

        n = prompt_len or self._last_prompt_len
        if n is None:
            raise LLMError("report() needs prompt_len (no generate() call yet)")
        if n > self.max_seq_len:
            raise LLMError(f"prompt_len={n} is longer than max_seq_len={self.max_seq_len}")
        pre = spinn_report(self.prefill_executable(n)[0])
        dec = spinn_report(self.decode_executable()[0])
        per_token = dec.latency_s
        return GenerationReport(
            system=dec.system, chips=dec.chips, batch=self.batch, max_seq_len=self.max_seq_len,
            prompt_len=n, dtype=self.dtype, ttft_s=pre.latency_s, decode_latency_s=per_token,
            tokens_per_s_per_user=1.0 / per_token if per_token else float("inf"),
            tokens_per_s=self.batch / per_token if per_token else float("inf"),
            energy_per_token_j=dec.energy_j / self.batch, prefill_energy_j=pre.energy_j)


def _quantize_weights(mod, calib, scheme):
    """int8 post-training quantization of a prefill or decode step's weight GEMMs.

    The attention matmuls (query x K^T, probabilities x V) stay float32, as the KV cache they
    read: the cache is a float32 tensor carried from step to step, so quantizing an attention
    matmul's cache operand would quantize every slot of the cache again at every step (two
    cache-sized quantize layers a block), where the weights are quantized once, at build time.
    """
    import dataclasses

    from ..quant import quantize
    from ..quant.scheme import as_scheme

    scheme = as_scheme(None if scheme is True else scheme)
    return quantize(mod, calib, scheme=dataclasses.replace(scheme, activation_matmuls=False))


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LLMError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def compile(model, target="spinn", max_seq_len: int = 128, batch: int = 1, quantize=None,
            calibration_prompt_len: int = 8, seed: int = 0, verbose: bool = False) -> CompiledLLM:
    """Compile a transformers GPT-2, Llama, Mistral, Qwen2, Phi-3, Gemma-2, Mixtral, GPT-J or
    Falcon causal LM for greedy generation on a spinn target.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
        ``Phi3ForCausalLM``, ``Gemma2ForCausalLM``, ``MixtralForCausalLM``, ``GPTJForCausalLM`` or
        ``FalconForCausalLM``
        (:data:`~tvm_spinn.llm.spec.CAUSAL_LM`; ``use_cache`` may be left at its default:
        the cache is this package's own). Its weights are used as they are (shared, not copied);
        the model and its config are left unchanged (training mode, attention implementation).
    target : str or tvm.target.Target
        A spinn target (``"spinn"``, ``"spinn/board"``, ...).
    max_seq_len : int
        Positions of a sequence: prompt plus generated tokens must fit (and at most the model's
        ``max_position_embeddings`` / ``n_positions``). The KV cache holds as many slots, or
        the model's sliding window where that is shorter.
    batch : int
        Sequences generated together (the cache's batch dimension).
    quantize : None, True or str
        ``None``: float32. ``True`` or a scheme string (:func:`tvm_spinn.quantize`): int8 weight
        GEMMs (the projections, MLPs and LM head), each step calibrated on seeded random prompts;
        the attention matmuls stay float32, as the KV cache they read (the scheme's
        ``activation_matmuls`` is not used).
    calibration_prompt_len, seed : int
        Prompt length and seed of the calibration prompts (int8 only).
    verbose : bool
        Show the libraries' warnings and per-operator notes of the builds (torch's export
        warnings, operators left on the fallback), hidden by default; so does the environment
        variable ``TVM_SPINN_VERBOSE=1`` (:mod:`tvm_spinn._quiet`). The hiding is scoped to the
        builds: the caller's warning filters and logger levels are left as they were.

    Returns
    -------
    CompiledLLM
        Executables are built lazily by the first ``generate`` / ``report``.

    Raises
    ------
    LLMError
        Unknown ``model_type``, a bad ``max_seq_len`` / ``batch``, or a cache longer than the
        model's position table.
    """
    from ..target import get_target

    spec = spec_of(model)
    max_seq_len = _check_positive("max_seq_len", max_seq_len)
    batch = _check_positive("batch", batch)
    if max_seq_len > spec.max_positions:
        raise LLMError(f"max_seq_len={max_seq_len} is longer than the model's position table "
                       f"(config max positions {spec.max_positions})")
    if not hasattr(model, "lm_head"):
        raise LLMError(f"model {type(model).__name__} has no lm_head: pass the causal-LM class "
                       f"({', '.join(sorted(set(CAUSAL_LM.values())))})")
    model = _private_copy(model)
    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        # the wrappers spell attention out themselves; eager keeps the copy's own forward the same
        model.config._attn_implementation = "eager"
    model.eval()
    return CompiledLLM(model, spec, get_target(target), max_seq_len, batch, quantize,
                       calibration_prompt_len, seed, verbose=bool(verbose))


def _private_copy(model):
    """A copy of ``model``'s module tree and config that shares its parameter and buffer tensors
    (no weight is copied): compiling switches the copy to eval mode and eager attention, and the
    caller's model and config stay as they were."""
    import copy
    import itertools

    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, shared)
