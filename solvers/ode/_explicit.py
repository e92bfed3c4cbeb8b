"""One step of an explicit embedded Runge–Kutta pair (FSAL), with its stage derivatives."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit import _sharding

from solvers.ode import _small

__all__ = ["erk_step", "erk_vjp", "explicit_stepper"]


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
        return jax.lax.dynamic_update_index_in_dim(ks, rhs(ui, s + c[i] * h), i, 0)

    ks = jax.lax.fori_loop(1, stages, stage, ks)
    z1 = z + h * _small.matmul(jnp.asarray(tab.b, dtype), ks)
    err = h * _small.matmul(jnp.asarray(tab.b_error, dtype), ks[:, :n_ctrl])
    return z1, ks[-1], err, ks


def _ctrl(v, like):
    """``v`` (its last axis: the controlled components) padded with zeros to ``like``'s
    last axis: an add of it is elementwise, where ``.at[..., :n].add`` is a scatter (a
    kernel of its own in every loop trip)."""
    pad = like.shape[-1] - v.shape[-1]
    return v if pad == 0 else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])


#: The most parameters whose cotangents :func:`erk_vjp` sums as one vector in its stage
#: loop: one kernel per stage instead of one per leaf (Lotka–Volterra's four scalars: 271
#: -> 264 kernels, its gradient 7-10% faster); past that the concatenation's copy costs
#: more than the kernels it saves (a neural field's 33,000 weights: 3% slower).
FLAT_THETA_MAX = 1024


def erk_vjp(tab, rhs, s, z, h, ks, theta, rows, n_ctrl, theta_rows=None):
    """The cotangents of one step of :func:`erk_step` from the stage derivatives ``ks`` it
    took: its ``jax.vjp`` without taking it again.

    The step maps ``(z, k0 = ks[0], θ)`` to ``z1 = z + h bᵀks``, ``k1 = ks[-1]``, the
    continuous extension's ``h Dᵀks`` and ``err = h b̂ᵀks``, with the stages
    ``ks[i] = rhs(U_i, s + c_i h, θ)``, ``U_i = u + h Σ_{j<i} a_ij ks[j]``. ``rows =
    (z̄1, (k̄1,), D̄, ērr)``, each with a leading axis of cotangents. The stages are
    differentiated last first, each linearised once (at ``U_i``, from ``ks``) for every
    row: one loop of ``jax.vjp`` of ``rhs``, where the vjp of the step would first take its
    stages again in a loop of their own. Returns ``(z̄, (k̄0,), θ̄)`` with that axis,
    ``θ̄`` for the first ``theta_rows`` rows only (all by default: the others' parameter
    cotangents, a neural field's weight gradients, are not computed). Up to
    ``FLAT_THETA_MAX`` parameters, ``θ̄``'s leaves come raveled and concatenated (in
    ``z``'s dtype): one sum per stage instead of one per leaf.
    """
    dtype = z.dtype
    stages = len(tab.b)
    a = jnp.asarray(tab.a, dtype)
    c = jnp.asarray(tab.c, dtype)
    z1_bar, (k1_bar,), dense_bar, err_bar = rows
    num = z1_bar.shape[0]
    # The cotangents of the stage derivatives, (rows, stages, N).
    kappa = h * (jnp.asarray(tab.b, dtype)[None, :, None] * z1_bar[:, None, :])
    # (the continuous extension's weights, (stages, degree), times each row's D̄)
    kappa = kappa + h * _small.matmul(jnp.asarray(tab.dense, dtype)[None], dense_bar)
    kappa = kappa + _ctrl(h * jnp.asarray(tab.b_error, dtype)[None, :, None]
                          * err_bar[:, None, :], kappa)
    kappa = kappa + jnp.pad(k1_bar[:, None], ((0, 0), (stages - 1, 0), (0, 0)))
    u = z[:n_ctrl]
    theta_rows = num if theta_rows is None else theta_rows

    def stage(m, carry):
        kappa, du, dtheta = carry
        i = stages - 1 - m
        ui = u + h * _small.matmul(a[i], ks[:, :n_ctrl])
        _, vjp = jax.vjp(
            lambda v, th: _sharding.vary_like(rhs(v, s + c[i] * h, th), (v, th)), ui, theta)
        du_i, dtheta_i = jax.vmap(vjp)(kappa[:theta_rows, i])
        if theta_rows < num:
            du_i = jnp.concatenate([du_i, jax.vmap(lambda r: vjp(r)[0])(kappa[theta_rows:, i])])
        kappa = kappa + _ctrl(h * a[i][None, :, None] * du_i[:, None, :], kappa)
        return kappa, du + du_i, jax.tree.map(jnp.add, dtheta, flat(dtheta_i))

    leaves = jax.tree.leaves(theta)
    one_vector = bool(leaves) and sum(jnp.size(v) for v in leaves) <= FLAT_THETA_MAX

    def flat(rows):  # (rows of the parameters' cotangents: one vector each, or as they are)
        if not one_vector:
            return rows
        return jnp.concatenate(
            [v.reshape(theta_rows, -1).astype(dtype) for v in jax.tree.leaves(rows)], axis=1)

    init = (kappa, _sharding.rows_like(u, num),
            flat(jax.tree.map(lambda t: _sharding.rows_like(t, theta_rows), theta)))
    kappa, du, dtheta = _sharding.fori_loop(0, stages - 1, stage, init)
    return z1_bar + _ctrl(du, z1_bar), (kappa[:, 0],), dtheta


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
    return Stepper(init, step, tab.dense, beta1=0.17, beta2=0.04, order=tab.error_order,
                   tableau=tab)
