"""Generated PE code for the row kernels (softmax, layer_norm, rms_norm) and the activations on
the exp model, run in the instruction-set simulator: bitwise equal to the simulator's C++
kernels, alone over several shapes (whole rows and rows split over PEs), on their own
arithmetic edge cases, and in a small transformer block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tvm import relax

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

import tvm_spinn  # noqa: E402
from tvm_spinn.pe import run_program_iss  # noqa: E402
from tvm_spinn.pe import view  # noqa: E402
from tvm_spinn.pe.images import role_image  # noqa: E402
from tvm_spinn.pe.iss import PeMachine  # noqa: E402
from tvm_spinn.program.ops.elementwise import exp_f32  # noqa: E402
from tvm_spinn.program.ops.rows import _layer_norm, _rms_norm, _softmax  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402

_F32 = np.float32


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_F32).view(np.uint32)


def _assert_bits(want: np.ndarray, got: np.ndarray):
    """Bitwise equality, NaN signs and payloads included."""
    assert want.shape == got.shape and want.dtype == got.dtype == _F32
    wb, gb = _bits(want).reshape(-1), _bits(got).reshape(-1)
    diff = np.flatnonzero(wb != gb)
    assert diff.size == 0, (f"{diff.size} of {wb.size} differ, first at {diff[:5]}: simulator "
                            f"{[hex(v) for v in wb[diff[:5]]]} iss {[hex(v) for v in gb[diff[:5]]]}")


# -- the kernels alone, on one PE ---------------------------------------------------------------
class _Rows:
    """One row kernel's image on one PE, run on whole rows [rows, cols] (every phase, one run)."""

    PHASES = {"softmax": 3, "layer_norm": 3, "rms_norm": 2}

    def __init__(self, kind: str):
        self.kind = kind
        image = role_image((kind,))
        self.m = PeMachine(image.elf, image.name, 0, 24)

    def run(self, x, *consts, eps=0.0, phases=None, st=None):
        rows, cols = x.shape
        m = self.m
        m.load()
        sizes = [4 * x.size, 4 * x.size, 16 * rows] + [4 * cols] * (len(consts) or (2 if self.kind == "layer_norm" else 1))
        bufs, pos = [], m.arena
        for size in sizes:
            bufs.append(pos)
            pos += -(-max(size, 4) // 64) * 64
        m.write(bufs[0], np.ascontiguousarray(x, dtype=_F32).tobytes())
        bits = 0
        for i, c in enumerate(consts):
            if c is not None:
                m.write(bufs[3 + i], np.ascontiguousarray(c, dtype=_F32).tobytes())
                bits |= 4 << i
        if st is not None:
            m.write(bufs[2], np.ascontiguousarray(st, dtype=_F32).tobytes())
        e = int(np.asarray(eps, dtype=_F32).view(np.uint32))
        phases = range(self.PHASES[self.kind]) if phases is None else phases
        if self.kind == "softmax":
            jobs = [[*bufs[:3], rows, cols, ph, 3] for ph in phases]
        else:
            jobs = [[*bufs, rows, cols, ph, 3 | bits, 0, cols, e] for ph in phases]
        m.run(jobs)
        return np.frombuffer(m.read(bufs[1], 4 * x.size), dtype=_F32).reshape(x.shape)


def _rows(rng, shape, scale=4.0):
    return (rng.normal(size=shape) * rng.choice([0.1, 1.0, scale * 10], size=shape)).astype(_F32)


def test_exp_model_bits_over_its_whole_range():
    """softmax's phase 1 with a max of 0 writes ``exp(x)``: the generated code's exp equals the
    simulator's exp model (C++ ``exp_f32``) on a sweep from below the subnormal cut-off past
    the overflow, the special values and the branch boundaries."""
    sweep = np.linspace(-110.0, 95.0, 40_001, dtype=_F32)
    edges = np.array([88.72283905206835, np.nextafter(_F32(88.72283905206835), _F32(100)), -103.97208,
                      np.nextafter(_F32(-103.97208), _F32(-200)), -87.3, -87.34, -88.0, -100.0, -0.0, 0.0,
                      1e-30, -1e-30, 3e-39, np.inf, -np.inf, np.nan], dtype=_F32)
    x = np.concatenate([sweep, edges, np.random.default_rng(1).normal(scale=30, size=4_000).astype(_F32)])
    x = x[: x.size // 64 * 64].reshape(-1, 64)
    pe = _Rows("softmax")
    got = np.concatenate([pe.run(x[r:r + 128], phases=[1], st=np.zeros(2 * 128, _F32)[:2 * len(x[r:r + 128])])
                          for r in range(0, len(x), 128)])  # pieces that fit the PE's SRAM
    want = exp_f32(x)
    assert np.count_nonzero((want > 0) & (want < np.finfo(_F32).tiny)) > 10  # subnormal results
    _assert_bits(want, got)


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (3, 32), (2, 33), (4, 100), (1, 257)])
def test_row_kernels_alone_equal_the_cxx_kernels(shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    x = _rows(rng, shape)
    gamma, beta = rng.normal(size=shape[-1]).astype(_F32), rng.normal(size=shape[-1]).astype(_F32)
    _assert_bits(_softmax(x), _Rows("softmax").run(x))
    ln = _Rows("layer_norm")
    for g, b in ((gamma, beta), (None, None), (gamma, None), (None, beta)):
        _assert_bits(_layer_norm(x, _F32(1e-5), g, b), ln.run(x, g, b, eps=1e-5))
    rms = _Rows("rms_norm")
    for w in (gamma, None):
        _assert_bits(_rms_norm(x, _F32(1e-6), w), rms.run(x, w, eps=1e-6))


def test_row_kernels_nan_payloads_are_the_m4f_s():
    """Rows where NaNs with payloads meet (quiet then signalling, signalling then quiet, either
    sign): the M4F takes the signalling operand first (FPProcessNaNs), x86 the first operand,
    so the simulator's kernels compute such rows with the M4F's rule; the executed code agrees."""
    rng = np.random.default_rng(7)
    x = _rows(rng, (8, 40))
    b = x.view(np.uint32)
    b[0, 3], b[1, 5], b[2, 7], b[3, 9] = 0x7FC01234, 0xFFC01234, 0x7F800055, 0xFF800055
    b[4, 1], b[4, 20] = 0x7FC01234, 0x7F800077
    b[5, 2], b[5, 30] = 0xFF800011, 0x7FC00099
    b[6, 0], b[6, 39] = 0x7F800001, 0xFF800002
    gamma, beta = rng.normal(size=40).astype(_F32), rng.normal(size=40).astype(_F32)
    _assert_bits(_softmax(x), _Rows("softmax").run(x))
    _assert_bits(_layer_norm(x, _F32(1e-5), gamma, beta), _Rows("layer_norm").run(x, gamma, beta, eps=1e-5))
    _assert_bits(_layer_norm(x, _F32(1e-5), None, None), _Rows("layer_norm").run(x, None, None, eps=1e-5))
    _assert_bits(_rms_norm(x, _F32(1e-6), gamma), _Rows("rms_norm").run(x, gamma, eps=1e-6))
    # x - max with max the row's first NaN (quiet 0x1234): the signalling NaN's element keeps its own
    # payload, quieted (x86 would take the first operand's)
    assert [hex(v) for v in _softmax(x)[4, [0, 20]].view(np.uint32)] == ["0x7fc01234", "0x7fc00077"]


def test_row_kernels_on_special_values():
    """Infinities, NaNs, signed zeros, subnormals, a constant row (zero variance) and a row whose
    exps underflow: the same values; a NaN where the C++ kernel has one (its payload is the
    host's, see :func:`_assert_bits`)."""
    rng = np.random.default_rng(7)
    x = _rows(rng, (12, 40))
    x[0, 3] = np.inf
    x[1, 5] = -np.inf
    x[2, :] = -np.inf
    x[3, 7] = np.nan
    x[4, :] = 2.5  # zero variance
    x[5, ::2] = -0.0
    x[6, 1::3] = _F32(3e-39)
    x[7] = np.linspace(-200, 0, 40, dtype=_F32)  # most exps underflow, some subnormal
    x[8, 0] = _F32(3e38)
    x[8, 1] = _F32(-3e38)
    gamma, beta = rng.normal(size=40).astype(_F32), rng.normal(size=40).astype(_F32)
    # an invalid operation's NaN (+inf - +inf in rows 0 and 2) is the M4F's default NaN in both
    want = _softmax(x)
    assert (want[[0, 2]].view(np.uint32) == 0x7FC00000).all()
    _assert_bits(want, _Rows("softmax").run(x))
    _assert_bits(_layer_norm(x, _F32(1e-5), gamma, beta), _Rows("layer_norm").run(x, gamma, beta, eps=1e-5))
    _assert_bits(_rms_norm(x, _F32(0.0), gamma), _Rows("rms_norm").run(x, gamma, eps=0.0))
    ok = ~np.isnan(_softmax(x)).any(axis=1)
    assert ok[[1, 4, 5, 6, 7]].all() and not ok[[0, 2, 3]].any()  # +inf - +inf, -inf - -inf, NaN


# -- whole programs: iss mode equal to the simulator ------------------------------------------
class _Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 3.0, dim=-1)


class _LayerNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        torch.nn.init.normal_(self.ln.weight)
        torch.nn.init.normal_(self.ln.bias)

    def forward(self, x):
        return self.ln(x * 2.0)


class _RmsNorm(torch.nn.Module):
    """Llama's RMSNorm as transformers writes it (fused into one ``rms_norm`` layer)."""

    def __init__(self, d):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d))

    def forward(self, x):
        x = x * 2.0
        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


_MODELS = {"softmax": lambda d: _Softmax(), "layer_norm": _LayerNorm, "rms_norm": _RmsNorm}


def _program(module, shape):
    mod = tvm_spinn.frontend.from_pytorch(module.eval(), (torch.randn(*shape),))
    (program,) = tvm_spinn.report(relax.build(mod, target="spinn")).programs
    return program


@pytest.mark.parametrize("kind", sorted(_MODELS))
@pytest.mark.parametrize("shape", [(4, 8), (3, 5, 33), (1, 2048)])
def test_program_iss_equals_simulator(kind, shape):
    """A row op alone in a program, as the mapper tiled it (short rows whole; few long rows
    split over PEs, their statistics chained): iss mode gives the simulator's bits."""
    torch.manual_seed(0)
    program = _program(_MODELS[kind](shape[-1]), shape)
    index = [layer.kind for layer in program.layers].index(kind)
    table = view.placed_tiles(program)[index]
    rows = int(np.prod(shape[:-1]))
    if shape == (1, 2048):  # one long row: the mapper splits it over PEs
        assert len(table) > rows
    x = (np.random.default_rng(3).normal(size=shape) * 4).astype(_F32)
    record: list = []
    got = run_program_iss(program, [x], record=record)
    (want,) = run_program(program, [x])
    _assert_bits(want, got[0])
    tiles = [r for r in record if r.layer == index]
    assert len(tiles) == len(table) and all(r.cycles > 0 for r in tiles)


# -- the activations on the exp model -----------------------------------------------------------
_UNARY = {"gelu": ("gelu", {}), "gelu_tanh": ("gelu_tanh", {}), "sigmoid": ("sigmoid", {}), "tanh": ("tanh", {}),
          "negative": ("negative", {}), "sqrt": ("sqrt", {}), "rsqrt": ("rsqrt", {}),
          "square": ("power", {"exponent": 2}), "cube": ("power", {"exponent": 3})}


@pytest.mark.parametrize("act", sorted(_UNARY))
def test_unary_kernels_equal_the_simulator(act):
    """Each element-wise function on a dense sweep over the exp model's branches, random values
    and the special values: the simulator's bits, NaNs included."""
    from tvm_spinn.program.ops.elementwise import unary

    x = np.concatenate([np.linspace(-12, 12, 6001, dtype=_F32), np.linspace(-100, 100, 2001, dtype=_F32),
                        (np.random.default_rng(5).normal(size=2000) * 5).astype(_F32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e-39, -3e-39, 0.625, -0.625, 44, -44,
                                  np.nextafter(_F32(44), _F32(50)), 1e-20, -1e-20], _F32)])
    image = role_image(("unary", act))
    m = PeMachine(image.elf, image.name, 0, 24)
    m.write(m.arena, x.tobytes())
    m.run([[m.arena, m.arena + x.nbytes, x.size]])
    got = np.frombuffer(m.read(m.arena + x.nbytes, x.nbytes), dtype=_F32)
    kind, attrs = _UNARY[act]
    with np.errstate(invalid="ignore", divide="ignore"):
        want = unary(kind, x, attrs)
    _assert_bits(want, got)


class _Activations(torch.nn.Module):
    def forward(self, x):
        h = torch.nn.functional.gelu(x * 2.0) + torch.sigmoid(x) * torch.tanh(x)
        return torch.nn.functional.gelu(h, approximate="tanh") - torch.rsqrt(h * h + 1.0)


def test_activations_program_iss_equals_simulator():
    torch.manual_seed(0)
    program = _program(_Activations(), (6, 40))
    assert {"gelu", "gelu_tanh", "sigmoid", "tanh", "rsqrt"} <= {layer.kind for layer in program.layers}
    x = (np.random.default_rng(4).normal(size=(6, 40)) * 3).astype(_F32)
    (want,) = run_program(program, [x])
    (got,) = run_program_iss(program, [x])
    _assert_bits(want, got)


# -- a transformer block ------------------------------------------------------------------------
class _FromEmbeds(torch.nn.Module):
    """A transformers model from its embeddings on (the token lookup stays out: ``take`` has no
    PE code)."""

    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, x):
        return self.model(inputs_embeds=x, **self.kwargs).last_hidden_state


def _bert():
    import transformers as tf
    cfg = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16)
    return _FromEmbeds(tf.BertModel(cfg, add_pooling_layer=False)), {"layer_norm", "softmax", "gelu", "dense", "matmul"}


def _llama():
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    cfg._attn_implementation = "eager"
    return _FromEmbeds(tf.LlamaModel(cfg), use_cache=False), {"rms_norm", "softmax", "sigmoid", "rope", "dense",
                                                              "matmul"}


class _Tokens(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


def _bert_tokens():
    """BERT from token ids: the embedding lookups (``take``) run on the PEs too."""
    model, must = _bert()
    return _Tokens(model.model), must | {"take"}


@pytest.mark.slow  # ~25-40 s each: the build and every tile of the model in the ISS
@pytest.mark.parametrize("make", [_bert, _llama, _bert_tokens], ids=["bert", "llama", "bert_tokens"])
def test_transformer_block_iss_equals_simulator(make, monkeypatch):
    """A one-layer BERT (layer_norm, gelu) and Llama (rms_norm, SiLU, rotary embedding) from
    transformers configs with random weights, built for spinn: with ``TVM_SPINN_SIM_MODE=iss``
    every region runs as PE code and gives the default simulator's bits, which are PyTorch's
    within fp32 error."""
    import tvm

    torch.manual_seed(0)
    model, must = make()
    model = model.eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 100, (1, 8), generator=gen) if make is _bert_tokens else torch.randn(1, 8, 32, generator=gen)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model, (x,)), target="spinn")
    programs = tvm_spinn.report(ex).programs
    assert must <= {layer.kind for p in programs for layer in p.layers}
    vm = relax.VirtualMachine(ex, tvm.cpu())
    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    want = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    calls = []
    import tvm_spinn.pe as pe
    real = pe.run_program_iss
    monkeypatch.setattr(pe, "run_program_iss", lambda p, i: calls.append(p.symbol) or real(p, i))
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "iss")
    got = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    assert len(calls) == len(programs)
    _assert_bits(want, got)
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~15-30 s each
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_zoo_transformer_under_iss_option_equals_simulator(name, monkeypatch):
    """The zoo's two-layer transformers (token ids in, ``take`` included; ViT from an image)
    called inside ``with SpinnOptions(iss=True)``: every region runs as PE code, with the
    default simulator's bits."""
    import tvm
    from test_zoo import ZOO

    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    torch.manual_seed(0)
    model, x = ZOO[name]()
    ex = relax.build(tvm_spinn.frontend.from_pytorch(model.eval(), (x,)), target="spinn")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    want = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    with tvm_spinn.SpinnOptions(iss=True):
        got = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    _assert_bits(want, got)


#: NaNs with payloads: quiet and signalling, both signs, the default NaN and an all-ones payload
_NANS = np.array([0x7FC01234, 0xFFC01234, 0x7F800055, 0xFF800055, 0x7FC00000, 0xFFC00000, 0x7FBFFFFF, 0xFFFFFFFF],
                 dtype=np.uint32).view(_F32)


@pytest.mark.parametrize("act", sorted(_UNARY))
def test_unary_nan_payloads_are_the_m4f_s(act):
    """A NaN input's sign and payload come out as the executed ARM code passes them on (quieted):
    the simulator's bits exactly, not x86's (whose commutative operations may take the other
    NaN operand)."""
    from tvm_spinn.program.ops.elementwise import unary

    image = role_image(("unary", act))
    m = PeMachine(image.elf, image.name, 0, 24)
    m.write(m.arena, _NANS.tobytes())
    m.run([[m.arena, m.arena + _NANS.nbytes, _NANS.size]])
    got = np.frombuffer(m.read(m.arena + _NANS.nbytes, _NANS.nbytes), dtype=_F32)
    kind, attrs = _UNARY[act]
    with np.errstate(invalid="ignore"):
        want = np.asarray(unary(kind, _NANS, attrs), dtype=_F32)
    assert [hex(v) for v in want.view(np.uint32)] == [hex(v) for v in got.view(np.uint32)]
    quieted = got.view(np.uint32) & 0x00400000 != 0
    # an arithmetic instruction quiets a NaN; VNEG only flips the sign bit (a signalling NaN stays one)
    assert np.all(quieted) if act != "negative" else np.array_equal(quieted, _NANS.view(np.uint32) & 0x00400000 != 0)


def _rms_chunks(pe: "_Rows", x, w, eps, width):
    """``x`` [rows, row] RMS-normalized by the rms_norm kernel as a split row runs it: chunks of
    ``width`` columns (the last shorter), phase 0 chunk after chunk with the row's blocked sum
    carried in the statistics buffer (the chain), then phase 1 on every chunk."""
    rows, row = x.shape
    m = pe.m
    m.load()
    pst = m.arena
    px = pst + 64 * rows
    py = px + 4 * rows * width + 64
    pw = py + 4 * rows * width + 64
    m.write(pst, np.zeros(4 * rows, _F32).tobytes())
    e = int(np.asarray(eps, dtype=_F32).view(np.uint32))
    out = np.empty_like(x)
    for phase in (0, 1):
        for c0 in range(0, row, width):
            c1 = min(row, c0 + width)
            m.write(px, np.ascontiguousarray(x[:, c0:c1]).tobytes())
            m.write(pw, np.ascontiguousarray(w[c0:c1]).tobytes())
            flags = 4 | (1 if c0 == 0 else 0) | (2 if c1 == row else 0)
            m.run([[px, py, pst, pw, rows, c1 - c0, phase, flags, c0, row, e]])
            if phase == 1:
                out[:, c0:c1] = np.frombuffer(m.read(py, 4 * rows * (c1 - c0)), _F32).reshape(rows, c1 - c0)
    return out


@pytest.mark.parametrize("row,width", [(200, 45), (256, 64), (100, 7), (97, 33), (64, 64)])
def test_rms_norm_split_row_chunks_equal_the_cxx_kernel(row, width):
    """A row split into chunks whose starts fall on and off the sum's block boundaries (the
    kernel sums its chunk a block at a time, its first block from the chunk's first column):
    chained chunk by chunk, the executed code's outputs are the simulator's whole-row kernel's
    bits, on wide-range values with zeros, subnormals, infinities and NaNs."""
    rng = np.random.default_rng(row * 100 + width)
    x = _rows(rng, (3, row))
    special = np.array([0.0, -0.0, 1e-45, -3e-39, 1e-20, 3e38, -3e38], _F32)
    x[1, rng.choice(row, size=min(row, 12), replace=False)] = rng.choice(special, size=min(row, 12))
    x[2, rng.integers(row)] = np.inf if row % 2 else np.nan
    w = rng.uniform(0.5, 1.5, row).astype(_F32)
    _assert_bits(_rms_norm(x, _F32(1e-6), w), _rms_chunks(_Rows("rms_norm"), x, w, 1e-6, width))


def _ln_chunks(pe: "_Rows", x, g, b, eps, width):
    """``x`` [rows, row] layer-normalized by the layer_norm kernel as a split row runs it: chunks
    of ``width`` columns (the last shorter), each in its own buffers; phase 0 and then phase 1
    chunk after chunk with the row's blocked sums carried in the statistics buffer (the chain),
    then phase 2 on every chunk."""
    rows, row = x.shape
    m = pe.m
    m.load()
    pst = m.arena
    starts = list(range(0, row, width))
    span = -(-4 * rows * width // 64) * 64 + 64
    base = [pst + 64 * rows + 4 * span * i for i in range(len(starts))]  # x, y, gamma, beta
    m.write(pst, np.zeros(4 * rows, _F32).tobytes())
    for c0, p in zip(starts, base):
        c1 = min(row, c0 + width)
        for k, data in enumerate((x[:, c0:c1], None, g[c0:c1], b[c0:c1])):
            if data is not None:
                m.write(p + k * span, np.ascontiguousarray(data).tobytes())
    e = int(np.asarray(eps, dtype=_F32).view(np.uint32))
    out = np.empty_like(x)
    for phase in (0, 1, 2):
        for c0, p in zip(starts, base):
            c1 = min(row, c0 + width)
            flags = 4 | 8 | (1 if c0 == 0 else 0) | (2 if c1 == row else 0)
            m.run([[p, p + span, pst, p + 2 * span, p + 3 * span, rows, c1 - c0, phase, flags, c0, row, e]])
            if phase == 2:
                out[:, c0:c1] = np.frombuffer(m.read(p + span, 4 * rows * (c1 - c0)), _F32).reshape(rows, c1 - c0)
    return out


@pytest.mark.parametrize("row,width", [(200, 45), (256, 64), (100, 7), (97, 33), (64, 64), (70, 32)])
def test_layer_norm_split_row_chunks_equal_the_cxx_kernel(row, width):
    """A row split into chunks whose starts fall on and off the sums' block boundaries (the
    kernel sums its chunk a block at a time, its first block from the chunk's first column):
    chained chunk by chunk, the executed code's outputs are the simulator's whole-row kernel's
    bits, on wide-range values with zeros, subnormals, infinities and NaNs."""
    rng = np.random.default_rng(row * 100 + width + 1)
    x = _rows(rng, (3, row))
    special = np.array([0.0, -0.0, 1e-45, -3e-39, 1e-20, 3e38, -3e38], _F32)
    x[1, rng.choice(row, size=min(row, 12), replace=False)] = rng.choice(special, size=min(row, 12))
    x[2, rng.integers(row)] = np.inf if row % 2 else np.nan
    g = rng.uniform(0.5, 1.5, row).astype(_F32)
    b = rng.standard_normal(row).astype(_F32)
    _assert_bits(_layer_norm(x, _F32(1e-5), g, b), _ln_chunks(_Rows("layer_norm"), x, g, b, 1e-5, width))
