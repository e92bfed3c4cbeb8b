"""Minimisation of a scalar ``fun(x, *args)``: L-BFGS, BFGS, gradient descent, Newton-CG, optax.

Every method steps ``x <- x + t d`` along a descent direction ``d`` with ``t`` from one
shared backtracking (Armijo) line search; they differ in ``d``:

- ``"lbfgs"``: ``-H g`` with ``H`` the limited-memory BFGS inverse Hessian (two-loop
  recursion over the last ``history_size`` pairs, initial scaling ``sᵀy / yᵀy``);
- ``"bfgs"``: a dense ``n × n`` BFGS inverse Hessian (small problems);
- ``"gradient"``: ``-g`` (the trial step grows twofold after each step, so that a
  backtracking search is not stuck with the smallest step it ever took);
- ``"newton-cg"``: the Newton direction from a truncated conjugate-gradient solve with
  Hessian-vector products (forward over reverse), stopped at negative curvature.

An optax ``GradientTransformation`` passed as the method is run to convergence instead
(its own steps, no line search).

A quasi-Newton pair ``(s, y)`` enters the memory only if ``sᵀy > 0`` (the curvature
condition; the update then keeps ``H`` positive definite). A direction that is not a
descent direction is replaced by ``-g``; a line search that fails along a quasi-Newton
direction resets the memory, one that fails along ``-g`` ends the solve as
``no_decrease``.

The solution satisfies ``∇fun(x*, *args) = 0``, which gives the implicit derivatives:
``dx*/dθ = -(∇²fun)⁻¹ ∂∇fun/∂θ`` (one adjoint solve with the Hessian, whose products
come from the VJP of the gradient); the iterations are never differentiated.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from implicit import _checks, _sharding
from solvers import _runner, _status

__all__ = ["minimize"]

METHODS = ("lbfgs", "bfgs", "gradient", "newton-cg")
#: ``linear_solver="auto"`` materialises the Hessian up to this many unknowns.
DENSE_MAX_SIZE = 64

_ARMIJO = 1e-4  # sufficient decrease: f(x + t d) <= f(x) + _ARMIJO t gᵀd
_MAX_BACKTRACKS = 40
_CG_MAX_STEPS = 200  # Hessian-vector products per Newton-CG direction (at most)


def minimize(
    fun,
    x0,
    *args,
    method="lbfgs",
    has_aux=False,
    history_size=10,
    lower=None,
    upper=None,
    rtol=None,
    atol=None,
    max_steps=1000,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
):
    """Find ``x* = argmin fun(x, *args)``, differentiable by the implicit function theorem.

    Each step moves along a descent direction (L-BFGS, BFGS, the negative gradient or a
    truncated Newton-CG direction) with a backtracking Armijo line search. The solve
    stops when the gradient is small relative to the gradient at the guess:
    ``max|∇fun(x)| <= atol + rtol * max|∇fun(x0)|`` (a guess that passes is returned
    after zero steps). Gradients of ``x*`` with respect to ``args`` and to traced values
    ``fun`` closes over come from the optimality condition ``∇fun(x*, *args) = 0``:
    ``dx*/dθ = -(∇²fun)⁻¹ ∂∇fun/∂θ``, one adjoint solve with the Hessian.

    Args:
      fun: ``fun(x, *args)`` returning a real scalar (or ``(scalar, aux)`` with
        ``has_aux=True``).
      x0: initial guess (pytree of float arrays; ints are promoted to float).
      *args: parameters (pytrees of arrays), differentiated; leaves that are not
        arrays (an Equinox module's activation, a string) are held fixed.
      method: ``"lbfgs"`` (default), ``"bfgs"``, ``"gradient"``, ``"newton-cg"``, or an
        optax ``GradientTransformation`` (e.g. ``optax.adam(1e-2)``), run to convergence
        on the user's pytrees: ``x <- x + updates`` with no line search (an
        ``optax.GradientTransformationExtraArgs`` such as ``optax.lbfgs()`` also gets
        ``value``, ``grad`` and ``value_fn``). Compiled solvers are cached per
        transformation object: create it once, outside a loop.
      has_aux: ``fun`` returns ``(value, aux)``; ``aux`` at the solution is returned too
        (differentiable: it is recomputed at ``x*``).
      history_size: L-BFGS memory (number of ``(s, y)`` pairs).
      lower, upper: optional box bounds (scalars, or pytrees like ``x0`` whose leaves are
        scalars or shaped like ``x0``'s; ``lower <= upper``, checked when they are
        concrete; both a ``ValueError`` otherwise): the guess and
        every trial point are projected into the box, directions keep the coordinates
        at an active bound fixed, and the stopping test is on the projected gradient
        ``x - clip(x - ∇fun(x), lower, upper)``. The derivative of ``x*`` comes from that
        projected condition: zero for coordinates at an active bound (one for the bound
        itself), the reduced Hessian's for the free ones.
      rtol, atol: tolerances of the gradient test above (defaults follow the dtype:
        1e-5/1e-6 in float32, 1e-8/1e-10 in float64, 4 eps/0.4 eps in
        float16 and bfloat16).
      max_steps: iteration cap.
      rule: ``"vjp"`` or ``"jvp"`` (see :func:`implicit.custom_root`).
      linear_solver: adjoint linear solver with the Hessian (see :mod:`implicit.linear`);
        ``"auto"`` (default): ``"dense"`` up to ``DENSE_MAX_SIZE`` (64) unknowns, above
        that ``"cg"`` (the Hessian at a strict minimum is symmetric positive definite:
        CG needs one product per iteration and no restart memory), or ``"gmres"`` with
        ``on_failure="ignore"`` (a truncated iterate's Hessian may be indefinite).
      on_failure: ``"raise"``, ``"nan"`` or ``"ignore"``.
      full_output: also return an :class:`solvers.Info`: ``converged``, ``num_steps``,
        ``residual`` (``max|∇fun(x*)|``), ``residual_history`` and ``status``
        (``converged``, ``max_steps``, ``nonfinite``, ``stagnated`` — neither ``fun``
        fell measurably nor the gradient reached a new smallest value for 50 steps — or
        ``no_decrease``).

    Returns:
      ``x*`` (structure of ``x0``); with ``has_aux``, ``(x*, aux)``; with
      ``full_output``, ``(x*, info)`` or, with both, ``(x*, aux, info)``.

    Example:
      >>> import jax, jax.numpy as jnp, solvers
      >>> fun = lambda x, b: jnp.sum((x - b) ** 2) + jnp.sum(x ** 4)
      >>> x = solvers.minimize(fun, jnp.zeros(2), jnp.array([1.0, 2.0]))
      >>> print(", ".join(f"{v:.4f}" for v in x))
      0.5898, 0.8351
      >>> grad_b = jax.grad(lambda b: solvers.minimize(fun, jnp.zeros(2), b)[0])
      >>> print(f"{grad_b(jnp.array([1.0, 2.0]))[0]:.4f}")
      0.3240
    """
    opts = _runner.options(
        fun, "fun", rtol=rtol, atol=atol, max_steps=max_steps, on_failure=on_failure,
        full_output=full_output, rule=rule, linear_solver=linear_solver,
    )
    name = _check_method(method)
    _checks.check_bool(has_aux, "has_aux")
    _checks.check_max_steps(history_size, "history_size")
    (fun,), args = _checks.split_args((fun,), args)
    # JAX's dtype rules for NumPy parameters too (float64 is float32 without x64, also
    # when x64 is switched in a scoped context between calls).
    args = _checks.canonicalize(args)
    x0 = _checks.as_floating(x0, "x0")
    bounded = lower is not None or upper is not None
    bounds = _checks.box_bounds(lower, upper, x0) if bounded else None
    if linear_solver == "auto":
        opts = opts._replace(linear_solver=auto_linear_solver(x0, on_failure, bounded))
    dtype = jnp.result_type(*jax.tree.leaves(x0))
    out = _runner.dispatch(
        _solve,
        x0,
        args,
        bounds,
        *_checks.tolerances(rtol, atol, dtype),
        options=opts,
        fun=fun,
        fn=fun,
        method=method,
        has_aux=has_aux,
        history_size=int(history_size),
        history=bool(full_output),
        solver=f"solvers.minimize(method={name})",
    )
    return _runner.unpack_aux(out, has_aux, full_output)


def _check_method(method):
    """A method name or an optax ``GradientTransformation``; returns its name for messages."""
    if isinstance(method, str) or not (hasattr(method, "init") and hasattr(method, "update")):
        if not isinstance(method, str) or method not in METHODS:
            valid = ", ".join(repr(c) for c in METHODS)
            raise ValueError(
                f"unknown `method`={method!r:.80}; valid values are: {valid}, or an optax "
                "GradientTransformation (e.g. optax.adam(1e-2))"
            )
        return repr(method)
    try:
        hash(method)
    except TypeError:
        raise TypeError(
            f"`method` (an optax GradientTransformation) must be hashable, got {method!r:.80}"
        ) from None
    return "optax"


def auto_linear_solver(x0, on_failure, bounded=False):
    """``linear_solver="auto"`` for an adjoint solve with a Hessian (see :func:`minimize`;
    with bounds the projected condition's Jacobian is not symmetric: no CG)."""
    size = sum(jnp.size(leaf) for leaf in jax.tree.leaves(x0))
    if size <= DENSE_MAX_SIZE:
        return "dense"
    return "gmres" if on_failure == "ignore" or bounded else "cg"


def check_scalar_output(out, fn_name, has_aux):
    """``fun(x0, *args)``'s value (shapes; with ``has_aux``, the pair's first, already
    checked by :func:`solvers._runner.main_output`) must be a real scalar."""
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        hint = "; pass has_aux=True if it returns (value, aux)" if not has_aux else ""
        raise ValueError(
            f"`{fn_name}` must return a scalar (one array of shape ()), got "
            f"{jax.tree.structure(out)}{hint}"
        )
    if out.shape != ():
        raise ValueError(
            f"`{fn_name}` must return a scalar (shape ()), got an array of shape {out.shape}; "
            "reduce it (e.g. with jnp.sum) or use solvers.least_squares for a vector of "
            "residuals"
        )
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"`{fn_name}` must return a real floating scalar, got dtype {out.dtype}")


@_runner.jit_solver
def _solve(
    x0,
    args,
    bounds,
    rtol,
    atol,
    *,
    fun,
    method,
    has_aux,
    history_size,
    history,
    options,
    solver,
    check,
):
    value, out = _runner.main_output(fun, "fun", x0, args, has_aux)
    check_scalar_output(out, "fun", has_aux)

    def body(x0, args):
        x0_flat, unravel = ravel_pytree(x0)
        dtype = x0_flat.dtype
        box = None
        if bounds is not None:
            box = tuple(jax.lax.stop_gradient(ravel_pytree(b)[0]) for b in bounds)
            x0_flat = jnp.clip(x0_flat, *box)

        def value_and_grad(v):
            f, g = jax.value_and_grad(lambda v: value(unravel(v), *args))(v)
            return jnp.asarray(f, dtype), ravel_pytree(g)[0].astype(dtype)

        if isinstance(method, str):
            make = _METHODS[method]
            run = _method(value_and_grad, *make(value_and_grad, history_size), box=box)
        else:
            run = _optax_method(method, value_and_grad, unravel,
                                lambda params: value(params, *args), box=box)
        state, info = _runner.iterate(
            run,
            x0_flat,
            rtol=rtol,
            atol=atol,
            max_steps=options.max_steps,
            record_history=history,
        )
        return unravel(state.x), info

    residual = jax.grad(value)
    if bounds is not None:
        lower, upper = bounds

        def residual(x, *args):  # the projected gradient: zero at a box-constrained minimum
            g = jax.grad(value)(x, *args)
            return jax.tree.map(lambda x, g, lo, hi: x - jnp.clip(x - g, lo, hi),
                                x, g, lower, upper)

    x, info = _runner.solve(residual, body, x0, args, rtol=rtol, options=options,
                            check=check, solver=solver)
    return _runner.with_aux(fun, x, args, info, has_aux)


# --- the line search, shared with least_squares -----------------------------------------


def approximate_wolfe(f, f_t, slope, dphi):
    """Hager and Zhang's approximate Wolfe test of a step along ``d`` from ``x`` to
    ``x_t``, for where ``f`` no longer decreases measurably: ``f(x_t)`` within ``32 eps
    |f|`` of ``f(x)`` (the rounding floor of the values) and ``0.8 |slope| >= dphi >= 0.9
    slope``, ``slope = ∇f(x)ᵀd < 0``, ``dphi = ∇f(x_t)ᵀd``: the step is judged by the
    derivative, still exact there. False for NaN."""
    floor = 32 * jnp.finfo(f.dtype).eps * jnp.abs(f)
    return (f_t <= f + floor) & (dphi <= -0.8 * slope) & (dphi >= 0.9 * slope)


def line_search(evaluate, x, f, slope, d, t0, derivative, skip=False, box=None, g=None):
    """Backtrack from ``t0`` until ``f(x + t d) <= f(x) + 1e-4 t slope`` (Armijo).

    ``evaluate(x) -> (f, extra)`` (``extra``: what the caller needs at the accepted point,
    e.g. the gradient); ``derivative(extra)``: the directional derivative ``∇f(x + t d)ᵀd``
    from it; ``slope = ∇f(x)ᵀd < 0``. Where ``f`` no longer decreases measurably (within
    ``32 eps |f|`` of ``f(x)``, the rounding floor of the values) Hager and Zhang's
    approximate Wolfe test is also accepted: ``0.8 |slope| >= ∇f(x + t d)ᵀd >= 0.9
    slope``, which judges the step by the derivative, still exact there. Each trial comes
    from the quadratic model of ``f(x + t d)``, kept within ``[0.1, 0.5]`` of the previous
    one; a non-finite value shrinks ``t`` tenfold. Returns ``(x + t d, f(x + t d), extra,
    t, ok)``; with ``skip`` the first trial is returned as is. ``evaluate`` appears once in
    the program (the loop's first pass tries ``t0``). With ``box = (lower, upper)`` the
    trials are projected, ``P(x + t d)``, and the Armijo test uses the step taken:
    ``f(P(x + t d)) <= f(x) + 1e-4 ∇f(x)ᵀ(P(x + t d) - x)`` (``g``: ``∇f(x)``).
    """
    skip = jnp.asarray(skip, bool)

    def accepted(t, x_t, f_t, extra):
        decrease = t * slope if box is None else _sharding.dot(g, x_t - x)
        armijo = f_t <= f + _ARMIJO * decrease  # False for NaN
        return armijo | approximate_wolfe(f, f_t, slope, derivative(extra))

    def trial(t):
        x_t = x + t * d
        if box is not None:
            x_t = jnp.clip(x_t, *box)
        f_t, extra = evaluate(x_t)
        return x_t, f_t, extra

    shapes = jax.eval_shape(trial, t0)
    placeholder = _sharding.zeros_of(shapes)

    def cond(carry):
        t, (x_t, f_t, extra), i = carry
        return (i == 0) | (~skip & ~accepted(t, x_t, f_t, extra) & (i <= _MAX_BACKTRACKS))

    def body(carry):
        t, (_, f_t, _), i = carry
        change = f_t - f - slope * t  # curvature term of the quadratic model, times t²
        quadratic = -slope * t * t / (2.0 * jnp.where(change > 0, change, 1.0))
        t_new = jnp.where(jnp.isfinite(f_t) & (change > 0), quadratic, 0.1 * t)
        t_new = jnp.where(i == 0, t0, jnp.clip(t_new, 0.1 * t, 0.5 * t)).astype(t.dtype)
        return t_new, trial(t_new), i + 1

    t0 = jnp.asarray(t0, f.dtype)
    t, (x_t, f_t, extra), _ = _sharding.while_loop(cond, body, (t0, placeholder, 0))
    return x_t, f_t, extra, t, skip | accepted(t, x_t, f_t, extra)


# --- the methods ------------------------------------------------------------------------


class _State(NamedTuple):
    x: Any  # the iterate (flat)
    f: Any  # fun(x)
    g: Any  # ∇fun(x)
    status: Any  # RUNNING, or a failure status
    error: Any  # max|g| (NaN when f is not finite)
    scale: Any  # max|∇fun(x0)|
    t: Any  # the last accepted step length
    best: Any  # the smallest fun so far
    improved: Any  # whether the last step lowered fun measurably (see _advance)
    memory: Any  # the method's own state


def _stationarity(x, g, box):
    """What the test judges: the gradient, or with a box the projected gradient
    ``x - clip(x - g, lower, upper)`` (zero at a box-constrained minimum)."""
    return g if box is None else x - jnp.clip(x - g, *box)


def _error(f, x, g, box):
    return jnp.where(jnp.isfinite(f), _runner.max_norm(_stationarity(x, g, box)), jnp.nan)


def _first_step(g):
    """A first step length for ``-g`` without curvature information: at most 1, and a
    unit 2-norm step when the gradient is large."""
    return jnp.minimum(1.0, 1.0 / jnp.maximum(jnp.sqrt(jnp.sum(g * g)), jnp.finfo(g.dtype).tiny))


def _method(value_and_grad, init_memory, direction, update, box=None):
    """The runner's :class:`~solvers._runner.Method` for a direction and its update.

    ``direction(state, free) -> (d, t0, steepest)``; ``update(memory, s, y, ok) -> memory``
    (``ok``: the line search succeeded; the memory is reset by the caller otherwise).
    With ``box``, the coordinates at an active bound (the gradient pushing outwards) are
    kept fixed, the fallback direction is the projected gradient, and the line search
    projects its trials; ``free`` (else None) marks the other coordinates, on which a
    method with curvature products restricts them (the Newton direction of the free
    coordinates needs ``∇²f`` restricted to them, not the whole Hessian's solve).
    """

    def step(state):
        x, f, g = state.x, state.f, state.g
        fallback = -g
        if box is None:
            d, t0, steepest = direction(state, None)
        else:
            # The method works on the free coordinates: the gradient's active part is left
            # out of its direction (then the direction descends: -g_Fᵀ H_FF g_F < 0) and
            # of its memory (see below).
            active = ((x <= box[0]) & (g > 0)) | ((x >= box[1]) & (g < 0))
            d, t0, steepest = direction(state._replace(g=jnp.where(active, 0.0, g)), ~active)
            d = jnp.where(active, 0.0, d)
            fallback = -_stationarity(x, g, box)
        slope = _sharding.dot(g, d)
        descent = jnp.isfinite(slope) & (slope < 0)
        d = jnp.where(descent, d, fallback)
        t0 = jnp.where(descent, t0, _first_step(g)).astype(x.dtype)
        steepest = steepest | ~descent
        slope = _sharding.dot(g, d)
        x_t, f_t, g_t, t, ok = line_search(value_and_grad, x, f, slope, d, t0,
                                           lambda g_t: _sharding.dot(g_t, d), box=box, g=g)
        y = g_t - g if box is None else jnp.where(active, 0.0, g_t - g)
        memory = update(state.memory, x_t - x, y, ok)
        memory = jax.tree.map(lambda new, old: jnp.where(ok, new, old), memory,
                              init_memory(x))
        x, f, g = (jnp.where(ok, new, old) for new, old in ((x_t, x), (f_t, f), (g_t, g)))
        state = _advance(state, x, f, g, failed=~ok & steepest, box=box)
        return state._replace(t=jnp.where(ok, t, state.t).astype(x.dtype), memory=memory)

    return _runner.Method(_initializer(value_and_grad, init_memory, box), step, _terminate)


def _initializer(value_and_grad, init_memory, box):
    def init(x0):
        f, g = value_and_grad(x0)
        error = _error(f, x0, g, box)
        return _State(x0, f, g, jnp.int32(_status.RUNNING), error,
                      _runner.max_norm(_stationarity(x0, g, box)), jnp.ones((), x0.dtype), f,
                      jnp.bool_(False), init_memory(x0))

    return init


def _advance(state, x, f, g, failed, box=None):
    """The state at the new iterate, with its status (``no_decrease`` if ``failed``) and
    whether fun fell measurably (beyond its rounding floor). The runner's stagnation
    test counts that as progress besides a new smallest gradient: the gradient need not
    decrease monotonically along a curved valley, and fun stops changing measurably near
    a minimum while the gradient (what the test judges) still shrinks."""
    floor = 32 * jnp.finfo(f.dtype).eps * jnp.abs(state.best)
    improved = f < state.best - floor
    status = jnp.where(failed, _status.NO_DECREASE, _status.RUNNING)
    return state._replace(x=x, f=f, g=g, status=status.astype(jnp.int32),
                          error=_error(f, x, g, box), best=jnp.where(improved, f, state.best),
                          improved=improved)


def _terminate(state):
    return _runner.Progress(state.error, state.scale, state.status,
                            improved=state.improved)


def _optax_method(tx, value_and_grad, unravel, value_tree, box=None):
    """An optax ``GradientTransformation`` run to convergence: ``x <- x + updates`` with
    ``updates, opt_state = tx.update(grads, opt_state, params)`` on the user's pytrees
    (a ``GradientTransformationExtraArgs`` also gets ``value``, ``grad`` and ``value_fn``,
    which optax's own line searches need); with ``box``, projected into it."""
    import optax

    extra = isinstance(tx, optax.GradientTransformationExtraArgs)

    def step(state):
        params, grads = unravel(state.x), unravel(state.g)
        if extra:
            updates, opt_state = tx.update(grads, state.memory, params, value=state.f,
                                           grad=grads, value_fn=value_tree)
        else:
            updates, opt_state = tx.update(grads, state.memory, params)
        x = state.x + ravel_pytree(updates)[0].astype(state.x.dtype)
        if box is not None:
            x = jnp.clip(x, *box)
        f, g = value_and_grad(x)
        return _advance(state, x, f, g, failed=jnp.bool_(False), box=box)._replace(
            memory=opt_state)

    init = _initializer(value_and_grad, lambda x0: tx.init(unravel(x0)), box)
    return _runner.Method(init, step, _terminate)


def _curvature_ok(s, y):
    """The curvature condition ``sᵀy > 0`` (relative to rounding): the BFGS update of a
    positive definite matrix stays positive definite."""
    sy = _sharding.dot(s, y)
    eps = jnp.finfo(s.dtype).eps
    return sy > eps * jnp.sqrt(jnp.sum(s * s) * jnp.sum(y * y))


def _gradient(value_and_grad, history_size):
    """Gradient descent: ``d = -g``, the trial step twice the last accepted one."""
    del value_and_grad, history_size

    def init(x0):
        return jnp.bool_(True)  # before the first step

    def direction(state, free):
        t0 = jnp.where(state.memory, _first_step(state.g), 2.0 * state.t)
        return -state.g, t0, jnp.bool_(True)

    def update(memory, s, y, ok):
        return jnp.bool_(False)

    return init, direction, update


class _LBFGSMemory(NamedTuple):
    s: Any  # (history_size, n) steps, a ring buffer
    y: Any  # (history_size, n) gradient changes
    rho: Any  # 1 / sᵀy
    k: Any  # pairs stored so far (the newest at (k - 1) % history_size)


def _lbfgs(value_and_grad, history_size):
    """L-BFGS: the two-loop recursion over the last ``history_size`` pairs."""
    del value_and_grad
    m = history_size

    def init(x0):
        zeros = _sharding.rows_like(x0, m)  # (split like x0 on an Explicit mesh)
        return _LBFGSMemory(zeros, zeros, jnp.zeros((m,), x0.dtype), jnp.int32(0))

    def direction(state, free):
        mem, g = state.memory, state.g
        count = jnp.minimum(mem.k, m)

        def backward(i, carry):  # newest to oldest
            q, alpha = carry
            j = (mem.k - 1 - i) % m
            a = jnp.where(i < count, mem.rho[j] * _sharding.dot(mem.s[j], q), 0.0)
            return q - a * mem.y[j], alpha.at[j].set(a)

        q, alpha = _sharding.fori_loop(0, m, backward, (g, jnp.zeros((m,), g.dtype)))
        newest = (mem.k - 1) % m
        yy = _sharding.dot(mem.y[newest], mem.y[newest])
        gamma = jnp.where(mem.k > 0, 1.0 / (mem.rho[newest] * jnp.where(yy > 0, yy, 1.0)),
                          1.0)
        r = gamma * q

        def forward(i, r):  # oldest to newest
            j = (mem.k - count + i) % m
            b = mem.rho[j] * _sharding.dot(mem.y[j], r)
            return jnp.where(i < count, r + (alpha[j] - b) * mem.s[j], r)

        r = _sharding.fori_loop(0, m, forward, r)
        empty = mem.k == 0
        t0 = jnp.where(empty, _first_step(g), 1.0)
        return -r, t0, empty

    def update(mem, s, y, ok):
        good = ok & _curvature_ok(s, y)
        slot = mem.k % m
        sy = _sharding.dot(s, y)
        new = _LBFGSMemory(
            mem.s.at[slot].set(s), mem.y.at[slot].set(y),
            mem.rho.at[slot].set(1.0 / jnp.where(good, sy, 1.0)), mem.k + 1,
        )
        return jax.tree.map(lambda a, b: jnp.where(good, a, b), new, mem)

    return init, direction, update


def _bfgs(value_and_grad, history_size):
    """BFGS with a dense inverse Hessian ``H`` (scaled by ``sᵀy / yᵀy`` at the first
    update, Nocedal & Wright eq. 6.20)."""
    del value_and_grad, history_size

    def init(x0):
        return jnp.eye(x0.size, dtype=x0.dtype), jnp.bool_(True)

    def direction(state, free):
        h, fresh = state.memory
        d = -_sharding.split_like(_sharding.dot(h, state.g), state.g)
        return d, jnp.where(fresh, _first_step(state.g), 1.0), fresh

    def update(memory, s, y, ok):
        h, fresh = memory
        # (H is whole on every device of an Explicit mesh, and so are its updates)
        s, y = _sharding.gathered(s), _sharding.gathered(y)
        good = ok & _curvature_ok(s, y)
        sy = _sharding.dot(s, y)
        rho = 1.0 / jnp.where(good, sy, 1.0)
        h = jnp.where(fresh, sy / jnp.where(good, _sharding.dot(y, y), 1.0) * h, h)
        hy = _sharding.dot(h, y)
        # (I - ρ s yᵀ) H (I - ρ y sᵀ) + ρ s sᵀ, expanded.
        h_new = (h - rho * (jnp.outer(s, hy) + jnp.outer(hy, s))
                 + (rho * rho * _sharding.dot(y, hy) + rho) * jnp.outer(s, s))
        return jnp.where(good, h_new, memory[0]), jnp.where(good, False, fresh)

    return init, direction, update


def _newton_cg(value_and_grad, history_size):
    """Truncated Newton: CG on ``∇²f d = -g`` with Hessian-vector products, forcing term
    ``min(0.5, sqrt|g|)``, stopped at negative curvature (then the last CG iterate, or
    ``-g`` if the first direction already has it)."""
    del history_size

    def grad(v):
        return value_and_grad(v)[1]

    def init(x0):
        return None

    def direction(state, free):
        g = state.g
        hvp = jax.linearize(grad, state.x)[1]
        if free is not None:  # ∇²f on the free coordinates (a box's active ones fixed)
            full = hvp
            hvp = lambda p: jnp.where(free, full(jnp.where(free, p, 0.0)), 0.0)  # noqa: E731
        gnorm = jnp.sqrt(jnp.sum(g * g))
        tol = jnp.minimum(0.5, jnp.sqrt(gnorm)) * gnorm
        max_iter = min(_CG_MAX_STEPS, 2 * g.size + 10)

        def cond(carry):
            _, r, _, i, done = carry
            return ~done & (i < max_iter) & (jnp.sqrt(jnp.sum(r * r)) > tol)

        def body(carry):
            d, r, p, i, _ = carry
            hp = hvp(p)
            curvature = _sharding.dot(p, hp)
            rr = _sharding.dot(r, r)
            negative = ~(curvature > 0)
            alpha = rr / jnp.where(negative, 1.0, curvature)
            d_new = d + alpha * p
            r_new = r + alpha * hp
            beta = _sharding.dot(r_new, r_new) / jnp.where(rr > 0, rr, 1.0)
            p_new = -r_new + beta * p
            keep = lambda new, old: jnp.where(negative, old, new)  # noqa: E731
            return keep(d_new, d), keep(r_new, r), keep(p_new, p), i + 1, negative

        # CG on H d = -g from d = 0: residual r = H d + g.
        zero = jnp.zeros_like(g)
        d, _, _, i, _ = _sharding.while_loop(cond, body, (zero, g, -g, 0, jnp.bool_(False)))
        none = jnp.all(d == 0)
        return jnp.where(none, -g, d), jnp.where(none, _first_step(g), 1.0), none

    def update(memory, s, y, ok):
        return None

    return init, direction, update


_METHODS = {"lbfgs": _lbfgs, "bfgs": _bfgs, "gradient": _gradient, "newton-cg": _newton_cg}
