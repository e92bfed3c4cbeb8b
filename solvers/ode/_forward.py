"""Forward sensitivities (``adjoint="forward"``): a ``jax.custom_jvp`` around the integration.

The rule integrates the sensitivity matrix ``S = ∂z/∂p`` alongside ``z`` with the same
steps: ``p`` are the scalars whose tangent is not (symbolically) zero, ``z0``'s ``N``
entries and those of each floating parameter leaf. Each step of the augmented state
``(z, S)`` takes the method's own step for ``z`` (its error estimate, and so the step-size
controller, see ``z`` alone: the steps are the primal's) and, for ``S``, the ``jax.jvp``
of that step along every direction with the step size and time held fixed (the derivative
of the computed solution, as the discrete adjoint's; an implicit method's stage equations
are differentiated by the implicit function theorem at the stage values it found). The
tangent of the outputs is then ``S · ṗ`` plus the time terms ``f(y_k, t_k) ṫ_k`` and
``-S_{z0} f(y_0, t_0) ṫ_0``: a linear function of the tangents with coefficients computed
from the primals, so reverse mode (its transpose) works as well. The augmented
integration is itself this custom_jvp, so derivatives of any order nest (``jax.hessian``,
``jacfwd(jacfwd)``, ``jacfwd(grad)``), each order multiplying the state size by ``1 + D``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from implicit import _sharding
from solvers import _status
from solvers.ode import _adjoint, _integrate

__all__ = ["make_solve"]


def _join(a, b):
    """``a`` (``(..., N)``) followed by the ``D`` directions ``b`` (``(D, ..., N)``)."""
    return jax.tree.map(lambda x, y: jnp.concatenate([x, jnp.ravel(y)]), a, b)


def make_solve(stepper_of, G, G_ctrl, n_ctrl, *, on_failure="raise", progress=None,
               adaptive=False, slope=None):
    """A ``jax.custom_jvp`` ``solve(z0, ts, theta, const, ctl) -> (zs, Stats)``.

    ``stepper_of(theta, const, rtol, atol, order)`` builds the method's
    :class:`~solvers.ode._integrate.Stepper` for the parameters ``theta``, whose
    ``diff_step`` is differentiated ``order`` times (an implicit method makes that many
    orders exact: chord corrections of its stage values); ``G(z, s, theta,
    const)`` is the derivative of the whole state, ``G_ctrl(u, s, theta, const)`` that of
    the first ``n_ctrl`` (controlled) components from those components alone (the first
    step's heuristic). ``ctl = (rtol, atol, _, _, h0, max_steps)``; its tangents (and
    ``const``'s) are ignored. ``on_failure="nan"``: the tangents of a failed integration
    are NaN too (as the reverse adjoints' gradients are).

    ``adaptive=True`` (``adjoint="forward_adaptive"``): the sensitivities are instead the
    ``jax.jvp`` of the integration itself along each direction, so they also carry the
    derivatives of what the primal chose from the state (the first step, every step size
    from the controller, rejections, the last step shortened onto ``ts[-1]``, the stage
    iterations of an implicit method): the exact derivative of the computed outputs as a
    function of the inputs. Forward mode through the loop (memory independent of the
    number of steps); the tangent is still ``S · ṗ``, so reverse mode works at first order.
    Non-finite sensitivities of a finite solution set the status ``nonfinite``.
    ``slope(z, s, theta, const)``: the state's time derivative where it is not ``G`` (a
    DAE's consistent slope), for the output times' tangents.
    """

    @jax.custom_jvp
    def solve(z0, ts, theta, const, ctl):
        rtol, atol, _, _, h0, budget = ctl
        stepper = stepper_of(theta, const, rtol, atol, 0)
        return _integrate.integrate(
            stepper, lambda u, s: G_ctrl(u, s, theta, const), z0, ts, rtol, atol, h0, budget,
            n_ctrl, progress=progress,
        )

    def solve_jvp(primals, tangents):
        z0, ts, theta, const, ctl = primals
        dz0, dts, dtheta = tangents[:3]
        N = z0.shape[0]
        dtype = z0.dtype
        leaves, treedef = jax.tree.flatten(theta)
        dleaves = jax.tree.leaves(dtheta, is_leaf=_adjoint.is_zero)
        live = [not _adjoint.is_zero(d) for d in dleaves]
        use_z0 = not (_adjoint.is_zero(dz0) and _adjoint.is_zero(dts))
        D_z = N if use_z0 else 0
        sizes = [int(np.size(leaf)) if on else 0 for leaf, on in zip(leaves, live)]
        D = D_z + sum(sizes)
        if D == 0:
            zs, stats = solve(z0, ts, theta, const, ctl)
            return (zs, stats), (jnp.zeros_like(zs), jax.tree.map(_adjoint.zero_tangent, stats))
        # Directions: the identity on p = (z0 if used, the live parameter leaves).
        S0 = jnp.zeros((D, N), dtype)
        if use_z0:
            S0 = S0.at[:N].set(jnp.eye(N, dtype=dtype))
        dirs, offset = [], D_z
        for leaf, size in zip(leaves, sizes):
            block = jnp.zeros((D, int(np.size(leaf))), jnp.result_type(leaf))
            if size:
                block = block.at[offset : offset + size].set(
                    jnp.eye(size, dtype=jnp.result_type(leaf))
                )
            dirs.append(block.reshape((D,) + jnp.shape(leaf)))
            offset += size
        theta_dirs = jax.tree.unflatten(treedef, dirs)
        # shard_map: the directions are tangents of the state and the parameters, which
        # vary over the mesh (odeint casts them); a tangent must have its primal's type.
        S0, theta_dirs = _sharding.vary_like((S0, theta_dirs), (z0, theta))

        if adaptive:
            zs, stats, S = _adaptive_sensitivities(
                stepper_of, G_ctrl, n_ctrl, z0, ts, theta, const, ctl, S0, theta_dirs,
                progress,
            )
        else:
            # The directions travel as an argument (in ``const``), never closed over: the
            # augmented solve is a custom_jvp traced on its own.
            aug_stepper_of, G_aug, G_ctrl_aug = _augment(stepper_of, G, G_ctrl, N)
            aug_solve = make_solve(aug_stepper_of, G_aug, G_ctrl_aug, n_ctrl,
                                   on_failure=on_failure, progress=progress)
            Zs, stats = aug_solve(
                jnp.concatenate([z0, S0.ravel()]), ts, theta, (const, theta_dirs), ctl
            )
            T = Zs.shape[0]
            zs = Zs[:, :N]
            S = Zs[:, N:].reshape(T, D, N)
        parts = []
        if use_z0:
            parts.append(jnp.zeros((N,), dtype) if _adjoint.is_zero(dz0) else dz0)
        for d, size in zip(dleaves, sizes):
            if size:
                parts.append(jnp.ravel(d).astype(dtype))
        p_dot = jnp.concatenate(parts)
        dzs = jnp.einsum("tdn,d->tn", S, p_dot, precision=_sharding.EXACT)
        if not _adjoint.is_zero(dts):
            f = jax.vmap(lambda z, t: (G if slope is None else slope)(z, t, theta, const))(
                zs, ts)
            # An output time that moves moves its output along f; a start that moves
            # shifts the whole solution: dy_k/dt_0 = -∂y_k/∂y_0 · f(y_0, t_0).
            dzs = dzs + f * dts[:, None]
            dzs = dzs - jnp.einsum("tdn,d->tn", S[:, :N], f[0] * dts[0],
                                   precision=_sharding.EXACT)
        dzs = dzs.at[0].set(parts[0] if use_z0 else jnp.zeros((N,), dtype))
        if on_failure == "nan":
            dzs = jnp.where(stats.status == _integrate.NOT_FAILED, dzs, jnp.nan)
        return (zs, stats), (dzs, jax.tree.map(_adjoint.zero_tangent, stats))

    solve.defjvp(solve_jvp, symbolic_zeros=True)
    return solve


def _adaptive_sensitivities(stepper_of, G_ctrl, n_ctrl, z0, ts, theta, const, ctl, S0,
                            theta_dirs, progress):
    """``(zs, Stats, S)``: the integration and its ``jax.jvp`` along the ``D`` directions
    ``(S0, theta_dirs)`` (``S``: ``(T, D, N)``), the step-size choices differentiated too."""
    rtol, atol, _, _, h0, budget = ctl

    def run(z0, theta):
        stepper = stepper_of(theta, const, rtol, atol, 0)
        return _integrate.integrate(
            stepper, lambda u, s: G_ctrl(u, s, theta, const), z0, ts, rtol, atol, h0,
            budget, n_ctrl, progress=progress,
        )

    def along(dz0, dtheta):
        (zs, stats), (dzs, _) = jax.jvp(run, (z0, theta), (dz0, dtheta))
        return zs, stats, dzs

    # The primal does not depend on the direction: one integration, D tangents.
    zs, stats, S = jax.vmap(along, out_axes=(None, None, 1))(S0, theta_dirs)
    finite = jnp.all(jnp.isfinite(S)) | ~jnp.all(jnp.isfinite(zs))
    status = jnp.where(
        finite | (stats.status != _integrate.NOT_FAILED), stats.status, _status.NONFINITE
    )
    return zs, stats._replace(status=status.astype(stats.status.dtype)), S


def _augment(stepper_of, G, G_ctrl, N):
    """The method and right-hand sides of the state ``(z, S)``, ``S`` the ``D`` directions
    (``(D, N)``, row-major after ``z``); their ``const`` is ``(const, theta_dirs)``, the
    base problem's and the parameters' directions."""

    def split(Z):
        return Z[:N], Z[N:].reshape(-1, N)

    def split_cache(cache):
        return (
            jax.tree.map(lambda c: c[:N], cache),
            jax.tree.map(lambda c: c[N:].reshape(-1, N), cache),
        )

    def G_ctrl_aug(u, s, theta, const_aug):
        return G_ctrl(u, s, theta, const_aug[0])

    def G_aug(Z, s, theta, const_aug):
        const, theta_dirs = const_aug
        z, S = split(Z)

        def along(dz, dth):
            return jax.jvp(lambda z, th: G(z, s, th, const), (z, theta), (dz, dth))[1]

        return jnp.concatenate([G(z, s, theta, const), jax.vmap(along)(S, theta_dirs).ravel()])

    def aug_stepper_of(theta, const_aug, rtol, atol, order):
        # The base step is differentiated once more than this one.
        const, theta_dirs = const_aug
        base = stepper_of(theta, const, rtol, atol, order + 1)

        def diff_of(th):
            return _adjoint._diff_step(stepper_of(th, const, rtol, atol, order + 1))

        def tangents(s, z, cache, h, ks_star, S, dcache):
            def along(dz, dc, dth):
                return jax.jvp(
                    lambda z, c, th: diff_of(th)(s, z, c, h, ks_star)[:3],
                    (z, cache, theta),
                    (dz, dc, dth),
                )[1]

            return jax.vmap(along)(S, dcache, theta_dirs)

        def join_ks(ks, dks):  # (stages, N) and (D, stages, N) -> (stages, N(1 + D))
            stages = ks.shape[0]
            return jnp.concatenate(
                [ks, jnp.moveaxis(dks, 0, 1).reshape(stages, -1)], axis=1
            )

        def init(s0, Z0):
            z0, S = split(Z0)
            cache = base.init(s0, z0)

            def along(dz, dth):
                return jax.jvp(
                    lambda z, th: stepper_of(th, const, rtol, atol, order + 1).init(s0, z),
                    (z0, theta),
                    (dz, dth),
                )[1]

            return _join(cache, jax.vmap(along)(S, theta_dirs))

        def step(s, Z, cache, h):
            z, S = split(Z)
            c, dc = split_cache(cache)
            z1, err, ks, c_acc, c_rej, ok, counts = base.step(s, z, c, h)
            dz1, dc_acc, dks = tangents(s, z, c, h, ks, S, dc)
            return (
                _join(z1, dz1),
                err,
                join_ks(ks, dks),
                _join(c_acc, dc_acc),
                _join(c_rej, dc),  # a rejected step leaves the state and its tangents
                ok,
                counts,
            )

        def diff_step(s, Z, cache, h, ks_star, eps=None):
            # (eps, the perturbation where the local error is made, and err: the state's.)
            z, S = split(Z)
            c, dc = split_cache(cache)
            ks_z = ks_star[:, :N]
            z1, c_acc, ks, err = diff_of(theta)(s, z, c, h, ks_z, eps)
            dz1, dc_acc, dks = tangents(s, z, c, h, ks_z, S, dc)
            return _join(z1, dz1), _join(c_acc, dc_acc), join_ks(ks, dks), err

        return base._replace(init=init, step=step, diff_step=diff_step)

    return aug_stepper_of, G_aug, G_ctrl_aug
