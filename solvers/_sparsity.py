"""``jac_sparsity="auto"``: a Jacobian's sparsity pattern read from the function's jaxpr.

Each value of the traced function carries, per element, the set of input elements it
depends on (a boolean SciPy sparse matrix: one row per element, one column per input
element), propagated equation by equation:

- elementwise primitives: the union of their floating operands' sets (broadcast);
  integer and boolean results (comparisons, ``select_n``'s predicate, indices) carry none:
  their derivative is zero;
- data movement (``reshape``, ``slice``, ``concatenate``, ``pad``, ``transpose``,
  ``broadcast_in_dim``, ``rev``, ``squeeze``, ``split``, and ``gather``/``dynamic_slice``/scatters
  with indices known at trace time): the operands' element indices moved by the same
  primitive, so every output element takes exactly its source's set;
- reductions: the union over each reduced group; ``dot_general``: the union over the
  contracted elements, only where a factor known at trace time (a constant matrix) is
  nonzero;
- calls (``jit``, custom derivatives, ``remat``) are followed inside; a ``cond`` takes the
  union of its branches;
- anything else (loops, ``sort``, FFTs, convolutions, ...): every output element depends
  on every input element its operands depend on.

So the pattern cannot miss an entry that is nonzero anywhere (the rules only ever add),
only add some that are always zero. Values computed from constants alone (``jnp.eye(n)``,
masks) are evaluated at trace time, so a product with a constant sparse matrix keeps its
sparsity.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

__all__ = ["jacobian_pattern"]

#: The most stored entries any intermediate pattern may have: past it the structure is
#: reported as not found (a dense Jacobian of this size is no use to a sparse solver).
MAX_ENTRIES = 20_000_000

#: Values known at trace time are evaluated up to this many elements.
MAX_KNOWN = 1_000_000

_ELEMENTWISE = frozenset("""
abs acos acosh add asin asinh atan atan2 atanh cbrt ceil clamp conj copy copy_p cos cosh
digamma div erf erf_inv erfc exp exp2 expm1 floor imag integer_pow is_finite lgamma log
log1p logistic max min mul ne neg nextafter pow real reduce_precision rem round rsqrt
select_n sign sin sinh sqrt square sub tan tanh convert_element_type
""".split())

_MOVEMENT = frozenset("reshape squeeze broadcast_in_dim transpose slice rev concatenate pad "
                      "stack".split())

_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod".split())

_INDEXED = frozenset("gather dynamic_slice dynamic_update_slice scatter scatter-add "
                     "scatter_add scatter-mul scatter_mul scatter-min scatter_min "
                     "scatter-max scatter_max".split())


#: Primitives whose inner jaxpr takes the equation's inputs and gives its outputs.
_CALLS = frozenset("pjit jit closed_call core_call checkpoint remat custom_jvp_call "
                   "custom_vjp_call custom_vjp_call_jaxpr".split())


class NoStructure(ValueError):
    """The pattern grew past :data:`MAX_ENTRIES`."""


def _floating(aval):
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _size(aval):
    return math.prod(aval.shape)


class _Patterns:
    """The dependency sets of one trace: ``n`` input elements."""

    def __init__(self, n):
        import scipy.sparse as sp

        self.sp = sp
        self.n = n
        self.not_followed = set()  # primitives followed conservatively

    def empty(self, size):
        return self.sp.csr_matrix((size, self.n), dtype=bool)

    def check(self, mat, prim):
        if mat.nnz > MAX_ENTRIES:
            raise NoStructure(f"the pattern grew past {MAX_ENTRIES} entries at `{prim}`")
        return mat

    def union(self, mats, size, prim):
        """The elementwise union of ``mats`` (rows ``size`` or 1, broadcast)."""
        out = self.empty(size)
        for m in mats:
            if m is None:
                continue
            if m.shape[0] != size:  # (a scalar operand)
                m = self.sp.csr_matrix(np.ones((size, 1), bool)) @ m
            out = out + m
        return self.check(out.astype(bool), prim)

    def everything(self, mats, size, prim):
        """Every one of ``size`` elements on everything ``mats`` depend on."""
        self.not_followed.add(prim)
        cols = np.zeros(self.n, bool)
        for m in mats:
            if m is not None and m.nnz:
                cols[m.indices] = True
        (idx,) = np.nonzero(cols)
        if size * idx.size > MAX_ENTRIES:
            raise NoStructure(f"`{prim}` (not followed: every output element on every "
                              "input) makes the pattern dense")
        rows = np.repeat(np.arange(size), idx.size)
        return self.sp.csr_matrix((np.ones(rows.size, bool), (rows, np.tile(idx, size))),
                                  shape=(size, self.n))

    def gather_rows(self, source, index):
        """``source`` (rows of a concatenation of operands) picked by ``index`` (-1: none)."""
        index = np.ravel(index)
        valid = index >= 0
        picked = source[np.where(valid, index, 0)]
        if not valid.all():
            picked = self.sp.csr_matrix(picked.multiply(valid[:, None]))
        return picked.astype(bool).tocsr()


def _pad(a, config, fill):
    """``lax.pad`` in NumPy (negative and interior padding included)."""
    for axis, (lo, hi, interior) in enumerate(config):
        n = a.shape[axis]
        size = max(lo, 0) + n + max(n - 1, 0) * interior + max(hi, 0)
        shape = list(a.shape)
        shape[axis] = size
        out = np.full(shape, fill, a.dtype)
        where = [slice(None)] * a.ndim
        where[axis] = slice(max(lo, 0), max(lo, 0) + max(n - 1, 0) * (interior + 1) + 1,
                            interior + 1)
        if n:
            out[tuple(where)] = a
        start = -lo if lo < 0 else 0
        stop = size + hi if hi < 0 else size
        where[axis] = slice(start, stop)
        a = out[tuple(where)]
    return a


def _move(prim, params, operands):
    """The movement primitive ``prim`` applied to NumPy index arrays."""
    name = prim.name
    a = operands[0]
    if name == "reshape":
        return np.reshape(a, params["new_sizes"])
    if name == "squeeze":
        return np.squeeze(a, axis=tuple(params["dimensions"]))
    if name == "broadcast_in_dim":
        shape = params["shape"]
        expanded = np.reshape(a, [shape[d] if d in params["broadcast_dimensions"] else 1
                                  for d in range(len(shape))])
        # (a size-1 operand axis broadcast to a longer one)
        return np.broadcast_to(expanded, shape)
    if name == "transpose":
        return np.transpose(a, params["permutation"])
    if name == "slice":
        strides = params["strides"] or (1,) * a.ndim
        return a[tuple(slice(s, e, st) for s, e, st in
                       zip(params["start_indices"], params["limit_indices"], strides))]
    if name == "rev":
        return np.flip(a, tuple(params["dimensions"]))
    if name == "concatenate":
        return np.concatenate(operands, axis=params["dimension"])
    if name == "stack":
        return np.stack(operands, axis=params["axis"])
    if name == "pad":
        return _pad(a, params["padding_config"], -1)
    raise AssertionError(name)


def _read_known(v, known):
    if isinstance(v, jex_core.Literal):
        return np.asarray(v.val)
    return known.get(v)


def _eval_known(eqn, values):
    """The outputs of ``eqn`` from known inputs (NumPy), or None."""
    if any(_size(v.aval) > MAX_KNOWN for v in eqn.outvars):
        return None
    try:
        with jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*values, **eqn.params)
    except Exception:  # noqa: BLE001 - not evaluable here: then simply not known
        return None
    out = out if eqn.primitive.multiple_results else [out]
    return [np.asarray(o) for o in out]


def _jaxpr_patterns(jaxpr, consts, in_deps, pats, known_in):
    """The dependency sets of ``jaxpr``'s outputs given its inputs'."""
    deps, known = {}, {}
    for v, c in zip(jaxpr.constvars, consts):
        try:
            known[v] = np.asarray(c)
        except Exception:  # noqa: BLE001 - a traced constant: unknown, no dependency
            pass
    for v, d, k in zip(jaxpr.invars, in_deps, known_in):
        deps[v] = d
        if k is not None:
            known[v] = k

    def read(v):
        return None if isinstance(v, jex_core.Literal) else deps.get(v)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        kin = [_read_known(v, known) for v in eqn.invars]
        if all(d is None for d in ins):  # depends on no input: maybe computable now
            if all(k is not None for k in kin):
                out = _eval_known(eqn, kin)
                if out is not None:
                    known.update(zip(eqn.outvars, out))
            continue
        outs = _equation(eqn, ins, kin, pats)
        for v, d in zip(eqn.outvars, outs):
            deps[v] = d if _floating(v.aval) else None
    return [read(v) for v in jaxpr.outvars]


def _subjaxpr(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if isinstance(j, jex_core.ClosedJaxpr):
            return j.jaxpr, j.consts
        if isinstance(j, jex_core.Jaxpr):
            return j, ()
    return None


def _equation(eqn, ins, kin, pats):
    prim, params = eqn.primitive, eqn.params
    name = prim.name
    outs = eqn.outvars
    if not any(_floating(v.aval) for v in outs):  # (comparisons, indices: no derivative)
        return [None] * len(outs)
    floats_in = [d if _floating(v.aval) else None for v, d in zip(eqn.invars, ins)]
    if name in _ELEMENTWISE and len(outs) == 1:
        if name == "select_n":  # (the predicate carries no derivative)
            floats_in = [None] + floats_in[1:]
        return [pats.union(floats_in, _size(outs[0].aval), name)]
    if name in _MOVEMENT:
        offsets = np.cumsum([0] + [_size(v.aval) for v in eqn.invars])
        index = [np.arange(offsets[i], offsets[i + 1]).reshape(v.aval.shape)
                 for i, v in enumerate(eqn.invars)]
        if name == "pad":
            index = index[:1]  # (the padding value: -1, below)
            moved = _move(prim, params, index)
            stacked = floats_in[0] if floats_in[0] is not None else pats.empty(index[0].size)
            # the padding value's set where padded
            out = pats.gather_rows(stacked, moved)
            if floats_in[1] is not None:
                pad_rows = pats.gather_rows(floats_in[1], np.where(moved < 0, 0, -1))
                out = (out + pad_rows).astype(bool).tocsr()
            return [pats.check(out, name)]
        moved = _move(prim, params, index)
        stacked = pats.sp.vstack([d if d is not None else pats.empty(_size(v.aval))
                                  for d, v in zip(floats_in, eqn.invars)]).tocsr()
        return [pats.check(pats.gather_rows(stacked, moved), name)]
    if name == "split":
        index = np.arange(_size(eqn.invars[0].aval)).reshape(eqn.invars[0].aval.shape)
        parts = np.split(index, np.cumsum(params["sizes"])[:-1], axis=params["axis"])
        source = floats_in[0] if floats_in[0] is not None else pats.empty(index.size)
        return [pats.gather_rows(source, part) for part in parts]
    if name in _REDUCTIONS:
        (d,) = floats_in
        shape = eqn.invars[0].aval.shape
        axes = tuple(params["axes"])
        out_shape = [s for i, s in enumerate(shape) if i not in axes]
        ids = np.arange(math.prod(out_shape)).reshape(out_shape)
        ids = np.broadcast_to(np.expand_dims(ids, axes), shape).ravel()
        group = pats.sp.csr_matrix((np.ones(ids.size, bool), (ids, np.arange(ids.size))),
                                   shape=(math.prod(out_shape), ids.size))
        return [pats.check((group @ d).astype(bool).tocsr(), name)]
    if name == "dot_general":
        return [_dot_general(eqn, floats_in, kin, pats)]
    if name in _INDEXED:
        moved = _indexed(eqn, ins, kin)
        if moved is not None:
            stacked = pats.sp.vstack([d if d is not None else pats.empty(_size(v.aval))
                                      for d, v in zip(floats_in, eqn.invars)]).tocsr()
            return [pats.check(pats.gather_rows(stacked, m), name) for m in moved]
    if name == "cond":
        branches = params["branches"]
        results = [_jaxpr_patterns(b.jaxpr, b.consts, ins[1:], pats, kin[1:])
                   for b in branches]
        return [pats.union([r[i] for r in results], _size(v.aval), name)
                for i, v in enumerate(outs)]
    sub = _subjaxpr(eqn) if name in _CALLS else None
    if sub is not None:
        jaxpr, consts = sub
        n_in = len(jaxpr.invars)
        return _jaxpr_patterns(jaxpr, consts, ins[-n_in:] if n_in else [], pats,
                               kin[-n_in:] if n_in else [])
    return [pats.everything(floats_in, _size(v.aval), name) for v in outs]


def _indexed(eqn, ins, kin):
    """Index arrays moved by a gather/dynamic_slice/scatter whose indices are known (the
    operands' elements numbered one after another; -1 where an output element has no
    source), or None where an index depends on the input or is not known."""
    for v, d, k in zip(eqn.invars, ins, kin):
        if not _floating(v.aval) and (d is not None or k is None):
            return None
    offsets = np.cumsum([0] + [_size(v.aval) for v in eqn.invars])
    args = []
    for i, (v, k) in enumerate(zip(eqn.invars, kin)):
        if _floating(v.aval):
            # numbered from 1 (0: no source), as floats of v's kind: exact below 2**24
            args.append(np.arange(offsets[i] + 1, offsets[i + 1] + 1).reshape(v.aval.shape)
                        .astype(np.float64 if offsets[-1] >= 2**24 else np.float32)
                        .astype(v.aval.dtype))
        else:
            args.append(k)
    if offsets[-1] >= 2**24 and jnp.dtype(eqn.invars[0].aval.dtype).itemsize < 8:
        return None
    if eqn.primitive.name.startswith("scatter") and eqn.primitive.name not in ("scatter",):
        return None  # (combining scatters: a sum of sources, not a move)
    try:
        with jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*args, **eqn.params)
    except Exception:  # noqa: BLE001 - then followed conservatively
        return None
    out = out if eqn.primitive.multiple_results else [out]
    return [np.rint(np.asarray(o, np.float64)).astype(np.int64) - 1 for o in out]


def _dot_general(eqn, floats_in, kin, pats):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    lf = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
    B = math.prod(lhs.shape[d] for d in lb)
    F = math.prod(lhs.shape[d] for d in lf)
    G = math.prod(rhs.shape[d] for d in rf)
    C = math.prod(lhs.shape[d] for d in lc)
    if B * F * G * C > MAX_ENTRIES:
        raise NoStructure("`dot_general` makes the pattern dense")
    L = np.transpose(np.arange(_size(lhs)).reshape(lhs.shape), (*lb, *lf, *lc)).reshape(B, F, C)
    R = np.transpose(np.arange(_size(rhs)).reshape(rhs.shape), (*rb, *rf, *rc)).reshape(B, G, C)
    out_ids = np.arange(B * F * G).reshape(B, F, G, 1)
    mask = np.ones((B, F, G, C), bool)
    for known, ids, expand in ((kin[0], L, lambda x: x[:, :, None, :]),
                               (kin[1], R, lambda x: x[:, None, :, :])):
        if known is not None:
            mask &= expand(np.ravel(known)[ids] != 0)
    out = pats.empty(B * F * G)
    for d, ids, expand in ((floats_in[0], L, lambda x: x[:, :, None, :]),
                           (floats_in[1], R, lambda x: x[:, None, :, :])):
        if d is None:
            continue
        cols = np.broadcast_to(expand(ids), mask.shape)[mask]
        rows = np.broadcast_to(out_ids, mask.shape)[mask]
        conn = pats.sp.csr_matrix((np.ones(rows.size, bool), (rows, cols)),
                                  shape=(B * F * G, d.shape[0]))
        out = out + conn @ d
    return pats.check(out.astype(bool).tocsr(), "dot_general")


def jacobian_pattern(fun, x, *args, name="jac_sparsity", has_aux=False):
    """The sparsity pattern of ``fun``'s Jacobian in ``x`` at trace time: a boolean SciPy
    CSR matrix ``(m, n)`` (``n``: ``x``'s raveled size, ``m``: the output's, its leaves
    raveled and concatenated), True where an entry may be nonzero. ``args`` (pytrees of
    arrays or tracers: their shapes only) are inputs the pattern does not follow; so are
    values ``fun`` closes over, except those known at trace time (NumPy constants), whose
    zeros are used.

    Example:
      >>> import jax.numpy as jnp
      >>> lap = lambda y: jnp.concatenate([y[1:] - y[:-1], y[:1]]) * y
      >>> jacobian_pattern(lap, jnp.zeros(4)).toarray().astype(int)
      array([[1, 1, 0, 0],
             [0, 1, 1, 0],
             [0, 0, 1, 1],
             [1, 0, 0, 1]])
    """

    def spec(a):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return jax.ShapeDtypeStruct(a.shape, a.dtype)
        return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))

    leaves, treedef = jax.tree.flatten(jax.tree.map(spec, (x, args)))
    try:
        hash(fun)
    except TypeError:  # (an unhashable function: read at every call)
        return _pattern_of(fun, *treedef.unflatten(leaves), name=name, has_aux=has_aux)
    # Read once per function, shapes and dtypes: an eager caller calling the solver again
    # would otherwise trace fun again at every call.
    return _cached_pattern(fun, treedef, tuple(leaves), name, has_aux)


@functools.lru_cache(maxsize=32)
def _cached_pattern(fun, treedef, leaves, name, has_aux):
    return _pattern_of(fun, *treedef.unflatten(leaves), name=name, has_aux=has_aux)


def _pattern_of(fun, x, args, *, name, has_aux):
    """:func:`jacobian_pattern` of ``x`` and ``args`` given as ShapeDtypeStructs."""
    from jax.flatten_util import ravel_pytree

    with jax.ensure_compile_time_eval():  # (concrete: nothing staged into a caller's trace)
        flat, unravel = ravel_pytree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), x))
    n = flat.size

    def flat_fun(y, *args):
        out = fun(unravel(y), *args)
        if has_aux:
            out = out[0]
        return jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree.leaves(out)])

    closed = jax.make_jaxpr(flat_fun)(jax.ShapeDtypeStruct(flat.shape, flat.dtype), *args)
    n_args = len(closed.jaxpr.invars) - 1
    pats = _Patterns(n)
    identity = pats.sp.identity(n, dtype=bool, format="csr")
    try:
        (out,) = _jaxpr_patterns(closed.jaxpr, closed.consts,
                                 [identity] + [None] * n_args, pats,
                                 [None] * (1 + n_args))
    except NoStructure as err:
        raise ValueError(f"`{name}='auto'` found no sparse structure in the Jacobian: {err}; "
                         f"pass the pattern (a boolean array or a band half-width)") from None
    m = _size(closed.jaxpr.outvars[0].aval)
    if out is None:
        out = pats.empty(m)
    out = out.tocsr()
    out.sort_indices()
    # Mostly full because a primitive was not followed: say which, rather than hand a
    # sparse solver a dense pattern (a pattern dense for a followed reason is the truth).
    if pats.not_followed and out.nnz > out.shape[0] * n // 2:
        why = ", ".join(sorted(pats.not_followed))
        raise ValueError(f"`{name}='auto'`: the Jacobian's pattern read from the function "
                         f"has {out.nnz} of {out.shape[0] * n} entries (followed "
                         f"conservatively, every output element on every input: {why}): no "
                         f"sparse "
                         f"structure to use; pass the pattern (a boolean array or a band "
                         f"half-width), or leave `{name}` at None for dense Jacobians")
    return out
