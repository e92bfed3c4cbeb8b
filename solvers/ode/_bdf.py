"""Variable-order (1–5), variable-step NDF/BDF: SciPy's ``BDF`` algorithm as a Stepper.

The method is the quasi-constant-step numerical differentiation formulas of Shampine &
Reichelt (1997, MATLAB's ``ode15s``; ``kappa`` below, as in ``scipy.integrate.BDF``),
written in terms of the backward differences ``D`` of the interpolating polynomial
through the last ``order + 1`` solution points, at a uniform spacing ``h``:

- the predictor is ``y_pred = Σ_{j≤k} D_j``; the corrector solves
  ``d - c f(t + h, y_pred + d) + ψ = 0`` for ``d`` (``c = h / α_k``,
  ``ψ = Σ_{1≤j≤k} γ_j D_j / α_k``) by simplified Newton iterations (at most
  ``NEWTON_MAXITER``, SciPy's convergence-rate test) with the iteration matrix
  ``I - cJ``, factored (its inverse up to 64 unknowns, by Gauss–Jordan up to 4:
  ``implicit._lu.iteration_factor``);
  ``y_new = y_pred + d`` and the local error estimate is ``error_const[k] · d``;
- the Jacobian is kept across steps and recomputed (at the predictor) only when Newton
  fails with a Jacobian from an earlier step; the factors are recomputed when ``c`` changes
  (a new step size or order) or ``J`` does;
- a step size change rescales ``D`` (SciPy's ``change_D``); after ``k + 1`` steps of the
  same size the order moves to whichever of ``k - 1, k, k + 1`` allows the largest step
  (error estimates from ``D_k`` and ``D_{k+2}``), and the step grows by at most
  ``MAX_FACTOR``.

Fitting the shared loop (:mod:`solvers.ode._integrate`): the multistep history lives in
the cache (``D`` of shape ``(MAX_ORDER + 3, N)``, the step size it is spaced at, the
order, the Jacobian and the factors of ``I - cJ``, ...; every leaf floating, so that the
discrete adjoint can differentiate through it), ``D`` is rescaled lazily at the start of a
step whose size differs from the cache's, and :attr:`Stepper.control` hands the loop the
step-size factor the order selection chose. The continuous extension is the interpolating polynomial
itself, of the step's order (SciPy's dense output), as monomial coefficients in
``θ = (t - s) / h``; a sixth, zero-weighted "stage" carries ``d / h`` for the discrete
adjoint, which differentiates the corrector by the implicit function theorem at the
solution the forward found (exact Jacobian there).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import functools

import jax
import jax.numpy as jnp
import numpy as np

from implicit import _sharding
from implicit import _lu
from solvers.ode import _control, _dae, _small

__all__ = ["bdf_stepper", "MAX_ORDER", "NEWTON_MAXITER"]

MAX_ORDER = 5
NEWTON_MAXITER = 4
MIN_FACTOR = 0.2
MAX_FACTOR = 10.0
# Newton's noise floor (``step``) is 10x the estimated rounding of the correction, at most
# this many tolerance units: an ODE's whole tolerance, a DAE's tenth of it (below).
NOISE_FLOOR_MAX = 1.0
NOISE_FLOOR_MAX_DAE = 0.1

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
    # (elementwise and unrolled, no scatter or scan: one fused kernel)
    j = jnp.arange(MAX_ORDER + 1, dtype=dtype)
    rows = [jnp.ones((MAX_ORDER + 1,), dtype)]
    for i in range(1, MAX_ORDER + 1):  # row i: the product of (m - 1 - factor j) / m, m <= i
        rows.append(rows[-1] * jnp.where(j == 0, 0.0, (i - 1 - factor * j) / i))
    return jnp.stack(rows)


def _rescale(D, order, factor):
    """SciPy's ``change_D``: ``D`` for the step size times ``factor`` (rows ``> order``
    unchanged)."""
    dtype = D.dtype
    R = _compute_R(factor, dtype)
    U = _compute_R(jnp.ones((), dtype), dtype)
    RU = _small.matmul(R, U)
    m = jnp.arange(MAX_ORDER + 1) <= order
    A = jnp.where(m[:, None] & m[None, :], RU, jnp.eye(MAX_ORDER + 1, dtype=dtype))
    return jnp.concatenate([_small.matmul(A.T, D[: MAX_ORDER + 1]), D[MAX_ORDER + 1:]])


#: The scalars of :class:`BDFCache`, in the order of its ``scalars`` vector:
#: ``h`` the spacing of ``D``; ``order`` the current order, 1..MAX_ORDER; ``n_equal`` the
#: steps taken at this size and order; ``c_lu`` the ``c`` the factors are for (0: none yet);
#: ``fresh`` 1.0 when ``J`` was computed during the current step (after a rejection too);
#: ``factor`` the step-size factor chosen after an accepted step; ``safety`` the step's
#: safety factor (fewer Newton iterations: bolder); ``refresh`` 1.0 when Newton failed:
#: the next attempt computes a new Jacobian (at its predictor), at the same step size
#: where the failed one was from an earlier step, at half of it otherwise (SciPy retries
#: within the step; here the loop does, as a rejected step). SciPy keeps the step's
#: Jacobian while it halves the step; on the transistor amplifier DAE (TRANSAMP) at rtol
#: 1e-4 that Jacobian, from the first attempt's predictor, failed at every size down to
#: an underflow at t = 0.1004 (1,388 steps to the end with a new one at each halving).
_SCALARS = ("h", "order", "n_equal", "c_lu", "fresh", "factor", "safety", "refresh")


class BDFCache(NamedTuple):
    """The multistep state (every leaf floating; integers stored as floats).

    The scalars (:data:`_SCALARS`, read as attributes: ``cache.h``) are one vector: one
    buffer to carry and select per step instead of eight (measured on Robertson: 5% off
    the solve, 12% off its gradient).
    """

    k0: Any  # (N,) the derivative at the initial point (the loop's first-step heuristic)
    D: Any  # (MAX_ORDER + 3, N) backward differences, spaced at ``h``
    J: Any  # (n, n) Jacobian of the controlled components (kept across steps); with a
    #         structure: compressed, (colours, n)
    Jy: Any  # (n,) |J| |y| at J's point: the scale of the residual's rounding (the
    #          Newton noise floor, see ``step``); zeros with a structure
    lu: Any  # the factors of I - c_lu J (implicit._lu.iteration_factor: its inverse or
    #          LU); with a structure: its block elimination
    scalars: Any  # (8,) the values named by _SCALARS

    @classmethod
    def make(cls, k0, D, J, Jy, lu, **scalars):
        """A cache from its arrays and every one of :data:`_SCALARS` by name."""
        dtype = D.dtype
        values = [jnp.asarray(scalars[name], dtype) for name in _SCALARS]
        return cls(k0, D, J, Jy, lu, jnp.stack(_sharding.stackable(values)))

    def updated(self, **changes):
        """This cache with some arrays or scalars replaced."""
        arrays = {k: v for k, v in changes.items() if k not in _SCALARS}
        scalars = self.scalars
        slots = jnp.arange(len(_SCALARS))
        for k, v in changes.items():
            if k in _SCALARS:  # (a select, which XLA fuses: .at[i].set is a scatter)
                scalars = jnp.where(slots == _SCALARS.index(k), v, scalars)
        return self._replace(scalars=scalars, **arrays)


# cache.h, cache.order, ...: read-only views of the scalars vector.
for _i, _name in enumerate(_SCALARS):
    setattr(BDFCache, _name, property(lambda self, i=_i: self.scalars[i]))


def bdf_stepper(rhs, n_ctrl, *, rtol, atol, structure=None, mass=None):
    """The :class:`~solvers.ode._integrate.Stepper` of variable-order NDF (SciPy's BDF).

    ``structure``: a :class:`solvers._sparse.Structure` of the Jacobian (``jac_sparsity``):
    the Jacobian is then kept in block-tridiagonal form (compressed jvps) and ``I - cJ``
    factored by block elimination (``J`` and ``lu`` in the cache: the compressed
    Jacobian and the factors);
    ``None``: dense (``jacfwd``; the inverse of ``I - cJ``, or its LU past 64 unknowns).

    ``mass``: a :class:`solvers.ode._dae.Mass` (``odeint``'s ``mass=``, DAEs
    ``M y' = f``): the corrector is then ``M(ψ + d) - c f(y_pred + d) = 0``, its Newton
    matrix ``M - cJ`` (as ``ode15s`` with a mass matrix), and the first step starts from
    the consistent slope (:func:`solvers.ode._dae.slope`). With a ``structure`` it must be
    diagonal. ``None``: ``M = I``, the code of an ODE.

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

    rms = _control.rms

    def slope(u, t):
        """The consistent slope of the DAE (``mass``): ``y'`` of the controlled part."""
        return _dae.slope(mass, lambda v, s: rhs(v, s)[:n], u, t)

    def jac(u, t):
        if structure is not None:  # compressed, (colours, n): the cache keeps this form
            return structure.compressed(lambda v: rhs(v, t)[:n], u)
        return jax.jacfwd(lambda v: rhs(v, t)[:n])(u)

    def block_factors(c, J):
        """The factors of ``I - cJ`` (``M - cJ``) from the compressed ``J`` (with a
        structure)."""
        if mass is not None:
            return structure.factor(structure.diag_minus(mass.diag, c, structure.scatter(J)))
        return structure.factor(structure.eye_minus(c, structure.scatter(J)))

    def eye(dtype):
        """``I``, or the mass matrix."""
        if mass is not None:
            return jnp.asarray(mass.matrix, dtype)
        return jnp.eye(n, dtype=dtype)

    def corrector(f, c, psi, d):
        """``c f - (ψ + d)``, or ``c f - M(ψ + d)`` (the ODE's own rounding kept)."""
        if mass is None:
            return c * f - psi - d
        return c * f - mass.times(psi + d)

    def factorise(c, J):
        """The factors of ``I - cJ`` for Newton's solves (every leaf floating). Structured: the
        elimination only (not the blocks of ``I - cJ``: Newton does not multiply by it)."""
        if structure is not None:
            return block_factors(c, J)[0]
        return _lu.iteration_factor(eye(J.dtype) - c * J)

    def solve(lu, b):
        if structure is not None:
            return structure.apply_inverse(lu, b)
        return _lu.iteration_solve(lu, b)

    def placeholder(J):
        return jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda J: factorise(1.0, J), J))

    def rounding_scale(J, u):
        # |J| |u|: the size of f's terms, whose rounding bounds the residual's (step).
        if structure is not None:
            return jnp.zeros_like(u)
        return _small.matmul(jnp.abs(J), jnp.abs(u))

    def init(s0, z0):
        dtype = z0.dtype
        f0 = rhs(z0[:n], s0)
        if mass is not None:  # (the consistent slope: y' for the predictor of step one)
            f0 = jnp.concatenate([slope(z0[:n], s0), f0[n:]])
        J = jax.lax.stop_gradient(jac(z0[:n], s0))
        Jy = jax.lax.stop_gradient(rounding_scale(J, z0[:n]))
        D = _sharding.rows_like(z0, R).at[0].set(z0).at[1].set(f0)  # spaced at h = 1
        zero, one = jnp.zeros((), dtype), jnp.ones((), dtype)
        return BDFCache.make(
            k0=f0, D=D, J=J, Jy=Jy, lu=placeholder(J), h=one, order=one, n_equal=zero, c_lu=zero,
            fresh=one, factor=one, safety=jnp.asarray(0.9, dtype), refresh=zero,
        )

    def predict(cache, h):
        """Rescale ``D`` to ``h``; the predictor, ``ψ``, ``c`` and the order (int)."""
        dtype = cache.D.dtype
        alpha, gamma, _, _ = consts(dtype)
        k = cache.order.astype(jnp.int32)
        changed = h != cache.h
        # (conditionals, here and for the order selection, not selects of both values:
        # the step size changes once in k + 1 steps or so; 19% of the Robertson solve)
        D = _sharding.cond(changed, lambda D: _rescale(D, k, h / cache.h), lambda D: D,
                           cache.D)
        n_equal = jnp.where(changed, 0.0, cache.n_equal).astype(dtype)
        rows = jnp.arange(R)
        y_pred = jnp.sum(jnp.where((rows <= k)[:, None], D, 0.0), axis=0)
        g = jnp.where(jnp.arange(MAX_ORDER + 1) <= k, gamma, 0.0)[1:]
        psi = _small.matmul(g, D[1 : MAX_ORDER + 1]) / alpha[k]
        c = h / alpha[k]
        return k, D, n_equal, y_pred, psi, c

    def update(D, k, d, n_equal, z, y_new, h, safety, dtype):
        """``D`` after the step, the order and factor for the next one, dense output."""
        _, _, error_const, C = consts(dtype)
        rows = jnp.arange(R)[:, None]
        Dk1 = D[k + 1]
        Dp = jnp.where(rows == k + 2, d - Dk1, jnp.where(rows == k + 1, d, D))
        # (the cumulative sum from the bottom, as a product with a triangle of ones)
        rc = _small.matmul(jnp.asarray(np.triu(np.ones((R, R))), dtype),
                     jnp.where(rows <= k + 1, Dp, 0.0))
        D_new = jnp.where(rows <= k, rc, Dp)

        def selection(z, y_new, d, D_new, safety):
            scale = atol + rtol * jnp.maximum(jnp.abs(z[:n]), jnp.abs(y_new[:n]))
            err_norm = rms(error_const[k] * d[:n], scale)
            err_m = jnp.where(k > 1, rms(error_const[k - 1] * D_new[k, :n], scale), jnp.inf)
            kp = jnp.minimum(k + 1, MAX_ORDER)
            err_p = jnp.where(k < MAX_ORDER, rms(error_const[kp] * D_new[k + 2, :n], scale),
                              jnp.inf)
            norms = jnp.stack([err_m, err_norm, err_p])
            expo = -1.0 / (k + jnp.arange(3)).astype(dtype)
            # (a zero error estimate: an infinite factor, and a zero derivative, not NaN)
            positive = norms > 0
            factors = jnp.where(positive, jnp.where(positive, norms, 1.0) ** expo, jnp.inf)
            factors = jnp.where(jnp.isnan(norms), 0.0, factors)
            return ((k + jnp.argmax(factors) - 1).astype(dtype),
                    jnp.minimum(MAX_FACTOR, safety * jnp.max(factors)).astype(dtype))

        def unchanged(*_):
            return k.astype(dtype), jnp.ones((), dtype)

        n_equal = n_equal + 1
        select = n_equal >= k + 1
        new_order, factor = _sharding.cond(select, selection, unchanged,
                                           z, y_new, d, D_new, safety)
        n_equal = jnp.where(select, 0.0, n_equal)
        # Dense output: the step's interpolant as monomials in θ (over h), and d / h.
        mask = (jnp.arange(1, MAX_ORDER + 1) <= k).astype(dtype)
        coef = _small.matmul((C * mask[:, None]).T, D_new[1 : MAX_ORDER + 1])
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

        def newton(lu, floor):
            # (lu is for I - cJ, this step's c and J; floor: a correction this small is at
            # the residual's rounding, see below)
            def cond(st):
                it, _, _, _, conv, stop = st
                return ~conv & ~stop & (it < NEWTON_MAXITER)

            def body(st):
                it, y, d, old, _, _ = st
                f = rhs(y, t_new)[:n]
                dy = solve(lu, corrector(f, c, psi_u, d))
                dn = rms(dy, scale)
                rate = dn / old
                has = it > 0
                at_floor = dn <= floor
                diverge = has & ~at_floor & (
                    (rate >= 1) | (rate ** (NEWTON_MAXITER - it) / (1 - rate) * dn > tol))
                bad = ~jnp.all(jnp.isfinite(f)) | ~jnp.isfinite(dn) | diverge
                conv = ~bad & ((dn == 0) | at_floor | (has & (rate / (1 - rate) * dn < tol)))
                y = jnp.where(bad, y, y + dy)
                d = jnp.where(bad, d, d + dy)
                return it + 1, y, d, dn, conv, bad

            st = (jnp.zeros((), i32), u_pred, jnp.zeros_like(u_pred), jnp.ones((), dtype),
                  jnp.bool_(False), jnp.bool_(False))
            it, y, d, _, conv, _ = _sharding.while_loop(cond, body, st)
            return it, y, d, conv

        # Newton failed with an old Jacobian at this step: a new one (at the predictor).
        # (One-trip loops under shard_map: a vmapped cond would cast the values the
        # branches close over to varying, refused where a branch mixes them with varying
        # ones: see _sharding.cond_once.)
        refresh = cache.refresh > 0
        def fresh_jacobian():
            J = jac(u_pred, t_new)
            return J, rounding_scale(J, u_pred)

        J, Jy = _sharding.cond_once(refresh, fresh_jacobian, lambda: (cache.J, cache.Jy),
                                    explicit=False)
        need = refresh | (c != cache.c_lu)
        lu = _sharding.cond_once(need, lambda: factorise(c, J), lambda: cache.lu,
                                 explicit=False)
        # The residual c f - ψ - d cannot be computed more exactly than c eps times the
        # size of f's terms, about |J| |y| (kinetics: Robertson's -k1 y1 + k3 y2 y3 cancels
        # to 1e-10 of its terms late on): past t = 1e9 at rtol 1e-9 that rounding, scaled,
        # was 1e-3, above the contraction test's 3e-5, and Newton "diverged" on noise at
        # most steps (8,586 steps and 2,048 Jacobians against SciPy's 2,263). A correction
        # within 10x that rounding is converged, up to NOISE_FLOOR_MAX tolerance units:
        # Robertson to 1e11 at rtol 1e-11 (atol 1e-17) has corrections of 0.2-0.3 units
        # that are noise (c f - ψ cancels to 1e-7 of its terms), and with the floor at most
        # 0.1 Newton failed there until the step shrank below the noise: 11,626 steps and
        # 2,901 Jacobians against SciPy's 4,557 steps, the same digits; at most 1: 4,727
        # steps, 24 Jacobians. With a mass matrix it stays 0.1: TRANSAMP's algebraic
        # variables took the accepted iterate's noise, 0.4-0.6 digits fewer at rtol
        # 1e-11/1e-12 (10.7 and 11.7, under rtol's), for 8% more and 1% fewer steps. |J| |y|
        # is taken where J was (cache.Jy: one product per Jacobian, not per step; at most a
        # few steps old, since a Newton failure brings a new J and with it a new floor).
        # With a singular mass matrix (DAEs) the correction of an algebraic variable is its
        # residual divided by about cJ, not the residual itself: the floor is the noise
        # after the solve (TRANSAMP at rtol 1e-10: exp((y4 - y5) / 0.026) rounded to 6e-17,
        # over y7's 1/9000 gives 5e-13, 1e-3 of the tolerance's scale, at any step size:
        # Newton "diverged" on it down to a step underflow at t = 0.142).
        if structure is None:
            noise, cap = rms(c * eps * Jy, scale), NOISE_FLOOR_MAX
            if mass is not None:
                noise = jnp.maximum(noise, rms(solve(lu, c * eps * Jy), scale))
                cap = NOISE_FLOOR_MAX_DAE
            floor = jnp.minimum(cap, 10 * noise)
        else:
            floor = jnp.zeros((), dtype)
        n_iter, u_new, d_u, conv = newton(lu, floor)
        c_lu = jnp.where(need, c, cache.c_lu)
        fresh = (cache.fresh > 0) | refresh
        fevals, njac, nlu = n_iter, refresh.astype(i32), need.astype(i32)
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
        common = dict(k0=cache.k0, J=J, Jy=Jy, lu=lu, c_lu=c_lu, safety=safety)
        acc = BDFCache.make(D=D_new, h=h, order=order, n_equal=n_eq,
                            fresh=jnp.zeros_like(fresh_f), factor=factor,
                            refresh=jnp.zeros_like(fresh_f), **common)
        # A rejected step leaves D as it was (spaced at cache.h; the retry rescales it from
        # there): the discrete adjoint takes the input cache of an accepted step to be the
        # output of the previous accepted one, whatever was rejected in between.
        rej = cache.updated(J=J, Jy=Jy, lu=lu, c_lu=c_lu, safety=safety, fresh=fresh_f,
                            factor=jnp.ones((), dtype), refresh=(~conv).astype(dtype))
        ok = conv & jnp.all(jnp.isfinite(y_new))
        return y_new, err, ks, acc, rej, ok, (fevals, njac, nlu)

    def diff_step(s, z, cache, h, ks_star, eps=None):
        # The corrector at the solution d* the forward found (from ks_star's last row):
        # F(d) = d - c f(y_pred + d) + ψ = 0, so dd = -(I - cJ(y*))⁻¹ dF (the implicit
        # function theorem, exact Jacobian at y*). Written as d = d* + (x - sg(x)),
        # x = -(I - cJ)⁻¹ F(d*): the value stays d*. Step size and order are held fixed.
        if z.shape[0] != n:
            raise NotImplementedError("diff_step: quadrature components")
        sg = jax.lax.stop_gradient
        dtype = z.dtype
        h = sg(h)
        cache = cache._replace(scalars=sg(cache.scalars))  # (step size and order fixed)
        k, D, n_equal, y_pred, psi, c = predict(cache, h)
        t_new = s + h
        d_star = sg(ks_star[-1] * h)
        y_star = sg(y_pred + d_star)
        J = sg(jac(y_star, t_new))
        if structure is not None:
            factors = block_factors(c, J)
            inv = functools.partial(structure.solve, factors)
        else:
            inv = functools.partial(_lu.solve, _lu.factor(eye(dtype) - c * J))
        # Two chord corrections at the Jacobian of the computed corrector, held fixed: each
        # makes one more order of derivatives exact (the second: jax.hessian through the
        # discrete adjoint, as kvaerno5's stages). (corrector(...) is -F.)
        d = d_star
        for _ in range(2):
            x = inv(corrector(rhs(y_pred + d, t_new), c, psi, d))
            d = d + (x - sg(x))
        if eps is not None:  # a perturbation where the local error is made: the
            d = d + eps  # corrector, so that the history (D) sees it too
        y_new = y_pred + d
        D_new, order, n_eq, factor, ks = update(D, k, d, n_equal, z, y_new, h,
                                                 sg(cache.safety), dtype)
        acc = BDFCache.make(k0=cache.k0, D=D_new, J=sg(cache.J), Jy=sg(cache.Jy),
                            lu=sg(cache.lu), h=h,
                            order=sg(order), n_equal=sg(n_eq), c_lu=cache.c_lu,
                            fresh=jnp.zeros((), dtype), factor=sg(factor),
                            safety=cache.safety, refresh=jnp.zeros((), dtype))
        _, _, error_const, _ = consts(dtype)
        return y_new, acc, ks, error_const[k] * d

    def control(ratio, accept, ok, cache):
        # After an accepted step: the factor the order selection chose (1 while the
        # order's k + 1 equal steps are not yet taken). After a rejection: SciPy's
        # max(MIN_FACTOR, safety · ratio^(-1/(k+1))). After a failed Newton iteration: the
        # same size where the Jacobian was from an earlier step, else half (a new
        # Jacobian either way: cache.refresh).
        r = jnp.maximum(ratio, 1e-10)
        rejected = jnp.maximum(MIN_FACTOR, cache.safety * r ** (-1.0 / (cache.order + 1)))
        rejected = jnp.where(jnp.isfinite(ratio), rejected, MIN_FACTOR)
        failed = jnp.where(cache.fresh > 0, 0.5, 1.0)
        return jnp.where(ok, jnp.where(accept, cache.factor, rejected), failed)

    dense = np.vstack([np.eye(MAX_ORDER), np.zeros((1, MAX_ORDER))])  # (stages, degree)
    # order=2: the local error of the first (order-1) step goes as h², for the first step.
    return Stepper(init, step, dense, beta1=0.0, beta2=0.0, order=2, init_counts=(1, 1, 0),
                   diff_step=diff_step, lands=False, control=control, history=True,
                   slope=None if mass is None else slope)
