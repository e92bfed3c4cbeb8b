"""Call-time validation shared by the engine and every solver.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
wrong value) with a message naming the argument and what was expected. Checks run in
Python at call or trace time, before any iteration.
"""

from __future__ import annotations

import inspect
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

ON_FAILURE = ("raise", "nan", "ignore")
RULES = ("vjp", "jvp")


def _is_concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def check_callable(fn, name: str):
    if not callable(fn):
        raise TypeError(f"`{name}` must be callable, got {type(fn).__name__}: {fn!r:.80}")


def check_choice(value, name: str, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"unknown `{name}`={value!r}; valid values are: {valid}")


def check_linear_solver(linear_solver, rule: str = "vjp", extra=()) -> None:
    from implicit.linear import LINEAR_METHODS, LINEAR_SOLVERS

    if callable(linear_solver) or linear_solver in extra:
        return
    names = tuple(extra) + LINEAR_SOLVERS + ("<a callable (matvec, b) -> x>",)
    check_choice(linear_solver, "linear_solver", names)
    if rule == "jvp" and linear_solver not in LINEAR_METHODS:
        valid = ", ".join(repr(c) for c in LINEAR_METHODS)
        raise ValueError(
            f"`linear_solver`={linear_solver!r} is not a linear map of its right-hand side, "
            f"so it cannot carry a forward-mode rule; with rule='jvp' use one of {valid} "
            "or a callable, or use rule='vjp'"
        )


def check_bool(value, name: str) -> None:
    """A flag option (``has_aux``, ``line_search``, ...) must be True or False."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be True or False, got {value!r:.80}")


def check_positive(value, name: str, *, allow_none: bool = True) -> None:
    """A positive finite scalar tolerance (traced values are accepted unchecked)."""
    if value is None and allow_none:
        return
    if not _is_concrete(value):
        if jnp.ndim(value) != 0:
            raise ValueError(f"`{name}` must be a scalar, got shape {jnp.shape(value)}")
        return
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - re-raised with context below
        arr = None
    if arr is None or arr.ndim != 0 or not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"`{name}` must be a positive number, got {value!r:.80}")
    if not (np.isfinite(arr) and arr > 0):
        raise ValueError(f"`{name}` must be a positive finite number, got {value!r}")


def check_max_steps(max_steps, name: str = "max_steps") -> int:
    if isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Integral):
        raise TypeError(f"`{name}` must be a positive int, got {max_steps!r:.80}")
    if max_steps <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {max_steps}")
    return int(max_steps)


def as_floating(tree, name: str):
    """Convert every leaf of ``tree`` to a floating array (ints and bools are promoted).

    Raises TypeError for leaves that are not numbers or arrays (strings, None, objects)
    and for complex leaves.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        raise ValueError(f"`{name}` must contain at least one array, got {tree!r:.80}")
    float_dtype = jax.dtypes.canonicalize_dtype(np.float64)  # float32 unless x64 is on
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"`{name}`" + jax.tree_util.keystr(path)
        if isinstance(leaf, (str, bytes)) or leaf is None:
            raise TypeError(f"{where} must be a floating array, got {type(leaf).__name__}")
        try:
            dtype = jnp.result_type(leaf)
        except TypeError:
            raise TypeError(
                f"{where} must be a floating array, got {type(leaf).__name__}: {leaf!r:.80}"
            ) from None
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(f"{where} must be real floating, got complex dtype {dtype}")
        # NumPy conversions keep eager calls cheap; jit takes NumPy arrays as they are.
        if jnp.issubdtype(dtype, jnp.floating):
            out.append(_canonical_leaf(leaf) if hasattr(leaf, "dtype") else np.asarray(leaf, dtype))
        elif jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
            out.append(as_scalar(leaf, float_dtype) if jnp.ndim(leaf) == 0
                       else jnp.asarray(leaf, dtype=float_dtype))
        else:
            raise TypeError(f"{where} must be a floating array, got dtype {dtype}")
    return jax.tree.unflatten(treedef, out)


def _canonical_leaf(leaf):
    # JAX's dtype rules: a NumPy float64 array is float32 when x64 is off.
    if isinstance(leaf, (np.ndarray, np.generic)):
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)
        if dtype != leaf.dtype:
            return np.asarray(leaf, dtype)
    return leaf


def canonicalize(tree):
    """NumPy leaves converted to the dtype JAX would give them (float64 -> float32 when
    x64 is off); JAX arrays and tracers are already canonical."""
    return jax.tree.map(_canonical_leaf, tree)


def call_shape(fn, fn_name: str, *args):
    """``jax.eval_shape(fn, *args)``, with a call that does not fit ``fn``'s signature
    reported as such (naming the function and how it is called)."""
    try:
        return jax.eval_shape(fn, *args)
    except TypeError as err:
        try:
            inspect.signature(fn).bind(*args)
        except TypeError:
            pass  # the call does not fit the signature: explained below
        except ValueError:
            raise  # no signature to compare with: JAX's own error stands
        else:
            raise  # the signature fits: the TypeError is from inside fn
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise TypeError(
            f"{fn_name} is called with {len(args)} positional arguments (the unknown, then "
            f"the solver's *args), which does not fit {name}{inspect.signature(fn)}: {err}"
        ) from err


def as_scalar(value, dtype):
    """A concrete scalar as a NumPy array of ``dtype`` (cheap); a traced one via jnp."""
    if isinstance(value, jax.core.Tracer):
        return jnp.asarray(value, dtype)
    return np.asarray(value, dtype)


def check_like(out, ref, out_name: str, ref_name: str) -> None:
    """``out`` (arrays or ShapeDtypeStructs) must match ``ref`` in structure, shape and dtype."""
    out_tree, ref_tree = jax.tree.structure(out), jax.tree.structure(ref)
    if out_tree != ref_tree:
        hint = ""
        if (
            isinstance(ref, (list, tuple))
            and out_tree.num_leaves == 1
            and all(jnp.ndim(leaf) == 0 for leaf in jax.tree.leaves(ref))
        ):
            hint = (
                f"; {ref_name} is a Python {type(ref).__name__} of scalars, which JAX treats "
                f"as a pytree of {len(jax.tree.leaves(ref))} separate scalars, while "
                f"{out_name} is one array: pass {ref_name} as an array, "
                f"e.g. jnp.array({ref_name})"
            )
        raise ValueError(
            f"{out_name} must have the same pytree structure as {ref_name}: "
            f"got {out_tree}, expected {ref_tree}{hint}"
        )
    paths = jax.tree_util.tree_flatten_with_path(ref)[0]
    for (path, r), o in zip(paths, jax.tree.leaves(out)):
        where = jax.tree_util.keystr(path)
        if jnp.shape(o) != jnp.shape(r):
            raise ValueError(
                f"{out_name}{where} must have the shape of {ref_name}{where}: "
                f"got {jnp.shape(o)}, expected {jnp.shape(r)}"
            )
        if _dtype(o) != _dtype(r):
            raise ValueError(
                f"{out_name}{where} must have the dtype of {ref_name}{where}: "
                f"got {_dtype(o)}, expected {_dtype(r)}"
            )


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def default_tolerances(dtype):
    """(rtol, atol) defaults for a floating dtype: 1e-5/1e-6 (float32), 1e-8/1e-10
    (float64); for 16-bit floats, whose rounding is coarser than float32's defaults,
    ``4 eps`` / ``0.4 eps`` (float16: 3.9e-3/3.9e-4, bfloat16: 3.1e-2/3.1e-3): a residual
    that rounding leaves at an ulp or two of the solution's scale still passes."""
    info = jnp.finfo(dtype)
    if info.bits >= 64:
        return 1e-8, 1e-10
    if info.bits >= 32:
        return 1e-5, 1e-6
    eps = float(info.eps)
    return 4 * eps, 0.4 * eps


def coarsest_dtype(tree):
    """The floating dtype among ``tree``'s leaves with the coarsest rounding (the largest
    eps; the leaves' common dtype when none is floating): what bounds the accuracy of a
    residual computed through every leaf, e.g. an adjoint solve's (see implicit.ift)."""
    leaves = jax.tree.leaves(tree)
    dtypes = [jnp.result_type(v) for v in leaves]
    floating = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)]
    if not floating:
        return jnp.result_type(*leaves)
    return max(floating, key=lambda d: float(jnp.finfo(d).eps))


def tolerances(rtol, atol, dtype):
    """The user's ``rtol``/``atol`` (``None``: the dtype's defaults) as scalars of ``dtype``."""
    default_rtol, default_atol = default_tolerances(dtype)
    return (
        as_scalar(default_rtol if rtol is None else rtol, dtype),
        as_scalar(default_atol if atol is None else atol, dtype),
    )


def _is_array_leaf(leaf):
    if isinstance(leaf, jax.core.Tracer) or isinstance(leaf, (np.ndarray, jax.Array)):
        return True
    return isinstance(leaf, (numbers.Number, np.generic)) and not isinstance(leaf, complex)


def _hashable(leaf):
    try:
        hash(leaf)
    except TypeError:
        return False
    return True


class BoundArgs:
    """``fn`` with the leaves of its extra arguments that are not arrays bound in (an
    Equinox module's activation function, a string setting): called as
    ``bound(*lead, *array_leaves)``, it calls ``fn(*lead, *args)`` with ``args`` rebuilt.
    Equal, and hashed alike, for the same function, tree structure and bound leaves, so
    that a solver compiled for one call is reused by the next (jit's static arguments)."""

    def __init__(self, fn, lead, treedef, bound):
        self.fn, self.lead, self.treedef, self.bound = fn, lead, treedef, bound
        self._by_index = dict(bound)

    def _key(self):
        return self.fn, self.lead, self.treedef, self.bound

    def __eq__(self, other):
        return isinstance(other, BoundArgs) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __call__(self, *inputs):
        lead, arrays = inputs[: self.lead], iter(inputs[self.lead:])
        bound = self._by_index
        leaves = [bound[i] if i in bound else next(arrays)
                  for i in range(self.treedef.num_leaves)]
        return self.fn(*lead, *jax.tree.unflatten(self.treedef, leaves))


def split_args(fns, args, lead=1, name: str = "args"):
    """``(fns, args)`` for a solver: the user's functions ``fn(*lead_inputs, *args)``
    (None: absent) and their extra positional arguments, whose leaves must be arrays,
    numbers or hashable settings. Settings (non-array leaves) are bound into the functions
    (:class:`BoundArgs`) and the array leaves returned, flat, as the arguments; where there
    are none, ``fns`` and ``args`` come back as they are."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tuple(args))
    bound = []
    for i, (path, leaf) in enumerate(flat):
        if _is_array_leaf(leaf):
            continue
        if isinstance(leaf, complex) or not _hashable(leaf):
            raise TypeError(
                f"`{name}{jax.tree_util.keystr(path)}` must be an array, a number or a "
                f"hashable setting (a function, a string; pytrees of them are fine), got "
                f"{type(leaf).__name__}: {leaf!r:.80}; or close over it in the function"
            )
        bound.append((i, leaf))
    if not bound:
        return tuple(fns), tuple(args)
    bound = tuple(bound)
    skip = {i for i, _ in bound}
    arrays = tuple(leaf for i, (_, leaf) in enumerate(flat) if i not in skip)
    fns = tuple(None if fn is None else BoundArgs(fn, lead, treedef, bound) for fn in fns)
    return fns, arrays


def as_floating_array(value, name: str):
    """One floating array (not a pytree): ints and bools are promoted, as in :func:`as_floating`."""
    if isinstance(value, (list, tuple, dict)) or (
        not isinstance(value, jax.core.Tracer)
        and not isinstance(value, (np.ndarray, np.generic, jax.Array, numbers.Number))
    ):
        raise TypeError(f"`{name}` must be a floating array or number, got {value!r:.80}")
    return as_floating(value, name)


def check_scalar_function_output(out, x, fn_name: str, x_name: str) -> None:
    """``out`` (a ShapeDtypeStruct) of an elementwise scalar function at ``x``: one array
    with ``x``'s shape and dtype."""
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise ValueError(
            f"{fn_name} must return one array (an elementwise scalar function), "
            f"got {jax.tree.structure(out)}"
        )
    check_like(out, x, fn_name, x_name)


def check_times(ts, name: str = "ts", dtype=None):
    """Output times: a non-empty 1-D real array, strictly increasing (checked when concrete).

    Returns ``ts`` as an array of the floating ``dtype`` (default: the default float).
    """
    if ts is None or isinstance(ts, (str, bytes)):
        raise TypeError(f"`{name}` must be a 1-D array of times, got {type(ts).__name__}")
    try:
        arr = ts if isinstance(ts, jax.core.Tracer) else jnp.asarray(ts)
    except TypeError:
        raise TypeError(
            f"`{name}` must be a 1-D array of times, got {type(ts).__name__}: {ts!r:.80}"
        ) from None
    if not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
        raise TypeError(f"`{name}` must be a real array of times, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(
            f"`{name}` must be a non-empty 1-D array of times, got shape {tuple(arr.shape)}"
        )
    if _is_concrete(arr):
        values = np.asarray(arr, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"`{name}` must be finite, got {values!r:.120}")
        bad = np.flatnonzero(np.diff(values) <= 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"`{name}` must be strictly increasing: {name}[{i}]={float(values[i])!r} is "
                f"followed by {name}[{i + 1}]={float(values[i + 1])!r}"
            )
    return jnp.asarray(arr, dtype=dtype or jnp.zeros(()).dtype)


def box_bounds(lower, upper, x0):
    """``(lower, upper)`` as pytrees like ``x0`` (a scalar broadcasts; ``None``: unbounded).

    Concrete bounds must satisfy ``lower <= upper`` elementwise (an empty box has no
    solution to return: refused here, not clipped into garbage); traced ones are taken as
    given."""
    lo, up = (_bound(b, x0, name, default) for b, name, default in
              ((lower, "lower", -jnp.inf), (upper, "upper", jnp.inf)))
    pairs = zip(jax.tree_util.tree_flatten_with_path(lo)[0], jax.tree.leaves(up))
    for (path, lo_leaf), up_leaf in pairs:
        if not (_is_concrete(lo_leaf) and _is_concrete(up_leaf)):
            continue
        lo_np = np.asarray(lo_leaf, np.float64)
        up_np = np.asarray(up_leaf, np.float64)
        bad = ~(lo_np <= up_np)  # (NaN bounds too)
        if bad.any():
            i, where = _first(bad, path)
            raise ValueError(
                f"`lower` must be <= `upper` elementwise (and not NaN): lower{where} = "
                f"{float(lo_np[i])!r}, upper{where} = {float(up_np[i])!r}"
            )
    return lo, up


def _first(bad, path):
    """The index of ``bad``'s first True entry and its name under the leaf's ``path``
    (``"['a'][3]"``). (np.argwhere finds nothing in a 0-d array: indexed apart.)"""
    i = tuple(int(k) for k in np.argwhere(bad)[0]) if bad.ndim else ()
    return i, f"{jax.tree_util.keystr(path)}{list(i) if i else ''}"


def scales(scale, x0, name):
    """Positive per-unknown sizes (``x_scale``) as a pytree like ``x0`` (a scalar
    broadcasts; leaves scalars or shaped like ``x0``'s). Concrete ones must be positive
    and finite: a ``ValueError`` naming the argument and the entry otherwise."""
    out = _bound(scale, x0, name, None)
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not _is_concrete(leaf):
            continue
        values = np.asarray(leaf, np.float64)
        bad = ~((values > 0) & np.isfinite(values))
        if bad.any():
            i, where = _first(bad, path)
            raise ValueError(f"`{name}` must be positive and finite: {name}{where} = "
                             f"{float(values[i])!r}")
    return out


def flat_scales(scale, dtype):
    """:func:`scales`' pytree raveled as the solver's unknowns are, in ``dtype``, not
    differentiated (``None`` stays ``None``)."""
    if scale is None:
        return None
    return jax.lax.stop_gradient(ravel_pytree(scale)[0]).astype(dtype)


def _bound(bound, x0, name, default):
    """A box bound as a pytree like ``x0`` (a scalar broadcasts, to the whole of ``x0`` or
    to one leaf; ``None``: unbounded). Any other shape is refused, not broadcast."""
    if bound is None:
        bound = default
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(bound)) and jnp.ndim(bound) == 0:
        return jax.tree.map(lambda leaf: jnp.full(jnp.shape(leaf), bound, leaf.dtype), x0)

    def like(path, b, leaf):
        if jnp.ndim(b) and jnp.shape(b) != jnp.shape(leaf):
            raise ValueError(
                f"`{name}` must be a scalar or a pytree shaped like x0: "
                f"{name}{jax.tree_util.keystr(path)} has shape {jnp.shape(b)}, "
                f"x0{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}")
        return jnp.broadcast_to(jnp.asarray(b, leaf.dtype), jnp.shape(leaf))

    if jax.tree.structure(bound) != jax.tree.structure(x0):
        raise ValueError(
            f"`{name}` must be a scalar or a pytree shaped like x0: {name} has structure "
            f"{jax.tree.structure(bound)}, x0 has {jax.tree.structure(x0)}")
    return jax.tree_util.tree_map_with_path(like, bound, x0)
