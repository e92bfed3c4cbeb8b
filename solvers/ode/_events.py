"""Terminal events: stop the integration where an event function crosses zero.

The forward pass is the ordinary stepping loop with the event values checked after every
accepted step (:func:`solvers.ode._integrate.integrate` with ``event=``): it stops after
the step across which a component changed sign and locates the crossing on that step's
continuous extension (refined on a step of the method itself where the method has a
:attr:`~solvers.ode._integrate.Stepper.restep`: kvaerno5). Rows of the output past the
event hold the state there; the backward pass below linearises at that time and state.

The derivatives (a ``jax.custom_vjp``) come from the implicit function theorem on
``g(y(t_e; θ), t_e, θ) = 0``:

    dt_e/dθ = -(g_y · ∂y(t_e)/∂θ + g_θ) / D,    D = g_y · f(y_e, t_e) + g_t,

and the state there moves with the end time, ``dy_e/dθ = ∂y(t_e)/∂θ + f(y_e, t_e)
dt_e/dθ``. The rule's forward function integrates once more, with the ordinary
differentiable solve's own rule (any adjoint), from ``ts[0]`` to the (held) event time
``t*`` on a grid of the same length as ``ts``: the output times before the event, then
points spread up to ``t*`` exactly. From that solve's last row ``y* = y(t*)`` the event
is written as ``t_e = t* + δ``, ``δ`` the root of ``g(Y(δ), t* + δ) = 0`` with ``Y(δ) =
y* + f δ + ½ (f_y f + f_t) δ²`` (the flow from ``t*``, exact to second order): zero at
the crossing found, its derivatives the implicit function theorem's, at any order. The
outputs' derivatives are those of this composition (their values stay the event
integration's), and the backward function is its reverse: both are differentiable again
wherever the solve's rule is (the discrete adjoint: ``jax.hessian``, grad of grad), and
``t*``, which the composition's derivatives do not depend on, is not differentiated. The
forward pass without a gradient costs one integration only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit import custom_root
from solvers.ode import _integrate

__all__ = ["make_event_solve", "DIRECTIONS", "event_grid"]

DIRECTIONS = ("both", "rising", "falling")


def event_grid(ts, t_e):
    """``(k, tau)``: ``k`` the last output index strictly before ``t_e`` (``T - 1`` when
    ``t_e`` is not finite: no event), ``tau`` strictly increasing output times equal to
    ``ts`` up to ``k`` and spread evenly from ``ts[k]`` to ``tau[-1] = t_e`` after it."""
    T = ts.shape[0]
    fired = jnp.isfinite(t_e)
    te = jnp.where(fired, t_e, ts[-1])
    k = jnp.clip(jnp.sum(ts < te) - 1, 0, T - 2)
    k = jnp.where(fired, k, T - 1)
    i = jnp.arange(T)
    frac = (i - k).astype(ts.dtype) / jnp.maximum(T - 1 - k, 1).astype(ts.dtype)
    spread = ts[k] + (te - ts[k]) * frac
    spread = jnp.where(i == T - 1, te, spread)
    return k, jnp.where(i <= k, ts, spread)


@jax.custom_jvp
def _with_derivative(value, carrier):
    """``value``, whose derivative is ``carrier``'s (where nothing differentiates it, the
    carrier is not computed)."""
    return value


@_with_derivative.defjvp
def _with_derivative_jvp(primals, tangents):
    return primals[0], tangents[1]


def make_event_solve(make_stepper, G, E, n, solve, *, direction, record=0, slope=None):
    """A differentiable ``event_solve(z0, ts, theta, const, ev_theta, ev_const, ctl)``
    returning ``(zs, Stats, EventResult)``.

    ``G(u, s, theta, const)``: the right-hand side; ``E(u, s, theta, const, ev_theta,
    ev_const) -> (E,)``: the raveled event values (``ev_theta``: the floating arrays the
    event function closes over, differentiated); ``solve``: the differentiable solve
    (:func:`solvers.ode._adjoint.make_solve`), whose own rule (``solve.rule``, its
    ``jax.custom_vjp``'s forward and backward functions) the derivatives go through;
    ``ctl`` as there. With ``record=B`` the :class:`~solvers.ode._integrate.Record`
    of the last ``B`` accepted steps follows (dense output; not differentiated: its
    cotangent is dropped). ``slope(u, s, theta, const)``: the state's time derivative where
    it is not ``G`` (a DAE's consistent slope), for the event time's derivative.
    """
    solve_fwd, solve_bwd = solve.rule
    f = G if slope is None else slope

    def run(z0, ts, theta, const, ev_theta, ev_const, ctl):
        rtol, atol, _, _, h0, budget = ctl

        def rhs(u, s):
            return G(u, s, theta, const)

        def event(u, s):
            return E(u, s, theta, const, ev_theta, ev_const)

        stepper = make_stepper(rhs, n, rtol=rtol, atol=atol)
        return _integrate.integrate(
            stepper, rhs, z0, ts, rtol, atol, h0, budget, n, event=event, direction=direction,
            record=record,
        )

    def grid(ts, result):
        # (the grid's points past the event are held: only its last row, at t*, is used)
        k, tau = event_grid(jax.lax.stop_gradient(ts), result.t)
        i = jnp.arange(ts.shape[0])
        return i <= k, jnp.where(i <= k, ts, tau)

    def at_event(ys, theta, ev_theta, const, ev_const, result, before):
        """``(zs, t_e, z_e)`` from the grid solve's outputs ``ys``, as carriers of their
        derivatives (to second order; their values are zero where no event fired):
        ``t_e = t* + δ``, ``z_e = Y(δ)``, with ``Y(δ) = y* + f δ + ½ (f_y f + f_t) δ²``
        the flow from the grid's last row ``y* = y(t*)`` and ``δ`` the root of
        ``g(Y(δ), t* + δ) = 0``: zero at the crossing found, its derivatives the implicit
        function theorem's (the engine's ``custom_root``, whose forward rule is
        differentiable again; no event: ``δ = 0`` is the root of ``δ``)."""
        fired = jnp.isfinite(result.t)
        t_star = jnp.where(fired, result.t, 0)
        index = jnp.maximum(result.index, 0)

        def flow(d, p, aux):
            (y, theta, _), (t_star, _, const, _, _) = p, aux
            fz = f(y, t_star, theta, const)
            dfz = jax.jvp(lambda z, s: f(z, s, theta, const), (y, t_star),
                          (fz, jnp.ones_like(t_star)))[1]
            return y + fz * d + 0.5 * dfz * d**2

        def h(d, p, aux):
            (_, theta, ev_theta), (t_star, index, const, ev_const, fired) = p, aux
            g = E(flow(d, p, aux), t_star + d, theta, const, ev_theta, ev_const)
            return jnp.where(fired, g[index], d)

        # (h closes over no traced value: the engine converts closed-over floats only)
        p, aux = (ys[-1], theta, ev_theta), (t_star, index, const, ev_const, fired)
        root = custom_root(h, linear_solver="diagonal", rule="jvp", on_failure="ignore")
        d = root(lambda d0, p, aux: d0)(jnp.zeros_like(t_star), p, aux)
        t_e = jnp.where(fired, t_star + d, 0)
        z_e = jnp.where(fired, flow(d, p, aux), 0)
        zs = jnp.where(before[:, None] | ~fired, ys, z_e)
        return zs, t_e, z_e

    @jax.custom_vjp
    def event_solve(z0, ts, theta, const, ev_theta, ev_const, ctl):
        return run(z0, ts, theta, const, ev_theta, ev_const, ctl)

    def fwd(z0, ts, theta, const, ev_theta, ev_const, ctl):
        # The integration with the event finds t* (not differentiated: a second derivative
        # differentiates this function, and t* enters only where its derivative is δ's);
        # the grid solve to t* (through the solve's own rule, forwards: differentiable
        # forwards and in reverse) and `at_event` give the derivatives. The values stay
        # the event integration's.
        sg = jax.lax.stop_gradient
        out = run(sg(z0), sg(ts), sg(theta), const, sg(ev_theta), ev_const, ctl)
        zs, _, result = out[:3]
        before, tau = grid(ts, result)
        grid_out, grid_res = solve_fwd(z0, tau, theta, const, ctl, ((), ()))
        ys = grid_out[0]
        zs_d, t_d, z_d = at_event(ys, theta, ev_theta, const, ev_const, result, before)
        zs = _with_derivative(zs, zs_d)
        result = result._replace(t=_with_derivative(result.t, t_d),
                                 z=_with_derivative(result.z, z_d))
        res = (grid_res, ys, theta, ev_theta, const, ev_const, sg(result), before)
        return (zs, out[1], result, *out[3:]), res

    def bwd(res, cotangents):
        grid_res, ys, theta, ev_theta, const, ev_const, result, before = res
        gzs, _, ev_ct = cotangents[:3]
        _, vjp = jax.vjp(
            lambda ys, theta, ev_theta: at_event(ys, theta, ev_theta, const, ev_const,
                                                 result, before), ys, theta, ev_theta)
        ys_bar, theta_bar, ev_theta_bar = vjp((gzs, ev_ct.t, ev_ct.z))
        z0_bar, tau_bar, theta_run = solve_bwd(grid_res, (ys_bar,))[:3]
        ts_bar = jnp.where(before, tau_bar, 0)
        theta_bar = jax.tree.map(jnp.add, theta_bar, theta_run)
        # A non-finite event value failed the forward pass: NaN gradients, never numbers.
        grads = (z0_bar, ts_bar, theta_bar, ev_theta_bar)
        z0_bar, ts_bar, theta_bar, ev_theta_bar = jax.tree.map(
            lambda v: jnp.where(result.bad, jnp.nan, v), grads
        )
        return z0_bar, ts_bar, theta_bar, None, ev_theta_bar, None, None

    event_solve.defvjp(fwd, bwd)
    return event_solve
