"""2-D pooling: ``max_pool2d`` and ``avg_pool2d`` (NCHW), and ``adaptive_avg_pool2d`` with
uniform windows, lowered to ``avg_pool2d``.

- Arithmetic (Cortex-M4F, fp32): the window is visited row by row; max pooling starts from the
  lowest finite float32 and keeps ``acc > v ? acc : v`` (the compare-and-select of TVM's max
  reducer) except that the first NaN of the window is kept (PyTorch's max pooling propagates
  NaN; the fallback's llvm build does the same); a window lying entirely in the padding gives
  -3.4028235e38, as TVM's topi and onnxruntime; average pooling adds the window's
  elements in that order into an fp32 sum (a NaN operand propagating as in
  :func:`~tvm_spinn.program.ops.elementwise.binary`), then divides by the window size or by the count of
  non-padding elements (``count_include_pad``).
- Tiles: ``[planes, rows]`` over the ``N*C`` planes and the output rows (planes outer); a tile
  holds the band of input rows under its output rows (with the window's halo), padded width.
- ``max_pool2d_backward`` (:class:`PoolGrad`, a training step's gradient of ``max_pool2d``) has
  the arithmetic of TVM's ``topi.nn.pool_grad`` (what the llvm build runs), bit for bit: each
  window's argmax over the input padded with the lowest float32, in window order, keeping the
  earlier element unless the new one is greater or the kept value is not greater or equal
  (a NaN: ``acc > v || acc == v`` is false, the later element is taken); then each input
  element's gradient is an fp32 sum from +0.0 over the windows that may hold it, in TVM's
  order (window rows, then columns, from the one nearest the element's own row/column
  backwards), adding the window's output gradient where its argmax is this element and +0.0
  where not. Windows past the last output row or column hold no element (TVM reads there
  without a bound check; its flat argmax index never matches there). Tiles: ``[elements]``
  of the flattened input gradient; natively one ``pool_grad`` instruction (C++
  ``MaxPool2dBackwardF32``, the same operations). A NaN sum follows the M4F's VADD as the PE
  code issues it, the window's term as the first operand (FPSCR.DN = 0: a signalling NaN
  first, then a quiet one, the term's before the sum's; ``inf + -inf`` the default NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import PAD4, POS2, check_bool, fail
from ..model import Layer
from .elementwise import binary
from .sharding import REPLICATE, GatherInput, ShardDecision, ShardingRule, shard
from .m4f import Mix, mix_cycles
from .rows import RowLoop, stepped_cycles
from .base import ComputedFlat, MappingError, OpFamily, ceil_div, itemsize, register, starts, working_budget

__all__ = ["Pool", "PoolGrad", "PoolGradJob", "pool_grad_jobs", "PoolGradCode", "POOL_GRAD_CODE",
           "pool_grad_tile_cycles", "PoolCode", "POOL_CODE", "smallest_pool_tile_bytes", "max_pool2d_backward",
           "pool_tile_cycles"]


@dataclass(frozen=True)
class PoolCode:
    """The pool kernel of one kind (:mod:`tvm_spinn.pe.kernels` ``pool``) as the generated code
    executes it.

    Attributes
    ----------
    step_rows : int
        Window rows per step of the window-row loop (2 where LLVM unrolls it by 2).
    step : RowLoop
        One step of ``step_rows`` window rows (its columns: the window's).
    tail : RowLoop or None
        The ``kh mod step_rows`` row left over (None when ``step_rows`` is 1).
    output : Mix
        Per output: its accumulator's start, its store (``avg``: after the VDIV by its divisor)
        and the addresses advanced on the stack.
    entry : Mix
        Per output whose window has at least one full step: the step loop's set-up.
    out_row : Mix
        Per row of outputs.
    plane : Mix
        Per plane.
    setup : Mix
        Per job: the geometry's loads and the loops' strides and base addresses, beyond the
        prologue and epilogue that ``m4f_job_cycles`` holds.
    """

    step_rows: int
    step: RowLoop
    tail: "RowLoop | None"
    output: Mix
    entry: Mix
    out_row: Mix
    plane: Mix
    setup: Mix

    def output_cycles(self, kh: int, kw: int, arch) -> float:
        """Cycles of one output of a ``kh x kw`` window.

        Parameters
        ----------
        kh, kw : int
            The window's height and width.
        arch : SpinnArch
            The TRM's prices (:func:`~.m4f.mix_cycles`).

        Returns
        -------
        float
            M4F cycles.
        """
        return float(stepped_cycles(self, mix_cycles(self.output, arch), int(kh), int(kw), arch))


#: The pool kernels as the generated code executes them, per kind: the instruction classes of
#: the executed blocks, counted at windows of 1 to 4 rows and 1 to 8 columns (the pieces are the
#: differences of the counts between those windows) and priced by :func:`~.m4f.mix_cycles`.
#: ``max``: one window row per step; a window element is a load, the compare-and-select and the
#: NaN test's compare-and-select (two VCMP + VMRS + IT + VMOV, LLVM's order). ``avg``: LLVM
#: unrolls the window-row loop by 2 as well, a step is a pair of rows (an odd height's last
#: row is the tail); a window element is a load and a VADD, and the first row of each pair
#: also tests for the window's first element (ORRS, IT, VMOV: the sum starts from it).
POOL_CODE = {
    "max_pool2d": PoolCode(
        step_rows=1,
        step=RowLoop(overhead=Mix(loads=1.0, alu=16.0),
                         group=Mix(loads=4.0, fpu=24.0, alu=15.0, branches=1.0),
                         remainder=(Mix(loads=2.0, paired=1.0, fpu=7.0, alu=8.0), Mix(loads=1.0, fpu=7.0, alu=8.0),
                                    Mix(loads=1.0, fpu=5.0, alu=4.0)),
                         short=Mix(alu=-6.0, branches=2.0)),
        tail=None,
        output=Mix(loads=8.0, paired=8.0, fpu=1.0, alu=13.0, branches=2.0),
        entry=Mix(),
        out_row=Mix(loads=9.0, paired=8.0, alu=14.0, branches=3.0),
        plane=Mix(loads=6.0, paired=10.0, alu=17.0),
        setup=Mix(loads=16.0, paired=4.0, alu=31.0)),
    "avg_pool2d": PoolCode(
        step_rows=2,
        step=RowLoop(overhead=Mix(loads=6.0, paired=1.0, alu=24.0),
                         group=Mix(loads=8.0, fpu=9.0, alu=16.0, branches=2.0),
                         remainder=(Mix(loads=9.0, paired=6.0, fpu=3.0, alu=15.0), Mix(loads=5.0, fpu=2.0, alu=10.0),
                                    Mix(loads=6.0, fpu=2.0, alu=9.0, branches=-1.0)),
                         short=Mix(loads=-2.0, alu=-10.0, branches=5.0)),
        tail=RowLoop(overhead=Mix(loads=3.0, alu=12.0, branches=-1.0),
                         group=Mix(loads=4.0, fpu=5.0, alu=9.0, branches=1.0),
                         remainder=(Mix(loads=2.0, paired=1.0, fpu=2.0, alu=8.0), Mix(loads=1.0, fpu=1.0, alu=5.0),
                                    Mix(loads=1.0, fpu=1.0, alu=4.0)),
                         short=Mix(loads=-3.0, alu=-10.0, branches=3.0)),
        output=Mix(loads=12.0, paired=10.0, divides=1.0, alu=15.0, branches=3.0),
        entry=Mix(loads=7.0, paired=5.0, alu=8.0),
        out_row=Mix(loads=22.0, paired=24.0, alu=20.0, branches=3.0),
        plane=Mix(loads=8.0, paired=16.0, alu=19.0),
        setup=Mix(loads=20.0, paired=7.0, alu=38.0)),
}


def pool_tile_cycles(kind: str, planes, rows, ow: int, kh: int, kw: int, arch) -> np.ndarray:
    """M4F cycles of a pool tile of ``planes`` planes of ``rows`` output rows of ``ow`` outputs
    (``planes``, ``rows`` int64 arrays), ``kh x kw`` windows: :data:`POOL_CODE` priced by
    :func:`~.m4f.mix_cycles`, plus one job (``m4f_job_cycles``)."""
    code = POOL_CODE[kind]
    out_row = mix_cycles(code.out_row, arch) + ow * code.output_cycles(kh, kw, arch)
    return (arch.m4f_job_cycles + mix_cycles(code.setup, arch)
            + planes * (mix_cycles(code.plane, arch) + rows * out_row))

_F32 = np.float32
_F32_LOWEST = np.finfo(np.float32).min


def smallest_pool_tile_bytes(in_w: int, out_w: int, pool_h: int, dilation_h: int, pad_w: int,
                             in_bytes: int = 4, out_bytes: int = 4) -> int:
    """SRAM of one output row of one pool plane: its input band (window height, padded width)
    and the output row, double-buffered."""
    khe = (pool_h - 1) * dilation_h + 1
    return 2 * (in_bytes * khe * (in_w + pad_w) + out_bytes * out_w)


def _geometry(program, layer: Layer):
    n, c, h, w = program.tensors[layer.inputs[0]].shape
    oh, ow = program.tensors[layer.output].shape[2:]
    kh, kw = layer.attrs["pool_size"]
    sh = layer.attrs["strides"][0]
    khe = (kh - 1) * layer.attrs["dilation"][0] + 1
    wp = w + layer.attrs["padding"][1] + layer.attrs["padding"][3]
    return n, c, h, w, oh, ow, kh, kw, sh, khe, wp


class Pool(OpFamily):
    """Max and average 2-D pooling."""

    kinds = ("max_pool2d", "avg_pool2d")
    priority = 40
    composites = ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d")
    tile_arity = 2

    # -- partition and codegen ---------------------------------------------------------------
    def patterns(self, kit) -> list[tuple]:
        return [kit.unary(f"spinn.{name}", f"relax.nn.{name}", self._check_pattern) for name in self.composites]

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        if not kit.check_tensors(op, ctx, ("input",)):
            return False
        root = ctx.annotated_expr["root"]
        attrs = root.attrs
        if attrs.layout != "NCHW" or attrs.out_layout != "NCHW":
            return kit.refuse(op, root, f"layout {attrs.layout} (need NCHW)")
        if getattr(attrs, "ceil_mode", False):
            return kit.refuse(op, root, "ceil_mode=True")
        ishape = kit.static_shape(ctx.annotated_expr["input"])
        oshape = kit.static_shape(root)
        if op == "spinn.adaptive_avg_pool2d":
            if ishape[2] % oshape[2] or ishape[3] % oshape[3]:
                return kit.refuse(op, root, f"adaptive pool {ishape[2:]}->{oshape[2:]} is not uniform")
            pool_h, dil_h, pad_w = ishape[2] // oshape[2], 1, 0
        else:
            pool_h, dil_h, pad_w = int(attrs.pool_size[0]), int(attrs.dilation[0]), int(attrs.padding[1]) + int(attrs.padding[3])
        need = smallest_pool_tile_bytes(ishape[3], oshape[3], pool_h, dil_h, pad_w)
        return kit.check_fits(op, root, need, f"one output row of a {ishape[3]}-wide plane")

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        call = calls[0][1]
        layer.inputs = [lowerer.operand(call.args[0], env)]
        if kind == "adaptive_avg_pool2d":  # uniform windows: an average pool with stride = window
            in_shape = lowerer.tensors[layer.inputs[0]].shape
            out_shape = lowerer.tensors[layer.output].shape
            kh, kw = in_shape[2] // out_shape[2], in_shape[3] // out_shape[3]
            layer.kind = "avg_pool2d"
            layer.attrs.update(pool_size=[kh, kw], strides=[kh, kw], padding=[0, 0, 0, 0],
                               dilation=[1, 1], count_include_pad=True)
            return
        a = call.attrs
        ints = lambda values: [int(v) for v in values]  # noqa: E731
        layer.attrs.update(
            pool_size=ints(a.pool_size), strides=ints(a.strides), padding=ints(a.padding),
            dilation=ints(a.dilation), count_include_pad=bool(getattr(a, "count_include_pad", False)),
        )

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        return ({"pool_size": POS2, "strides": POS2, "padding": PAD4, "dilation": POS2},
                {"count_include_pad": check_bool})

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        v.need(f"{f}.inputs", kind, ins, 1)
        for i, tid in enumerate(ins):
            v.dtype(f"{f}.inputs[{i}]", tid, ("float32",))
        v.dtype(fo, out, ("float32",))
        v.consts(f, consts, set())
        n, c, h, w = v.rank(f"{f}.inputs[0]", ins[0], 4, 4)
        kh, kw = attrs["pool_size"]
        (sh, sw), (dh, dw), (pt, pl, pb, pr) = attrs["strides"], attrs["dilation"], attrs["padding"]
        oh, ow = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
        if oh < 1 or ow < 1:
            fail(f"{f}.attrs.pool_size", f"the window is larger than the padded {h}x{w} input")
        v.shape(fo, out, [n, c, oh, ow])
        return (n * c, oh), None

    # -- tiles as data ------------------------------------------------------------------------
    def region_extent(self, program, layer):
        out = program.tensors[layer.output].shape
        return (out[0] * out[1], out[2])

    def expand_regions(self, program, layer, tile):
        ext = self.region_extent(program, layer)
        p0, p1 = starts(ext[0], int(tile[0]))
        r0, r1 = starts(ext[1], int(tile[1]))
        pi = np.repeat(np.arange(len(p0)), len(r0))
        ri = np.tile(np.arange(len(r0)), len(p0))
        lo = np.stack([p0[pi], r0[ri]], axis=1)
        hi = np.stack([p1[pi], r1[ri]], axis=1)
        return lo, hi, np.full(len(pi), -1, dtype=np.int64)

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        n, c, _, _, oh, ow, kh, kw, *_ = _geometry(program, layer)
        return n * c * oh * ow * kh * kw, None

    def smallest_tile_bytes(self, program, layer, arch):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        _, _, _, w, _, ow, kh, _, _, _, _ = _geometry(program, layer)
        pad = layer.attrs["padding"][1] + layer.attrs["padding"][3]
        return smallest_pool_tile_bytes(w, ow, kh, layer.attrs["dilation"][0], pad, ie, oe)

    def choose_tile(self, program, layer, arch, pes, naive):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        n, c, h, w, oh, ow, kh, kw, sh, khe, wp = _geometry(program, layer)

        def band_bytes(rows: int) -> int:  # one plane's input band (with halo) and output rows
            return ie * ((rows - 1) * sh + khe) * wp + oe * rows * ow

        budget = working_budget(arch)
        rows = oh
        while rows > 1 and 2 * band_bytes(rows) > budget:
            rows = ceil_div(rows, 2)
        if 2 * band_bytes(rows) > arch.tile_sram_bytes:
            need = 2 * band_bytes(1)
            raise MappingError(
                f"layer {layer.name}: one output row of a {h}x{w} plane needs {need} bytes of SRAM, "
                f"a PE has {arch.tile_sram_bytes}; the smallest system that fits has sram_bytes >= "
                f"{need + arch.sram_reserved_bytes}"
            )
        planes = 1 if rows < oh else max(1, min(budget // (2 * band_bytes(oh)), ceil_div(n * c, pes)))
        return [planes, rows]

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        ie = sum(itemsize(program, tid) for tid in layer.inputs)
        oe = itemsize(program, layer.output)
        n, c, h, w, oh, ow, kh, kw, sh, khe, wp = _geometry(program, layer)
        ext = hi - lo
        k, rows = ext[:, 0], ext[:, 1]
        band = ie * ((rows - 1) * sh + khe) * wp + oe * rows * ow
        cycles = np.ceil(pool_tile_cycles(layer.kind, k, rows, ow, kh, kw, arch))
        return (2 * band * k, ie * k * np.minimum(h, (rows - 1) * sh + khe) * w, 0,
                oe * k * rows * ow, cycles)

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        x = runner.env[runner.layer.inputs[0]]
        n, c, h, w = x.shape
        pt, pl, pb, pr = runner.layer.attrs["padding"]
        fill = _F32_LOWEST if runner.layer.kind == "max_pool2d" else 0.0
        runner.planes = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=fill).reshape(
            n * c, h + pt + pb, w + pl + pr)
        runner.valid = np.pad(np.ones((h, w), _F32), ((pt, pb), (pl, pr)))
        runner.out_planes = runner.out.reshape(n * c, runner.out.shape[2], runner.out.shape[3])

    def run_tile(self, runner, tile) -> None:
        (p0, p1), (r0, r1) = tile.region
        layer = runner.layer
        attrs = layer.attrs
        kh, kw = attrs["pool_size"]
        sh, sw = attrs["strides"]
        dh, dw = attrs["dilation"]
        ow = runner.out_planes.shape[2]
        oh = r1 - r0
        # The band of (padded) input rows under output rows [r0, r1).
        src = runner.planes[p0:p1, r0 * sh: (r1 - 1) * sh + (kh - 1) * dh + 1]
        valid = runner.valid[r0 * sh: (r1 - 1) * sh + (kh - 1) * dh + 1]
        acc = None
        count = np.zeros((oh, ow), _F32)
        for i in range(kh):  # sequential window order, vectorized over planes and pixels
            for j in range(kw):
                sl = (slice(i * dh, i * dh + sh * (oh - 1) + 1, sh), slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))
                v = src[:, sl[0], sl[1]]
                if layer.kind == "max_pool2d":
                    acc = np.full(v.shape, _F32_LOWEST) if acc is None else acc
                    acc = np.where((acc > v) | np.isnan(acc), acc, v)
                else:
                    acc = v.astype(_F32) if acc is None else binary("add", acc, v)
                    count += valid[sl]
        if layer.kind == "avg_pool2d":
            div = _F32(kh * kw) if attrs.get("count_include_pad") else count
            acc = (acc / div).astype(_F32)
        runner.out_planes[p0:p1, r0:r1] = acc

    def whole_region(self, layer, out):
        return ((0, out.shape[0] * out.shape[1]), (0, out.shape[2]))

    def step(self, program, layer):
        """:meth:`run_tile` over the whole output (float32), with the window slices and the
        average pool's counts prepared once: the same window order and operations."""
        tensors = program.tensors
        x_tid = layer.inputs[0]
        if np.dtype(tensors[x_tid].dtype) != _F32 or np.dtype(tensors[layer.output].dtype) != _F32:
            return None
        shape = tuple(tensors[layer.output].shape)
        n, c, h, w = tensors[x_tid].shape
        attrs = layer.attrs
        pt, pl, pb, pr = attrs["padding"]
        kh, kw = attrs["pool_size"]
        sh, sw = attrs["strides"]
        dh, dw = attrs["dilation"]
        oh, ow = shape[2], shape[3]
        is_max = layer.kind == "max_pool2d"
        fill = _F32_LOWEST if is_max else _F32(0.0)
        padded = (n * c, h + pt + pb, w + pl + pr)
        band = (oh - 1) * sh + (kh - 1) * dh + 1
        windows = [(slice(i * dh, i * dh + sh * (oh - 1) + 1, sh), slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))
                   for i in range(kh) for j in range(kw)]
        div = None
        if not is_max:
            valid = np.pad(np.ones((h, w), _F32), ((pt, pb), (pl, pr)))[:band]
            count = np.zeros((oh, ow), _F32)
            for sl in windows:
                count += valid[sl]
            div = _F32(kh * kw) if attrs.get("count_include_pad") else count

        def step(program, env):
            x = env[x_tid]
            planes = np.full(padded, fill, dtype=_F32)
            planes.reshape(n, c, padded[1], padded[2])[:, :, pt:pt + h, pl:pl + w] = x
            src = planes[:, :band]
            acc = None
            for s0, s1 in windows:  # sequential window order, vectorized over planes and pixels
                v = src[:, s0, s1]
                if is_max:
                    acc = np.full(v.shape, _F32_LOWEST) if acc is None else acc
                    acc = np.where((acc > v) | np.isnan(acc), acc, v)
                else:
                    acc = v.astype(_F32) if acc is None else binary("add", acc, v)
            if not is_max:
                acc = (acc / div).astype(_F32)
            if acc.dtype != _F32 or not acc.flags.c_contiguous:
                acc = np.ascontiguousarray(acc, dtype=_F32)
            return acc.reshape(shape)
        return step

    def native(self, program, layer, nb, clip=None):
        """float32 pools as one ``pool`` instruction: :meth:`step`'s window order, padding
        values and operations."""
        tensors = program.tensors
        x_tid = layer.inputs[0]
        if tensors[x_tid].dtype != "float32" or tensors[layer.output].dtype != "float32":
            return False
        n, c, h, w = (int(d) for d in tensors[x_tid].shape)
        oh, ow = (int(d) for d in tensors[layer.output].shape[2:])
        attrs = layer.attrs
        pt, pl = int(attrs["padding"][0]), int(attrs["padding"][1])
        nb.emit("pool", nb.read(x_tid), nb.write(layer.output), n * c, h, w, oh, ow, *attrs["pool_size"],
                *attrs["strides"], *attrs["dilation"], pt, pl, int(layer.kind == "max_pool2d"),
                int(bool(attrs.get("count_include_pad"))))
        return True


class PoolSharding(ShardingRule):
    """Pooling keeps a split of the channels (axis 1), and on the data axis (``dp``) of the
    batch (axis 0); any other split is gathered. Row blocks (``sp``) would cut windows:
    replicated."""

    def propagate(self, ctx, layer, ins):
        if ctx.axis.name == "sp":
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        if ins[0] == shard(1) or (ctx.axis.name == "dp" and ins[0] == shard(0)):
            return ShardDecision(ins[0], "split")
        if ins[0].split:
            return ShardDecision(REPLICATE, "rep", (GatherInput(0),))
        return ShardDecision(REPLICATE, "rep")


Pool.sharding = PoolSharding()
register(Pool())


def max_pool2d_backward(dy: np.ndarray, x: np.ndarray, pool_size, strides, padding) -> np.ndarray:
    """The gradient of ``max_pool2d(x)`` (NCHW, no dilation) for the output gradient ``dy``, as
    TVM's ``topi.nn.pool_grad`` computes it (see the module docstring)."""
    n, c, h, w = x.shape
    kh, kw = pool_size
    sh, sw = strides
    pt, pl, pb, pr = padding
    oh, ow = dy.shape[2:]
    xp = np.full((n, c, h + pt + pb, w + pl + pr), _F32_LOWEST, dtype=_F32)
    xp[:, :, pt:pt + h, pl:pl + w] = x
    # argmax tap of every window: -1 (nothing taken yet, as TVM's identity) until an element is
    # taken; acc > v || acc == v keeps the earlier one (indices ascend in window order)
    tap = np.full((n, c, oh, ow), -1, dtype=np.int64)
    best = np.full((n, c, oh, ow), _F32_LOWEST, dtype=_F32)
    for i in range(kh):
        for j in range(kw):
            v = xp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
            keep = (best > v) | (best == v)
            tap = np.where(keep, tap, i * kw + j)
            best = np.where(best > v, best, v)
    dx = np.zeros((n, c, h, w), dtype=_F32)
    ih = np.arange(h)[:, None] + pt  # padded coordinates of every input element
    iw = np.arange(w)[None, :] + pl
    lo_h = np.where(ih < kh, 0, (ih - kh) // sh + 1)
    lo_w = np.where(iw < kw, 0, (iw - kw) // sw + 1)
    for wh in range(-(-kh // sh)):
        for ww in range(-(-kw // sw)):
            oi, oj = ih // sh - wh, iw // sw - ww  # [h, 1], [1, w]
            ok = (oi >= lo_h) & (oj >= lo_w) & (oi < oh) & (oj < ow)
            oi_c, oj_c = np.clip(oi, 0, oh - 1), np.clip(oj, 0, ow - 1)
            taken = tap[:, :, oi_c, oj_c] == (ih - oi_c * sh) * kw + (iw - oj_c * sw)
            # the PE's VADD: the window's term first (its NaN rule, :func:`binary`)
            with np.errstate(invalid="ignore"):  # inf + -inf: the default NaN, by binary's rule
                dx = binary("add", np.where(ok & taken, dy[:, :, oi_c, oj_c], _F32(0)), dx)
    return dx


@dataclass(frozen=True)
class PoolGradJob:
    """One job of the ``pool_grad`` PE kernel (:mod:`tvm_spinn.pe.kernels`): the output
    elements ``[lo, hi)`` of rows ``[row0, row1)`` of ``plane`` (``lo``, ``hi`` counted from
    the band's first element), and the windows that may hold them: rows ``[oy0, oy0 + nwy)``,
    columns ``[ox0, ox0 + nwx)``."""

    plane: int
    row0: int
    row1: int
    lo: int
    hi: int
    oy0: int
    nwy: int
    ox0: int
    nwx: int


def pool_grad_jobs(e0: int, e1: int, h: int, w: int, oh: int, ow: int, pool, strides, padding,
                   free: int) -> list[PoolGradJob]:
    """The jobs of a ``max_pool2d_backward`` tile ``[e0, e1)`` of the flattened input gradient:
    per plane it covers, per band of its rows whose buffers (the padded input rows under the
    band's windows, their output gradients, the band's elements; float32) fit ``free`` bytes
    (halved until they do), the windows that may hold a band element (a one-row band: only the
    windows over its columns).

    Parameters
    ----------
    e0, e1 : int
        The tile's first and past-the-last element of the flattened input gradient.
    h, w, oh, ow : int
        The input's and the output gradient's plane sizes.
    pool, strides : tuple of int
        The window ``(kh, kw)`` and its strides ``(sh, sw)``.
    padding : tuple of int
        ``(top, left, bottom, right)``.
    free : int
        SRAM bytes a job's buffers may use.

    Returns
    -------
    list of PoolGradJob
        In plane and row order.
    """
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = pool, strides, padding
    wp, hw, jobs = w + pl + pr, h * w, []
    for q in range(e0 // hw, (e1 - 1) // hw + 1):
        s0, s1 = max(e0, q * hw) - q * hw, min(e1, (q + 1) * hw) - q * hw
        ra, rb = s0 // w, -(-s1 // w)
        band = rb - ra
        while band > 1:
            nwy = -(-band // sh) + -(-kh // sh) + 1
            if 4 * (((nwy - 1) * sh + kh) * wp + nwy * ow + band * w) <= free:
                break
            band = -(-band // 2)
        for qa in range(ra, rb, band):
            qb = min(qa + band, rb)
            # the windows that may hold a row r of [qa, qb): oy * sh <= r + pt < oy * sh + kh
            oy0 = max(0, -(-(qa + pt - kh + 1) // sh))
            nwy = max(0, min(oh, (qb - 1 + pt) // sh + 1) - oy0)
            lo, hi = max(s0, qa * w) - qa * w, min(s1, qb * w) - qa * w
            ox0, ox1 = 0, ow
            if qb - qa == 1:  # the columns [lo, hi) of one row: the windows over them
                ox0 = max(0, -(-(lo + pl - kw + 1) // sw))
                ox1 = min(ow, (hi - 1 + pl) // sw + 1)
            jobs.append(PoolGradJob(q, qa, qb, lo, hi, oy0, nwy, ox0, max(0, ox1 - ox0)))
    return jobs


@dataclass(frozen=True)
class PoolGradCode:
    """The ``pool_grad`` PE kernel as the generated code executes it, in M4F cycles at the
    Cortex-M4 TRM's prices (:mod:`tvm_spinn.pe.cycles`), each piece the difference of the
    executed cycles of single jobs that differ in that piece only (read from the ISS at jobs of
    0 to 2 rows of 10 windows, windows of 1 to 4 rows of 1 to 8 columns, 0 to 200 elements).

    Attributes
    ----------
    job : float
        One job run on its own: the runtime's start-up, the job loop's step, the kernel's
        prologue, geometry loads and epilogue.
    zero, zero_element : float
        The +0.0 fill of the job's elements: its loop's set-up, and per element.
    window_row : float
        Per row of windows: the row's addresses and its loop.
    window : float
        Per window: the argmax's start, the taken tap's tests and the loop step.
    tap_row : float
        Per row of a window: its column loop's set-up and exit.
    tap_group : float
        Per 4 columns of a window's row (LLVM unrolls the column loop by 4): 4 loads and
        compare-and-selects of the argmax.
    tap_rest : tuple of float
        The ``kw mod 4`` columns left over (1, 2, 3 of them).
    add : float
        Per gradient added to an element (a load, VADD, store).
    """

    job: float
    zero: float
    zero_element: float
    window_row: float
    window: float
    tap_row: float
    tap_group: float
    tap_rest: tuple
    add: float

    def window_cycles(self, kh: int, kw: int) -> float:
        """Cycles of one ``kh x kw`` window's argmax and tests."""
        full, rest = divmod(int(kw), 4)
        return self.window + kh * (self.tap_row + full * self.tap_group + (0.0, *self.tap_rest)[rest])

    def job_cycles(self, job: PoolGradJob, kh: int, kw: int) -> float:
        """Cycles of one job (:func:`pool_grad_jobs`); a gradient added per window, or per
        element where the job has fewer elements than windows (each window takes one element)."""
        windows = job.nwy * job.nwx
        elements = job.hi - job.lo
        return (self.job + self.zero + elements * self.zero_element + job.nwy * self.window_row
                + windows * self.window_cycles(kh, kw) + min(windows, elements) * self.add)


#: The ``pool_grad`` kernel's pieces (see :class:`PoolGradCode`).
POOL_GRAD_CODE = PoolGradCode(job=115.0, zero=16.5, zero_element=2.25, window_row=46.0, window=61.0, tap_row=10.0,
                              tap_group=41.0, tap_rest=(17.0, 34.0, 43.0), add=15.0)


def pool_grad_tile_cycles(e0: int, e1: int, geometry: tuple, free: int) -> float:
    """M4F cycles of a ``max_pool2d_backward`` tile ``[e0, e1)``: its jobs priced by
    :data:`POOL_GRAD_CODE`.

    Parameters
    ----------
    e0, e1 : int
        The tile's elements of the flattened input gradient.
    geometry : tuple
        ``(h, w, oh, ow, pool, strides, padding)`` as :func:`pool_grad_jobs` takes them.
    free : int
        SRAM bytes a job's buffers may use.

    Returns
    -------
    float
        M4F cycles.
    """
    (kh, kw) = geometry[4]
    return float(sum(POOL_GRAD_CODE.job_cycles(j, kh, kw) for j in pool_grad_jobs(e0, e1, *geometry, free)))


class PoolGrad(ComputedFlat):
    """``max_pool2d_backward(dy, x)``: the input gradient of a max pooling (training)."""

    kinds = ("max_pool2d_backward",)
    priority = 40

    def patterns(self, kit) -> list[tuple]:
        return [kit.binary("spinn.max_pool2d_backward", "relax.grad.max_pool2d_backward", self._check_pattern)]

    @staticmethod
    def _check_pattern(kit, op: str, ctx) -> bool:
        if not kit.check_tensors(op, ctx, ("lhs", "rhs")):
            return False
        root = ctx.annotated_expr["root"]
        a = root.attrs
        if a.layout != "NCHW" or a.out_layout != "NCHW":
            return kit.refuse(op, root, f"layout {a.layout} (need NCHW)")
        if bool(a.ceil_mode) or any(int(d) != 1 for d in a.dilation):
            return kit.refuse(op, root, "ceil_mode or dilation (TVM's pool_grad has neither)")
        return True

    def lower(self, lowerer, name, kind, calls, env, layer) -> None:
        call = calls[0][1]
        layer.inputs = [lowerer.operand(a, env) for a in call.args[:2]]
        a = call.attrs
        layer.attrs.update(pool_size=[int(v) for v in a.pool_size], strides=[int(v) for v in a.strides],
                           padding=[int(v) for v in a.padding])

    def attr_schema(self, kind: str, mode: str):
        return {"pool_size": POS2, "strides": POS2, "padding": PAD4}, {}

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        v.float32_only(f, kind, ins, out, consts, 2)
        n, c, h, w = v.rank(f"{f}.inputs[1]", ins[1], 4, 4)
        (kh, kw), (sh, sw), (pt, pl, pb, pr) = attrs["pool_size"], attrs["strides"], attrs["padding"]
        oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
        if oh < 1 or ow < 1:
            fail(f"{f}.attrs.pool_size", f"the window is larger than the padded {h}x{w} input")
        v.shape(f"{f}.inputs[0]", ins[0], [n, c, oh, ow])
        v.shape(f"{f}.output", out, [n, c, h, w])
        return (n * c * h * w,), None

    def work(self, program, layer, arch):
        return int(np.prod(program.tensors[layer.output].shape, dtype=np.int64)), None

    def cycles_per_element(self, layer, arch):
        """Per input element: the argmax's compares (window taps per output, over the
        ``stride^2`` inputs per output) and, per window that may hold it, a compare and an add."""
        (kh, kw), (sh, sw) = layer.attrs["pool_size"], layer.attrs["strides"]
        windows = -(-kh // sh) * -(-kw // sw)
        return arch.m4f_elementwise_cycles * (2 * kh * kw / (sh * sw) + 2 * windows)

    @staticmethod
    def geometry(program, layer) -> tuple:
        """``(h, w, oh, ow, pool, strides, padding)`` of :func:`pool_grad_jobs`."""
        h, w = (int(d) for d in program.tensors[layer.inputs[1]].shape[2:])
        oh, ow = (int(d) for d in program.tensors[layer.inputs[0]].shape[2:])
        a = layer.attrs
        return h, w, oh, ow, tuple(a["pool_size"]), tuple(a["strides"]), tuple(a["padding"])

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        """The flat family's SRAM and bytes; the M4F cycles of each tile's jobs as the PE kernel
        runs them (:func:`pool_grad_tile_cycles`: per plane and band of rows, every window that
        may hold one of the tile's elements)."""
        sram, ins, w, out, _ = super().tile_costs(program, layer, arch, tile, lo, hi)
        geometry, free = self.geometry(program, layer), working_budget(arch)
        cycles = np.array([pool_grad_tile_cycles(int(a), int(b), geometry, free) for a, b in zip(lo[:, 0], hi[:, 0])])
        return sram, ins, w, out, np.ceil(cycles)

    def native(self, program, layer, nb, clip=None):
        """One ``pool_grad`` instruction: :func:`max_pool2d_backward`'s argmax and sums."""
        tensors = program.tensors
        dy, x = layer.inputs
        if any(tensors[t].dtype != "float32" for t in (dy, x, layer.output)):
            return False
        n, c, h, w = (int(d) for d in tensors[x].shape)
        oh, ow = (int(d) for d in tensors[dy].shape[2:])
        a = layer.attrs
        nb.emit("pool_grad", nb.read(dy), nb.read(x), nb.write(layer.output), n * c, h, w, oh, ow,
                *a["pool_size"], *a["strides"], a["padding"][0], a["padding"][1])
        return True

    def values(self, layer, env):
        a = layer.attrs
        return max_pool2d_backward(env[layer.inputs[0]], env[layer.inputs[1]], a["pool_size"], a["strides"],
                                   a["padding"])


class PoolGradSharding(ShardingRule):
    """``max_pool2d_backward(dy, x)``: the gradient of each (sample, channel) plane reads only
    that plane of ``dy`` and ``x``, so a split of the batch (axis 0) or of the channels (axis 1)
    that the split operands share is kept (a replicated operand is sliced for free, a layer on
    replicated operands stays replicated); a split of the spatial axes would cut windows, so it
    is gathered, and row blocks (``sp``) are replicated."""

    def propagate(self, ctx, layer, ins):
        axes = {s.axis for s in ins if s.split}
        if ctx.axis.name != "sp" and len(axes) == 1 and axes <= {0, 1}:
            return ShardDecision(shard(axes.pop()), "split")
        if axes or ctx.axis.name == "sp":
            return ShardDecision(REPLICATE, "rep", gather_all=True)
        return ShardDecision(REPLICATE, "rep")


PoolGrad.sharding = PoolGradSharding()
register(PoolGrad())
