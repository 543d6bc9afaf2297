"""Run ``rewrite_call`` with a function's large constants standing in as parameters.

After each rewrite, ``rewrite_call`` canonicalizes and eliminates common subexpressions until
nothing changes, and both hash and compare constants by their data: on a model with hundreds
of megabytes of weights that is most of a rewrite's time (BERT-base: ~2 s per rewrite that
changes something). :class:`HiddenConstants` replaces every large constant whose data no other
large constant may share by a parameter of the same type, so that comparing by identity and by
data agree, lets the rewriter make new large constants the same way, and binds the constants
back at the end: the rewrites and simplifications are TVM's own, on an equivalent function.
When two large constants may hold the same data (or a rewrite makes such a constant), the caller
runs its rewrite on the constants themselves instead (:attr:`HiddenConstants.collided`).
"""

from __future__ import annotations

import numpy as np

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.dpl import is_const, is_var

from .. import _lib

__all__ = ["HiddenConstants", "make_const"]


def _key(arr: np.ndarray) -> tuple:
    """Equal for equal data (dtype, shape, a strided sample of the elements in C order)."""
    step = max(1, arr.size // 64)
    return str(arr.dtype), arr.shape, arr.flat[::step].tobytes(), arr.flat[arr.size - 1:].tobytes()


def make_const(value: np.ndarray, dtype: str) -> Constant:
    """``relax.const(np.ascontiguousarray(value), dtype)`` with one copy instead of three."""
    try:
        if value.dtype == np.dtype(dtype):
            tensor = tvm.runtime.empty(value.shape, dtype)
            dst = np.from_dlpack(tensor)
            if value.ndim == 2 and not value.flags.c_contiguous and value.T.flags.c_contiguous:
                # a transposed weight (a [K, N] view of an [N, K] array): a cache-blocked C++
                # transpose on every core (numpy's strided copy is ~7x slower)
                _lib.transpose2d(value.T, dst)
            elif value.ndim == 2 and not value.flags.c_contiguous:
                # another strided view: copied a band of columns at a time (cache-friendly)
                for j in range(0, value.shape[1], 64):
                    np.copyto(dst[:, j:j + 64], value[:, j:j + 64], casting="no")
            else:
                np.copyto(dst, value, casting="no")
            return relax.const(tensor)
    except (TypeError, ValueError, BufferError, RuntimeError):
        pass
    return relax.const(np.ascontiguousarray(value), dtype)


def _array(const: Constant) -> np.ndarray:
    try:
        return np.from_dlpack(const.value)  # no copy
    except (TypeError, ValueError, BufferError, RuntimeError):
        return const.value.numpy()


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def visit_generic_const_(self, const):  # noqa: D102
        return self.table.get(const, const)


class HiddenConstants:
    """``func`` with its large constants (``>= min_elements``) as extra parameters.

    Use :attr:`func` in ``rewrite_call``, :meth:`const_pattern` where the pattern had
    ``is_const()``, :meth:`value` / :meth:`matched` to read a match, :meth:`const` to make
    constants, and :meth:`restore` on the result; if :attr:`collided`, discard the result.
    """

    def __init__(self, func: relax.Function, min_elements: int):
        self.min_elements = min_elements
        self.collided = False
        self._parts: dict = {}
        found: dict = {}

        def collect(expr):
            if (isinstance(expr, Constant) and hasattr(expr.value, "numpy")
                    and int(np.prod(expr.value.shape)) >= min_elements):
                found[expr] = None

        relax.analysis.post_order_visit(func, collect)
        self._keys: dict = {}
        for const in found:
            self._keys.setdefault(_key(_array(const)), []).append(const)
        self.hidden: dict = {}  # placeholder -> (constant, its data)
        table = {}
        for group in self._keys.values():
            if len(group) == 1:  # else: maybe equal data, left as constants (compared by data)
                table[group[0]] = self._placeholder(group[0], _array(group[0]))
        self.func = func
        if table:
            func = _Substitute(table).visit_expr(func)
            self.func = relax.Function(list(func.params) + list(self.hidden), func.body, func.ret_ty,
                                       func.is_pure, func.attrs)

    def _placeholder(self, const: Constant, data: np.ndarray) -> relax.Var:
        var = relax.Var(f"spinn_hidden_const_{len(self.hidden)}", const.ty)
        self.hidden[var] = (const, data)
        return var

    def const_pattern(self):
        """The pattern to use for ``is_const()``: a constant or a placeholder (see :meth:`value`)."""
        c, v = is_const(), is_var()
        pattern = c | v
        self._parts[pattern] = (c, v)
        return pattern

    def matched(self, matches, pattern) -> bool:
        """Whether ``pattern`` (from :meth:`const_pattern`) took part in the match."""
        c, v = self._parts[pattern]
        return c in matches or v in matches

    def value(self, matches, pattern) -> np.ndarray | None:
        """The data of what ``pattern`` matched, or None when that is not a constant (the
        reference ``is_const()`` would not have matched: the rewriter must keep the call)."""
        c, v = self._parts[pattern]
        if c in matches:
            return matches[c].value.numpy()
        if v in matches and matches[v] in self.hidden:
            return self.hidden[matches[v]][1]
        return None

    def constant(self, matches, pattern) -> Constant | None:
        """The constant (the original object) that ``pattern`` matched, or None (see :meth:`value`)."""
        c, v = self._parts[pattern]
        if c in matches:
            return matches[c]
        if v in matches and matches[v] in self.hidden:
            return self.hidden[matches[v]][0]
        return None

    def const(self, value: np.ndarray, dtype: str) -> relax.Expr | None:
        """A constant of ``value`` for the rewriter to return (a placeholder if large); None
        if it might equal another large constant: then :attr:`collided` is set."""
        if value.size < self.min_elements:
            return relax.const(np.ascontiguousarray(value), dtype)
        key = _key(value)
        if key in self._keys or self.collided:
            self.collided = True
            return None
        const = make_const(value, dtype)
        self._keys[key] = [const]
        return self._placeholder(const, value)

    def restore(self, func: relax.Function) -> relax.Function:
        """``func`` (a rewrite of :attr:`func`) with the constants bound back."""
        used = set(relax.analysis.free_vars(func.body))
        params = [p for p in func.params if p not in self.hidden]
        binds = {var: const for var, (const, _) in self.hidden.items() if var in used}
        func = relax.Function(params + list(binds), func.body, func.ret_ty, func.is_pure, func.attrs)
        return func.bind_params(binds) if binds else func
