"""One step of an explicit embedded Runge–Kutta pair (FSAL), with its stage derivatives."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit import _sharding

from solvers.ode import _small

__all__ = ["erk_step", "explicit_stepper"]


def erk_step(tab, rhs, s, z, k0, h, n_ctrl):
    """Take one step of size ``h`` from ``(s, z)``; ``k0 = rhs(z[:n_ctrl], s)`` (FSAL).

    ``rhs(u, s)`` reads the first ``n_ctrl`` components only and returns the derivative
    of all of them. The stages run in a ``lax.fori_loop``, so ``rhs`` is traced (and
    compiled) once. Returns ``(z1, k1, err, ks)``: the new state, its derivative, the
    local error estimate of the controlled components and the stage derivatives
    (``(stages, N)``, for the continuous extension).
    """
    dtype = z.dtype
    a = jnp.asarray(tab.a, dtype)
    c = jnp.asarray(tab.c, dtype)
    u = z[:n_ctrl]
    stages = len(tab.b)
    ks = _sharding.rows_like(z, stages).at[0].set(k0)

    def stage(i, ks):
        ui = u + h * _small.matmul(a[i], ks[:, :n_ctrl])
        return ks.at[i].set(rhs(ui, s + c[i] * h))

    ks = jax.lax.fori_loop(1, stages, stage, ks)
    z1 = z + h * _small.matmul(jnp.asarray(tab.b, dtype), ks)
    err = h * _small.matmul(jnp.asarray(tab.b_error, dtype), ks[:, :n_ctrl])
    return z1, ks[-1], err, ks


def explicit_stepper(tab, rhs, n_ctrl, *, rtol=None, atol=None):
    """The :class:`~solvers.ode._integrate.Stepper` of an explicit FSAL pair."""
    from solvers.ode._integrate import Stepper

    del rtol, atol  # no stage equations to solve
    stages = len(tab.b)

    def init(s0, z0):
        return (rhs(z0[:n_ctrl], s0),)

    def step(s, z, cache, h):
        (k0,) = cache
        z1, k1, err, ks = erk_step(tab, rhs, s, z, k0, h, n_ctrl)
        return z1, err, ks, (k1,), (k0,), jnp.bool_(True), (stages - 1, 0, 0)

    # Hairer's PI constants for DOPRI5 (β = 0.04): h ∝ ratio^-(1/5 - 0.75β) · ratio_prev^β.
    return Stepper(init, step, tab.dense, beta1=0.17, beta2=0.04, order=tab.error_order)
