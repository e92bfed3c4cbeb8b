"""Terminal events: stop the integration where an event function crosses zero.

The forward pass is the ordinary stepping loop with the event values checked after every
accepted step (:func:`solvers.ode._integrate.integrate` with ``event=``): it stops after
the step across which a component changed sign and locates the crossing on that step's
continuous extension (refined on a step of the method itself where the method has a
:attr:`~solvers.ode._integrate.Stepper.restep`: kvaerno5). Rows of the output past the
event hold the state there; the backward pass below linearises at that time and state.

The gradient (a ``jax.custom_vjp``) comes from the implicit function theorem on
``g(y(t_e; θ), t_e, θ) = 0``:

    dt_e/dθ = -(g_y · ∂y(t_e)/∂θ + g_θ) / D,    D = g_y · f(y_e, t_e) + g_t,

and the state there moves with the end time, ``dy_e/dθ = ∂y(t_e)/∂θ + f(y_e, t_e)
dt_e/dθ``. With cotangents ``ȳ`` on the state at the event (the event state and every
output row past it) and ``t̄`` on the event time, the loss sees ``∂y(t_e)/∂θ`` through
the cotangent ``ȳ - w g_y`` and ``g_θ`` through ``-w``, ``w = (ȳ · f + t̄) / D``. The
backward pass therefore re-integrates, with the ordinary differentiable solve (any
adjoint), from ``ts[0]`` to the (fixed) event time on a grid of the same length as
``ts``: the output times before the event, then points spread up to ``t_e`` exactly (the
rows past the event; their cotangents are zero but the last one's), and hands it those
cotangents. The forward pass without a gradient costs one integration only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit import _sharding
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


def make_event_solve(make_stepper, G, E, n, solve, *, direction, record=0, slope=None):
    """A differentiable ``event_solve(z0, ts, theta, const, ev_theta, ev_const, ctl)``
    returning ``(zs, Stats, EventResult)``.

    ``G(u, s, theta, const)``: the right-hand side; ``E(u, s, theta, const, ev_theta,
    ev_const) -> (E,)``: the raveled event values (``ev_theta``: the floating arrays the
    event function closes over, differentiated); ``solve``: the differentiable solve
    (:func:`solvers.ode._adjoint.make_solve`), used by the backward
    pass; ``ctl`` as there. With ``record=B`` the :class:`~solvers.ode._integrate.Record`
    of the last ``B`` accepted steps follows (dense output; not differentiated: its
    cotangent is dropped). ``slope(u, s, theta, const)``: the state's time derivative where
    it is not ``G`` (a DAE's consistent slope), for the event time's derivative.
    """

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

    @jax.custom_vjp
    def event_solve(z0, ts, theta, const, ev_theta, ev_const, ctl):
        return run(z0, ts, theta, const, ev_theta, ev_const, ctl)

    def fwd(z0, ts, theta, const, ev_theta, ev_const, ctl):
        out = run(z0, ts, theta, const, ev_theta, ev_const, ctl)
        res = (z0, ts, theta, const, ev_theta, ev_const, ctl, out[2])
        return out, res

    def bwd(res, cotangents):
        z0, ts, theta, const, ev_theta, ev_const, ctl, result = res
        gzs, _, ev_ct = cotangents[:3]
        t_bar, z_bar = ev_ct.t, ev_ct.z
        dtype = z0.dtype
        T = ts.shape[0]
        fired = jnp.isfinite(result.t)
        k, tau = event_grid(ts, result.t)
        i = jnp.arange(T)
        after = ((i > k) & fired)[:, None]
        # The cotangent of the state at the event: its own and every row past it.
        y_bar = jnp.where(fired, z_bar + jnp.sum(jnp.where(after, gzs, 0), axis=0), 0)
        y_bar = jnp.where(jnp.isfinite(y_bar), y_bar, 0)  # (no event: NaN state, unused)
        t_bar = jnp.where(fired, t_bar, 0)
        te = jnp.where(fired, result.t, ts[-1])
        ze = jnp.where(fired, result.z, z0)
        index = jnp.maximum(result.index, 0)

        def g(u, s, theta, ev_theta):
            return E(u, s, theta, const, ev_theta, ev_const)[index]

        f_e = (G if slope is None else slope)(ze, te, theta, const)  # (y' at the event)
        g_e, g_vjp = jax.vjp(g, ze, te, theta, ev_theta)
        # (shard_map: the cotangent has the type of the event value)
        g_y, g_t, g_th, g_evth = g_vjp(_sharding.vary_like(jnp.ones((), dtype), g_e))
        rep = _sharding.replicated(g_y, f_e)  # (a whole sharded state: an all-reduce)
        D = _sharding.matmul(g_y, f_e, out_sharding=rep) + g_t
        w = _sharding.matmul(y_bar, f_e, out_sharding=rep)
        w = jnp.where(fired, (w + t_bar) / jnp.where(fired, D, 1), 0)
        cot = jnp.where(after, 0, gzs)
        cot = cot.at[T - 1].set(jnp.where(fired, y_bar - w * g_y, gzs[T - 1]))

        def diff(z0, tau, theta):
            return solve(z0, tau, theta, const, ctl)[0]

        _, vjp = jax.vjp(diff, z0, jax.lax.stop_gradient(tau), theta)
        z0_bar, tau_bar, theta_bar = vjp(cot)
        # The event time's dependence on θ is the IFT term (w), not the grid's end.
        ts_bar = jnp.where(i <= k, tau_bar, 0)
        theta_bar = jax.tree.map(lambda a, b: a - w * b, theta_bar, g_th)
        ev_theta_bar = jax.tree.map(lambda b: -w * b, g_evth)
        # A non-finite event value failed the forward pass: NaN gradients, never numbers.
        grads = (z0_bar, ts_bar, theta_bar, ev_theta_bar)
        z0_bar, ts_bar, theta_bar, ev_theta_bar = jax.tree.map(
            lambda v: jnp.where(result.bad, jnp.nan, v), grads
        )
        return z0_bar, ts_bar, theta_bar, None, ev_theta_bar, None, None

    event_solve.defvjp(fwd, bwd)
    return event_solve

