"""Nonlinear least squares ``min 0.5 ||residual(x, *args)||²``: Levenberg–Marquardt, Gauss–Newton.

Both methods form the Jacobian ``J`` of the residuals (dense: ``jax.jacfwd`` when there
are at most as many unknowns as residuals, ``jax.jacrev`` otherwise or when the residual
has no forward mode, as one written with ``jax.custom_vjp``):

- ``"levenberg-marquardt"``: steps ``h = -(JᵀJ + μ D)⁻¹ Jᵀr`` (a least-squares solve of
  ``[J; sqrt(μ D)]``, not the normal equations) with ``D`` the largest
  ``diag(JᵀJ)`` seen so far (Moré's scaling, invariant to the units of each unknown),
  ``μ`` starting at ``damping``, and Nielsen's damping update: a step with gain ratio
  ``ρ > 0`` is taken and
  ``μ <- μ max(1/3, 1 - (2ρ - 1)³)``, a rejected one multiplies ``μ`` by ``ν`` (doubling
  ``ν`` after each rejection in a row); where the decrease is below the rounding of
  ``0.5 ||r||²`` (near a minimum with non-zero residuals) a step passing the line
  search's approximate Wolfe test is taken, ``μ <- μ / 3``;
- ``"gauss-newton"``: the least-squares step ``h = -J⁺ r`` (``jnp.linalg.lstsq``, fine
  with a rank-deficient ``J``) in Powell's dogleg trust region: ``h`` where it fits the
  radius, else the path from the Cauchy point (the model's minimiser along ``-Jᵀr``)
  towards ``h``, cut at the radius; a step giving 1e-4 of the model's decrease (or
  passing the approximate Wolfe test where the decrease is below rounding) is taken,
  the radius shrinks to a quarter of a poor step and doubles after a very good one at
  the edge; a radius shrunk to rounding without a decrease is ``no_decrease``.

The stopping test is on the Gauss–Newton step ``h = -J⁺ r`` at the iterate, an estimate
of its distance to the minimiser, elementwise: ``|h_i| <= atol + rtol |x_i|`` for every
unknown (so that unknowns of very different magnitudes are each resolved to ``rtol``),
or on the first-order condition itself: ``|(Jᵀr)_i| <= 32 eps |r| |J_i|`` with
``|J_i|`` the larger of column ``i``'s norms at the guess and now (the gradient zero to
rounding; where the residuals' curvature dominates ``JᵀJ``, as at a minimum with
``J = 0`` and non-zero residuals, ``h`` does not measure the distance). The step test
counts only where ``h`` accounts for the whole gradient (``Jᵀ(r + J h)`` zero to
rounding alike): where ``lstsq`` drops singular values whose directions carry the
gradient (an ill-conditioned ``J`` in float32), ``h`` is no distance either.
Converged on the step test, the solver returns ``x + h``: the step it measured is taken.
The implicit derivatives come from the optimality condition ``Jᵀ r = 0``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from implicit import _checks, _lu, _sharding
from solvers import _runner, _status
from solvers.minimize import approximate_wolfe, auto_linear_solver
from solvers.root import dogleg_step

__all__ = ["least_squares"]

METHODS = ("levenberg-marquardt", "gauss-newton")

DAMPING = 1e-3  # Levenberg–Marquardt's default initial μ (relative to D)
_STATIONARY = 32  # the gradient test's cosines, in eps (see _error)
_TRUST_ACCEPT = 1e-4  # Gauss–Newton takes a step giving this share of the predicted decrease
_NU_MAX = 2.0**40  # rejections in a row (ν doubles) before the solve is `no_decrease`


def least_squares(
    residual,
    x0,
    *args,
    method="levenberg-marquardt",
    has_aux=False,
    rtol=None,
    atol=None,
    x_scale=None,
    max_steps=200,
    damping=None,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
):
    """Find ``x* = argmin 0.5 ||residual(x, *args)||²``, differentiable by the implicit
    function theorem.

    Levenberg–Marquardt (default; Nielsen's damping update, Moré's scaling) or
    Gauss–Newton in a dogleg trust region. The solve stops when the Gauss–Newton
    step ``h = -J⁺ r`` at the iterate is small for every unknown:
    ``|h_i| <= atol + rtol |x_i|``, or when the gradient is zero to rounding:
    ``|(Jᵀr)_i| <= 32 eps |r| |J_i|``, ``|J_i|`` the larger of the norms of ``J``'s
    column ``i`` at ``x0`` and now (``J = 0`` at a minimum with non-zero
    residuals included). Converged on the step test, it returns ``x + h`` (the step the
    test measured, taken). Gradients of ``x*`` with respect to ``args`` and to
    traced values ``residual`` closes over come from the optimality condition
    ``J(x*)ᵀ r(x*) = 0`` (one adjoint solve with the Hessian of ``0.5 ||r||²``, whose
    products come from the VJP of ``Jᵀ r``); the iterations are never differentiated.

    Args:
      residual: ``residual(x, *args)`` returning an array or a pytree of float arrays
        (any number of residuals); one with a ``jax.custom_vjp`` works (its Jacobian by
        reverse mode; the solve is then differentiable in reverse mode only). With
        ``has_aux=True``, a pair of that and any auxiliary pytree.
      x0: initial guess (pytree of float arrays; ints are promoted to float).
      *args: parameters (pytrees of arrays), differentiated (e.g. the data);
        leaves that are not arrays (an Equinox module's activation) are held fixed.
      method: ``"levenberg-marquardt"`` or ``"gauss-newton"``.
      has_aux: ``residual`` returns ``(residuals, aux)`` (a fitted curve, a
        diagnostic); ``aux`` at the solution is returned too (differentiable, through
        ``x*`` by the implicit function theorem).
      damping: Levenberg–Marquardt's initial damping ``μ`` (a positive number;
        ``None``: 1e-3), relative to the largest ``diag(JᵀJ)`` seen, unknown by unknown
        (as jaxopt's ``damping_parameter``, which is relative to the largest diagonal
        entry): a larger value starts with shorter, more gradient-like steps (10 solves
        Meyer's scaled fit from far away). Gauss–Newton has none: a ``ValueError`` there.
      rtol, atol: tolerances of the test above (defaults follow the dtype: 1e-5/1e-6
        in float32, 1e-8/1e-10 in float64, 4 eps/0.4 eps in
        float16 and bfloat16).
      x_scale: the unknowns' typical sizes (as SciPy's ``x_scale``; positive; a scalar, or
        a pytree like ``x0`` whose leaves are scalars or shaped like ``x0``'s): the step
        test is then ``|h_i| <= atol * x_scale_i + rtol |x_i|``, so an unknown of 1e-9
        that tends to 0 is settled to its own size, not to ``atol``.
      max_steps: iteration cap (LM: rejected steps count).
      rule: ``"vjp"`` or ``"jvp"`` (see :func:`implicit.custom_root`).
      linear_solver: adjoint linear solver (see :mod:`implicit.linear`); ``"auto"``: as
        :func:`solvers.minimize` (``"dense"`` up to 64 unknowns, ``"cg"`` above, or
        ``"gmres"`` with ``on_failure="ignore"``).
      on_failure: ``"raise"``, ``"nan"`` or ``"ignore"``.
      full_output: also return an :class:`solvers.Info`: ``converged``, ``num_steps``,
        ``residual`` (``max|Jᵀr|`` at the solution), ``residual_history`` (each step's
        test error, ``max(|h_i| - rtol |x_i|, 0)``, 0 where the gradient test passes)
        and ``status`` (``converged``, ``max_steps``, ``nonfinite``, ``stagnated`` or
        ``no_decrease``).

    Returns:
      ``x*`` with the structure of ``x0``, or ``(x*, info)`` with ``full_output=True``;
      with ``has_aux``, ``(x*, aux)`` or ``(x*, aux, info)``.

    Example:
      >>> import jax, jax.numpy as jnp, solvers
      >>> t = jnp.linspace(0.0, 2.0, 8)
      >>> model = lambda p, t: p[0] * jnp.exp(-p[1] * t)
      >>> fit = lambda p, y: model(p, t) - y
      >>> y = model(jnp.array([2.0, 1.5]), t)
      >>> print(jnp.round(solvers.least_squares(fit, jnp.ones(2), y), 4))
      [2.  1.5]

      ``jax.jacrev(lambda y: solvers.least_squares(fit, jnp.ones(2), y))(y)`` is then the
      ``(2, 8)`` sensitivity of the fitted parameters to the data.
    """
    opts = _runner.options(
        residual, "residual", rtol=rtol, atol=atol, max_steps=max_steps,
        on_failure=on_failure, full_output=full_output, rule=rule,
        linear_solver=linear_solver,
    )
    _checks.check_choice(method, "method", METHODS)
    _checks.check_positive(damping, "damping")
    _checks.check_bool(has_aux, "has_aux")
    if damping is not None and method != "levenberg-marquardt":
        raise ValueError(f"`damping` is Levenberg–Marquardt's initial damping: "
                         f"method={method!r} takes none, got damping={damping!r}")
    (residual,), args = _checks.split_args((residual,), args)
    # JAX's dtype rules for NumPy parameters too (float64 is float32 without x64, also
    # when x64 is switched in a scoped context between calls).
    args = _checks.canonicalize(args)
    x0 = _checks.as_floating(x0, "x0")
    if linear_solver == "auto":
        opts = opts._replace(linear_solver=auto_linear_solver(x0, on_failure))
    dtype = jnp.result_type(*jax.tree.leaves(x0))
    out = _runner.dispatch(
        _solve,
        x0,
        args,
        None if x_scale is None else _checks.scales(x_scale, x0, "x_scale"),
        *_checks.tolerances(rtol, atol, dtype),
        _checks.as_scalar(DAMPING if damping is None else damping, dtype),
        options=opts,
        residual=residual,
        fn=residual,
        method=method,
        has_aux=has_aux,
        solver=f"solvers.least_squares(method={method!r})",
        forward_hint=_forward_hint(rule),
    )
    return _runner.unpack_aux(out, has_aux, full_output)


def _forward_hint(rule):
    """What to tell a forward-mode caller refused by a custom_vjp: the solve's own rule,
    or a residual written with ``jax.custom_vjp`` (no rule makes that one forward)."""
    custom = ("a residual written with jax.custom_vjp has no forward mode at all: "
              "differentiate in reverse mode (jax.grad, jax.jacrev) or give the residual a "
              "jax.custom_jvp rule")
    if rule == "jvp":
        return custom
    return ("pass rule='jvp' (with a linear linear_solver such as 'gmres' or 'dense') for "
            f"forward mode (jax.jvp, jax.jacfwd, jax.hessian); {custom}")


def _check_residual_output(out):
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(
                f"`residual` must return an array or a pytree of real floating arrays, got "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)} at "
                f"residual(x0, *args){jax.tree_util.keystr(path)}"
            )
    if not jax.tree.leaves(out):
        raise ValueError("`residual` must return at least one array, got an empty pytree")


def _has_forward_mode(fn, x):
    """Whether ``fn`` has a forward-mode derivative: False for a ``jax.custom_vjp`` one
    (its Jacobian is then formed in reverse mode, one VJP per residual)."""
    try:
        jax.eval_shape(jax.jacfwd(fn), x)
    except TypeError as err:
        if "forward-mode" in str(err) and "custom_vjp" in str(err):
            return False
        raise
    return True


@_runner.jit_solver
def _solve(x0, args, x_scale, rtol, atol, damping, *, residual, method, has_aux, options,
           solver, check):
    residual_aux = residual
    residual, out = _runner.main_output(residual, "residual", x0, args, has_aux)
    _check_residual_output(out)

    def body(x0, args):
        x0_flat, unravel = ravel_pytree(x0)
        dtype = x0_flat.dtype

        def fn(v):
            return ravel_pytree(residual(unravel(v), *args))[0].astype(dtype)

        m = jax.eval_shape(fn, x0_flat).size
        jac = jax.jacfwd if x0_flat.size <= m and _has_forward_mode(fn, x0_flat) else jax.jacrev

        def evaluate(v):
            """``(0.5 ||r||², (r, J, Jᵀr))`` at ``v``."""
            j, r = jac(lambda v: (lambda r: (r, r))(fn(v)), has_aux=True)(v)
            # (J whole on every device of an Explicit mesh: its factorisations need it)
            j = _sharding.gathered(j)
            return 0.5 * jnp.sum(r * r), (r, j, _sharding.split_like(_sharding.dot(j.T, r), v))

        make = _levenberg_marquardt if method == "levenberg-marquardt" else _gauss_newton
        tol = (rtol, _checks.flat_scales(x_scale, dtype))
        state, info = _runner.iterate(
            make(evaluate, tol, damping), x0_flat, rtol=rtol, atol=atol,
            max_steps=options.max_steps, record_history=options.full_output,
        )
        info = info._replace(residual=_runner.max_norm(state.g))
        # Converged on the step test: the step it measured is taken (x + h, as accurate
        # as the test found; not where the gradient test passed, h unbounded there).
        polish = info.converged & ~_stationary(state.r, state.g, state.j, state.d0)
        return unravel(state.x + jnp.where(polish, state.h, 0.0)), info

    def optimality(x, *args):  # ∇ 0.5 ||r||² = Jᵀ r
        r, vjp = jax.vjp(lambda x: residual(x, *args), x)
        return vjp(r)[0]

    x, info = _runner.solve(optimality, body, x0, args, rtol=rtol, options=options,
                            check=check, solver=solver)
    return _runner.with_aux(residual_aux, x, args, info, has_aux)


class _State(NamedTuple):
    x: Any  # the iterate (flat)
    f: Any  # 0.5 ||r||²
    r: Any  # residuals at x
    j: Any  # Jacobian at x
    g: Any  # Jᵀr at x: the gradient of f
    h: Any  # the Gauss–Newton step at x (the test's; Gauss–Newton's direction)
    status: Any
    error: Any  # max(|h_i| - rtol |x_i|, 0), or 0 where the gradient test passes
    mu: Any  # LM damping (Gauss–Newton: the trust region's radius)
    nu: Any  # LM rejection factor
    d: Any  # the largest diag(JᵀJ) so far (LM's scaling; the gradient test's)
    d0: Any  # diag(JᵀJ) at the guess (the gradient test's column norms, at least)
    best: Any  # the smallest 0.5 ||r||² so far
    improved: Any  # whether the last step lowered it measurably (see _accept)


def _gauss_newton_step(r, j, x):
    # (16-bit floats solved in float32: LAPACK has no 16-bit least squares)
    j, r_all = _lu.factorable(j), _lu.factorable(_sharding.gathered(r))
    return -_sharding.split_like(jnp.linalg.lstsq(j, r_all)[0].astype(x.dtype), x)


def _damped_step(r, j, damping, x):
    """The Levenberg–Marquardt step ``-(JᵀJ + diag(damping))⁻¹ Jᵀr``, as the least-squares
    solution of ``[J; diag(sqrt(damping))] h = [-r; 0]`` (as MINPACK, which uses QR; here
    ``jnp.linalg.lstsq``, as the Gauss–Newton step: a batched QR is refused on an Explicit
    mesh): the normal equations square ``J``'s condition number (6e8 on Meyer's scaled
    fit: beyond float64's precision in ``JᵀJ``)."""
    # (on an Explicit mesh the split pieces gathered, as J is)
    j = _lu.factorable(j)
    a = jnp.concatenate([j, jnp.diag(jnp.sqrt(_sharding.gathered(damping))).astype(j.dtype)])
    b = jnp.concatenate([-_lu.factorable(_sharding.gathered(r)),
                         _sharding.gathered(jnp.zeros_like(x, a.dtype))])
    h = jnp.linalg.lstsq(a, b, rcond=0.0)[0]  # (full rank: the damping rows)
    return _sharding.split_like(h.astype(x.dtype), x)


def _error(x, f, r, j, g, d0, tol):
    """The test's error (see the module docstring) and the Gauss–Newton step: the step's
    excess over ``rtol |x_i|`` (in units of ``x_scale_i`` where given: ``tol = (rtol,
    x_scale)``), or 0 where the gradient is zero to rounding (the
    first-order condition, which the step cannot measure where the residuals' curvature
    dominates ``JᵀJ``: ``J -> 0`` at a minimum with non-zero residuals, where ``h``
    grows without bound): ``|(Jᵀr)_i| <= 32 eps |J_i| |r|`` for every unknown, with
    ``|J_i|`` the larger of column ``i``'s norms at the guess and now (MINPACK's cosine
    test; against the guess's norm too, so that a column shrinking to 0 passes)."""
    h = _gauss_newton_step(r, j, x)
    rtol, x_scale = tol
    excess = jnp.maximum(jnp.abs(h) - rtol * jnp.abs(x), 0.0)
    error = _runner.max_norm(excess if x_scale is None else excess / x_scale)
    # The step measures the distance only if it accounts for the whole gradient: the
    # linear model's gradient after it, Jᵀ(r + J h), zero to rounding. Not where lstsq
    # dropped small singular values whose directions carry the gradient (float32 on
    # Meyer's scaled fit, cond(J) 6e8: a tiny h, 'converged' at 6500 times the cost).
    remainder = _sharding.dot(j.T, r + _sharding.dot(j, h))
    explained = _stationary(r, _sharding.split_like(remainder, x), j)
    error = jnp.where(explained, error, jnp.finfo(x.dtype).max)
    stationary = _stationary(r, g, j, d0)
    return jnp.where(jnp.isfinite(f), jnp.where(stationary, 0.0, error), jnp.nan), h


def _stationary(r, g, j, d0=0.0):
    """Whether ``g`` (a gradient ``Jᵀr``) is zero to rounding (see :func:`_error`), the
    norm of ``J``'s columns taken as at least ``sqrt(d0)``."""
    d = jnp.maximum(d0, jnp.sum(j * j, axis=0))
    cosine = _STATIONARY * jnp.finfo(g.dtype).eps * jnp.sqrt(d * _sharding.dot(r, r))
    return jnp.all(jnp.abs(g) <= cosine)


def _accept(state, ok, x, f, r, j, g, tol):
    """``state`` moved to the evaluated point ``x`` where ``ok``, with its test and its
    Gauss–Newton step (where not, those of the point it stays at, computed alike)."""
    x, f, r, j, g = (jnp.where(ok, new, old) for new, old in
                     ((x, state.x), (f, state.f), (r, state.r), (j, state.j), (g, state.g)))
    d = jnp.maximum(state.d, jnp.sum(j * j, axis=0))
    error, h = _error(x, f, r, j, g, state.d0, tol)
    # A measurable decrease of 0.5 ||r||² is progress for the runner's stagnation test
    # too: far from the minimum (and along ill-conditioned valleys) the Gauss–Newton
    # step the test measures need not shrink while the objective falls.
    improved = f < state.best - 32 * jnp.finfo(f.dtype).eps * jnp.abs(state.best)
    return state._replace(x=x, f=f, r=r, j=j, g=g, error=error, h=h, d=d,
                          best=jnp.where(improved, f, state.best), improved=improved)


def _start(evaluate, tol, damping):
    def init(x0):
        f, (r, j, g) = evaluate(x0)
        d = jnp.sum(j * j, axis=0)
        one = jnp.ones((), x0.dtype)
        error, h = _error(x0, f, r, j, g, d, tol)  # (d: d0)
        return _State(x0, f, r, j, g, h, jnp.int32(_status.RUNNING), error, damping * one,
                      2.0 * one, d, d, f, jnp.bool_(False))

    def terminate(state):
        return _runner.Progress(state.error, jnp.zeros_like(state.error), state.status,
                                improved=state.improved)

    return init, terminate


def _levenberg_marquardt(evaluate, tol, damping):
    init, terminate = _start(evaluate, tol, damping)

    def step(state):
        x, f, j, g, mu, nu = state.x, state.f, state.j, state.g, state.mu, state.nu
        # Unknowns the residuals do not depend on (a zero column) keep a unit scale.
        d = jnp.where(state.d > 0, state.d, 1.0)
        h = _damped_step(state.r, j, mu * d, x)
        x_new = x + h
        f_new, (r_new, j_new, g_new) = evaluate(x_new)
        predicted = 0.5 * _sharding.dot(h, mu * d * h - g)  # the model's decrease, > 0
        rho = (f - f_new) / jnp.where(predicted > 0, predicted, 1.0)
        measured = (predicted > 0) & (rho > 0)
        # Near a minimum with non-zero residuals the decrease falls below the rounding
        # of f before the step test can pass: there the step is judged by the slope
        # along it, still exact (the line search's approximate Wolfe test), and μ
        # decreases as for a good model.
        slope = _sharding.dot(g, h)
        rounding = approximate_wolfe(f, f_new, slope, _sharding.dot(g_new, h))
        ok = jnp.isfinite(f_new) & jnp.all(jnp.isfinite(h)) & (slope < 0) & (measured | rounding)
        factor = jnp.where(measured, jnp.maximum(1.0 / 3.0, 1.0 - (2.0 * rho - 1.0) ** 3),
                           1.0 / 3.0)
        mu = jnp.where(ok, mu * factor, mu * nu)
        nu = jnp.where(ok, 2.0, 2.0 * nu)
        state = _accept(state, ok, x_new, f_new, r_new, j_new, g_new, tol)
        wide = nu.astype(jnp.promote_types(nu.dtype, jnp.float32))  # (2**40: no float16)
        status = jnp.where(jnp.isfinite(state.f) & (wide > _NU_MAX), _status.NO_DECREASE,
                           _status.RUNNING).astype(jnp.int32)
        return state._replace(status=status, mu=mu.astype(x.dtype), nu=nu.astype(x.dtype))

    return _runner.Method(init, step, terminate)


def _gauss_newton(evaluate, tol, damping):
    """Gauss–Newton in Powell's dogleg trust region (``mu`` holds the radius): the step
    ``h`` where it fits, else the path from the Cauchy point (the model's minimiser along
    ``-Jᵀr``) towards ``h`` cut at the radius. A line search along ``h`` alone crawls where
    ``J`` is nearly singular (``h`` almost orthogonal to the gradient): SciPy's
    boundary-value problem stalled at cost 19.8 after 1000 steps."""
    start, terminate = _start(evaluate, tol, damping)

    def init(x0):
        return start(x0)._replace(mu=jnp.maximum(_norm(x0), 1.0).astype(x0.dtype))

    def step(state):
        x, f, g, h, j, radius = state.x, state.f, state.g, state.h, state.j, state.mu
        p = dogleg_step(g, h, j, radius)
        p_norm = _norm(p)
        f_new, (r_new, j_new, g_new) = evaluate(x + p)
        slope = _sharding.dot(g, p)
        jp = _sharding.dot(j, p)
        predicted = -(slope + 0.5 * _sharding.dot(jp, jp))  # the model's decrease, > 0
        rho = (f - f_new) / jnp.where(predicted > 0, predicted, 1.0)
        # (Near a minimum with non-zero residuals: judged by the slope, as in LM.)
        rounding = approximate_wolfe(f, f_new, slope, _sharding.dot(g_new, p))
        ok = (jnp.isfinite(f_new) & jnp.all(jnp.isfinite(p)) & (predicted > 0)
              & ((rho > _TRUST_ACCEPT) | rounding))
        radius = jnp.where(~ok | (rho < 0.25), 0.25 * p_norm,
                           jnp.where((rho > 0.75) & (p_norm >= 0.99 * radius),
                                     jnp.maximum(radius, 2.0 * p_norm), radius))
        state = _accept(state, ok, x + p, f_new, r_new, j_new, g_new, tol)
        eps = jnp.finfo(x.dtype).eps
        stuck = ~ok & (radius <= eps * jnp.maximum(_norm(state.x), eps))
        status = jnp.where(jnp.isfinite(state.f) & stuck, _status.NO_DECREASE, _status.RUNNING)
        return state._replace(status=status.astype(jnp.int32), mu=radius.astype(x.dtype))

    return _runner.Method(init, step, terminate)


def _norm(v):
    return jnp.sqrt(_sharding.dot(v, v))
