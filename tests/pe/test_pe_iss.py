"""Generated PE code run in the instruction-set simulator (``iss``) against the default
simulator: the same bits on every op kind the generator lowers, fp32 (NaN, inf, -0.0 and
subnormal inputs included) and int8; faults and unlowerable layers raise one named error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tvm import relax

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

import tvm_spinn  # noqa: E402
from tvm_spinn.pe import IssFault, PeCodegenError, run_program_iss  # noqa: E402
from tvm_spinn.pe.images import role_image  # noqa: E402
from tvm_spinn.pe.iss import PeMachine  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402

from test_int8 import qgemm_module  # noqa: E402

QNAN, SNAN = 0x7FC01234, 0xFF800055


def _programs(mod, target="spinn"):
    return tvm_spinn.report(relax.build(mod, target=target)).programs


def _special(shape, seed: int) -> np.ndarray:
    """Normal values with NaNs (quiet and signalling, with payloads), infinities, signed zeros
    and subnormals sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    flat = x.reshape(-1)
    bits = flat.view(np.uint32)
    bits[::7] = QNAN
    bits[3::17] = SNAN
    flat[1::11] = np.inf
    flat[4::13] = -np.inf
    flat[2::5] = -0.0
    flat[5::9] = np.float32(3e-39) * np.sign(rng.normal(size=flat[5::9].shape)).astype(np.float32)
    return x


def _assert_same_bits(program, inputs):
    """Outputs of the default simulator and of ``iss`` mode are bitwise equal, NaN payloads and
    signs included."""
    want = run_program(program, inputs)
    got = run_program_iss(program, inputs)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        w, g = w.reshape(-1), g.reshape(-1)
        wb, gb = (w.view(np.uint32), g.view(np.uint32)) if w.dtype == np.float32 else (w.view(np.uint8), g.view(np.uint8))
        diff = np.flatnonzero(wb != gb)
        assert diff.size == 0, (f"{diff.size} elements differ, first at {diff[:5]}: default "
                                f"{[hex(v) for v in wb[diff[:5]]]} iss {[hex(v) for v in gb[diff[:5]]]}")


class _DenseElementwise(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(24, 40)
        self.fc2 = torch.nn.Linear(40, 8)

    def forward(self, x, y):
        h = torch.relu(self.fc(x))
        return self.fc2(torch.relu(h * y + y) - y / 3.0), h * y


def test_fp32_dense_and_elementwise_bit_identical():
    torch.manual_seed(0)
    x, y = torch.randn(6, 24), torch.randn(6, 40)
    mod = tvm_spinn.frontend.from_pytorch(_DenseElementwise().eval(), (x, y))
    (program,) = _programs(mod)
    kinds = {layer.kind for layer in program.layers}
    assert {"dense", "multiply", "add"} <= kinds, kinds
    _assert_same_bits(program, [_special((6, 24), 1), _special((6, 40), 2)])


class _Arithmetic(torch.nn.Module):
    def forward(self, a, b):
        return a - b, a / b, -a, torch.sqrt(a), a.pow(2), a.pow(3), torch.rsqrt(b)


def test_arithmetic_and_unary_bit_identical():
    """subtract, divide, negative, sqrt, rsqrt and power 2 and 3 each a layer of their own on the
    special values (NaN payloads, infinities, signed zeros, subnormals; a divide by zero): the
    default simulator's bits."""
    a, b = torch.randn(6, 40), torch.randn(6, 40)
    programs = _programs(tvm_spinn.frontend.from_pytorch(_Arithmetic().eval(), (a, b)))
    kinds = {layer.kind for program in programs for layer in program.layers}
    assert {"subtract", "divide", "negative", "sqrt", "rsqrt", "power"} <= kinds, kinds
    for program in programs:  # each region on special values of its inputs' shapes
        inputs = [_special(program.tensors[t].shape, 3 + i) for i, t in enumerate(program.inputs)]
        inputs[-1].reshape(-1)[:3] = 0.0
        _assert_same_bits(program, inputs)


class _ConvMatmul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, stride=2)

    def forward(self, x, a, b):
        return torch.relu(self.conv(x)), torch.matmul(a, b)


def test_fp32_conv2d_and_matmul_bit_identical():
    torch.manual_seed(1)
    x, a, b = torch.randn(1, 3, 9, 7), torch.randn(5, 12), torch.randn(12, 6)
    mod = tvm_spinn.frontend.from_pytorch(_ConvMatmul().eval(), (x, a, b))
    programs = _programs(mod)
    assert {"conv2d", "matmul"} <= {layer.kind for p in programs for layer in p.layers}
    feeds = {(1, 3, 9, 7): _special((1, 3, 9, 7), 3), (5, 12): _special((5, 12), 4), (12, 6): _special((12, 6), 5)}
    for program in programs:
        _assert_same_bits(program, [feeds[tuple(program.tensors[t].shape)] for t in program.inputs])


@pytest.mark.parametrize("xdtype,k,symmetric", [("int8", 40, False), ("uint8", 600, False), ("int8", 40, True)])
def test_int8_dense_bit_identical(xdtype, k, symmetric):
    """Requantized int8 dense on the MAC array: per-channel weight zero points, a bias, and (k =
    600 on the 24-bit production chip) a reduction in two accumulator-safe chunks; symmetric:
    both zero points 0, so the kernel forms no operand sums."""
    rng = np.random.default_rng(7)
    m, n = 10, 12
    lo, hi = (-128, 128) if xdtype == "int8" else (0, 256)
    x = rng.integers(lo, hi, size=(m, k)).astype(xdtype)
    w = rng.integers(-127, 128, size=(k, n)).astype("int8")
    sw = rng.uniform(0.001, 0.005, size=n).astype("float32")
    zw = rng.integers(-3, 4, size=n).astype("int8") * (not symmetric)
    zx = 0 if symmetric else 5 if xdtype == "int8" else 131
    mod = qgemm_module(x.shape, xdtype, w, sw, zw, 0.01, zx, op="dense",
                       bias=rng.normal(size=n).astype("float32"), out=(0.3, -4, "int8"), w_axis=1)
    progs = [p for p in _programs(mod) if any(layer.mode == "int8" for layer in p.layers)]
    assert progs
    for program in progs:
        (dense,) = [layer for layer in program.layers if layer.kind == "dense"]
        assert dense.mode == "int8"
        inputs = [x if program.tensors[t].dtype == xdtype else rng.normal(size=program.tensors[t].shape).astype("float32")
                  for t in program.inputs]
        _assert_same_bits(program, inputs)


@pytest.mark.parametrize("xdtype,groups,per_channel,cin", [("int8", 1, True, 3), ("uint8", 4, False, 8),
                                                        ("int8", 1, False, 80)])
def test_int8_conv2d_bit_identical(xdtype, groups, per_channel, cin):
    """Requantized int8 conv2d on the MAC array (the tile transposed: pixels x channels):
    padding (the zero point), stride, groups, per-channel and per-tensor weight zero points and
    scales, a bias, a ReLU; cin = 80 (k = 720) reduces in two accumulator-safe chunks."""
    rng = np.random.default_rng(11 + groups)
    lo, hi = (-128, 128) if xdtype == "int8" else (0, 256)
    o = 8
    x = rng.integers(lo, hi, size=(1, cin, 7, 6)).astype(xdtype)
    w = rng.integers(-127, 128, size=(o, cin // groups, 3, 3)).astype("int8")
    sw = rng.uniform(0.002, 0.01, size=o if per_channel else 1).astype("float32")
    zw = rng.integers(-3, 4, size=sw.shape).astype("int8")
    mod = qgemm_module(x.shape, xdtype, w, sw, zw, 0.02, 7 if xdtype == "int8" else 131,
                       bias=rng.normal(scale=0.5, size=o).astype("float32"), relu=groups == 1,
                       out=(0.05, -5, "int8"), conv_attrs=dict(strides=2, padding=1, groups=groups))
    progs = [p for p in _programs(mod) if any(layer.mode == "int8" for layer in p.layers)]
    assert progs
    for program in progs:
        (conv,) = [layer for layer in program.layers if layer.kind == "conv2d"]
        assert conv.mode == "int8"
        _assert_same_bits(program, [x if program.tensors[t].dtype == xdtype
                                    else rng.normal(size=program.tensors[t].shape).astype("float32")
                                    for t in program.inputs])


def test_int8_dense_split_reduction_bit_identical():
    """A batch-1 int8 dense layer whose reduction the mapper splits over PEs (each part a tile
    with its own k range; the parts after the first continue the sums handed on, so every chunk
    of theirs goes through the pipeline's scratch blocks): the default simulator's bits."""
    from tvm_spinn.mapping.schedule import derive_tables
    rng = np.random.default_rng(12)
    x = rng.integers(-128, 128, size=(1, 2048)).astype("int8")
    w = rng.integers(-127, 128, size=(2048, 16)).astype("int8")
    zw = rng.integers(-3, 4, size=16).astype("int8")
    mod = qgemm_module(x.shape, "int8", w, rng.uniform(0.001, 0.005, size=16).astype("float32"), zw, 0.01, 5,
                       op="dense", out=(0.3, -4, "int8"), w_axis=1)
    (program,) = [p for p in _programs(mod) if any(layer.mode == "int8" for layer in p.layers)]
    (index,) = [i for i, layer in enumerate(program.layers) if layer.kind == "dense"]
    table = derive_tables(program, program.arch)[index]
    assert table.lo.shape[1] == 4 and (table.lo[:, 3] > 0).any()  # the reduction is split
    _assert_same_bits(program, [x])


@pytest.mark.parametrize("xdtype,k,relu", [("uint8", 600, True), ("int8", 40, False)])
def test_int8_gemv_bit_identical(xdtype, k, relu):
    """A batch-1 requantized int8 dense layer runs the one-row kernel (``("gemm_i8", "gemv")``:
    one straight-line form a column): per-channel weight zero points (some 0), a bias, a ReLU's
    narrower clamp or the full range, one chunk or two; the default simulator's bits."""
    from tvm_spinn.pe.roles import layer_role
    rng = np.random.default_rng(21 + k)
    n = 37
    lo, hi = (-128, 128) if xdtype == "int8" else (0, 256)
    x = rng.integers(lo, hi, size=(1, k)).astype(xdtype)
    w = rng.integers(-127, 128, size=(k, n)).astype("int8")
    zw = rng.integers(-3, 4, size=n).astype("int8")
    zw[::3] = 0
    mod = qgemm_module(x.shape, xdtype, w, rng.uniform(0.001, 0.005, size=n).astype("float32"), zw, 0.01,
                       5 if xdtype == "int8" else 131, op="dense", bias=rng.normal(size=n).astype("float32"),
                       relu=relu, out=(0.3, -4, "int8"), w_axis=1)
    progs = [p for p in _programs(mod) if any(layer.mode == "int8" for layer in p.layers)]
    assert progs
    for program in progs:
        (index,) = [i for i, layer in enumerate(program.layers) if layer.kind == "dense"]
        assert layer_role(program, index) == ("gemm_i8", "gemv")
        _assert_same_bits(program, [x if program.tensors[t].dtype == xdtype
                                    else rng.normal(size=program.tensors[t].shape).astype("float32")
                                    for t in program.inputs])


def test_int8_matmul_bit_identical():
    """Requantized int8 matmul of two uint8 activations (both zero points nonzero), batched."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, size=(2, 3, 16, 20)).astype("uint8")
    b = rng.integers(0, 256, size=(2, 3, 20, 12)).astype("uint8")
    mod = qgemm_module(a.shape, "uint8", None, 0.02, 140, 0.05, 90, op="matmul", wdtype="uint8",
                       b_shape=b.shape, out=(0.9, 128, "uint8"))
    progs = [p for p in _programs(mod) if any(layer.mode == "int8" for layer in p.layers)]
    assert progs
    for program in progs:
        (mm,) = [layer for layer in program.layers if layer.kind == "matmul"]
        assert mm.mode == "int8"
        feeds = {a.shape: a, b.shape: b}
        _assert_same_bits(program, [feeds[tuple(program.tensors[t].shape)] for t in program.inputs])


def unlowerable_dense():
    """An int8 dense whose requantization rule (a rounding no kernel has) the PE code generator
    refuses: the program's layer is given it after the build."""
    import dataclasses

    w = np.random.default_rng(0).integers(-127, 128, size=(16, 8)).astype("int8")
    mod = qgemm_module((4, 16), "int8", w, np.float32(0.01), 0, 0.02, 3, op="dense", out=(0.3, -4, "int8"))
    (program,) = [p for p in _programs(mod) if any(layer.mode == "int8" for layer in p.layers)]
    layers = tuple(dataclasses.replace(layer, attrs={**layer.attrs, "rounding": "truncate"}) if layer.kind == "dense"
                   else layer for layer in program.layers)
    return dataclasses.replace(program, layers=layers)


def test_unlowerable_layer_is_named_before_running():
    program = unlowerable_dense()
    (dense,) = [layer for layer in program.layers if layer.kind == "dense"]
    with pytest.raises(PeCodegenError, match=rf"layer {dense.name} \(dense\): cannot generate PE code.*truncate"):
        run_program_iss(program, [np.zeros(program.tensors[t].shape, program.tensors[t].dtype) for t in program.inputs])


class _Where(torch.nn.Module):
    def forward(self, x, y):
        return torch.where(x < y, x + 1.0, y * 2.0)


def test_where_less_bit_identical():
    programs = _programs(tvm_spinn.frontend.from_pytorch(_Where().eval(), (torch.randn(6, 40), torch.randn(6, 40))))
    assert "where_less" in {layer.kind for p in programs for layer in p.layers}
    for program in programs:
        _assert_same_bits(program, [_special(program.tensors[t].shape, 31 + j) for j, t in enumerate(program.inputs)])


class _Clips(torch.nn.Module):
    def forward(self, x):
        return torch.clamp(x + 1.0, -0.5, 0.5), torch.clamp(x, 0.0, 1.5), torch.clamp(x * 2.0, -2.0, -0.0)


def test_clip_bit_identical():
    """clip as compare-and-select on the PE: NaN (payloads kept), infinities, signed zeros (a
    +0.0 lower and a -0.0 upper bound too) and subnormals give the simulator's bits."""
    programs = _programs(tvm_spinn.frontend.from_pytorch(_Clips().eval(), (torch.randn(6, 40),)))
    clips = [layer for program in programs for layer in program.layers if layer.kind == "clip"]
    assert {(c.attrs["min"], c.attrs["max"]) for c in clips} == {(-0.5, 0.5), (0.0, 1.5), (-2.0, -0.0)}
    for program in programs:
        _assert_same_bits(program, [_special(program.tensors[t].shape, 21) for t in program.inputs])


def test_fault_names_pe_image_and_pc():
    image = role_image(("binary", "add", False))
    machine = PeMachine(image.elf, image.name, 7, 24)
    with pytest.raises(IssFault, match=r"PE 7, image binary_add: emulation fault: .*UNMAPPED.* at pc=0x[0-9a-f]{8}") as err:
        machine.run([[0x9000_0000, machine.arena, machine.arena + 64, 4]])
    kernel = machine.symbols["pe_kernel"]
    assert err.value.pe == 7 and err.value.image == "binary_add" and kernel <= err.value.pc < machine.symbols["_end"]
    # an undefined instruction (0xDEFF: UDF in Thumb) where the kernel starts, on a fresh PE
    machine = PeMachine(image.elf, image.name, 3, 24)
    machine.uc.mem_write(kernel, b"\xff\xde\xff\xde")
    with pytest.raises(IssFault, match=rf"PE 3, image binary_add: .* at pc=0x{kernel:08x}"):
        machine.run([[machine.arena, machine.arena, machine.arena, 1]])


def test_sim_mode_override_runs_the_model_as_pe_code(monkeypatch):
    """``TVM_SPINN_SIM_MODE=iss`` (the debugging override) runs a built model's regions as PE
    code through the ordinary runtime: the same bits as the default mode."""
    import tvm

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 12)

        def forward(self, x):
            h = self.fc(x)
            return torch.relu(h) * h

    torch.manual_seed(2)
    x = torch.randn(4, 16)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(Net().eval(), (x,)), target="spinn")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    feed = _special((4, 16), 6)
    want = vm["main"](tvm.runtime.tensor(feed)).numpy()
    calls = []
    import tvm_spinn.pe as pe
    real = pe.run_program_iss
    monkeypatch.setattr(pe, "run_program_iss", lambda p, i: calls.append(p.symbol) or real(p, i))
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "iss")
    got = vm["main"](tvm.runtime.tensor(feed)).numpy()
    assert calls and np.array_equal(want.view(np.uint32), got.view(np.uint32))


@pytest.mark.slow
def test_image_bytes_identical_across_processes():
    import subprocess
    import sys

    specs = [("binary", "add", True), ("gemm_f32", False), ("gemm_i8",), ("softmax",), ("layer_norm",), ("rms_norm",),
             ("unary", "gelu"), ("gemm_i8", "f32", True), ("gemm_i8", "tflite")]
    here = [role_image(s).sha256 for s in specs]
    code = ("from tvm_spinn.pe.images import role_image; "
            f"print(' '.join(role_image(s).sha256 for s in {specs!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-len(here):] == here


def _bits(x) -> int:
    return int(np.float32(x).view(np.uint32))


def _m4f_nan(x, y) -> int:
    """FPProcessNaNs (ARMv7-M ARM A2.5.5, FPSCR.DN = 0) of two operands, at least one a NaN: a
    signalling NaN quieted (the first operand's if both are), else the first quiet NaN."""
    for v in (x, y):
        if np.isnan(v) and not _bits(v) & 0x00400000:
            return _bits(v) | 0x00400000
    return _bits(x) if np.isnan(x) else _bits(y)


def _put(x, index, bits):
    x.reshape(-1).view(np.uint32)[index] = bits


def test_gemm_nan_payloads_follow_the_m4f():
    """NaN payloads and signs of fp32 GEMM outputs are the M4F's (the PE kernel's VMUL of B's element
    by A's, VADD of the accumulator and the product, then of the bias), in the default simulator
    and in ``iss`` mode alike: a quiet NaN against a signalling one, two quiet ones, a signalling
    one first, ``0 * inf`` and ``inf - inf`` (the default NaN 0x7FC00000; x86 gives 0xFFC00000),
    and a NaN bias."""
    qn1, qn2, sn1, sn2 = 0x7FC01234, 0xFFC00777, 0x7F800055, 0xFF800066

    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(5, 7)

        def forward(self, a):
            return self.fc(a)

    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 5)).astype(np.float32)
    net = Lin().eval()
    w = net.fc.weight.detach().numpy().T.copy()  # [k, n]: the GEMM's B
    bias = net.fc.bias.detach().numpy().copy()
    _put(a, 0 * 5 + 1, qn1)
    _put(w, 1 * 7 + 0, sn2)  # row 0, column 0: quiet A, signalling B -> B's, quieted
    _put(a, 1 * 5 + 2, qn1)
    _put(w, 2 * 7 + 1, qn2)  # row 1, column 1: both quiet -> B's (VMUL's first operand)
    _put(a, 2 * 5 + 3, sn1)  # row 2: signalling A
    a[3, 0], w[0, 3] = 0.0, np.inf  # row 3, column 3: 0 * inf
    a[5, 1], a[5, 2] = np.inf, -np.inf  # row 5: inf - inf wherever B's signs agree
    _put(bias, 6, sn1)  # column 6: a signalling bias
    with torch.no_grad():
        net.fc.weight.copy_(torch.from_numpy(w.T.copy()))
        net.fc.bias.copy_(torch.from_numpy(bias))
    (program,) = _programs(tvm_spinn.frontend.from_pytorch(net, (torch.zeros(6, 5),)))
    want, got = run_program(program, [a])[0], run_program_iss(program, [a])[0]
    g = got.view(np.uint32)
    assert g[0, 0] == sn2 | 0x00400000
    assert g[1, 1] == qn2
    assert g[2, 2] == sn1 | 0x00400000
    assert g[3, 3] == 0x7FC00000
    assert g[0, 6] == _m4f_nan(np.float32(a[0] @ w[:, 6]), bias[6]) == sn1 | 0x00400000
    assert np.any(g[5] == 0x7FC00000)
    assert np.array_equal(want.view(np.uint32), g)


def test_matmul_nan_payloads_follow_the_m4f():
    class Mm(torch.nn.Module):
        def forward(self, a, b):
            return torch.matmul(a, b)

    a = np.array([[-0.0, 1.0], [np.nan, 2.0]], dtype=np.float32)
    b = np.array([[np.inf, 1.0], [1.0, 1.0]], dtype=np.float32)
    (program,) = _programs(tvm_spinn.frontend.from_pytorch(Mm().eval(), (torch.zeros(2, 2), torch.zeros(2, 2))))
    want, got = run_program(program, [a, b])[0], run_program_iss(program, [a, b])[0]
    assert got.view(np.uint32)[0, 0] == 0x7FC00000  # -0 * inf: the M4F's default NaN
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


def test_image_bytes_identical_when_rebuilt():
    """Compiling and linking a role again (caches dropped) gives the same bytes; the image holds
    the kernel and the runtime's entry points, nothing of TVM's packed-function wrappers."""
    from tvm_spinn.pe.iss import image_symbols
    from tvm_spinn.pe.kernels import kernel_object
    from tvm_spinn.pe.runtime import runtime_object

    spec = ("gemm_f32", True)
    first = role_image(spec).elf
    kernel_object.cache_clear()
    runtime_object.cache_clear()
    assert role_image(spec).elf == first
    symbols = image_symbols(first)
    assert {"_start", "pe_kernel", "pe_halt", "_end"} <= set(symbols)
    assert not any(name.startswith("__tvm_ffi") for name in symbols)
    # unused runtime code is dropped: only the int8 role keeps the MAC array's driver
    i8 = image_symbols(role_image(("gemm_i8",)).elf)
    assert not {"pe_mac_start", "pe_mac_wait"} & set(symbols) and {"pe_mac_start", "pe_mac_wait"} <= set(i8)


class _Moves(torch.nn.Module):
    """Data movement between element-wise layers: transpose, slices (strided), broadcast,
    reshape, concat and a constant pad of -0.0."""

    def forward(self, x, y):
        a = x.transpose(0, 1) + 1.0                       # permute_dims
        b = a[1:5:2, ::3] * 2.0                            # strided_slice
        c = y.expand(6, 4, 5) - 1.0                        # broadcast_to
        d = torch.cat([a, a * 3.0], dim=1)                 # concat
        e = torch.nn.functional.pad(x * 0.5, (1, 2, 0, 1), value=-0.0)  # pad
        f = (x * 4.0).reshape(2, 3, 6)                     # reshape
        return b, c, d, e, f


def test_data_movement_bit_identical():
    programs = _programs(tvm_spinn.frontend.from_pytorch(_Moves().eval(), (torch.zeros(6, 6), torch.zeros(4, 1))))
    kinds = {layer.kind for program in programs for layer in program.layers}
    assert {"reshape", "permute_dims", "strided_slice", "broadcast_to", "concat", "pad"} <= kinds, kinds
    for r, program in enumerate(programs):
        _assert_same_bits(program, [_special(program.tensors[t].shape, 11 + r + 7 * j)
                                    for j, t in enumerate(program.inputs)])


@pytest.mark.parametrize("axis,dtype", [(None, "int8"), (1, "uint8")])
def test_quantize_dequantize_bit_identical(axis, dtype):
    """quantize (ties to even, saturation, NaN -> 0, infinities) and dequantize, per tensor and
    per channel."""
    rng = np.random.default_rng(6)
    x = _special((2, 5, 6, 6), 21)
    n = 5 if axis is not None else 1
    scale = rng.uniform(0.01, 0.05, size=n).astype("float32")
    scale[0] = 0.5
    # ties of x / s (0.5 apart), values near 2^23 and 2^31, and the saturation ends
    x[0, 0, 1, :] = [0.25, 0.75, -0.25, -0.75, 1.25, 1e6]
    x[0, 0, 2, :] = [4194304.25, -4194304.25, 4194303.75, 3e9, -3e9, 1e-45]
    zero = rng.integers(-10, 10, size=n) + (128 if dtype == "uint8" else 0)
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(list(x.shape), "float32"))
    c = lambda v, dt: relax.const(np.asarray(v, dtype=dt))  # noqa: E731
    with bb.function("main", [xv]):
        with bb.dataflow():
            s = c(scale if n > 1 else scale[0], "float32")
            z = c(zero if n > 1 else zero[0], dtype)
            q = bb.emit(relax.op.quantize(xv, s, z, axis=axis if axis is not None else -1, out_dtype=dtype))
            d = bb.emit(relax.op.dequantize(q, s, z, axis=axis if axis is not None else -1))
            gv = bb.emit_output(relax.Tuple([q, d]))
        bb.emit_func_output(gv)
    programs = _programs(bb.get())
    kinds = {layer.kind for p in programs for layer in p.layers}
    assert {"quantize", "dequantize"} <= kinds
    for program in programs:
        _assert_same_bits(program, [x if program.tensors[t].dtype == "float32"
                                    else rng.integers(-128, 128, size=program.tensors[t].shape).astype(program.tensors[t].dtype)
                                    for t in program.inputs])


class _Pools(torch.nn.Module):
    def forward(self, x):
        a = torch.nn.functional.max_pool2d(x + 1.0, 3, stride=2, padding=1)
        b = torch.nn.functional.avg_pool2d(x * 2.0, 3, stride=2, padding=1, count_include_pad=False)
        c = torch.nn.functional.avg_pool2d(x - 1.0, 2, stride=1, padding=1, count_include_pad=True)
        d = torch.nn.functional.max_pool2d(x * 3.0, 2, stride=2, dilation=2)
        return a, b, c, d


def test_pools_bit_identical():
    """max and average pooling (padding, both divisors, dilation) with NaN/inf/-0.0/subnormal
    inputs: the window order and the NaN rule of the default simulator."""
    programs = _programs(tvm_spinn.frontend.from_pytorch(_Pools().eval(), (torch.zeros(2, 3, 9, 10),)))
    kinds = {layer.kind for program in programs for layer in program.layers}
    assert {"max_pool2d", "avg_pool2d"} <= kinds, kinds
    for r, program in enumerate(programs):
        _assert_same_bits(program, [_special(program.tensors[t].shape, 31 + r) for t in program.inputs])


class _Mean(torch.nn.Module):
    def forward(self, x):
        return (x * 2.0).mean(dim=-1), (x + 1.0).mean(dim=(2, 3))


def test_mean_bit_identical():
    """fp32 mean over trailing axes: the sequential sum (NaN payloads by the M4F's rule, in
    the default simulator's C++ row sum too), then the division."""
    programs = _programs(tvm_spinn.frontend.from_pytorch(_Mean().eval(), (torch.zeros(3, 4, 5, 40),)))
    assert "mean" in {layer.kind for program in programs for layer in program.layers}
    for r, program in enumerate(programs):
        x = [_special(program.tensors[t].shape, 41 + r) for t in program.inputs]
        for a in x:  # rows with two NaNs meeting: quiet then signalling, and inf + -inf
            rows = a.reshape(-1, a.shape[-1])
            rows[0, :3] = np.array([QNAN, SNAN, 0], np.uint32).view(np.float32)
            rows[1, :] = 1.0
            rows[1, :2] = [np.inf, -np.inf]
        _assert_same_bits(program, x)


def test_iss_build_names_a_layer_without_a_pe_kernel(monkeypatch):
    """A build that asks for ``iss`` (``SpinnOptions(iss=True)`` or ``$TVM_SPINN_SIM_MODE``)
    names a layer the PE code generator cannot lower at ``relax.build``, before any call; the
    default build of the same model succeeds."""
    from tvm_spinn.pe.errors import PeCodegenError
    from tvm_spinn.runtime import simulator

    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=-1)

    mod = tvm_spinn.frontend.from_pytorch(Net().eval(), (torch.randn(4, 16),))
    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    def refuse(program):
        raise PeCodegenError(program.layers[0].name, program.layers[0].kind, "refused")

    monkeypatch.setitem(simulator._MODE_CHECKS, "iss", refuse)
    relax.build(mod, target="spinn")  # the default mode checks nothing
    with tvm_spinn.SpinnOptions(iss=True):
        with pytest.raises(Exception, match=r"softmax.*refused"):
            relax.build(mod, target="spinn")
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "iss")
    with pytest.raises(Exception, match=r"softmax.*refused"):
        relax.build(mod, target="spinn")


def test_iss_build_checks_every_layer_of_a_lowerable_model(monkeypatch):
    """The registered ``iss`` check passes a model whose layers all have PE kernels (the build
    under ``SpinnOptions(iss=True)`` succeeds and runs as PE code) and refuses, naming the layer,
    a program with a layer it cannot lower."""
    from types import SimpleNamespace as NS
    from tvm_spinn.pe.errors import PeCodegenError
    from tvm_spinn.runtime import simulator

    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=-1)

    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    mod = tvm_spinn.frontend.from_pytorch(Net().eval(), (torch.randn(4, 16),))
    with tvm_spinn.SpinnOptions(iss=True):
        relax.build(mod, target="spinn")
    bad = NS(layers=[NS(name="odd_0", kind="softmax", mode="int8", attrs={}, inputs=[0], output=1, consts={})],
             tensors={0: NS(dtype="float32", shape=(4, 8)), 1: NS(dtype="float32", shape=(4, 8))})
    with pytest.raises(PeCodegenError, match="odd_0"):
        simulator._MODE_CHECKS["iss"](bad)


def test_options_iss_field_runs_the_model_as_pe_code(monkeypatch):
    """``SpinnOptions(iss=True)`` active around a call runs the spinn regions as PE code (the
    same bits); outside it the default simulator runs; ``$TVM_SPINN_SIM_MODE`` decides where set."""
    import tvm

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 12)

        def forward(self, x):
            return torch.softmax(self.fc(x), dim=-1)

    torch.manual_seed(4)
    ex = relax.build(tvm_spinn.frontend.from_pytorch(Net().eval(), (torch.randn(4, 16),)), target="spinn")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    feed = tvm.runtime.tensor(np.random.default_rng(8).normal(size=(4, 16)).astype(np.float32))
    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    want = vm["main"](feed).numpy()
    calls = []
    import tvm_spinn.pe as pe
    real = pe.run_program_iss
    monkeypatch.setattr(pe, "run_program_iss", lambda p, i: calls.append(p.symbol) or real(p, i))
    with tvm_spinn.SpinnOptions(iss=True):
        got = vm["main"](feed).numpy()
    assert calls and np.array_equal(want.view(np.uint32), got.view(np.uint32))
    calls.clear()
    vm["main"](feed)
    assert not calls  # the options are no longer active
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "layers")
    with tvm_spinn.SpinnOptions(iss=True):
        vm["main"](feed)
    assert not calls
    with pytest.raises(TypeError, match=r"SpinnOptions.*iss"):
        tvm_spinn.SpinnOptions(iss="yes")


@pytest.mark.parametrize("mode", ["fast", "clip", "wrap"])
def test_take_resolves_indices_on_the_pe(mode):
    """``take`` (an embedding lookup) on either axis of the table: the PE resolves each index by
    the layer's mode into the row whose segments it hands the DMA engine; the simulator's
    output, and the timing model's cycles (the kernel's counted run, indices and segments)
    within 1% of the executed ones (indices out of range take other paths). In ``fast`` mode an
    index out of range raises the simulator's IndexError (layer, index, extent)."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(5, 12, 3)).astype(np.float32)
    for axis in (0, 1):
        bb = relax.BlockBuilder()
        idx = relax.Var("idx", relax.TensorType([4, 7], "int32"))
        with bb.function("main", [idx]):
            with bb.dataflow():
                y = bb.emit(relax.op.take(relax.const(table), idx, axis=axis, mode=mode))
                out = bb.emit_output(bb.emit(relax.op.multiply(y, relax.const(np.float32(2.0)))))
            bb.emit_func_output(out)
        (program,) = _programs(bb.get())
        assert "take" in {layer.kind for layer in program.layers}
        extent = table.shape[axis]
        lo, hi = (0, extent) if mode == "fast" else (-extent - 3, 2 * extent + 3)
        x = rng.integers(lo, hi, size=(4, 7)).astype(np.int32)
        _assert_same_bits(program, [x])
        record = []
        run_program_iss(program, [x], record)
        rows = [r for r in record if program.layers[r.layer].kind == "take"]
        modelled, executed = sum(r.modelled for r in rows), sum(r.cycles for r in rows)
        assert abs(modelled - executed) <= 0.01 * executed, (modelled, executed)  # errors 0 to 0.2%
        if mode == "fast":
            x[2, 3], x[3, 0] = extent + 1, -1
            with pytest.raises(IndexError, match=rf"take index {extent + 1} is out of range for axis {axis} "
                                                 rf"of extent {extent}"):
                run_program_iss(program, [x])


@pytest.mark.parametrize("kind,k", [("dense", 40), ("dense", 600), ("matmul", 600)])
def test_int32_sums_bit_identical(kind, k):
    """The int8 GEMM with raw int32 sums (no epilogue): the array writes the first chunk's sums
    into the accumulator, the M4F adds the later chunks' (k = 600: two accumulator-safe chunks on
    the 24-bit production chip); iss equals the default simulator and numpy."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "program"))
    from test_int32_gemm import int32_program

    from tvm_spinn.mapping import MappingOptions, map_program

    rng = np.random.default_rng(12)
    m, n = 9, 14
    x = rng.integers(-128, 128, size=(m, k)).astype(np.int8)
    w = rng.integers(-128, 128, size=(k, n)).astype(np.int8)
    x[0], w[:, 0] = -128, -128
    program = int32_program(kind, m, k, n, w)
    mapped = map_program(program, program.arch, MappingOptions())
    feeds = [x] if kind == "dense" else [x, w]
    (want,) = run_program(mapped, feeds)
    (got,) = run_program_iss(mapped, feeds)
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert np.array_equal(got, (x.astype(np.int64) @ w.astype(np.int64)).astype(np.int32))


def test_int8_requantization_bit_identical_over_the_shift_range():
    """The ``gemm_i8`` kernel's requantization run directly (a last chunk whose array sums are
    zero, so the accumulator is the given int32 values) against
    :func:`tvm_spinn.program.quant.requantize` on the simulator's operands: every shift of
    ``[1, 62]`` (the 32-bit path from 32 up, the 64-bit one below), accumulators and biases at
    the int32 extremes, zero-point terms that wrap in 32 bits, unsaturated and saturated
    outputs."""
    from tvm_spinn.pe.kernels.i8_epilogues import i8_dsp_table
    from tvm_spinn.program.quant import requantize
    from tvm_spinn.target.arch import SpinnArch

    arch = SpinnArch()
    image = role_image(("gemm_i8",))
    machine = PeMachine(image.elf, image.name, 0, arch.acc_bits, arch)
    rng = np.random.default_rng(21)
    m, n = 6, 62
    shift = np.arange(1, 63, dtype=np.int64)
    m0 = rng.integers(1 << 30, 1 << 31, size=n)
    # accumulators of the size each shift brings near the int8 range, and the extremes
    scale = np.ldexp(100.0, shift.astype(int) - 30)
    acc = np.clip(rng.normal(size=(m, n)) * scale, -2.0 ** 31, 2.0 ** 31 - 1).astype(np.int64)
    acc[0, :], acc[1, :] = -(1 << 31), (1 << 31) - 1
    bias = rng.integers(-(1 << 31), 1 << 31, size=n)
    zw = rng.integers(-128, 128, size=n)
    rowsum = rng.integers(-(1 << 31), 1 << 31, size=m)
    colsum = rng.integers(-(1 << 31), 1 << 31, size=n)
    # the even columns without zero-point terms and with a bias of the accumulators' size
    even = slice(0, n, 2)
    bias[even] = np.clip(rng.normal(size=n // 2) * scale[even], -2.0 ** 31, 2.0 ** 31 - 1).astype(np.int64)
    zw[even], colsum[even] = 0, 0
    zx, kk, y_zero, y_min, y_max = 77, 300, -5, -128, 127
    v = (acc - zw * rowsum[:, None] - zx * colsum + kk * zx * zw).astype(np.int32).astype(np.int64)
    want = requantize(v + bias, m0, shift, y_zero, y_min, y_max).astype(np.int8)
    inside = (want > y_min) & (want < y_max)
    assert inside[2:, shift < 32].sum() > 20 and inside[2:, shift >= 32].sum() > 20 and not inside.all()
    consts = np.concatenate([[zx, kk, y_zero, y_min, y_max], np.stack([zw, bias, m0, shift], axis=1).ravel()])
    # then the next chunk's five words (none) and the host's per-column table of the DSP paths
    consts = np.concatenate([consts, np.zeros(5, np.int64), i8_dsp_table(consts)]).astype(np.int32)
    k = 4
    arrays = [np.zeros(m * k, np.int8), np.zeros(k * n, np.int8), np.zeros(m * n, np.int32), acc.astype(np.int32),
              rowsum.astype(np.int32), colsum.astype(np.int32), consts, np.zeros(m * n, np.int8)]
    addr, pointers = machine.arena, []
    for arr in arrays:
        pointers.append(addr)
        machine.write(addr, arr.tobytes())
        addr += -(-arr.nbytes // 8) * 8
    from tvm_spinn.program.ops.gemm.geometry import int8_block_columns
    machine.run([pointers + [m, n, k, 2 | int8_block_columns(m, n, arch) << 8]])
    got = np.frombuffer(machine.read(pointers[-1], m * n), np.int8).reshape(m, n)
    assert np.array_equal(got, want)


def _movement_module(dtype: str, shape, op: str):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            if op == "permute":
                y = bb.emit(relax.op.permute_dims(x, [4, 2, 0, 3, 1]))
            elif op == "slice":
                y = bb.emit(relax.op.strided_slice(x, axes=[0, 2, 4], begin=[1, 3, 0], end=[2, 0, 6],
                                                   strides=[1, -2, 4]))
            else:
                y = bb.emit(relax.op.broadcast_to(x, [3, *shape[1:]]))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dtype,shape,op", [("int8", (2, 3, 4, 5, 6), "permute"), ("float32", (2, 3, 4, 5, 6), "permute"),
                                            ("int8", (2, 3, 5, 2, 7), "slice"), ("float32", (1, 4, 1, 5), "broadcast")])
def test_strided_views_move_by_dma_bit_identical(dtype, shape, op):
    """Strided views of the input (a 5-D permutation, a slice with a negative step, a broadcast)
    run as the ``dma`` role, the DMA engine driven by strided descriptors, with the default
    simulator's bits; the PE executes no per-element code (a tile's cycles are its descriptors'
    code and the engine's element a cycle: well under two cycles an element here)."""
    from tvm_spinn.pe.roles import layer_role
    programs = _programs(_movement_module(dtype, shape, op))
    (program,) = programs
    assert [layer_role(program, i) for i in range(len(program.layers))] == [("dma",)]
    x = (_special(shape, 4) if dtype == "float32" else
         np.random.default_rng(4).integers(-128, 128, shape).astype(dtype))
    _assert_same_bits(program, [x])
    record = []
    run_program_iss(program, [x], record)
    elements = int(np.prod(program.tensors[program.layers[0].output].shape))
    assert sum(r.cycles for r in record) == sum(r.modelled for r in record)
    assert sum(r.cycles for r in record) < 2 * elements + 260 * len(record)


def _scatter_module(dtype: str, shapes, op: str, axis: int = 0, pad_width=(), value: float = 0.0):
    """A ``concat`` of ``shapes`` along ``axis``, or a ``pad`` of ``shapes[0]``, alone in a program."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType(list(s), dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            if op == "concat":
                y = bb.emit(relax.op.concat(xs, axis=axis))
            else:
                y = bb.emit(relax.op.nn.pad(xs[0], list(pad_width), pad_value=value))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _values(shape, dtype: str, seed: int) -> np.ndarray:
    if dtype == "float32":
        return _special(shape, seed)
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max + 1, shape).astype(dtype)


@pytest.mark.parametrize("dtype,shapes,axis", [
    ("float32", [(3, 5, 7), (3, 2, 7), (3, 1, 7)], 1),
    ("int8", [(2, 3, 4, 5, 6), (2, 3, 4, 5, 1), (2, 3, 4, 5, 3)], 4),
    ("uint8", [(1, 6), (4, 6), (2, 6)], 0),
    ("float32", [(2, 3, 1, 5)] * 9, 2),
    ("int8", [(4, 1, 3), (4, 2, 3)], 1),
])
def test_concat_moves_by_dma_bit_identical(dtype, shapes, axis):
    """``concat`` (several dtypes and axes, up to the 9 inputs a pattern covers) runs as the ``dma``
    role, each input's elements scattered into the tile by descriptors with strides on the
    destination, with the default simulator's bits; the timing model's tile cycles are the
    executed ones exactly (the same ``dma`` code, the host's descriptor count)."""
    from tvm_spinn.pe.roles import layer_role
    (program,) = _programs(_scatter_module(dtype, shapes, "concat", axis=axis))
    assert [layer.kind for layer in program.layers] == ["concat"]
    assert layer_role(program, 0) == ("dma",)
    xs = [_values(program.tensors[t].shape, dtype, 30 + j) for j, t in enumerate(program.inputs)]
    _assert_same_bits(program, xs)
    record = []
    run_program_iss(program, xs, record)
    assert sum(r.cycles for r in record) == sum(r.modelled for r in record)


@pytest.mark.parametrize("shape,pad_width,value", [
    ((6, 6), (1, 2, 0, 1), -0.0),
    ((2, 3, 4, 5), (0, 0, 1, 0, 0, 3, 2, 2), 1.5),
    ((3, 1, 4), (0, 0, 2, 2, 0, 0), -3.25e-39),
    ((4, 5), (0, 0, 0, 0), 7.0),
    ((1, 3, 17, 17), (0, 0, 0, 0, 1, 1, 1, 1), 0.0),
])
def test_pad_moves_by_dma_bit_identical(shape, pad_width, value):
    """``pad`` (zero widths on some or all axes, a subnormal, -0.0 and other fill values) runs as
    the ``dma`` role: a fill descriptor (the value read with strides 0) where a piece holds fill
    elements, then the input scattered into the interior, with the default simulator's bits
    (NaN payloads, infinities and subnormals of the input kept); modelled cycles = executed."""
    from tvm_spinn.pe.roles import layer_role
    (program,) = _programs(_scatter_module("float32", [shape], "pad", pad_width=pad_width, value=value))
    assert [layer.kind for layer in program.layers] == ["pad"]
    assert layer_role(program, 0) == ("dma",)
    x = _special(shape, 40)
    _assert_same_bits(program, [x])
    record = []
    run_program_iss(program, [x], record)
    assert sum(r.cycles for r in record) == sum(r.modelled for r in record)


@pytest.mark.parametrize("m,n,k,chunk", [(9, 11, 13, 13), (9, 11, 13, 5), (3, 6, 9, 4), (4, 4, 8, 8), (2, 1, 7, 7)])
def test_gemm_f32_kernel_every_loop_nest(m, n, k, chunk):
    """The fp32 GEMM kernel on tiles that run each of its loop nests (4 x 4 blocks with whole and
    remainder trips of the unrolled k loop, 4 x 1 blocks right of them, 1 x 4 blocks below, single
    outputs in the corner), the reduction in chunks, bias per column or per row and the ReLU:
    every output is numpy's fp32 sum of its products in ascending k, each product and sum
    rounded (NaNs where numpy has them; every other value to the bit, signed zeros and
    subnormals included)."""
    from tvm_spinn.pe.execute import gemm_f32_panels

    a, b = _special((m, k), 31 + m), _special((k, n), 37 + n)
    bias = _special((max(m, n),), 41)
    for relu in (False, True):
        machine = PeMachine(role_image(("gemm_f32", relu)).elf, "gemm_f32", 0, 24)
        for per_row in (False, True):
            want = np.zeros((m, n), np.float32)
            with np.errstate(all="ignore"):
                for kk in range(k):
                    want = want + a[:, kk:kk + 1] * b[kk:kk + 1, :]
                want = want + (bias[:m, None] if per_row else bias[None, :n])
                if relu:
                    want = np.where(want <= 0, np.float32(0), want)
            pa = machine.arena
            pb = pa + 4 * m * chunk
            pc = pb + 4 * chunk * n
            pbias = pc + 4 * m * n
            machine.write(pbias, bias.tobytes())
            for k0 in range(0, k, chunk):
                k1 = min(k0 + chunk, k)
                pan_a, pan_b = gemm_f32_panels(a[:, k0:k1], b[k0:k1])
                machine.write(pa, pan_a)
                machine.write(pb, pan_b)
                flags = (1 if k0 == 0 else 0) | ((2 | 4 | (8 if per_row else 0)) if k1 == k else 0)
                machine.run([[pa, pb, pc, pbias, m, n, k1 - k0, flags]])
            got = np.frombuffer(machine.read(pc, 4 * m * n), np.float32).reshape(m, n)
            assert np.array_equal(np.isnan(got), np.isnan(want))
            ok = ~np.isnan(want)
            assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32)), (relu, per_row)
