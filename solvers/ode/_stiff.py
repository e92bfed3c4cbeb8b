"""One step of an L-stable ESDIRK pair (Kværnø 5(4)); stage equations by simplified Newton.

Stage ``i`` solves ``U = base_i + hγ f(U, s + c_i h)`` with
``base_i = u + h Σ_{j<i} a_ij k_j``, starting from the stage-derivative predictor
``base_i + hγ Σ_j α_ij k_j``; then ``k_i = (U - base_i) / (hγ)``. The method is stiffly
accurate (the new state is the last stage value, ``u + h Σ b_j k_j``) and the embedded
solution is the sixth stage value. The stages run in a ``lax.fori_loop`` (one traced copy
of the right-hand side and of the Newton solve); one Jacobian and one factorisation of
``M = I - hγJ`` per step serve all of them. A stage solve that fails rejects the step (the
loop halves ``h``); it never raises.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from implicit import _sharding
from implicit import _lu
from solvers import _runner

__all__ = ["implicit_stepper", "NEWTON_KAPPA", "NEWTON_MAX_STEPS"]

NEWTON_KAPPA = 0.01  # stage solves stop at NEWTON_KAPPA × the step's error tolerance
# (its relative part no lower than 10 eps, as bdf's)
NEWTON_MAX_STEPS = 8


def implicit_stepper(tab, rhs, n_ctrl, *, rtol, atol, derivative_order=2, structure=None):
    """The :class:`~solvers.ode._integrate.Stepper` of an ESDIRK pair with explicit first stage.

    ``rhs(u, s)`` returns the derivative of the whole state; the components past
    ``n_ctrl`` are quadratures (``rhs`` does not read them), evaluated at the stage values.
    ``derivative_order``: the order up to which ``diff_step``'s derivatives are exact (one
    chord correction of the stage values per order). 2 by default: ``jax.hessian`` through
    the discrete adjoint is exact (as bdf's corrector, also corrected twice); the forward
    sensitivities ask for the order they need.
    The stage equations are solved by simplified Newton iterations with the factors of
    ``M = I - hγJ`` (one Jacobian and one factorisation per step; the stopping test of
    :func:`solvers.root.newton`: the step, scaled by ``ρ / (1 - ρ)`` once a contraction rate
    ``ρ < 1/2`` is seen, within ``atol + rtol max|U|``).
    ``structure``: a :class:`solvers._sparse.Structure` (``jac_sparsity``): the Jacobian by
    compressed jvps and ``M`` factored by block elimination. ``None``: dense (``jacfwd``;
    ``M``'s inverse, or its LU past 64 unknowns: :func:`implicit._lu.iteration_factor`).
    """
    from solvers.ode._integrate import Stepper

    stages = len(tab.b)
    gamma = float(tab.gamma)
    # NumPy constants, cast to the state's dtype at trace time: a jnp array built here
    # would carry the dtype of whatever x64 setting was on when it was first built.
    explicit_part = np.tril(np.asarray(tab.a, np.float64), -1)  # the strictly lower triangle

    class _Info(NamedTuple):
        num_steps: Any
        converged: Any

    def simplified_newton(guess, base, hg, t, solve_M):
        """Simplified Newton on ``U - base - hγ f(U, t) = 0``, ``solve_M(r)`` solving with
        the step's ``M = I - hγJ``, stopping as :func:`solvers.root.newton` does."""
        dtype = guess.dtype
        # (floored at 10 eps, as bdf's: a stage solve cannot stop below rounding, and
        # float32 at rtol 1e-7, or any 16-bit float, would never converge)
        r_tol = jnp.maximum(NEWTON_KAPPA * rtol, 10 * jnp.finfo(dtype).eps)
        a_tol = NEWTON_KAPPA * atol

        def cond(st):
            it, _, _, conv, bad = st
            return ~conv & ~bad & (it < NEWTON_MAX_STEPS)

        def body(st):
            it, U, prev, _, _ = st
            r = U - base - hg * rhs(U, t)[:n_ctrl]
            d = -solve_M(r)
            U_new = U + d
            err, size = _runner.max_norms(d, U_new)  # (the runner's norms: 0 when empty)
            rate = err / prev
            scaled = jnp.where((it > 0) & (rate < 0.5), err * rate / (1 - rate), err)
            bad = ~jnp.all(jnp.isfinite(U_new))
            conv = ~bad & (scaled <= a_tol + r_tol * size)
            return it + 1, jnp.where(bad, U, U_new), err, conv, bad

        st = (jnp.zeros((), jnp.int32), guess, jnp.full((), jnp.inf, dtype), jnp.bool_(False),
              jnp.bool_(False))
        it, U, _, conv, _ = _sharding.while_loop(cond, body, st)
        return U, _Info(it, conv)

    def init(s0, z0):
        return (rhs(z0[:n_ctrl], s0),)

    def step(s, z, cache, h):
        (k0,) = cache
        dtype = z.dtype
        a = jnp.asarray(explicit_part, dtype)
        pred = jnp.asarray(tab.predictor, dtype)
        c = jnp.asarray(tab.c, dtype)
        u = z[:n_ctrl]
        hg = h * gamma
        # One Jacobian per step, shared by the six implicit stages. (Keeping it across
        # steps too let Newton stop after one iteration with a stage error near its
        # tolerance, which then swamped the error estimate and stalled the step size.)
        if structure is not None:
            J = structure.jacobian(lambda v: rhs(v, s)[:n_ctrl], u)
            elimination = structure.factor(structure.eye_minus(hg, J))[0]

            def solve_M(r):
                return structure.apply_inverse(elimination, r)
        else:
            J = jax.jacfwd(lambda v: rhs(v, s)[:n_ctrl])(u)
            factors = _lu.iteration_factor(jnp.eye(n_ctrl, dtype=dtype) - hg * J)

            def solve_M(r):
                return _lu.iteration_solve(factors, r)
        ks = _sharding.rows_like(z, stages).at[0].set(k0)

        def stage(i, carry):
            ks, ok, fevals = carry
            k_u = ks[:, :n_ctrl]
            base = u + h * _sharding.matmul(a[i], k_u)
            guess = base + hg * _sharding.matmul(pred[i], k_u)
            t = s + c[i] * h
            U, info = simplified_newton(guess, base, hg, t, solve_M)
            k = (U - base) / hg
            fevals = fevals + info.num_steps + 1
            if z.shape[0] > n_ctrl:  # quadratures: evaluate them at the stage value
                k = jnp.concatenate([k, rhs(U, t)[n_ctrl:]])
                fevals = fevals + 1
            ok = ok & info.converged & jnp.all(jnp.isfinite(k))
            return jax.lax.dynamic_update_index_in_dim(ks, k, i, 0), ok, fevals

        ks, ok, fevals = _sharding.fori_loop(
            1, stages, stage, (ks, jnp.bool_(True), jnp.zeros((), jnp.int32))
        )
        z1 = z + h * _sharding.matmul(jnp.asarray(tab.b, dtype), ks)
        err = h * _sharding.matmul(jnp.asarray(tab.b_error, dtype), ks[:, :n_ctrl])
        return z1, err, ks, (ks[-1],), (k0,), ok, (fevals, 1, 1)

    def diff_step(s, z, cache, h, ks_star, eps=None):
        # The derivative of the step the forward took: stage i's value U* (from the stage
        # derivatives ks_star) satisfies r(U) = U - base_i - hγ f(U, t_i) ≈ 0, so
        # dU = (I - hγ J(U*))⁻¹ (d base_i + hγ ∂f/∂θ dθ) (the implicit function theorem,
        # with the exact Jacobian at U*, not the frozen one Newton used). Written as
        # U = U* - (x - stop_gradient(x)), x = (I - hγJ)⁻¹ r: the value stays U*.
        if z.shape[0] != n_ctrl:
            raise NotImplementedError("diff_step: quadrature components")
        (k0,) = cache
        dtype = z.dtype
        a = jnp.asarray(explicit_part, dtype)
        c = jnp.asarray(tab.c, dtype)
        hg = h * gamma
        ks_star = jax.lax.stop_gradient(ks_star)
        ks = jnp.zeros_like(ks_star).at[0].set(k0)
        eye = None if structure is not None else jnp.eye(n_ctrl, dtype=dtype)

        def stage(i, ks):
            base = z + h * _sharding.matmul(a[i], ks)
            U_star = jax.lax.stop_gradient(base + hg * ks_star[i])
            t = s + c[i] * h
            if structure is not None:
                J = jax.lax.stop_gradient(structure.jacobian(lambda v: rhs(v, t), U_star))
                fac = structure.factor(structure.eye_minus(hg, J))

                def inv(r):
                    return structure.solve(fac, r)
            else:
                J = jax.lax.stop_gradient(jax.jacfwd(lambda v: rhs(v, t))(U_star))
                lu = _lu.factor(eye - hg * J)

                def inv(r):
                    return _lu.solve(lu, r)
            U = U_star
            # Each chord correction (the Jacobian exact at U*, held fixed) makes one more
            # order of derivatives exact: r(U) = U - base - hγ f(U), whose Jacobian at U*
            # is M, vanishes to order k at U_k.
            for _ in range(derivative_order):
                r = U - base - hg * rhs(U, t)
                x = inv(r)
                U = U - (x - jax.lax.stop_gradient(x))
            return jax.lax.dynamic_update_index_in_dim(ks, (U - base) / hg, i, 0)

        ks = _sharding.fori_loop(1, stages, stage, ks)
        z1 = z + h * _sharding.matmul(jnp.asarray(tab.b, dtype), ks)
        err = h * _sharding.matmul(jnp.asarray(tab.b_error, dtype), ks)
        if eps is not None:  # (a perturbation where the local error is made)
            z1 = z1 + eps
        return z1, (ks[-1],), ks, err

    def restep(s, z, ks, h):
        # The first stage is the derivative at the start; the method is stiffly accurate,
        # so the last stage derivative is the one at the new state.
        z1, _, ks1, _, _, ok, counts = step(s, z, (ks[0],), h)
        return z1, ks1[-1], ok, counts

    k = tab.error_order
    # The continuous extension is a cubic Hermite (third order against the step's fifth):
    # interpolated outputs were the error of the gradient on Robertson (per output at
    # rtol 1e-6: 4.4e-6 at t = 1e-4, against 2e-9 landing there; total 4.5e-6 against
    # 7.7e-8), so the steps end on every output time instead (issue 10).
    return Stepper(init, step, tab.dense, beta1=0.7 / k, beta2=0.4 / k, order=k,
                   diff_step=diff_step, lands=True, restep=restep)
