"""Bracketed scalar roots, elementwise over arrays: bisection and Chandrupatla's method.

Both keep, for every element, a bracket ``[a, b]`` on which the scalar function changes
sign, and stop when it is narrower than ``atol + rtol * |x|`` or cannot shrink any
further in floating point (so every tolerance is reachable, float32 included). A
bracket without a sign change is a runtime failure that follows ``on_failure`` (also
under ``jit`` and ``vmap``; with ``"nan"`` only the bad elements are NaN). Derivatives
come from the implicit function theorem with a diagonal Jacobian (one JVP of ones).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from implicit import _checks, custom_root
from solvers import _loop

__all__ = ["bisection", "chandrupatla"]

_CHUNK = 16_384  # elements per chunk on CPU (see `_chunked`)

REASONS = (
    "the bracket has no sign change: F(lower) and F(upper) have the same sign "
    "(or one of them, or lower or upper, is not finite)",
    "F returned NaN inside the bracket",
)


def bisection(
    F,
    lower,
    upper,
    *args,
    rtol=None,
    atol=None,
    max_steps=256,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
):
    """Find a root of a scalar function inside a sign-changing bracket, elementwise.

    Halves ``[lower, upper]`` keeping the half on which ``F`` changes sign, until it is
    narrower than ``atol + rtol * |x|``; returns its midpoint. ``F`` acts elementwise:
    ``lower``, ``upper`` and the arrays in ``args`` broadcast together, and ``F(x)[i]``
    depends only on ``x[i]`` and the ``i``-th elements of those arrays (arrays that do
    not broadcast, e.g. shared coefficients, are used whole). Gradients with
    respect to ``args`` (and traced values ``F`` closes over) are ``-(∂F/∂θ) / (∂F/∂x)``;
    ``lower`` and ``upper`` get zero gradients.

    Args:
      F: elementwise scalar function ``F(x, *args)`` returning an array shaped like ``x``.
      lower, upper: the bracket ends (arrays or numbers, broadcast together; either
        order). ``F(lower)`` and ``F(upper)`` must differ in sign (or one be zero).
      *args: parameters (pytrees of arrays), differentiated.
      rtol, atol: tolerances on the bracket width (defaults follow the dtype: 1e-5/1e-6
        in float32, 1e-8/1e-10 in float64).
      max_steps: iteration cap.
      rule: ``"vjp"`` or ``"jvp"`` (see :func:`implicit.custom_root`).
      linear_solver: adjoint linear solver; ``"auto"`` (default) is the exact diagonal
        solve ``b / (∂F/∂x)`` (one JVP). Any :mod:`implicit.linear` method also works.
      on_failure: ``"raise"``, ``"nan"`` or ``"ignore"`` (a bad bracket then returns its
        midpoint).
      full_output: also return an :class:`solvers.Info` whose ``converged``,
        ``residual`` (``|F(x*)|``) and ``status`` (``REASONS[status - 1]``) are elementwise;
        ``num_steps`` counts the loop's steps (all elements advance together) and
        ``residual_history`` holds the widest unconverged bracket after each step.

    Returns:
      The roots (shape of the broadcast inputs), or ``(roots, info)``.

    Example:
      >>> import jax, jax.numpy as jnp, solvers
      >>> cube_root = lambda a: solvers.bisection(lambda x, a: x ** 3 - a, 0.0, 10.0, a)
      >>> print(jnp.round(cube_root(jnp.array([1.0, 8.0, 27.0])), 4))
      [1. 2. 3.]
      >>> print(round(float(jax.grad(cube_root)(8.0)), 5))  # 1 / (3 * 8^(2/3))
      0.08333
      >>> a = jnp.array([8.0, 2000.0])  # 2000^(1/3) is not in [0, 10]
      >>> x = solvers.bisection(lambda x, a: x ** 3 - a, 0.0, 10.0, a, on_failure="nan")
      >>> print(jnp.round(x, 4))
      [ 2. nan]
    """
    return _bracketed(
        "bisection",
        F,
        lower,
        upper,
        args,
        rtol,
        atol,
        max_steps,
        rule,
        linear_solver,
        on_failure,
        full_output,
    )


def chandrupatla(
    F,
    lower,
    upper,
    *args,
    rtol=None,
    atol=None,
    max_steps=256,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
):
    """Find a root of a scalar function inside a sign-changing bracket: Chandrupatla's method.

    Like :func:`bisection` (same arguments, same guarantees), but each step tries inverse
    quadratic interpolation through the last three points and falls back to bisection
    where that is unsafe (Chandrupatla, 1997: Brent's reliability with a simpler rule),
    so it needs a handful of steps where bisection needs dozens. Returns the bracket end
    with the smaller ``|F|``.

    Example:
      >>> import jax, jax.numpy as jnp, solvers
      >>> cube_root = lambda a: solvers.chandrupatla(lambda x, a: x ** 3 - a, 0.0, 10.0, a)
      >>> print(jnp.round(cube_root(jnp.array([1.0, 8.0, 27.0])), 4))
      [1. 2. 3.]
      >>> print(round(float(jax.grad(cube_root)(8.0)), 5))  # 1 / (3 * 8^(2/3))
      0.08333
    """
    return _bracketed(
        "chandrupatla",
        F,
        lower,
        upper,
        args,
        rtol,
        atol,
        max_steps,
        rule,
        linear_solver,
        on_failure,
        full_output,
    )


def _bracketed(
    method,
    F,
    lower,
    upper,
    args,
    rtol,
    atol,
    max_steps,
    rule,
    linear_solver,
    on_failure,
    full_output,
):
    _checks.check_callable(F, "F")
    _checks.check_common_options(
        rtol=rtol,
        atol=atol,
        max_steps=max_steps,
        rule=rule,
        linear_solver=linear_solver,
        on_failure=on_failure,
        extra_linear_solvers=("auto",),
    )
    if linear_solver == "auto":
        linear_solver = _diagonal_solve
    _checks.check_args(args)
    lower = _checks.as_floating_array(lower, "lower")
    upper = _checks.as_floating_array(upper, "upper")
    dtype = jnp.result_type(lower, upper)
    return _loop.dispatch(
        _solve,
        lower.astype(dtype),
        upper.astype(dtype),
        args,
        *_checks.tolerances(rtol, atol, dtype),
        F=F,
        method=method,
        rule=rule,
        linear_solver=linear_solver,
        on_failure=on_failure,
        record_history=bool(full_output),
        solver=f"solvers.{method}",
        full_output=full_output,
        max_steps=int(max_steps),
        reasons=REASONS,
    )


def _diagonal_solve(matvec, b):
    """Exact solve for an elementwise ``F``: its Jacobian is the diagonal ``matvec(1)``."""
    return b / matvec(jnp.ones_like(b))


@_loop.jit_solver
def _solve(
    lower,
    upper,
    args,
    rtol,
    atol,
    *,
    F,
    method,
    rule,
    linear_solver,
    on_failure,
    record_history,
    solver,
    check,
    max_steps,
):
    # The problems' shape: the bracket's, broadcast with what F makes of the parameters.
    try:
        shape = jnp.broadcast_shapes(lower.shape, upper.shape)
    except ValueError:
        raise ValueError(
            f"`lower` and `upper` must broadcast together, got shapes {lower.shape} and "
            f"{upper.shape}"
        ) from None
    out = jax.eval_shape(F, jnp.zeros(shape, lower.dtype), *args)
    try:
        shape = jnp.broadcast_shapes(shape, out.shape)
    except (AttributeError, ValueError):
        pass  # reported by the check below
    x0 = jnp.zeros(shape, lower.dtype)
    _checks.check_scalar_function_output(jax.eval_shape(F, x0, *args), x0, "F(x, *args)", "x")
    lower = jnp.broadcast_to(lower, shape)
    upper = jnp.broadcast_to(upper, shape)
    init, step, finish = _METHODS[method]

    @custom_root(
        F, linear_solver=linear_solver, has_aux=True, rule=rule, rtol=rtol, on_failure=on_failure
    )
    def solve(x0, *args):
        def run(lower, upper, args):
            def fn(x):
                return F(x, *args)

            state, info = _loop.iterate(
                step(fn, rtol, atol),
                init(fn, lower, upper),
                rtol=jnp.zeros((), lower.dtype),
                atol=jnp.zeros((), lower.dtype),
                max_steps=max_steps,
                record_history=record_history,
            )
            x, residual = finish(state)
            return x, residual, state.flag, info.num_steps, info.residual_history

        if _chunked(shape):
            x, residual, flag, steps, history = _run_in_chunks(run, lower, upper, args)
        else:
            x, residual, flag, steps, history = run(lower, upper, args)
        info = _loop.Info(
            converged=flag == _CONVERGED,
            num_steps=jnp.broadcast_to(steps, flag.shape),
            residual=residual,
            residual_history=history,
            status=jnp.maximum(flag.astype(jnp.int32) - 1, 0),
        )
        x = _loop.apply_failure_policy(
            x,
            info,
            solver=solver,
            on_failure=on_failure,
            check=check,
            max_steps=max_steps,
            reasons=REASONS,
        )
        return x, info

    return solve(x0, *args)


# Per-element state flags (int8): still refining, converged, or failed with a REASONS code.
_ACTIVE, _CONVERGED, _BAD_BRACKET, _NAN_INSIDE = 0, 1, 2, 3


def _chunked(shape):
    """Solve in chunks of ``_CHUNK`` elements (CPU, large problems)?

    Every step reads and writes the whole state (five to nine arrays); for 100,000
    elements that is several MB, beyond the CPU's caches. Chunks of 16,384 stay in cache
    and stop as soon as their own elements have converged: about twice as fast on CPU.
    Accelerators prefer one wide solve.
    """
    return math.prod(shape) >= 2 * _CHUNK and jax.default_backend() == "cpu"


def _run_in_chunks(run, lower, upper, args):
    """``run(lower, upper, args)`` over chunks of the flattened problem, with ``lax.map``.

    Parameters broadcast to the problem's shape are split with it; others (scalars, or
    arrays ``F`` uses whole) are passed to every chunk.
    """
    shape = lower.shape
    n = lower.size
    pad = -n % _CHUNK

    def split(leaf):  # (n_chunks, _CHUNK), padded with copies of the first element
        flat = jnp.broadcast_to(leaf, shape).reshape(-1)
        flat = jnp.concatenate([flat, jnp.broadcast_to(flat[:1], (pad,))])
        return flat.reshape(-1, _CHUNK)

    leaves, treedef = jax.tree.flatten(args)
    per_element = [jnp.ndim(leaf) > 0 and _broadcasts_to(jnp.shape(leaf), shape) for leaf in leaves]
    mapped = [split(leaf) for leaf, m in zip(leaves, per_element) if m]

    def one_chunk(chunk):
        lo, hi, chunk_leaves = chunk
        it = iter(chunk_leaves)
        chunk_args = [next(it) if m else leaf for leaf, m in zip(leaves, per_element)]
        return run(lo, hi, jax.tree.unflatten(treedef, chunk_args))

    x, residual, flag, steps, history = jax.lax.map(one_chunk, (split(lower), split(upper), mapped))

    def unsplit(a):
        return a.reshape(-1)[:n].reshape(shape)

    steps = jnp.broadcast_to(steps[:, None], (steps.shape[0], _CHUNK))
    if history is not None:  # the widest unconverged bracket over all chunks, per step
        history = jnp.max(jnp.where(jnp.isnan(history), -jnp.inf, history), axis=0)
        history = jnp.where(history == -jnp.inf, jnp.nan, history)
    return unsplit(x), unsplit(residual), unsplit(flag), unsplit(steps), history


def _broadcasts_to(leaf_shape, shape):
    try:
        return jnp.broadcast_shapes(leaf_shape, shape) == tuple(shape)
    except ValueError:
        return False


def _initial_flag(a, b, fa, fb):
    """Elementwise flag of a new bracket ``[a, b]`` with ``F`` values ``fa``, ``fb``."""
    finite = jnp.isfinite(a) & jnp.isfinite(b)
    sign_change = ((fa <= 0) & (fb >= 0)) | ((fa >= 0) & (fb <= 0))  # False for NaN
    return jnp.where(
        finite & sign_change, jnp.where((fa == 0) | (fb == 0), _CONVERGED, _ACTIVE), _BAD_BRACKET
    ).astype(jnp.int8)


def _cannot_shrink(a, b):
    """No floating-point number strictly between ``a`` and ``b``."""
    mid = a + 0.5 * (b - a)
    return (mid == a) | (mid == b)


def _next_flag(flag, active, f, converged):
    new = jnp.where(jnp.isnan(f), _NAN_INSIDE, jnp.where(converged, _CONVERGED, _ACTIVE))
    return jnp.where(active, new, flag).astype(jnp.int8)


def _error(width, flag):
    """The widest bracket still being refined (0 once every element is done)."""
    return jnp.max(jnp.where(flag == _ACTIVE, width, 0.0), initial=0.0)


# Each step decides from the trial point the previous step evaluated and stored, then
# evaluates the next one: F's value is read from the loop state, never recomputed. (Left
# to itself, XLA may duplicate F(x) into several fusions whose roundings differ (FMA
# contraction), and a bracket updated from two different signs of F no longer holds the
# root.)

# --- bisection ------------------------------------------------------------------------


class _Bisection(NamedTuple):
    a: Any  # F(a) <= 0 <= F(b) (the ends are swapped at the start if need be)
    b: Any
    x: Any  # the midpoint, evaluated
    fx: Any
    flag: Any


def _midpoint(fn, a, b):
    x = a + 0.5 * (b - a)
    return x, fn(x)


def _bisection_init(fn, lower, upper):
    fa, fb = fn(lower), fn(upper)
    flag = _initial_flag(lower, upper, fa, fb)
    swap = fa > 0
    a, b = jnp.where(swap, upper, lower), jnp.where(swap, lower, upper)
    # A zero at an end is the answer: collapse the bracket onto it.
    root = jnp.where(fa == 0, lower, upper)
    converged = flag == _CONVERGED
    a, b = jnp.where(converged, root, a), jnp.where(converged, root, b)
    return _Bisection(a, b, *_midpoint(fn, a, b), flag)


def _bisection_step(fn, rtol, atol):
    def step(state):
        a, b, x, fx, flag = state
        active = flag == _ACTIVE
        a = jnp.where(active & (fx <= 0), x, a)  # F(x) = 0: both ends move to x
        b = jnp.where(active & (fx >= 0), x, b)
        width = jnp.abs(b - a)
        converged = (width <= atol + rtol * jnp.abs(x)) | _cannot_shrink(a, b)
        flag = _next_flag(flag, active, fx, converged)
        return _Bisection(a, b, *_midpoint(fn, a, b), flag), _error(width, flag), 0.0

    return step


def _bisection_finish(state):
    return state.x, jnp.abs(state.fx)  # the midpoint of the final bracket


# --- Chandrupatla ---------------------------------------------------------------------


class _Chandrupatla(NamedTuple):
    x1: Any  # the newest point; [x1, x2] brackets the root
    f1: Any
    x2: Any
    f2: Any
    x3: Any  # the previous point (for the interpolation)
    f3: Any
    x: Any  # the next point, evaluated
    fx: Any
    flag: Any


def _chandrupatla_init(fn, lower, upper):
    f1, f2 = fn(lower), fn(upper)
    flag = _initial_flag(lower, upper, f1, f2)
    return _Chandrupatla(lower, f1, upper, f2, upper, f2, *_midpoint(fn, lower, upper), flag)


def _chandrupatla_step(fn, rtol, atol):
    def step(state):
        x1, f1, x2, f2, x3, f3, x, f, flag = state
        active = flag == _ACTIVE
        # Keep the bracket: the new point replaces the end of its own sign.
        same = (f < 0) == (f1 < 0)
        x1, f1, x2, f2, x3, f3 = (
            jnp.where(active, new, old)
            for new, old in (
                (x, x1),
                (f, f1),
                (jnp.where(same, x2, x1), x2),
                (jnp.where(same, f2, f1), f2),
                (jnp.where(same, x1, x2), x3),
                (jnp.where(same, f1, f2), f3),
            )
        )
        xmin = jnp.where(jnp.abs(f1) < jnp.abs(f2), x1, x2)
        width = jnp.abs(x2 - x1)
        # Never ask for less than a few ulps: the interpolation could not get there.
        eps = jnp.finfo(x.dtype).eps
        tol = atol + jnp.maximum(rtol, 4 * eps) * jnp.abs(xmin)
        converged = (f1 == 0) | (f2 == 0) | (width <= tol) | _cannot_shrink(x1, x2)
        flag = _next_flag(flag, active, f, converged)
        # Inverse quadratic interpolation where it is safe (Chandrupatla's test,
        # ξ ∈ (0, 1) and 1 - √(1 - ξ) < φ < √ξ, squared), else bisection; t kept tol / 2
        # away from the ends so that every step makes progress.
        d12, d32, d31 = f1 - f2, f3 - f2, f3 - f1
        xi = (x1 - x2) / (x3 - x2)
        phi = d12 / d32
        alpha = (x3 - x1) / (x2 - x1)
        iqi = f1 / d32 * (f3 / d12 + alpha * f2 / d31)  # Chandrupatla's eq. (1)
        safe = (phi * phi < xi) & ((1 - phi) * (1 - phi) < 1 - xi)  # False for NaN
        t = jnp.where(safe & jnp.isfinite(iqi), iqi, 0.5)
        limit = jnp.minimum(0.5 * tol / jnp.where(width > 0, width, 1.0), 0.5)
        x = x1 + jnp.clip(t, limit, 1 - limit) * (x2 - x1)
        state = _Chandrupatla(x1, f1, x2, f2, x3, f3, x, fn(x), flag)
        return state, _error(width, flag), 0.0

    return step


def _chandrupatla_finish(state):
    smaller = jnp.abs(state.f1) < jnp.abs(state.f2)
    x = jnp.where(smaller, state.x1, state.x2)
    # A bad bracket hands back its midpoint (with on_failure="ignore"), not one of its ends.
    x = jnp.where(state.flag == _BAD_BRACKET, state.x1 + 0.5 * (state.x2 - state.x1), x)
    return x, jnp.where(smaller, jnp.abs(state.f1), jnp.abs(state.f2))


_METHODS = {
    "bisection": (_bisection_init, _bisection_step, _bisection_finish),
    "chandrupatla": (_chandrupatla_init, _chandrupatla_step, _chandrupatla_finish),
}
