"""The GEMM operator family: conv2d, dense and matmul, fp32 (M4F) and int8 (MAC array)."""

from __future__ import annotations

import math

import numpy as np

from .... import options as _options
from ...checks import RELU, ZERO, check_bool, check_str, fail
from ...model import Layer
from ...quant import ROUNDINGS
from ..base import ACC_BYTES, OpFamily, gemm_tile_bytes, itemsize, starts
from .geometry import (GEMM_KINDS, _CONV, _INT8, _REQUANT, _conv_input_bytes, _cost_operands, _operand_elems,
                       _part_side, choose_gemm_tile, chunk_length, gemm_shape, gemm_tile_cycles,
                       k_part_bounds, k_part_tail_cycles, safe_k_chunk, smallest_gemm_tile_bytes, splits_of)
from .patterns import (_check_conv2d, _check_dense, _check_int8_epilogue, _check_matmul, _gemm_patterns,
                       _lower_bias, _lower_qgemm, _qgemm_patterns)
from .reference import (_arrange, _fp32_native, _fp32_step, _gemm_block, _gemm_whole, _int8_native,
                        _int8_operands, _qgemm_block, _qgemm_part, _qgemm_whole, _rhs)


# -- the family -----------------------------------------------------------------------------------
class Gemm(OpFamily):
    """conv2d, dense and matmul, fp32 (M4F) and int8 (MAC array)."""

    kinds = GEMM_KINDS
    priority = 10
    modes = ("fp32", "int8")
    tile_arity = 3
    tile_optional = 1  # [tm, tn, tk, p]: the reduction split over p PEs (int8)
    #: a clip reading only this family's fp32 result runs in its epilogue (see :meth:`step`)
    fuses_clip = True
    #: the region axis a GEMM's weight operand varies along: conv2d's output channels
    #: (A = weight), dense's and matmul's output columns (B = weight)
    _WEIGHT_AXIS = {"conv2d": 1, "dense": 2, "matmul": 2}

    # -- operand traffic ------------------------------------------------------------------------
    def weight_region_axis(self, layer):
        return self._WEIGHT_AXIS[layer.kind]

    def streamed_inputs(self, program, layer):
        acts = super().streamed_inputs(program, layer)
        if layer.kind == "matmul":
            # a tile's ``in_bytes`` are the left operand's; the right one (``w_bytes``) has its
            # own source, so where it lives (e.g. a KV cache held in SRAM) does not send the
            # left operand to DRAM
            return [tid for tid in layer.inputs[:1] if tid in acts]
        return acts

    def weight_gemm(self, layer):
        return layer.kind == "dense" and "weight" in layer.consts

    def activation_gemm(self, layer):
        return layer.kind == "matmul"

    def layouts(self, layer):
        if layer.kind == "dense":
            return frozenset(("resident", "split_k") if layer.mode == "int8" else ("resident",))
        if layer.kind == "matmul" and layer.mode != "int8":
            return frozenset(("one_round",))
        return frozenset()

    # -- partition ------------------------------------------------------------------------------
    def lowers(self, composite: str) -> bool:
        return composite.startswith(("conv2d", "dense", "matmul", "qconv2d", "qdense", "qmatmul"))

    def patterns(self, kit) -> list[tuple]:
        """int8 patterns (largest first) before the fp32 ones, so a quantized GEMM reaches the
        MAC array with its dequantizes, epilogue and requantize fused."""
        from tvm.relax.dpl import is_op, wildcard

        lhs, rhs = wildcard(), wildcard()
        matmul = is_op("relax.matmul")(lhs, rhs)
        return [
            *_qgemm_patterns(kit, "spinn.qconv2d", "relax.nn.conv2d", weight_const=True),
            *_qgemm_patterns(kit, "spinn.qdense", "relax.matmul", weight_const=True),
            *_qgemm_patterns(kit, "spinn.qmatmul", "relax.matmul", weight_const=False),
            *_gemm_patterns(kit, "spinn.conv2d", "relax.nn.conv2d", _check_conv2d),
            *_gemm_patterns(kit, "spinn.dense", "relax.matmul", _check_dense),
            kit.entry("spinn.matmul", matmul, {"lhs": lhs, "rhs": rhs, "root": matmul}, _check_matmul),
        ]

    def lower(self, lowerer, name: str, kind: str, calls: list, env: dict, layer: Layer) -> None:
        """Lower a GEMM composite (all its calls: the GEMM, its dequantizes and epilogue)."""
        if kind.startswith(("qconv2d", "qdense", "qmatmul")):
            _lower_qgemm(lowerer, layer, name, calls, env)
            return
        main = calls[0][1]
        ops = [c.op.name for _, c in calls]
        if kind == "matmul":
            layer.inputs = [lowerer.operand(x, env) for x in main.args]
            return
        base = "conv2d" if kind.startswith("conv2d") else "dense"
        layer.kind = base
        layer.inputs = [lowerer.operand(main.args[0], env)]
        layer.consts["weight"] = lowerer.operand(main.args[1], env)
        layer.attrs["relu"] = "relax.nn.relu" in ops
        if "relax.add" in ops:
            add = calls[ops.index("relax.add")][1]
            bias = add.args[1] if not add.args[1].same_as(calls[0][0]) else add.args[0]
            layer.consts["bias"] = _lower_bias(lowerer, bias, layer.output, base, name)
        if base == "conv2d":
            a = main.attrs
            layer.attrs.update(strides=[int(v) for v in a.strides], padding=[int(v) for v in a.padding],
                               dilation=[int(v) for v in a.dilation], groups=int(a.groups))

    # -- validation -----------------------------------------------------------------------------
    def attr_schema(self, kind: str, mode: str):
        if mode == "int8":
            req = dict(_INT8)
            if kind == "conv2d":
                req.update(_CONV)
            if kind == "matmul":
                req.update(b_zero=ZERO, b_flip=check_bool)
            return req, dict(_REQUANT, rounding=lambda v, f: check_str(v, f, ROUNDINGS))
        if kind == "conv2d":
            return dict(_CONV), dict(RELU)
        return {}, dict(RELU)

    def check(self, v, f, kind, mode, ins, consts, out, attrs):
        fo = f"{f}.output"
        int8 = mode == "int8"
        act = ("int8", "uint8") if int8 else ("float32",)
        v.need(f"{f}.inputs", kind, ins, 2 if kind == "matmul" else 1)
        for i, tid in enumerate(ins):
            v.dtype(f"{f}.inputs[{i}]", tid, act)
        if kind == "conv2d":
            n, c, h, w = v.rank(f"{f}.inputs[0]", ins[0], 4, 4)
            wt = consts.get("weight")
            if wt is None:
                fail(f"{f}.consts", "missing key(s) ['weight']")
            o, cg, kh, kw = v.rank(f"{f}.consts.weight", wt, 4, 4)
            groups = attrs["groups"]
            if c % groups or o % groups or c // groups != cg:
                fail(f"{f}.attrs.groups", f"{groups} groups do not split input {v.shapes[ins[0]]} "
                                          f"and weight {v.shapes[wt]}")
            (sh, sw), (dh, dw), (pt, pl, pb, pr) = attrs["strides"], attrs["dilation"], attrs["padding"]
            oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
            ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
            if oh < 1 or ow < 1:
                fail(f"{f}.consts.weight", f"the kernel is larger than the padded {h}x{w} input")
            v.shape(fo, out, [n, o, oh, ow])
            batch, m, nn, k, channels = n * groups, o // groups, oh * ow, cg * kh * kw, o
        elif kind == "dense":
            x = v.rank(f"{f}.inputs[0]", ins[0], 1)
            wt = consts.get("weight")
            if wt is None:
                fail(f"{f}.consts", "missing key(s) ['weight']")
            kk, nn = v.rank(f"{f}.consts.weight", wt, 2, 2)
            if x[-1] != kk:
                fail(f"{f}.consts.weight", f"{v.shapes[wt]} does not multiply input {x}")
            v.shape(fo, out, x[:-1] + [nn])
            batch, m, k, channels = 1, math.prod(x[:-1]), kk, nn
        else:
            a = v.rank(f"{f}.inputs[0]", ins[0], 2)
            b = v.rank(f"{f}.inputs[1]", ins[1], 2)
            bs = v.broadcast(a[:-2], b[:-2])
            if a[-1] != b[-2] or bs is None:
                fail(f"{f}.inputs", f"{a} and {b} do not multiply")
            v.shape(fo, out, bs + [a[-2], b[-1]])
            batch, m, nn, k, channels = math.prod(bs), a[-2], b[-1], a[-1], b[-1]
        if kind != "matmul":
            v.dtype(f"{f}.consts.weight", consts["weight"], ("int8",) if int8 else ("float32",))
        if int8:
            _check_int8_epilogue(v, f, kind, ins, consts, out, attrs, channels, k)
        else:
            v.dtype(fo, out, ("float32",))
            v.consts(f, consts, set() if kind == "matmul" else {"weight"},
                     set() if kind == "matmul" else {"bias"})
            if "bias" in consts:
                v.dtype(f"{f}.consts.bias", consts["bias"], ("float32",))
                v.shape(f"{f}.consts.bias", consts["bias"], [channels])
        return (batch, m, nn), [m, nn, k]

    def check_mapping(self, arch, f: str, mode: str, k: int | None, tile) -> None:
        """An int8 layer's k-chunks must fit the MAC array's accumulator."""
        if len(tile) > 3:
            parts = int(tile[3])
            if mode != "int8" and parts > 1:
                fail(f"{f}.tile[3]", f"a reduction split over {parts} PEs needs an int8 layer "
                                     f"(fp32 sums in ascending k on one PE)")
            if k is not None and parts > splits_of(k, tile[2]):
                fail(f"{f}.tile[3]", f"{parts} reduction parts exceed the tile's "
                                     f"{splits_of(k, tile[2])} k-chunks (K {k}, tk {tile[2]})")
        if mode != "int8":
            return
        chunk = chunk_length(k, tile[2])
        limit = safe_k_chunk(arch)
        if chunk > limit:
            fail(f"{f}.tile[2]", f"k-chunks of {chunk} products overflow the "
                                 f"{arch.acc_bits}-bit accumulator (at most {limit})")

    # -- tiles as data ------------------------------------------------------------------------
    def region_extent(self, program, layer):
        g = gemm_shape(program, layer)
        return (g.batch, g.m, g.n)

    def expand_regions(self, program, layer, tile):
        batch, m, n = self.region_extent(program, layer)
        tm, tn = int(tile[0]), int(tile[1])
        m0, m1 = starts(m, tm)
        n0, n1 = starts(n, tn)
        b = np.repeat(np.arange(batch, dtype=np.int64), len(m0) * len(n0))
        mi = np.tile(np.repeat(np.arange(len(m0)), len(n0)), batch)
        ni = np.tile(np.arange(len(n0)), batch * len(m0))
        lo = np.stack([b, m0[mi], n0[ni]], axis=1)
        hi = np.stack([b + 1, m1[mi], n1[ni]], axis=1)
        if layer.kind == "conv2d":
            group = b * len(m0) + mi
        elif layer.kind == "dense":
            group = ni.astype(np.int64)
        else:
            group = np.full(len(b), -1, dtype=np.int64)
        parts = int(tile[3]) if len(tile) > 3 else 1
        if parts == 1:
            return lo, hi, group
        # each region's reduction in ``parts`` tiles (parts innermost), each with its own block
        kb = k_part_bounds(gemm_shape(program, layer).k, int(tile[2]), parts)
        t = len(group)
        j = np.tile(np.arange(parts, dtype=np.int64), t)
        lo = np.concatenate([np.repeat(lo, parts, axis=0), kb[j][:, None]], axis=1)
        hi = np.concatenate([np.repeat(hi, parts, axis=0), kb[j + 1][:, None]], axis=1)
        group = np.repeat(group, parts)
        group = np.where(group >= 0, group * parts + j, -1)
        return lo, hi, group

    def k_splits(self, program, layer, tile) -> int:
        return splits_of(gemm_shape(program, layer).k, tile[2])

    # -- mapping ------------------------------------------------------------------------------
    def work(self, program, layer, arch):
        g = gemm_shape(program, layer)
        return 2 * g.batch * g.m * g.n * g.k, [g.m, g.n, g.k]

    def smallest_tile_bytes(self, program, layer, arch):
        _, elems, _ = _cost_operands(program, layer)
        ae, be, _, _ = _operand_elems(layer.kind, layer.mode, elems)
        return smallest_gemm_tile_bytes(arch, gemm_shape(program, layer).k, ae, be)

    def choose_tile(self, program, layer, arch, pes, naive, resident=False):
        g = gemm_shape(program, layer)
        in_fn = (lambda vn: int(_conv_input_bytes(program, layer, 0, vn))) if layer.kind == "conv2d" else None
        _, elems, side = _cost_operands(program, layer)
        return list(choose_gemm_tile(g, arch, layer.name, pes=pes, kind=layer.kind, naive=naive,
                                     input_bytes=in_fn, mode=layer.mode, elem_bytes=elems, int8=side,
                                     split_k=_options.current().mapping.split_k, resident=resident,
                                     row_tiles=_options.current().mapping.row_tiles))

    def tile_costs(self, program, layer, arch, tile, lo, hi):
        t = program.tensors
        g = gemm_shape(program, layer)
        ks = self.k_splits(program, layer, tile)
        w_tid, elems, side = _cost_operands(program, layer)
        ae, be, _, oe = _operand_elems(layer.kind, layer.mode, elems)
        tk = min(int(tile[2]), g.k)
        ext = hi - lo
        vm, vn = ext[:, 1], ext[:, 2]
        split = lo.shape[1] > 3  # a reduction split over PEs: part k-ranges [k0, k1)
        kk = ext[:, 3] if split else g.k
        last = hi[:, 3] == g.k if split else True  # the reducing part (or the whole tile)
        pm, pn = -(-vm // arch.mac_rows) * arch.mac_rows, -(-vn // arch.mac_cols) * arch.mac_cols
        a_bytes, b_bytes = ae * vm * kk, be * kk * vn
        if layer.kind == "conv2d":
            in_b, w_b = _conv_input_bytes(program, layer, lo[:, 2], hi[:, 2]) * kk // g.k, a_bytes
        else:
            in_b, w_b = a_bytes, b_bytes
        # Per-channel epilogue data (bias; int8: acc_offset, multiplier, shift, scale...) travels
        # with the weight block (of the reducing part): the tile's output channels of every
        # const but the weight.
        channels = t[w_tid].shape[0] if layer.kind == "conv2d" else g.n
        v = vm if layer.kind == "conv2d" else vn
        for role, tid in sorted(layer.consts.items()):
            if role == "weight" or tid == w_tid:
                continue
            numel = int(np.prod(t[tid].shape, dtype=np.int64))
            size = itemsize(program, tid)
            w_b = w_b + last * (size * v * max(1, numel // channels) if numel >= channels else size * numel)
        if split:
            parts = int(tile[3])
            chunks = -(-kk // chunk_length(g.k, tk))
            cycles = gemm_tile_cycles(vm, vn, kk, chunks, arch, layer.mode, _part_side(side))
            cycles = np.ceil(cycles + last * k_part_tail_cycles(vm, vn, parts, arch, side))
            # a part's result is its int32 partial sums (the reducer's: the layer's output)
            out_b = np.where(last, oe, ACC_BYTES) * vm * vn
            # the reducer receives the partials one at a time into one more accumulator block
            sram = gemm_tile_bytes(pm, pn, tk, ae, be) + last * ACC_BYTES * pm * pn
        else:
            cycles = np.ceil(gemm_tile_cycles(vm, vn, g.k, ks, arch, layer.mode, side))
            out_b = oe * vm * vn
            sram = gemm_tile_bytes(pm, pn, tk, ae, be)
        return sram, in_b, w_b, out_b, cycles

    # -- functional simulator -----------------------------------------------------------------
    def prepare_tiles(self, runner) -> None:
        layer, env = runner.layer, runner.env
        if layer.mode != "int8":
            _arrange(runner, env[layer.inputs[0]], _rhs(layer, env), 0)
            bias = layer.consts.get("bias")
            runner.bias = env[bias] if bias is not None else None
            return
        attrs = layer.attrs
        x, rhs, zx = _int8_operands(layer, env)
        _arrange(runner, x, rhs, attrs["x_zero"])  # padding holds the zero point (real 0.0)
        wz = env[layer.consts["w_zero"]].astype(np.int64) if "w_zero" in layer.consts else None
        # zero points of the A rows / B columns: conv rows are output channels, dense columns are
        # output features, matmul's are per tensor
        runner.za, runner.zb = {"conv2d": (wz, zx), "dense": (zx, wz)}.get(
            layer.kind, (zx, np.int64(attrs.get("b_zero", 0))))
        runner.epi = {k: env[layer.consts[k]] for k in ("scale", "bias", "bias_q", "multiplier", "shift") if k in layer.consts}
        runner.acc_bits = int(runner.p.arch.acc_bits)
        runner.partials = {}  # split reductions: region -> (k covered, int32 partial sums)

    def run_tile(self, runner, tile) -> None:
        (b0, _), (m0, m1), (n0, n1) = tile.region[:3]
        step = -(-runner.g.k // tile.k_splits)
        if len(tile.region) > 3:  # one part of a reduction split over PEs (int8 only)
            (k0, k1), = tile.region[3:]
            _qgemm_part(runner, b0, m0, m1, n0, n1, k0, k1, step)
            return
        block = _qgemm_block if runner.layer.mode == "int8" else _gemm_block
        block(runner, b0, m0, m1, n0, n1, step)

    def run_whole(self, program, index: int, layer: Layer, env, out: np.ndarray) -> np.ndarray:
        """The whole layer in one batched C++ call (int8: chunked at the program's length)."""
        if layer.mode == "int8":
            _qgemm_whole(program, layer, index, env, out)
        else:
            _gemm_whole(program, layer, env, out)
        return out

    def step(self, program, layer, clip: Layer | None = None):
        """The prepared fp32 step (int8 layers run :meth:`run_whole`); ``clip``: a clip layer
        whose operations the epilogue applies (it reads only this layer's result)."""
        return _fp32_step(program, layer, clip) if layer.mode == "fp32" else None

    def native(self, program, layer, nb, clip: Layer | None = None) -> bool:
        """fp32 layers as instructions (:func:`_fp32_native`), int8 layers too (:func:`_int8_native`)."""
        if layer.mode == "int8":
            return clip is None and _int8_native(program, layer, nb)
        return layer.mode == "fp32" and _fp32_native(program, layer, nb, clip)
