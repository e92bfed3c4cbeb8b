"""Error norms, the PI step-size controller and the automatic initial step."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["error_ratio", "rms", "pi_factor", "initial_step", "FACTOR_MIN", "FACTOR_MAX"]

SAFETY = 0.9
FACTOR_MIN = 0.2  # largest shrink after a rejected step
FACTOR_MAX = 10.0  # largest growth after an accepted one
RATIO_FLOOR = 1e-4  # Hairer's `facold` floor: an error far below tolerance counts as 1e-4


def error_ratio(err, z0, z1, rtol, atol, n_ctrl):
    """Weighted RMS of the local error over the first ``n_ctrl`` (controlled) components.

    ``sqrt(mean((err / (atol + rtol * max(|z0|, |z1|)))²))``: a step is accepted when this is
    at most 1. Components past ``n_ctrl`` (parameter cotangents of the adjoint system) are
    left out: the seminorm of Kidger, Chen & Lyons (2021).
    """
    scale = atol + rtol * jnp.maximum(jnp.abs(z0[:n_ctrl]), jnp.abs(z1[:n_ctrl]))
    return rms(err[:n_ctrl], scale)


def rms(v, scale):
    """``sqrt(mean((v / scale)²))``, whose derivative at ``v = 0`` is zero (the norm's
    subgradient), not ``sqrt``'s infinite one times zero (NaN): the step sizes read it, and
    ``adjoint="forward_adaptive"`` differentiates them. Accumulated in float32 at least (a
    float16 state's squares overflow from a ratio of 256 on), returned in ``v``'s dtype (a
    finite ratio past float16's range as its largest value: a large error, not a non-finite
    one)."""
    dtype = jnp.result_type(v)
    acc = jnp.promote_types(dtype, jnp.float32)
    ms = jnp.mean(jnp.square(v.astype(acc) / jnp.asarray(scale).astype(acc)))
    positive = ms > 0
    r = jnp.where(positive, jnp.sqrt(jnp.where(positive, ms, 1.0)), 0.0)
    if acc != dtype:
        r = jnp.where(jnp.isfinite(r), jnp.minimum(r, jnp.finfo(dtype).max), r)
    return r.astype(dtype)


def pi_factor(ratio, ratio_prev, accept, *, beta1, beta2):
    """Step-size factor of a PI controller: ``safety · ratio^-β1 · ratio_prev^β2``, clipped.

    After a rejection the step only shrinks; a non-finite error shrinks it by
    ``FACTOR_MIN``.
    """
    r = jnp.maximum(ratio, 1e-10)
    factor = SAFETY * r ** (-beta1) * ratio_prev**beta2
    factor = jnp.clip(factor, FACTOR_MIN, FACTOR_MAX)
    factor = jnp.where(accept, factor, jnp.minimum(factor, SAFETY))
    return jnp.where(jnp.isfinite(ratio), factor, FACTOR_MIN)


def initial_step(rhs, s0, u0, k0, span, rtol, atol, order):
    """Hairer, Nørsett & Wanner's initial step (Solving ODEs I, II.4), one extra evaluation.

    ``rhs(u, s)`` returns the derivative of the controlled components ``u``; ``k0`` is its
    value at ``(u0, s0)``.
    """
    dtype = u0.dtype
    scale = atol + rtol * jnp.abs(u0)

    d0, d1 = rms(u0, scale), rms(k0, scale)
    h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), jnp.asarray(1e-6, dtype), 0.01 * d0 / d1)
    h0 = jnp.minimum(h0, span)
    k1 = rhs(u0 + h0 * k0, s0 + h0)
    d2 = rms(k1 - k0, scale) / h0
    dmax = jnp.maximum(d1, d2)
    h1 = jnp.where(
        dmax <= 1e-15,
        jnp.maximum(jnp.asarray(1e-6, dtype), h0 * 1e-3),
        (0.01 / dmax) ** (1.0 / order),
    )
    h = jnp.minimum(100 * h0, h1)
    return jnp.where(jnp.isfinite(h) & (h > 0), jnp.minimum(h, span), h0)
