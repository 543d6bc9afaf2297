"""The fallback's own pipeline: legalize, fuse, apply tuning logs, default CPU schedules.

What is not offloaded to spinn runs on the host CPU (``spinn``, ``spinn/board``) or a GPU
(``spinn/cuda``). Before the fallback's base pipeline (TVM's ``default_build`` for llvm, TVM's
CUDA pipeline with dlight for cuda) runs, :func:`run_fallback`

1. routes the indices of every ``take`` in ``fast`` mode through a bounds check
   (:mod:`tvm_spinn.runtime.checked_take`: TVM's gather reads outside the table for an index
   out of range, the check raises an ``IndexError`` naming it instead),
   legalizes and fuses the rest like TVM's CPU pipeline (:func:`prepare_fallback`; the tuner
   extracts its tasks from exactly this module, so tuning records match at build time); on
   llvm, inference batch norm is decomposed (it fuses into the convolution before it) and
   float32 ``erf``/``tanh``/``exp`` become vectorizable approximations (TVM's fast math),
2. applies MetaSchedule tuning logs when the active :class:`~tvm_spinn.tune.BuildOptions` names
   some (``MetaScheduleApplyDatabase``),
3. gives every PrimFunc still unscheduled a default schedule: on llvm the dlight CPU rules
   (GEMV, Reduction) and :class:`ParallelVectorize` (parallel outer loops, vectorized inner
   loops, register tiles for reductions); on cuda the dlight GPU rules of TVM's pipeline,
4. on llvm, makes floating-point ``max``/``min`` propagate NaN as PyTorch and numpy do (relu,
   clip, max pooling, max reductions), as the simulator's offloaded operators do
   (:func:`_nan_propagating`; after scheduling, so the schedules still see TVM's reducers).

Which targets get this: spinn targets always (with ``BuildOptions()`` when no context is
active); plain ``llvm``/``cuda`` targets only inside ``with tvm_spinn.build_options(...)``, so
TVM's own behaviour is unchanged unless asked.
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import dlight as dl

from ._env import env

__all__ = ["ParallelVectorize", "prepare_fallback", "default_schedule_pass", "default_rules",
           "has_unit_reduction", "run_fallback"]

#: below this many iterations (spatial x reduction) a loop nest is not parallelized
_PARALLEL_MIN_WORK = 16384


def prepare_fallback(mod: tvm.IRModule) -> tvm.IRModule:
    """Legalize and fuse the non-offloaded part like TVM's CPU pipeline (call inside the target).

    Parameters
    ----------
    mod : tvm.IRModule
        Relax module, already partitioned and codegen'd for spinn when the target is spinn.

    Returns
    -------
    tvm.IRModule
        Module whose fallback operators are fused TIR PrimFuncs (the tuning tasks).
    """
    from .partition.fold import FoldSmallConstants

    seq = tvm.transform.Sequential([
        FoldSmallConstants,
        _CheckTakeIndices,
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        # inference batch norm -> elementwise ops: folded into constants and fused into the
        # preceding convolution's epilogue (as a tuple-valued op it was a task of its own)
        relax.transform.DecomposeOpsForInference(),
        relax.transform.LegalizeOps(),
        _VectorizableMath,
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ])
    return seq(mod)


def _take_label(call, var) -> str:
    table = call.args[0].ty
    shape = tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in table.shape)
    kind = call.op.name.split(".")[-1]
    return f"{kind} {var.name!r} (fallback) of a {shape} {table.dtype} {'table' if kind == 'take' else 'tensor'}"


#: Indexing ops whose TVM lowering reads (or writes) wherever an index points: op -> whether its
#: indices are tuples over the leading axes (``*_nd``) rather than positions along one axis.
_INDEXING_OPS = {"relax.take": False, "relax.gather_elements": False, "relax.scatter_elements": False,
                 "relax.gather_nd": True, "relax.scatter_nd": True}


@relax.expr_functor.mutator
class _TakeIndexChecker(relax.PyExprMutator):
    """Puts :data:`~tvm_spinn.runtime.checked_take.CHECK_FUNC` before the indices of every
    ``take`` in ``fast`` mode (``clip`` and ``wrap`` stay in bounds by construction), and before
    those of ``gather_elements`` / ``scatter_elements`` (:data:`CHECK_ND_FUNC` for
    ``gather_nd`` / ``scatter_nd``), whose TVM lowerings trust their indices."""

    def visit_var_binding_(self, binding) -> None:  # noqa: D102
        value = binding.value
        op = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else None
        if op not in _INDEXING_OPS or (op == "relax.take" and str(value.attrs.mode) != "fast"):
            super().visit_var_binding_(binding)
            return
        from .runtime.checked_take import CHECK_FUNC, CHECK_ND_FUNC

        args = [self.visit_expr(a) for a in value.args]
        table, indices = args[0], args[1]
        label = _take_label(value, binding.var)
        if _INDEXING_OPS[op]:
            checked = self.builder_.emit(relax.call_pure_packed(
                CHECK_ND_FUNC, indices, table, int(value.attrs.batch_dims) if op == "relax.gather_nd" else 0,
                label, ty_args=indices.ty))
        else:
            axis = value.attrs.axis
            axis = 0 if axis is None else int(axis)
            if axis < 0:
                axis += len(table.ty.shape)
            checked = self.builder_.emit(relax.call_pure_packed(CHECK_FUNC, indices, table, axis, label,
                                                                ty_args=indices.ty))
        if op == "relax.take":
            # "clip" on checked indices is the same gather: it only keeps TopI's warning that
            # "fast" may read out of bounds (printed once per take at every build) from showing
            new = relax.op.take(table, checked, axis=value.attrs.axis, mode="clip")
        else:
            new = relax.Call(value.op, [table, checked, *args[2:]], value.attrs, value.ty_args)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(new)))


@tvm.transform.module_pass(opt_level=0, name="SpinnCheckTakeIndices")
def _CheckTakeIndices(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Bounds-check the indices of the fallback's ``fast`` takes (see :class:`_TakeIndexChecker`).

    Offloaded takes are already outside: the spinn codegen replaced them by external calls,
    whose simulator checks its indices itself."""
    checker = _TakeIndexChecker(mod)
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, relax.Function) and not any(
                k in (func.attrs or {}) for k in ("Codegen", "Composite", "Primitive")):
            new = checker.visit_expr(func)
            if not new.same_as(func):
                checker.builder_.update_func(gvar, new)
    return checker.builder_.finalize()


def check_take_indices(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every ``fast`` take of its Relax functions bounds-checked (a build for plain
    ``llvm`` of user inputs, e.g. calibration, reads no memory past a table either)."""
    return _CheckTakeIndices(mod)


# TVM's own float32 approximations (topi.fast_erf / topi.fast_tanh, Eigen's rational
# polynomials; erf within 5e-7 absolute of the exact function, tanh a few ULP): the same
# coefficients, written as TIR expressions so that any PrimFunc can use them in place.
_ERF_CLAMP = 4.0
_ERF_NUM = (-2.7261423674040941e-10, 2.7706814620387377e-08, -2.101023937939317e-06,
            -5.6925062381196767e-05, -0.00073499063728377223, -0.0029545999132096767,
            -0.016096033155918121)
_ERF_DEN = (-1.4566071513399947e-05, -0.00021337404905352741, -0.001682827016338706,
            -0.0073733292520046234, -0.014264739118516445)
_TANH_CLAMP = 9.0
_TANH_NUM = (-2.76076847742355e-16, 2.0001879048247699e-13, -8.60467152213735e-11,
             5.1222970903711401e-08, 1.4857223571797901e-05, 0.00063726192887543596,
             0.0048935245589178597)
_TANH_DEN = (1.1982583946670199e-06, 0.000118534705686654, 0.0022684346324390002,
             0.0048935251855438504)


def _horner(x2, coefficients):
    acc = tvm.tirx.const(coefficients[0], "float32")
    for c in coefficients[1:]:
        acc = x2 * acc + tvm.tirx.const(c, "float32")
    return acc


def _bind(expr, var, value):
    """``expr`` with ``var`` replaced by ``value``: written out, not a ``Let`` (MetaSchedule's
    feature extraction and FLOP estimate reject ``Let``; LLVM removes the repeats)."""
    return tvm_ffi.structural_map(expr, (tvm.tirx.Var, lambda v: value if v.same_as(var) else v),
                                  order="post")


def _odd_rational(arg, clamp: float, num, den):
    """``x * P(x^2) / Q(x^2)`` with ``x = clamp(arg)``."""
    x = tvm.tirx.Var("x", "float32")
    limit = tvm.tirx.const(clamp, "float32")
    return _bind(x * _horner(x * x, num) / _horner(x * x, den), x,
                 tvm.tirx.max(tvm.tirx.min(arg, limit), -limit))


_EXP_HI, _EXP_LO = 88.376266479492188, -88.376258850097656
_EXP_POLY = (0.00019875691214110702, 0.0013981999363750219, 0.008333452045917511,
             0.041665796190500259, 0.1666666567325592, 0.5)


def _fast_exp(arg):
    """TVM's ``topi.fast_exp`` (Cephes' expf) for float32: ``2^n * p(r)``, ``x = n ln2 + r``
    (clamped to the float32 range; ``2^n`` built from the exponent bits), with a two-part ln2.
    Not a NaN-propagating exp: the softmaxes it serves do not see NaN inputs."""
    f32 = "float32"
    x = tvm.tirx.Var("x", f32)
    n = tvm.tirx.Var("n", f32)
    r = tvm.tirx.Var("r", f32)
    poly = _horner(r, _EXP_POLY) * r * r + r + tvm.tirx.const(1.0, f32)
    two_n = tvm.tirx.call_intrin(f32, "tirx.reinterpret", tvm.tirx.shift_left(
        (n + tvm.tirx.const(127.0, f32)).astype("int32"), tvm.tirx.const(23, "int32")))
    body = tvm.tirx.max(two_n * poly, x)
    # Cody-Waite: ln2 = C1 + C2 with C1 short enough that n * C1 is exact, so r keeps its
    # precision for large |x| (one float32 ln2 lost up to 4e-6 relative at |x| ~ 88)
    body = _bind(body, r, (x - n * tvm.tirx.const(0.693359375, f32))
                 - n * tvm.tirx.const(-2.12194440e-4, f32))
    body = _bind(body, n, tvm.tirx.floor(x * tvm.tirx.const(1.4426950216293335, f32)
                                         + tvm.tirx.const(0.5, f32)))
    return _bind(body, x, tvm.tirx.max(tvm.tirx.min(arg, tvm.tirx.const(_EXP_HI, f32)),
                                       tvm.tirx.const(_EXP_LO, f32)))


_FAST_MATH = {
    "tirx.erf": lambda arg: _odd_rational(arg, _ERF_CLAMP, _ERF_NUM, _ERF_DEN),
    "tirx.tanh": lambda arg: _odd_rational(arg, _TANH_CLAMP, _TANH_NUM, _TANH_DEN),
    "tirx.exp": _fast_exp,
}


def _fast_math_call(call):
    if (isinstance(call.op, tvm.ir.Op) and call.op.name in _FAST_MATH and len(call.args) == 1
            and str(call.ty) == "float32"):
        return _FAST_MATH[call.op.name](call.args[0])
    return call


@tvm.transform.module_pass(opt_level=0, name="SpinnVectorizableMath")
def _VectorizableMath(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """On llvm, float32 ``erf``, ``tanh`` and ``exp`` become TVM's fast approximations.

    LLVM has no vector lowering for them: ``erf`` is a libm call per element (GELU took over half
    of a transformer block's time, scalar), and vectorized ``tanh``/``exp`` are split into
    scalar calls (softmax, sigmoid). The approximations are plain arithmetic, so the default
    schedules and MetaSchedule vectorize them. Other dtypes and targets are left alone."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return mod
    return _map_prim_funcs(mod, tvm.ir.Call, _fast_math_call)


def _map_prim_funcs(mod: tvm.IRModule, node_type, rewrite) -> tvm.IRModule:
    """``mod`` with ``rewrite`` applied (post-order) to every ``node_type`` node of every
    PrimFunc body; functions it leaves unchanged are kept as they are."""
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, tvm.tirx.PrimFunc):
            body = tvm_ffi.structural_map(func.body, (node_type, rewrite), order="post")
            if not body.same_as(func.body):
                mod[gvar] = func.with_body(body)
    return mod


def _nan_propagating(node):
    """``max``/``min`` of floats returning a NaN operand (LLVM lowers TIR's ``max(a, b)`` to
    ``a > b ? a : b``, which answers ``b`` when ``a`` is NaN: ``relu(NaN)`` would be 0)."""
    if not str(node.ty).startswith(("float", "bfloat")):
        return node
    a, b = node.a, node.b
    return tvm.tirx.Select(tvm.tirx.isnan(a), a, tvm.tirx.Select(tvm.tirx.isnan(b), b, node))


@tvm.transform.module_pass(opt_level=0, name="SpinnNanPropagatingMinMax")
def _NanPropagatingMinMax(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Floating-point ``max``/``min`` in every PrimFunc propagate NaN (:func:`_nan_propagating`)."""
    mod = _map_prim_funcs(mod, tvm.tirx.Max, _nan_propagating)
    return _map_prim_funcs(mod, tvm.tirx.Min, _nan_propagating)


def _divisor(extent: int, candidates) -> int:
    for c in candidates:
        if c > 1 and extent % c == 0:
            return c
    return 1


def _extent(sch, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tvm.tirx.IntImm) else None


# Pure memo (a function of the target string and TVM's tables): state-free in effect.
@functools.lru_cache(maxsize=None)
def _vector_bits(target: str) -> int:
    """SIMD register width of an llvm target's CPU, from its features.

    ``llvm_get_vector_width`` answers 512 for every x86 CPU (even with no ``-mcpu``, which
    compiles for baseline SSE2): lanes sized by it were 4x too wide."""
    from tvm.target.codegen import llvm_cpu_has_features

    t = tvm.target.Target(target)
    try:
        with t:
            if llvm_cpu_has_features("avx512f", t):
                return 512
            if llvm_cpu_has_features("avx", t):
                return 256
    except Exception:  # noqa: BLE001  (feature query unsupported: assume 128-bit vectors)
        pass
    return 128


class ParallelVectorize(dl.ScheduleRule):
    """Default CPU schedule: parallel outer loops, vectorized inner loops, reduction tiles.

    Elementwise producers and consumers are inlined (dlight's ``try_inline``). A reduction
    block whose loops are spatial-then-reduction (matmul, convolution, pooling) gets
    ``[outer spatial (parallel)] [reduction] [u rows (unrolled)] [v lanes (vectorized)]``
    with its elementwise epilogue computed at the parallel loop; injective blocks get their
    outer loops fused and parallelized and their innermost loop vectorized. Work below
    ``16384`` iterations stays serial. Functions it cannot analyze are left to the next rule.
    """

    def is_target_available(self, target) -> bool:  # noqa: D102
        return target.kind.name == "llvm"

    def apply(self, func, target, _tunable):  # noqa: D102
        if not isinstance(func, tvm.tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._apply(func, target)
        except Exception:  # noqa: BLE001  (a pattern we cannot schedule: leave it as is)
            if env("TVM_SPINN_DEBUG_SCHEDULE"):
                import traceback

                traceback.print_exc()
            return None

    def _apply(self, func, target):
        bits = _vector_bits(str(target))
        # one core: a parallel loop is only overhead (and a fork-join barrier to wait at)
        parallel = int(target.attrs.get("num-cores", 2) or 2) > 1
        sch = tvm.s_tir.Schedule(func)
        infos = dl.normalize_prim_func(sch)
        if infos is None or self._touches_bf16(sch, infos):
            return None
        if sum(1 for info in infos if not info.is_injective()) > 1:
            return None  # softmax, layer norm: dlight's CPU Reduction rule
        infos = self._inline(sch, infos)
        done = set()
        for i, info in enumerate(infos):
            if i in done:
                continue
            kinds = "".join(it.kind for it in info.iters)
            dtype_bits = self._dtype_bits(sch, info.block_rv)
            lanes = max(1, bits // max(8, dtype_bits))
            if "R" in kinds:
                if not self._is_sr(kinds):
                    return None
                par = self._reduction(sch, info, lanes, parallel)
                if par is not None and i + 1 < len(infos) and "R" not in infos[i + 1].dom_kind():
                    if self._epilogue(sch, infos[i + 1].block_rv, par, lanes):
                        done.add(i + 1)
            elif set(kinds) <= {"S"}:
                self._injective(sch, info.block_rv, lanes, parallel)
            else:
                return None
        return sch

    @staticmethod
    def _inline(sch, infos):
        """dlight's ``try_inline``, except that padding stays a stage of its own.

        Inlined into a convolution, padding becomes a bounds check per multiply-add.
        """
        pads = [info for info in infos if info.is_injective() and info.is_data_pad(sch)]
        rest = [info for info in infos if info not in pads]
        remaining = dl.try_inline(sch, rest)
        order = {id(info): i for i, info in enumerate(infos)}
        return sorted(pads + remaining, key=lambda info: order[id(info)])

    @staticmethod
    def _touches_bf16(sch, infos) -> bool:
        """bf16 is legalized to uint16 storage after scheduling; vectorized bf16 stores fail."""
        for info in infos:
            block = sch.get(info.block_rv)
            for region in list(block.reads) + list(block.writes):
                holder = getattr(region, "buffer", None) or getattr(region, "source", None)
                if str(getattr(holder, "dtype", "")).startswith("bfloat"):
                    return True
        return False

    @staticmethod
    def _dtype_bits(sch, block) -> int:
        """Bits of the widest element the block reads or writes (32 if unknown).

        Lanes sized by a narrow output alone make too-wide vectors of its wider inputs: an int8
        reduction over float32 reads became 128-lane float vectors, which took LLVM most of a
        second to compile (BERT's attention-mask check) for no run-time gain."""
        block = sch.get(block)
        bits = 0
        for region in list(block.writes) + list(block.reads):
            holder = getattr(region, "buffer", None) or getattr(region, "source", None)
            try:
                bits = max(bits, tvm.DataType(str(holder.dtype)).bits)
            except Exception:  # noqa: BLE001  (unknown region kind: assume 32-bit)
                bits = max(bits, 32)
        return bits or 32

    @staticmethod
    def _is_sr(kinds: str) -> bool:
        stripped = kinds.lstrip("S")
        return bool(stripped) and set(stripped) == {"R"} and len(stripped) < len(kinds)

    def _reduction(self, sch, info, lanes: int, parallel: bool = True):
        loops = sch.get_loops(info.block_rv)
        kinds = "".join(it.kind for it in info.iters)
        if len(loops) != len(kinds):
            return None
        n_s = len(kinds) - len(kinds.lstrip("S"))
        spatial, reduce = list(loops[:n_s]), list(loops[n_s:])
        exts = [_extent(sch, lp) for lp in loops]
        if any(e is None for e in exts):
            return None
        work = 1
        for e in exts:
            work *= e
        v = _divisor(exts[n_s - 1], (2 * lanes, lanes, lanes // 2, 4, 2))
        inner = []
        if v > 1:
            so, si = sch.split(spatial[-1], [None, v])
            spatial[-1] = so
            inner.append(si)
        if n_s >= 2:
            axis = self._row_axis(sch, info.block_rv, n_s)
            u = _divisor(exts[axis], (4, 2))
            if u > 1:
                ro, ri = sch.split(spatial[axis], [None, u])
                spatial[axis] = ro
                inner.insert(0, ri)
        sch.reorder(*spatial, *reduce, *inner)
        par = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        if parallel and work >= _PARALLEL_MIN_WORK and (_extent(sch, par) or 1) > 1:
            sch.parallel(par)
        if v > 1:
            sch.vectorize(inner[-1])
        if len(inner) == 2:
            sch.unroll(inner[0])
        sch.decompose_reduction(info.block_rv, reduce[0])
        return par

    @staticmethod
    def _row_axis(sch, block, n_s: int) -> int:
        """The spatial axis to unroll into register-tile rows.

        The innermost spatial axis (before the vectorized one) that some input varying along
        the vector lanes does not depend on: each vector loaded from that input then serves
        every row of the tile. Matmul ``C[i, j] += A[i, k] B[k, j]``: ``i`` (``B`` does not
        depend on it); NCHW convolution: the output channel (the input image does not), not
        the output row (every row reads other input rows)."""
        stmt = sch.get(block)
        iters = [iv.var for iv in stmt.iter_vars]

        def uses(region, var) -> bool:
            found = []
            for rng in region.region:
                tvm_ffi.structural_walk(rng.min, (tvm.tirx.Var, lambda v: found.append(v.same_as(var))),
                                        order="pre")
            return any(found)

        vec = iters[n_s - 1]
        operands = [r for r in stmt.reads if uses(r, vec)]
        for axis in range(n_s - 2, -1, -1):
            if any(not uses(r, iters[axis]) for r in operands):
                return axis
        return n_s - 2

    def _epilogue(self, sch, block, par, lanes: int) -> bool:
        try:
            sch.reverse_compute_at(block, par)
        except Exception:  # noqa: BLE001  (region not coverable: schedule it on its own)
            return False
        loops = sch.get_loops(block)
        ext = _extent(sch, loops[-1]) if loops else None
        if ext and ext <= 4 * lanes and _divisor(ext, (ext,)) == ext:
            sch.vectorize(loops[-1])
        return True

    def _injective(self, sch, block, lanes: int, parallel: bool = True) -> None:
        loops = list(sch.get_loops(block))
        exts = [_extent(sch, lp) for lp in loops]
        if not loops or any(e is None for e in exts):
            return
        total = 1
        for e in exts:
            total *= e
        v = _divisor(exts[-1], (2 * lanes, lanes, lanes // 2, 4, 2))
        if v > 1:
            outer, vec = sch.split(loops[-1], [None, v])
            loops[-1] = outer
            sch.vectorize(vec)
        if parallel and total >= _PARALLEL_MIN_WORK:
            par = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            sch.parallel(par)


def _has_unit_reduction(func: tvm.tirx.PrimFunc) -> bool:
    """A top-level block whose reduction axes all have extent 1 (e.g. a 1x1 conv of one channel),
    or one with a zero-extent axis (nothing to schedule)."""
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(dl.analysis.get_root_block(sch))
    except Exception:  # noqa: BLE001 - not a schedulable function: nothing to protect
        return False
    for block in blocks:
        if any(isinstance(iv.dom.extent, tvm.tirx.IntImm) and int(iv.dom.extent) == 0
               for iv in sch.get(block).iter_vars):
            return True  # zero-size (e.g. batch 0): dlight's reduction rules fail on it
        reduce = [iv for iv in sch.get(block).iter_vars if int(iv.iter_type) == 2]  # CommReduce
        if reduce and all(isinstance(iv.dom.extent, tvm.tirx.IntImm) and int(iv.dom.extent) == 1
                          for iv in reduce):
            return True
    return False


@tvm.transform.module_pass(opt_level=0, name="SpinnKeepUnitReductionsUnscheduled")
def _KeepUnitReductionsUnscheduled(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Leave PrimFuncs with unit-extent reductions to TVM's untuned lowering.

    dlight's block normalization turns such a reduction into a spatial block and then inlines
    its epilogue into the update (``quantize(acc + x*w)`` re-read as the accumulator): wrong
    results. Marking them scheduled keeps the default schedules away from them."""
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, tvm.tirx.PrimFunc) and _has_unit_reduction(func):
            mod[gvar] = func.with_attr("tirx.is_scheduled", True)
    return mod


_PROBE_LANES = 4  # whether an intrinsic has a vector lowering does not depend on the width


# Pure memo (a function of the target, the op and TVM's lowering tables): state-free in effect.
@functools.lru_cache(maxsize=None)
def _vectorizes(target: str, op: str, ret: str, args: tuple[str, ...]) -> bool:
    """Whether LLVM codegen accepts ``op(args) -> ret`` inside a vectorized loop.

    Some intrinsics have only a scalar lowering on llvm (``tirx.cosh``/``tirx.sinh`` in any
    float type, many float16 ones, ``tirx.fmod``...): vectorized, codegen fails with
    "unknown intrinsic". The answer depends on TVM's lowering tables and the target, so it is
    measured once per signature by compiling a one-call kernel rather than kept in a list."""
    from tvm import te

    try:
        ins = [te.placeholder((_PROBE_LANES,), dtype=dt, name=f"a{k}") for k, dt in enumerate(args)]
        out = te.compute((_PROBE_LANES,), lambda i: tvm.tirx.call_intrin(ret, op, *[a[i] for a in ins]),
                         name="out")
        sch = tvm.s_tir.Schedule(te.create_prim_func([*ins, out]))
        sch.vectorize(sch.get_loops(sch.get_sblock("out"))[0])
        tvm.compile(sch.mod, target=tvm.target.Target(target))
        return True
    except Exception:  # noqa: BLE001 - any failure means: keep such loops scalar
        return False


def _numeric(dtype: str) -> bool:
    return dtype.startswith(("float", "int", "uint", "bfloat")) and "x" not in dtype


def _scalar_only_calls(loop, target: str) -> list[str]:
    """Calls in ``loop``'s body (a vectorized ``For``) that LLVM cannot vectorize."""
    bad: list[str] = []

    def visit(call):
        if isinstance(call.op, tvm.ir.Op) and call.op.name.startswith("tirx."):
            sig = (call.op.name, str(call.ty), tuple(str(a.ty) for a in call.args))
            # only math on numbers is probed: builtins taking handles or strings cannot be
            # rebuilt from placeholders, and they are not the unvectorizable intrinsics
            if not _numeric(sig[1]) or not all(_numeric(t) for t in sig[2]):
                return
            if not _vectorizes(target, *sig):
                bad.append(call.op.name)

    tvm_ffi.structural_walk(loop.body, (tvm.ir.Call, visit), order="pre")
    return bad


@tvm.transform.module_pass(opt_level=0, name="SpinnScalarizeUnvectorizableLoops")
def _ScalarizeUnvectorizableLoops(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Turn vectorized loops back into serial ones where a call in them has no vector lowering.

    The default schedules (ours and dlight's) vectorize inner loops without knowing which math
    intrinsics LLVM can vectorize; ``torch.cosh`` would otherwise fail to build. The loop
    stays scalar (LLVM may still auto-vectorize it); everything else of the schedule is kept."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return mod
    key = str(target)

    def on_for(loop):
        if loop.kind != tvm.tirx.ForKind.VECTORIZED or not _scalar_only_calls(loop, key):
            return loop
        return tvm.tirx.For(loop.loop_var, loop.min, loop.extent, tvm.tirx.ForKind.SERIAL,
                            loop.body, loop.thread_binding, loop.annotations, loop.step, loop.span)

    return _map_prim_funcs(mod, tvm.tirx.For, on_for)


def _empty_constant_as_allocation(const):
    if not hasattr(const.value, "shape") or 0 not in [int(d) for d in const.value.shape]:
        return const
    alloc = relax.op.builtin.alloc_tensor(relax.ShapeExpr([int(d) for d in const.value.shape]),
                                          str(const.value.dtype), 0)
    return relax.BlockBuilder().normalize(alloc)


@tvm.transform.module_pass(opt_level=0, name="SpinnEmptyConstantsAsAllocations")
def _EmptyConstantsAsAllocations(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802
    """Replace zero-size constants (e.g. a folded ``(3, 0, 5)`` tensor) by empty allocations.

    TVM saves a zero-size tensor in the executable's constant pool but cannot load it back
    ("Invalid DLTensor file format"): an exported library would not reload. An empty
    allocation holds the same (no) data. Run after constant folding."""
    for gvar, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, relax.Function):
            new = tvm_ffi.structural_map(func, (tvm.ir.Constant, _empty_constant_as_allocation),
                                         order="post")
            if not new.same_as(func):
                mod[gvar] = new
    return mod


def default_schedule_pass(target: tvm.target.Target) -> tvm.transform.Pass:
    """The default-schedule pass for ``target`` (call inside ``with target``).

    Parameters
    ----------
    target : tvm.target.Target
        Fallback target: ``llvm`` gets dlight's CPU rules and :class:`ParallelVectorize` (loops
        whose intrinsics LLVM cannot vectorize are then made serial again); other kinds get
        dlight's GPU rules (the same as TVM's CUDA pipeline).

    Returns
    -------
    tvm.transform.Pass
        ``dlight.ApplyDefaultSchedule`` with those rules; functions already scheduled (e.g. by
        tuning logs) are left alone.
    """
    if target.kind.name == "llvm":
        return tvm.transform.Sequential([
            _KeepUnitReductionsUnscheduled,
            dl.ApplyDefaultSchedule(*default_rules(target)),
            _ScalarizeUnvectorizableLoops,
        ])
    return dl.ApplyDefaultSchedule(*default_rules(target))


def default_rules(target: tvm.target.Target) -> list:
    """The dlight rules of the default schedules, in the order they are tried.

    Parameters
    ----------
    target : tvm.target.Target
        ``llvm``: dlight's CPU GEMV, :class:`ParallelVectorize`, dlight's CPU Reduction;
        other kinds: dlight's GPU rules (as in TVM's CUDA pipeline).

    Returns
    -------
    list of dlight.ScheduleRule
        The first rule that returns a schedule for a PrimFunc schedules it (the tuner measures
        the same schedule as each task's default candidate).
    """
    if target.kind.name == "llvm":
        return [dl.cpu.GEMV(), ParallelVectorize(), dl.cpu.Reduction()]
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def has_unit_reduction(func: tvm.tirx.PrimFunc) -> bool:
    """Whether the default schedules leave ``func`` to TVM's untuned lowering (see below)."""
    return _has_unit_reduction(func)


def run_fallback(base: tvm.transform.Pass, mod: tvm.IRModule, target: tvm.target.Target,
                 spinn: bool) -> tvm.IRModule:
    """Run the fallback's base pipeline, with tuning logs and default schedules when enabled.

    Parameters
    ----------
    base : tvm.transform.Pass
        TVM's pipeline for the fallback target (applied last).
    mod : tvm.IRModule
        Module after offloading (spinn targets) or the user's module (other targets).
    target : tvm.target.Target
        The build target.
    spinn : bool
        Whether ``target`` is a spinn target (then defaults apply without a context).

    Returns
    -------
    tvm.IRModule
        The lowered module.
    """
    from ._build_options import active_build_options

    options = active_build_options(spinn)
    if options is None or target is None or target.kind.name not in ("llvm", "cuda"):
        return base(mod)
    with target:
        mod = prepare_fallback(mod)
        if options.tuning_logs is not None:
            from ._tuning_db import apply_tuning_logs

            mod = apply_tuning_logs(mod, options.tuning_logs, target)
        if options.default_schedules:
            mod = default_schedule_pass(target)(mod)
        if target.kind.name == "llvm":
            mod = _NanPropagatingMinMax(mod)
        mod = _EmptyConstantsAsAllocations(mod)  # constants are folded by now
    return base(mod)
