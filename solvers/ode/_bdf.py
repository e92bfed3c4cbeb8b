"""Variable-order (1–5), variable-step NDF/BDF: SciPy's ``BDF`` algorithm as a Stepper.

The method is the quasi-constant-step numerical differentiation formulas of Shampine &
Reichelt (1997, MATLAB's ``ode15s``; ``kappa`` below, as in ``scipy.integrate.BDF``),
written in terms of the backward differences ``D`` of the interpolating polynomial
through the last ``order + 1`` solution points, at a uniform spacing ``h``:

- the predictor is ``y_pred = Σ_{j≤k} D_j``; the corrector solves
  ``d - c f(t + h, y_pred + d) + ψ = 0`` for ``d`` (``c = h / α_k``,
  ``ψ = Σ_{1≤j≤k} γ_j D_j / α_k``) by simplified Newton iterations (at most
  ``NEWTON_MAXITER``, SciPy's convergence-rate test) with the iteration matrix
  ``I - cJ``, LU-factorised; ``y_new = y_pred + d`` and the local error estimate is
  ``error_const[k] · d``;
- the Jacobian is kept across steps and recomputed (at the predictor) only when Newton
  fails with a Jacobian from an earlier step; the LU is recomputed when ``c`` changes
  (a new step size or order) or ``J`` does;
- a step size change rescales ``D`` (SciPy's ``change_D``); after ``k + 1`` steps of the
  same size the order moves to whichever of ``k - 1, k, k + 1`` allows the largest step
  (error estimates from ``D_k`` and ``D_{k+2}``), and the step grows by at most
  ``MAX_FACTOR``.

Fitting the shared loop (:mod:`solvers.ode._integrate`): the multistep history lives in
the cache (``D`` of shape ``(MAX_ORDER + 3, N)``, the step size it is spaced at, the
order, the Jacobian and LU, ...; every leaf floating, so that the discrete adjoint can
differentiate through it), ``D`` is rescaled lazily at the start of a step whose size
differs from the cache's, and :attr:`Stepper.control` hands the loop the step-size factor
the order selection chose. The continuous extension is the interpolating polynomial
itself, of the step's order (SciPy's dense output), as monomial coefficients in
``θ = (t - s) / h``; a sixth, zero-weighted "stage" carries ``d / h`` for the discrete
adjoint, which differentiates the corrector by the implicit function theorem at the
solution the forward found (exact Jacobian there).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from implicit import _sharding
from implicit import _lu

__all__ = ["bdf_stepper", "MAX_ORDER", "NEWTON_MAXITER"]

MAX_ORDER = 5
NEWTON_MAXITER = 4
MIN_FACTOR = 0.2
MAX_FACTOR = 10.0

# NumPy constants (float64), cast to the state's dtype at trace time.
_KAPPA = np.array([0.0, -0.1850, -1.0 / 9.0, -0.0823, -0.0415, 0.0])
_GAMMA = np.hstack([0.0, np.cumsum(1.0 / np.arange(1, MAX_ORDER + 1))])
_ALPHA = (1.0 - _KAPPA) * _GAMMA
_ERROR_CONST = _KAPPA * _GAMMA + 1.0 / np.arange(1, MAX_ORDER + 2)


def _monomials():
    """``C[j-1, d-1]``: the coefficient of ``θ^d`` in ``P_j(θ) = Π_{m<j} (θ - 1 + m)/(m + 1)``.

    The interpolant of a step from ``s`` to ``s + h`` is ``D_0 + Σ_j D_j P_j(θ)``
    (``θ = (t - s)/h``); its constant term is ``D_0 - D_1``, the state at ``s``.
    """
    C = np.zeros((MAX_ORDER, MAX_ORDER))
    p = np.polynomial.Polynomial([1.0])
    for j in range(1, MAX_ORDER + 1):
        m = j - 1
        p = p * np.polynomial.Polynomial([(m - 1.0) / (m + 1.0), 1.0 / (m + 1.0)])
        coef = np.zeros(MAX_ORDER + 1)
        coef[: len(p.coef)] = p.coef
        C[j - 1] = coef[1:]
    return C


_MONOMIALS = _monomials()


def _compute_R(factor, dtype):
    """SciPy's ``compute_R`` at the largest order, ``(MAX_ORDER + 1)²`` (its leading
    ``(k + 1)²`` block is that of order ``k``)."""
    i = jnp.arange(1, MAX_ORDER + 1, dtype=dtype)[:, None]
    j = jnp.arange(1, MAX_ORDER + 1, dtype=dtype)[None, :]
    M = jnp.ones((MAX_ORDER + 1, MAX_ORDER + 1), dtype)
    M = M.at[1:, 1:].set((i - 1 - factor * j) / i).at[1:, 0].set(0.0)
    return jnp.cumprod(M, axis=0)


def _rescale(D, order, factor):
    """SciPy's ``change_D``: ``D`` for the step size times ``factor`` (rows ``> order``
    unchanged)."""
    dtype = D.dtype
    R = _compute_R(factor, dtype)
    U = _compute_R(jnp.ones((), dtype), dtype)
    RU = R @ U
    m = jnp.arange(MAX_ORDER + 1) <= order
    A = jnp.where(m[:, None] & m[None, :], RU, jnp.eye(MAX_ORDER + 1, dtype=dtype))
    return D.at[: MAX_ORDER + 1].set(A.T @ D[: MAX_ORDER + 1])


class BDFCache(NamedTuple):
    """The multistep state (every leaf floating; integers stored as floats)."""

    k0: Any  # (N,) the derivative at the initial point (the loop's first-step heuristic)
    D: Any  # (MAX_ORDER + 3, N) backward differences, spaced at ``h``
    h: Any  # the spacing of D
    order: Any  # current order, 1..MAX_ORDER
    n_equal: Any  # steps taken at this size and order
    J: Any  # (n, n) Jacobian of the controlled components (kept across steps); with a
    #         structure: compressed, (colours, n)
    lu: Any  # (n, n) LU of I - c_lu J; with a structure: its block elimination
    piv: Any  # (n,) its row permutation (floats)
    c_lu: Any  # the c the LU is for (0: none yet)
    fresh: Any  # 1.0 when J was computed during the current step (after a rejection too)
    factor: Any  # step-size factor chosen after an accepted step
    safety: Any  # the step's safety factor (fewer Newton iterations: bolder)


def bdf_stepper(rhs, n_ctrl, *, rtol, atol, structure=None):
    """The :class:`~solvers.ode._integrate.Stepper` of variable-order NDF (SciPy's BDF).

    ``structure``: a :class:`solvers._sparse.Structure` of the Jacobian (``jac_sparsity``):
    the Jacobian is then kept in block-tridiagonal form (compressed jvps) and ``I - cJ``
    factored by block elimination (``J`` and ``lu`` in the cache: the compressed
    Jacobian and the factors);
    ``None``: dense (``jacfwd``, LU).

    ``rhs(u, s)`` returns the derivative of the whole state; the components past
    ``n_ctrl`` are quadratures (``rhs`` does not read them): the corrector gives them
    ``d_q = c f_q(u_new) - ψ_q`` without iterating, and they are left out of the error
    control.
    """
    from solvers.ode._integrate import Stepper

    n = n_ctrl
    R = MAX_ORDER + 3

    def consts(dtype):
        return (jnp.asarray(_ALPHA, dtype), jnp.asarray(_GAMMA, dtype),
                jnp.asarray(_ERROR_CONST, dtype), jnp.asarray(_MONOMIALS, dtype))

    def rms(v, scale):
        return jnp.sqrt(jnp.mean(jnp.square(v / scale)))

    def jac(u, t):
        if structure is not None:  # compressed, (colours, n): the cache keeps this form
            return structure.compressed(lambda v: rhs(v, t)[:n], u)
        return jax.jacfwd(lambda v: rhs(v, t)[:n])(u)

    def block_factors(c, J):
        """The factors of ``I - cJ`` from the compressed ``J`` (with a structure)."""
        return structure.factor(structure.eye_minus(c, structure.scatter(J)))

    def factorise(c, J):
        """The factors of ``I - cJ`` and the row permutation (floats; dense only). Structured: the
        elimination only (not the blocks of ``I - cJ``: Newton does not multiply by it)."""
        if structure is not None:
            return block_factors(c, J)[0], jnp.zeros((n,), J.dtype)
        lu, perm = _lu.factor(jnp.eye(n, dtype=J.dtype) - c * J)
        return lu, perm.astype(J.dtype)

    def solve(lu, piv, b):
        if structure is not None:
            return structure.apply_inverse(lu, b)
        return _lu.solve((lu, piv), b)

    def placeholder(J):
        if structure is not None:
            return jax.tree.map(jnp.zeros_like,
                                jax.eval_shape(lambda J: block_factors(1.0, J)[0], J))
        return jnp.zeros((n, n), J.dtype)

    def init(s0, z0):
        dtype = z0.dtype
        f0 = rhs(z0[:n], s0)
        J = jax.lax.stop_gradient(jac(z0[:n], s0))
        D = _sharding.rows_like(z0, R).at[0].set(z0).at[1].set(f0)  # spaced at h = 1
        zero, one = jnp.zeros((), dtype), jnp.ones((), dtype)
        return BDFCache(
            k0=f0, D=D, h=one, order=one, n_equal=zero, J=J,
            lu=placeholder(J), piv=jnp.zeros((n,), dtype), c_lu=zero,
            fresh=one, factor=one, safety=jnp.asarray(0.9, dtype),
        )

    def predict(cache, h):
        """Rescale ``D`` to ``h``; the predictor, ``ψ``, ``c`` and the order (int)."""
        dtype = cache.D.dtype
        alpha, gamma, _, _ = consts(dtype)
        k = cache.order.astype(jnp.int32)
        changed = h != cache.h
        D = jnp.where(changed, _rescale(cache.D, k, h / cache.h), cache.D)
        n_equal = jnp.where(changed, 0.0, cache.n_equal).astype(dtype)
        rows = jnp.arange(R)
        y_pred = jnp.sum(jnp.where((rows <= k)[:, None], D, 0.0), axis=0)
        g = jnp.where(jnp.arange(MAX_ORDER + 1) <= k, gamma, 0.0)[1:]
        psi = (g @ D[1 : MAX_ORDER + 1]) / alpha[k]
        c = h / alpha[k]
        return k, D, n_equal, y_pred, psi, c

    def update(D, k, d, n_equal, z, y_new, h, safety, dtype):
        """``D`` after the step, the order and factor for the next one, dense output."""
        _, _, error_const, C = consts(dtype)
        rows = jnp.arange(R)[:, None]
        Dk1 = D[k + 1]
        Dp = jnp.where(rows == k + 2, d - Dk1, jnp.where(rows == k + 1, d, D))
        rc = jnp.cumsum(jnp.where(rows <= k + 1, Dp, 0.0)[::-1], axis=0)[::-1]
        D_new = jnp.where(rows <= k, rc, Dp)
        scale = atol + rtol * jnp.maximum(jnp.abs(z[:n]), jnp.abs(y_new[:n]))
        err_norm = rms(error_const[k] * d[:n], scale)
        err_m = jnp.where(k > 1, rms(error_const[k - 1] * D_new[k, :n], scale), jnp.inf)
        kp = jnp.minimum(k + 1, MAX_ORDER)
        err_p = jnp.where(k < MAX_ORDER, rms(error_const[kp] * D_new[k + 2, :n], scale),
                          jnp.inf)
        norms = jnp.stack([err_m, err_norm, err_p])
        expo = -1.0 / (k + jnp.arange(3)).astype(dtype)
        factors = jnp.where(jnp.isnan(norms), 0.0, norms**expo)
        n_equal = n_equal + 1
        select = n_equal >= k + 1
        new_order = jnp.where(select, k + jnp.argmax(factors) - 1, k)
        factor = jnp.where(select, jnp.minimum(MAX_FACTOR, safety * jnp.max(factors)), 1.0)
        n_equal = jnp.where(select, 0.0, n_equal)
        # Dense output: the step's interpolant as monomials in θ (over h), and d / h.
        mask = (jnp.arange(1, MAX_ORDER + 1) <= k).astype(dtype)
        coef = (C * mask[:, None]).T @ D_new[1 : MAX_ORDER + 1]
        ks = jnp.concatenate([coef, d[None]]) / h
        return D_new, new_order.astype(dtype), n_equal.astype(dtype), factor.astype(dtype), ks

    def step(s, z, cache, h):
        dtype = z.dtype
        N = z.shape[0]
        k, D, n_equal, y_pred, psi, c = predict(cache, h)
        t_new = s + h
        u_pred, psi_u = y_pred[:n], psi[:n]
        scale = atol + rtol * jnp.abs(u_pred)
        eps = jnp.finfo(dtype).eps
        tol = jnp.maximum(10 * eps / rtol, jnp.minimum(0.03, jnp.sqrt(rtol)))
        i32 = jnp.int32

        def newton(lu, piv):
            # (lu is for I - cJ, this step's c and J)
            def cond(st):
                it, _, _, _, conv, stop = st
                return ~conv & ~stop & (it < NEWTON_MAXITER)

            def body(st):
                it, y, d, old, _, _ = st
                f = rhs(y, t_new)[:n]
                dy = solve(lu, piv, c * f - psi_u - d)
                dn = rms(dy, scale)
                rate = dn / old
                has = it > 0
                diverge = has & ((rate >= 1) | (rate ** (NEWTON_MAXITER - it) / (1 - rate) * dn
                                                 > tol))
                bad = ~jnp.all(jnp.isfinite(f)) | ~jnp.isfinite(dn) | diverge
                conv = ~bad & ((dn == 0) | (has & (rate / (1 - rate) * dn < tol)))
                y = jnp.where(bad, y, y + dy)
                d = jnp.where(bad, d, d + dy)
                return it + 1, y, d, dn, conv, bad

            st = (jnp.zeros((), i32), u_pred, jnp.zeros_like(u_pred), jnp.ones((), dtype),
                  jnp.bool_(False), jnp.bool_(False))
            it, y, d, _, conv, _ = _sharding.while_loop(cond, body, st)
            return it, y, d, conv

        def attempt_cond(st):
            i, _, _, _, _, fresh, conv = st[:7]
            return (i == 0) | (~conv & ~fresh)

        def attempt(st):
            i, J, lu, piv, c_lu, fresh, _, _, _, _, fe, nj, nl = st
            refresh = i > 0  # Newton failed with an old Jacobian: a new one, and retry
            # (one-trip loops under shard_map: a vmapped cond would cast the values the
            # branches close over to varying, refused where a branch mixes them with
            # varying ones: see _sharding.cond_once)
            J = _sharding.cond_once(refresh, lambda: jac(u_pred, t_new), lambda: J,
                                    explicit=False)
            need = refresh | (c != c_lu)
            lu, piv = _sharding.cond_once(
                need,
                lambda: factorise(c, J),
                lambda: (lu, piv),
                explicit=False,
            )
            it, y, d, conv = newton(lu, piv)
            return (i + 1, J, lu, piv, jnp.where(need, c, c_lu), fresh | refresh, conv, it, y,
                    d, fe + it, nj + refresh.astype(i32), nl + need.astype(i32))

        zero = jnp.zeros((), i32)
        st = (zero, cache.J, cache.lu, cache.piv, cache.c_lu, cache.fresh > 0, jnp.bool_(False),
              zero, u_pred, jnp.zeros_like(u_pred), zero, zero, zero)
        (_, J, lu, piv, c_lu, fresh, conv, n_iter, u_new, d_u, fevals, njac, nlu) = (
            _sharding.while_loop(attempt_cond, attempt, st))
        if N > n:  # quadratures: explicit in the corrector
            d_q = c * rhs(u_new, t_new)[n:] - psi[n:]
            d = jnp.concatenate([d_u, d_q])
            fevals = fevals + 1
        else:
            d = d_u
        y_new = y_pred + d
        _, _, error_const, _ = consts(dtype)
        err = error_const[k] * d[:n]
        safety = (0.9 * (2 * NEWTON_MAXITER + 1) / (2 * NEWTON_MAXITER + n_iter)).astype(dtype)
        D_new, order, n_eq, factor, ks = update(D, k, d, n_equal, z, y_new, h, safety, dtype)
        fresh_f = fresh.astype(dtype)
        common = dict(k0=cache.k0, J=J, lu=lu, piv=piv, c_lu=c_lu, safety=safety)
        acc = BDFCache(D=D_new, h=h, order=order, n_equal=n_eq, fresh=jnp.zeros_like(fresh_f),
                       factor=factor, **common)
        # A rejected step leaves D as it was (spaced at cache.h; the retry rescales it from
        # there): the discrete adjoint takes the input cache of an accepted step to be the
        # output of the previous accepted one, whatever was rejected in between.
        rej = BDFCache(D=cache.D, h=cache.h, order=cache.order, n_equal=cache.n_equal,
                       fresh=fresh_f, factor=jnp.ones((), dtype), **common)
        ok = conv & jnp.all(jnp.isfinite(y_new))
        return y_new, err, ks, acc, rej, ok, (fevals, njac, nlu)

    def diff_step(s, z, cache, h, ks_star):
        # The corrector at the solution d* the forward found (from ks_star's last row):
        # F(d) = d - c f(y_pred + d) + ψ = 0, so dd = -(I - cJ(y*))⁻¹ dF (the implicit
        # function theorem, exact Jacobian at y*). Written as d = d* - (x - sg(x)),
        # x = (I - cJ)⁻¹ F(d*): the value stays d*. Step size and order are held fixed.
        if z.shape[0] != n:
            raise NotImplementedError("diff_step: quadrature components")
        sg = jax.lax.stop_gradient
        dtype = z.dtype
        h = sg(h)
        cache = cache._replace(h=sg(cache.h), order=sg(cache.order),
                               n_equal=sg(cache.n_equal))
        k, D, n_equal, y_pred, psi, c = predict(cache, h)
        t_new = s + h
        d_star = sg(ks_star[-1] * h)
        y_star = sg(y_pred + d_star)
        J = sg(jac(y_star, t_new))
        F = d_star - c * rhs(y_pred + d_star, t_new) + psi
        if structure is not None:
            x = structure.solve(block_factors(c, J), F)
        else:
            x = _lu.solve(_lu.factor(jnp.eye(n, dtype=dtype) - c * J), F)
        d = d_star - (x - sg(x))
        y_new = y_pred + d
        D_new, order, n_eq, factor, ks = update(D, k, d, n_equal, z, y_new, h,
                                                 sg(cache.safety), dtype)
        acc = BDFCache(k0=cache.k0, D=D_new, h=h, order=sg(order), n_equal=sg(n_eq),
                       J=sg(cache.J), lu=sg(cache.lu), piv=sg(cache.piv), c_lu=sg(cache.c_lu),
                       fresh=jnp.zeros((), dtype), factor=sg(factor), safety=sg(cache.safety))
        return y_new, acc, ks

    def control(ratio, accept, cache):
        # After an accepted step: the factor the order selection chose (1 while the
        # order's k + 1 equal steps are not yet taken). After a rejection: SciPy's
        # max(MIN_FACTOR, safety · ratio^(-1/(k+1))).
        r = jnp.maximum(ratio, 1e-10)
        rejected = jnp.maximum(MIN_FACTOR, cache.safety * r ** (-1.0 / (cache.order + 1)))
        rejected = jnp.where(jnp.isfinite(ratio), rejected, MIN_FACTOR)
        return jnp.where(accept, cache.factor, rejected)

    dense = np.vstack([np.eye(MAX_ORDER), np.zeros((1, MAX_ORDER))])  # (stages, degree)
    # order=2: the local error of the first (order-1) step goes as h², for the first step.
    return Stepper(init, step, dense, beta1=0.0, beta2=0.0, order=2, init_counts=(1, 1, 0),
                   diff_step=diff_step, lands=False, control=control)
