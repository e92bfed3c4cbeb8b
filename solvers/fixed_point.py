"""Fixed points ``x = f(x, *args)``: plain (damped) iteration and Anderson acceleration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from implicit import _checks, _lu, _sharding
from solvers import _runner

__all__ = ["fixed_point"]

METHODS = ("iterate", "anderson")
#: ``linear_solver="auto"`` materialises the adjoint matrix up to this many unknowns
#: (cheaper to compile and to run than a Krylov method at that size).
DENSE_MAX_SIZE = 64


def fixed_point(
    f,
    x0,
    *args,
    method="iterate",
    has_aux=False,
    damping=1.0,
    history_size=5,
    regularization=1e-8,
    rtol=None,
    atol=None,
    max_steps=1000,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
    check_every=None,
):
    """Find ``x*`` with ``f(x*, *args) == x*``, differentiable by the implicit function theorem.

    ``method="iterate"`` runs ``x <- x + damping * (f(x) - x)``; ``method="anderson"``
    extrapolates from the last ``history_size`` iterates (Anderson acceleration, type II,
    with a ridge of ``regularization`` relative to each residual's squared norm, at least
    4 eps of the dtype, so it stays effective when residuals are tiny). Both stop when
    ``max|f(x) - x| <= atol + rtol * max|f(x)|``. Gradients with respect to ``args`` and to
    traced values ``f`` closes over solve ``(I - ∂f/∂x)ᵀ w = ḡ`` with ``linear_solver``;
    the iterations are never differentiated, so memory does not grow with ``max_steps``.

    Args:
      f: ``f(x, *args)`` returning a pytree with the structure, shapes and dtypes of ``x``
        (with ``has_aux=True``, a pair of that and any auxiliary pytree).
      x0: initial guess (pytree of arrays; ints are promoted to float).
      *args: parameters (pytrees of arrays), differentiated; leaves that are not
        arrays (an Equinox module's activation, a string) are held fixed.
      method: ``"iterate"`` or ``"anderson"``.
      has_aux: ``f`` returns ``(x_new, aux)`` (a DEQ layer's logits, a loss term);
        ``aux`` at the fixed point is returned too (differentiable, through ``x*`` by
        the implicit function theorem).
      damping: step fraction in ``(0, 1]`` (also Anderson's mixing parameter). A
        concrete 1 (the default) compiles the undamped step ``x <- f(x)``, one pass over
        the iterate fewer; other values, traced or not, share one compiled program.
      history_size: Anderson's memory (``method="anderson"``).
      regularization: Anderson's relative ridge (raised to 4 eps of the dtype where it is
        smaller: 4.8e-7 in float32).
      rtol, atol: tolerances (defaults follow the dtype: 1e-5/1e-6 in float32,
        1e-8/1e-10 in float64, 4 eps/0.4 eps in
        float16 and bfloat16); the adjoint linear solve uses ``rtol / 10``.
      max_steps: iteration cap.
      rule: ``"vjp"`` or ``"jvp"`` (see :func:`implicit.custom_root`).
      linear_solver: adjoint linear solver (see :mod:`implicit.linear`). ``"auto"``
        (default) takes ``"neumann"`` for undamped ``method="iterate"`` with
        ``rule="vjp"`` — the adjoint iteration then converges exactly as fast as the
        forward one did, with one VJP per step and no Krylov overhead — and otherwise
        (also with ``on_failure="ignore"``, whose returned point may be a truncated
        iterate where the Neumann series need not converge) ``"dense"`` up to
        ``DENSE_MAX_SIZE`` (64) unknowns, ``"gmres"`` above. A backward
        solve that misses its tolerance follows ``on_failure`` (never a silently wrong
        gradient).
      on_failure: ``"raise"``, ``"nan"`` or ``"ignore"``.
      full_output: also return an :class:`solvers.Info` with ``converged``,
        ``num_steps`` (0 when the guess passes the test), ``residual``,
        ``residual_history`` and ``status`` (``converged``, ``max_steps``, ``nonfinite``
        or ``stagnated``; see :data:`solvers.STATUSES`).
      check_every: steps per convergence test (``None``: 1 on CPU, 4 on GPU/TPU, where each
        test syncs with the host). A solve may take up to ``check_every - 1`` steps more than
        it needs (and than ``max_steps``); the guess is still tested first.

    Returns:
      ``x*`` with the structure of ``x0``, or ``(x*, info)`` with ``full_output=True``;
      with ``has_aux``, ``(x*, aux)`` or ``(x*, aux, info)``.

    Example:
      >>> import jax, solvers
      >>> newton_sqrt = lambda a: solvers.fixed_point(lambda x, a: 0.5 * (x + a / x), a, a)
      >>> print(newton_sqrt(2.0), jax.grad(newton_sqrt)(2.0))
      1.4142135 0.35355338
    """
    opts = _runner.options(
        f, "f", rtol=rtol, atol=atol, max_steps=max_steps, on_failure=on_failure,
        full_output=full_output, rule=rule, linear_solver=linear_solver,
        check_every=check_every, check_every_on_accelerator=4,
    )
    _checks.check_choice(method, "method", METHODS)
    _checks.check_positive(damping, "damping", allow_none=False)
    if _checks._is_concrete(damping) and float(damping) > 1:
        raise ValueError(f"`damping` must be in (0, 1], got {damping}")
    _checks.check_max_steps(history_size, "history_size")
    _checks.check_positive(regularization, "regularization", allow_none=False)
    _checks.check_bool(has_aux, "has_aux")
    (f,), args = _checks.split_args((f,), args)
    x0 = _checks.as_floating(x0, "x0")
    # A concrete damping of 1 is no damping: the step is f(x) itself (None), one pass over
    # the iterate fewer per step than x + 1 * (f(x) - x).
    undamped = _checks._is_concrete(damping) and float(damping) == 1
    if linear_solver == "auto":
        opts = opts._replace(
            linear_solver=_auto_linear_solver(method, undamped, rule, on_failure, x0)
        )
    dtype = jnp.result_type(*jax.tree.leaves(x0))
    out = _runner.dispatch(
        _solve,
        x0,
        args,
        None if undamped else _checks.as_scalar(damping, dtype),
        _checks.as_scalar(regularization, dtype),
        *_checks.tolerances(rtol, atol, dtype),
        options=opts,
        f=f,
        fn=f,
        method=method,
        has_aux=has_aux,
        history_size=int(history_size),
        solver=f"solvers.fixed_point(method={method!r})",
    )
    return _runner.unpack_aux(out, has_aux, full_output)


def _auto_linear_solver(method, undamped, rule, on_failure, x0):
    """``linear_solver="auto"``: Neumann for a converged plain iteration, else dense/GMRES.

    The Neumann series converges exactly when the forward plain iteration did (the same
    spectral radius), so it needs a converged forward solve: with ``on_failure="ignore"``
    the returned point may be a truncated or oscillating iterate, where only a direct or
    Krylov solve gives the implicit-function-theorem gradient.
    """
    if method == "iterate" and undamped and rule == "vjp" and on_failure != "ignore":
        return "neumann"
    size = sum(jnp.size(leaf) for leaf in jax.tree.leaves(x0))
    return "dense" if size <= DENSE_MAX_SIZE else "gmres"


@_runner.jit_solver
def _solve(
    x0,
    args,
    damping,
    regularization,
    rtol,
    atol,
    *,
    f,
    method,
    has_aux,
    history_size,
    options,
    solver,
    check,
):
    f_aux = f
    f, out = _runner.main_output(f, "f", x0, args, has_aux)
    _checks.check_like(out, x0, "f(x0, *args)", "x0")
    make = _iterate_method if method == "iterate" else _anderson_method

    def body(x0, args):
        fn = lambda x: f(x, *args)  # noqa: E731
        method = make(fn, damping, regularization, history_size)
        state, info = _runner.iterate(
            method,
            x0,
            rtol=rtol,
            atol=atol,
            max_steps=options.max_steps,
            record_history=options.full_output,
            check_every=options.check_every,
        )
        return state[0], info

    def residual(x, *args):
        return jax.tree.map(jnp.subtract, f(x, *args), x)

    x, info = _runner.solve(residual, body, x0, args, rtol=rtol, options=options,
                            check=check, solver=solver)
    return _runner.with_aux(f_aux, x, args, info, has_aux)


def _init(x0):
    """The state's first fields: ``(x, error, scale)``, not evaluated yet (warm-up)."""
    dtype = jnp.result_type(*jax.tree.leaves(x0))
    big = jnp.asarray(jnp.finfo(dtype).max, dtype)
    return x0, big, big


def _progress(state):
    _, error, scale = state[:3]
    return _runner.Progress(error, scale)


def _damped(x, g, fx, damping):
    """``x + damping g`` (``g = f(x) - x``), or ``f(x)`` itself for ``damping=None`` (1)."""
    if damping is None:
        return fx
    return jax.tree.map(lambda xi, gi: xi + damping * gi, x, g)


def _iterate_method(fn, damping, regularization, history_size):
    """Plain (damped) iteration ``x <- x + damping (f(x) - x)`` (``damping=None``: 1).

    State ``(x, error, scale)``: a step evaluates ``f`` at ``x`` once, records the test's
    error ``max|f(x) - x|`` and scale ``max|f(x)|`` of ``x`` and moves on to the next
    iterate. The test thus judges the previous iterate, and the solution returned is
    one (free) step closer to the fixed point than the iterate that passed. The first
    step evaluates the guess (the runner's warm-up): ``f`` appears once in the program.
    """
    del regularization, history_size

    def step(state):
        x = state[0]
        fx = fn(x)
        g = jax.tree.map(jnp.subtract, fx, x)
        return _damped(x, g, fx, damping), *_runner.max_norms(g, fx)

    return _runner.Method(init=_init, step=step, terminate=_progress, warmup=True)


def _anderson_method(fn, damping, regularization, history_size):
    """Anderson acceleration (type II) over the last ``history_size`` iterates.

    State ``(x, error, scale, ys, gs, gram, k)``: the next iterate, the error and scale of
    the last evaluated one (as in :func:`_iterate_method`), the ring buffers of past
    residuals ``g = f(x) - x`` and of the damped plain steps from those iterates,
    ``y = x + damping g`` (the next iterate is their combination ``Σ α_i y_i``, the
    weights ``α`` minimising ``|Σ α_i g_i|`` with ``Σ α_i = 1``), the residuals' Gram
    matrix ``gs gsᵀ`` and the number of evaluations. A step adds one residual, so only its
    row and column of the Gram matrix are new: one product with the history (``m n``)
    instead of the whole matrix (``m² n``). The first step, with one residual in the
    history, is a damped plain step.
    """

    # Undamped, the stored step is still written as x + 1 g (XLA drops the 1): from g, it
    # fuses with g's computation; storing f(x) itself measured 15% slower per step.
    mix = 1.0 if damping is None else damping

    def init(x0):
        flat = ravel_pytree(x0)[0]
        # Broadcast from the iterate: on an Explicit mesh the buffers keep its sharding.
        zeros = jnp.broadcast_to(jnp.zeros_like(flat), (history_size, flat.size))
        gram = jnp.zeros((history_size, history_size), flat.dtype)
        return (*_init(x0), zeros, zeros, gram, jnp.int32(0))

    def step(state):
        x, _, _, ys, gs, gram, k = state
        fx = fn(x)
        x_flat, unravel = ravel_pytree(x)
        g = ravel_pytree(fx)[0] - x_flat
        m = ys.shape[0]
        slot = k % m
        ys = ys.at[slot].set(x_flat + mix * g)
        gs = gs.at[slot].set(g)
        row = _sharding.matmul(gs, g, out_sharding=_sharding.replicated(gs))  # (Explicit)
        gram = gram.at[slot].set(row).at[:, slot].set(row)
        valid = jnp.arange(m) <= k
        a = jnp.where(valid[:, None] & valid[None, :], gram, 0.0)
        # Solved scaled to a unit diagonal, with a ridge on it: each residual's weight is
        # penalised relative to its own size (an absolute ridge stalls once the residuals
        # are small; one relative to the largest lets old large residuals bias the new
        # small ones), and the ridge is at least 4 eps of the dtype, above the rounding of
        # the scaled Gram matrix. Below it a rank-deficient history (a 1-d problem: every
        # history) left a zero or negative pivot in float32, and the iteration fell back to
        # plain steps: a repelling 1-d map took 6 steps on a CPU, 11 on a GPU, 2 now.
        # Unused slots get a unit diagonal and a zero weight. (The diagonal through a
        # NumPy mask, a literal: jnp.diag's iota masks and gather indices are hoisted out
        # of the loop by XLA, three more buffers set up before it.)
        eye = np.eye(m, dtype=bool)
        d = jnp.sum(jnp.where(eye, a, 0.0), axis=0)
        scale = jnp.where(d > 0, jax.lax.rsqrt(jnp.where(d > 0, d, 1.0)), 1.0)
        ridge = jnp.maximum(regularization, 4 * jnp.finfo(a.dtype).eps)
        a = a * scale[:, None] * scale[None, :]
        a = jnp.where(eye, jnp.where(valid, a + ridge, 1.0), a)
        # (positive definite with the ridge: no pivots, which on an Explicit mesh a
        # vmapped LU's gather could not shard either)
        alpha = scale * _lu.solve_positive_definite(a, jnp.where(valid, scale, 0.0))
        alpha = alpha / jnp.sum(alpha)
        # A non-finite combination (overflowing residuals) falls back to a damped plain
        # step.
        x_new = jnp.where(jnp.all(jnp.isfinite(alpha)), _sharding.matmul(alpha, ys), ys[slot])
        return (unravel(x_new), *_runner.max_norms(g, fx), ys, gs, gram, k + 1)

    return _runner.Method(init=init, step=step, terminate=_progress, warmup=True)
