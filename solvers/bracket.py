"""Bracketed scalar roots, elementwise over arrays: bisection and Chandrupatla's method.

Both keep, for every element, a bracket ``[a, b]`` on which the scalar function changes
sign, and stop when it is narrower than ``atol + rtol * |x|`` or cannot shrink any
further in floating point (so every tolerance is reachable, float32 included). A
bracket without a sign change is a runtime failure that follows ``on_failure`` (also
under ``jit`` and ``vmap``; with ``"nan"`` only the bad elements are NaN). Derivatives
come from the implicit function theorem with a diagonal Jacobian (one JVP of ones).
A bracket that closes on a pole or a jump of ``F`` (``|F|`` at its ends grows instead of
shrinking) is a failure too (status ``discontinuity``), never a root.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from implicit import _checks, _sharding
from solvers import _runner, _status

__all__ = ["bisection", "chandrupatla"]

_CHUNK = 16_384  # elements per chunk on CPU (see `_chunked`)



def bisection(
    F,
    lower,
    upper,
    *args,
    expand=False,
    rtol=None,
    atol=None,
    max_steps=256,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
    check_every=None,
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
      *args: parameters (pytrees of arrays), differentiated; leaves that are not
        arrays (an Equinox module's activation, a string) are held fixed.
      expand: widen a bracket on which ``F`` does not change sign before solving:
        the end with the smaller ``|F|`` moves outwards by 1.6 times the width, up to
        ``EXPAND_TRIES`` (50) times per element (``F`` at an end non-finite: stop). An
        element still without a sign change fails with status ``no_sign_change``.
      rtol, atol: tolerances on the bracket width (defaults follow the dtype: 1e-5/1e-6
        in float32, 1e-8/1e-10 in float64, 4 eps/0.4 eps in
        float16 and bfloat16).
      max_steps: iteration cap.
      rule: ``"vjp"`` or ``"jvp"`` (see :func:`implicit.custom_root`).
      linear_solver: adjoint linear solver; ``"auto"`` (default) is ``"diagonal"``, the
        exact solve ``b / (∂F/∂x)`` (one JVP), checked elementwise so that a failed
        element leaves the others' gradients intact. Any :mod:`implicit.linear` method
        also works.
      on_failure: ``"raise"``, ``"nan"`` or ``"ignore"`` (a bad bracket then returns its
        midpoint).
      full_output: also return an :class:`solvers.Info` whose ``converged``,
        ``residual`` (``|F(x*)|``) and ``status`` (``converged``, ``no_sign_change``,
        ``discontinuity``, ``nonfinite`` or ``max_steps``) are elementwise;
        ``num_steps`` counts the loop's steps (all elements advance together) and
        ``residual_history`` holds the widest unconverged bracket after each step.
      check_every: steps per convergence test (``None``: 1 on CPU, 4 on GPU/TPU, where each
        test syncs with the host). A solve may take up to ``check_every - 1`` steps more than
        it needs (and than ``max_steps``); the guess is still tested first.

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
      >>> x = solvers.bisection(lambda x, a: x ** 3 - a, 0.0, 10.0, a, expand=True)
      >>> print([round(float(v), 3) for v in x])  # the bracket widened to a sign change
      [2.0, 12.599]
    """
    return _bracketed(
        "bisection",
        F,
        lower,
        upper,
        args,
        expand,
        rtol,
        atol,
        max_steps,
        rule,
        linear_solver,
        on_failure,
        full_output,
        check_every,
    )


def chandrupatla(
    F,
    lower,
    upper,
    *args,
    expand=False,
    rtol=None,
    atol=None,
    max_steps=256,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
    check_every=None,
):
    """Find a root of a scalar function inside a sign-changing bracket: Chandrupatla's method.

    Like :func:`bisection` (same arguments, same guarantees), but each step tries inverse
    quadratic interpolation through the last three points and falls back to bisection
    where that is unsafe (Chandrupatla, 1997: Brent's reliability with a simpler rule),
    so it needs a handful of steps where bisection needs dozens. Returns the bracket end
    with the smaller ``|F|``.

    Args:
      F: elementwise scalar function ``F(x, *args)`` returning an array shaped like ``x``.
      lower, upper: the bracket ends (broadcast together; either order), where ``F``
        differs in sign (or is zero).
      *args: parameters (pytrees of arrays), differentiated; leaves that are not
        arrays are held fixed.
      expand: widen a bracket without a sign change before solving, as
        :func:`bisection` does.
      rtol, atol: tolerances on the bracket width (defaults follow the dtype, as in
        :func:`bisection`).
      max_steps: iteration cap.
      rule: ``"vjp"`` or ``"jvp"`` (see :func:`implicit.custom_root`).
      linear_solver: adjoint linear solver; ``"auto"`` (default) is the exact
        elementwise ``b / (∂F/∂x)``.
      on_failure: ``"raise"``, ``"nan"`` or ``"ignore"``.
      full_output: also return an elementwise :class:`solvers.Info` (as
        :func:`bisection`).
      check_every: steps per convergence test (``None``: 1 on CPU, 4 on GPU/TPU).

    Returns:
      The roots (shape of the broadcast inputs), or ``(roots, info)``.

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
        expand,
        rtol,
        atol,
        max_steps,
        rule,
        linear_solver,
        on_failure,
        full_output,
        check_every,
    )


def _bracketed(
    method,
    F,
    lower,
    upper,
    args,
    expand,
    rtol,
    atol,
    max_steps,
    rule,
    linear_solver,
    on_failure,
    full_output,
    check_every,
):
    opts = _runner.options(
        F, "F", rtol=rtol, atol=atol, max_steps=max_steps, on_failure=on_failure,
        full_output=full_output, rule=rule, linear_solver=linear_solver,
        check_every=check_every, check_every_on_accelerator=4,
    )
    if linear_solver == "auto":
        opts = opts._replace(linear_solver="diagonal")
    (F,), args = _checks.split_args((F,), args)
    lower = _checks.as_floating_array(lower, "lower")
    upper = _checks.as_floating_array(upper, "upper")
    dtype = jnp.result_type(lower, upper)
    return _runner.dispatch(
        _solve,
        lower.astype(dtype),
        upper.astype(dtype),
        args,
        *_checks.tolerances(rtol, atol, dtype),
        options=opts,
        F=F,
        fn=F,
        method=method,
        expand=bool(expand),
        solver=f"solvers.{method}",
    )


@_runner.jit_solver
def _solve(
    lower,
    upper,
    args,
    rtol,
    atol,
    *,
    F,
    method,
    expand,
    options,
    solver,
    check,
):
    # The problems' shape: the bracket's, broadcast with what F makes of the parameters.
    try:
        shape = jnp.broadcast_shapes(lower.shape, upper.shape)
    except ValueError:
        raise ValueError(
            f"`lower` and `upper` must broadcast together, got shapes {lower.shape} and "
            f"{upper.shape}"
        ) from None
    out = _checks.call_shape(F, "F", jnp.zeros(shape, lower.dtype), *args)
    try:
        shape = jnp.broadcast_shapes(shape, out.shape)
    except (AttributeError, ValueError):
        pass  # reported by the check below
    # On an Explicit mesh the problems keep the sharding F gives them (scalar ends
    # broadcast to it), so that the elementwise updates mix equally sharded arrays.
    sharding = _explicit_sharding(out, shape)
    x0 = jnp.zeros(shape, lower.dtype, out_sharding=sharding)
    _checks.check_scalar_function_output(jax.eval_shape(F, x0, *args), x0, "F(x, *args)", "x")
    lower = jnp.broadcast_to(lower, shape, out_sharding=sharding)
    upper = jnp.broadcast_to(upper, shape, out_sharding=sharding)
    init, step, finish = _METHODS[method]

    def body(x0, args):
        def run(lower, upper, args):
            def fn(x):
                return F(x, *args)

            zero = jnp.zeros((), lower.dtype)
            if expand:
                lower, upper = _expand(fn, lower, upper)
            # |F| at the ends, for the pole test after the loop (not carried through it:
            # the loop is memory-bound, every carried array costs).
            state0, f_start = init(fn, lower, upper)
            method = _runner.Method(
                init=lambda state: state,
                step=step(fn, rtol, atol),
                # Done when no element is still refining: the widest active bracket is 0.
                terminate=lambda state: _runner.Progress(_error(state), zero),
                branches=True,  # (the ends keep F's sign: one F(x) per step, see Method)
            )
            # (No stagnation test: every step shrinks every active bracket.)
            state, info = _runner.iterate(
                method,
                state0,
                rtol=zero,
                atol=zero,
                max_steps=options.max_steps,
                record_history=options.full_output,
                stagnation_window=None,
                check_every=options.check_every,
            )
            x, residual = finish(state)
            status = _final_status(state, residual, f_start)
            return x, residual, status, info.num_steps, info.residual_history

        if _chunked(shape) and not _spmd(out, lower, upper, args):
            x, residual, status, steps, history = _run_in_chunks(run, lower, upper, args)
        else:
            x, residual, status, steps, history = run(lower, upper, args)
        info = _runner.Info(
            converged=status == _status.CONVERGED,
            num_steps=jnp.broadcast_to(steps, status.shape),
            residual=residual,
            residual_history=history,
            status=status,
        )
        return x, info

    return _runner.solve(F, body, x0, args, rtol=rtol, options=options, check=check,
                         solver=solver)


def _explicit_sharding(out, shape):
    """The sharding of ``F``'s output when it is an Explicit mesh's (else ``None``)."""
    sharding = getattr(out, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if getattr(out, "shape", None) != shape or not getattr(mesh, "shape", None):
        return None
    explicit = [t == AxisType.Explicit for t in mesh.axis_types]
    return sharding if any(explicit) else None


def _spmd(*trees):
    """Whether any input lives on a mesh of several devices that XLA partitions (Auto
    or Explicit axes): then one wide solve, as the chunks' sequential ``lax.map`` over
    the flattened problem would gather the sharded axis onto every device."""
    for leaf in jax.tree.leaves(trees):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is None and isinstance(leaf, jax.Array | jax.core.Tracer):
            mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if not getattr(mesh, "shape", None):
            continue
        if any(size > 1 and t != AxisType.Manual
               for size, t in zip(mesh.shape.values(), mesh.axis_types)):
            return True
    return False


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

    x, residual, status, steps, history = jax.lax.map(
        one_chunk, (split(lower), split(upper), mapped)
    )

    def unsplit(a):
        return a.reshape(-1)[:n].reshape(shape)

    steps = jnp.broadcast_to(steps[:, None], (steps.shape[0], _CHUNK))
    if history is not None:  # the widest unconverged bracket over all chunks, per step
        history = jnp.max(jnp.where(jnp.isnan(history), -jnp.inf, history), axis=0)
        history = jnp.where(history == -jnp.inf, jnp.nan, history)
    return unsplit(x), unsplit(residual), unsplit(status), unsplit(steps), history


def _broadcasts_to(leaf_shape, shape):
    try:
        return jnp.broadcast_shapes(leaf_shape, shape) == tuple(shape)
    except ValueError:
        return False


#: Bracket expansion (``expand=True``): tries per element and the growth factor (the
#: end with the smaller |F| moves outwards by this many widths; Numerical Recipes' zbrac).
EXPAND_TRIES = 50
EXPAND_FACTOR = 1.6


def _sign_change(fa, fb):
    return ((fa <= 0) & (fb >= 0)) | ((fa >= 0) & (fb <= 0))  # False for NaN


def _expand(fn, a, b):
    """Widen each bracket ``[a, b]`` without a sign change, elementwise (``expand=True``).

    The loop stops when every element has a sign change, a non-finite ``F`` at an end,
    or has used ``EXPAND_TRIES`` tries; the brackets are then solved as given (and an
    element still without a sign change fails there as ``no_sign_change``). The ends are
    not differentiated (the root's derivative comes from the implicit function theorem).
    """
    a, b = jax.lax.stop_gradient(a), jax.lax.stop_gradient(b)
    fa, fb = fn(a), fn(b)

    def searching(a, b, fa, fb):
        finite = jnp.isfinite(a) & jnp.isfinite(b) & jnp.isfinite(fa) & jnp.isfinite(fb)
        return finite & ~_sign_change(fa, fb)

    def cond(carry):
        a, b, fa, fb, i = carry
        return jnp.any(searching(a, b, fa, fb)) & (i < EXPAND_TRIES)

    def body(carry):
        a, b, fa, fb, i = carry
        move = searching(a, b, fa, fb)
        move_a = move & (jnp.abs(fa) < jnp.abs(fb))
        move_b = move & ~move_a
        a_new = jnp.where(move_a, a + EXPAND_FACTOR * (a - b), a)
        b_new = jnp.where(move_b, b + EXPAND_FACTOR * (b - a), b)
        # One evaluation per element and trip: at whichever end moved.
        x = jnp.where(move_a, a_new, b_new)
        fx = fn(x)
        fa = jnp.where(move_a, fx, fa)
        fb = jnp.where(move_b, fx, fb)
        return a_new, b_new, fa, fb, i + 1

    a, b, _, _, _ = _sharding.while_loop(cond, body, (a, b, fa, fb, jnp.int32(0)))
    return a, b


def _initial_flag(a, b, fa, fb):
    """Elementwise status of a new bracket ``[a, b]`` with ``F`` values ``fa``, ``fb``."""
    finite = jnp.isfinite(a) & jnp.isfinite(b)
    sign_change = _sign_change(fa, fb)
    return jnp.where(
        finite & sign_change,
        jnp.where((fa == 0) | (fb == 0), _status.CONVERGED, _status.RUNNING),
        _status.NO_SIGN_CHANGE,
    ).astype(jnp.int8)


def _cannot_shrink(a, b):
    """No floating-point number strictly between ``a`` and ``b``."""
    mid = a + 0.5 * (b - a)
    return (mid == a) | (mid == b)


def _next_flag(flag, active, f, converged):
    new = jnp.where(
        jnp.isnan(f), _status.NONFINITE, jnp.where(converged, _status.CONVERGED, _status.RUNNING)
    )
    return jnp.where(active, new, flag).astype(jnp.int8)


def _error(state):
    """The widest bracket still being refined (0 once every element is done)."""
    active = state.flag == _status.RUNNING
    width = jnp.abs(state[1] - state[0])  # both states start with their two ends
    return jnp.max(jnp.where(active, width, 0.0), initial=0.0)


def _final_status(state, residual, f_start):
    """Elementwise status: still refining is ``max_steps``; a converged bracket on which
    ``|F|`` at the answer exceeds ``|F|`` at both starting ends closed on a pole (or a
    jump), not on a root (near a root ``|F|`` shrinks with the bracket)."""
    status = state.flag.astype(jnp.int32)
    status = jnp.where(status == _status.RUNNING, _status.MAX_STEPS, status)
    pole = (status == _status.CONVERGED) & (residual > f_start)
    return jnp.where(pole, _status.DISCONTINUITY, status)


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
    flag: Any  # RUNNING, or the element's final status


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
    converged = flag == _status.CONVERGED
    a, b = jnp.where(converged, root, a), jnp.where(converged, root, b)
    # max(|F(lower)|, |F(upper)|): |F| at the answer must shrink below it (pole test).
    f_start = jnp.maximum(jnp.abs(fa), jnp.abs(fb))
    return _Bisection(a, b, *_midpoint(fn, a, b), flag), f_start


def _bisection_step(fn, rtol, atol):
    def step(state):
        a, b, x, fx, flag = state
        active = flag == _status.RUNNING
        a = jnp.where(active & (fx <= 0), x, a)  # F(x) = 0: both ends move to x
        b = jnp.where(active & (fx >= 0), x, b)
        width = jnp.abs(b - a)
        converged = (width <= atol + rtol * jnp.abs(x)) | _cannot_shrink(a, b)
        flag = _next_flag(flag, active, fx, converged)
        return _Bisection(a, b, *_midpoint(fn, a, b), flag)

    return step


def _bisection_finish(state):
    return state.x, jnp.abs(state.fx)  # the midpoint of the final bracket


# --- Chandrupatla ---------------------------------------------------------------------


class _Chandrupatla(NamedTuple):
    x1: Any  # the newest point; [x1, x2] brackets the root
    x2: Any
    f1: Any
    f2: Any
    x3: Any  # the previous point (for the interpolation)
    f3: Any
    x: Any  # the next point, evaluated
    fx: Any
    flag: Any


def _chandrupatla_init(fn, lower, upper):
    f1, f2 = fn(lower), fn(upper)
    flag = _initial_flag(lower, upper, f1, f2)
    f_start = jnp.maximum(jnp.abs(f1), jnp.abs(f2))  # for the pole test
    return _Chandrupatla(
        lower, upper, f1, f2, upper, f2, *_midpoint(fn, lower, upper), flag,
    ), f_start


def _chandrupatla_step(fn, rtol, atol):
    def step(state):
        x1, x2, f1, f2, x3, f3, x, f, flag = state
        active = flag == _status.RUNNING
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
        return _Chandrupatla(x1, x2, f1, f2, x3, f3, x, fn(x), flag)

    return step


def _chandrupatla_finish(state):
    smaller = jnp.abs(state.f1) < jnp.abs(state.f2)
    x = jnp.where(smaller, state.x1, state.x2)
    # A bad bracket hands back its midpoint (with on_failure="ignore"), not one of its ends.
    bad = state.flag == _status.NO_SIGN_CHANGE
    x = jnp.where(bad, state.x1 + 0.5 * (state.x2 - state.x1), x)
    return x, jnp.where(smaller, jnp.abs(state.f1), jnp.abs(state.f2))


_METHODS = {
    "bisection": (_bisection_init, _bisection_step, _bisection_finish),
    "chandrupatla": (_chandrupatla_init, _chandrupatla_step, _chandrupatla_finish),
}
