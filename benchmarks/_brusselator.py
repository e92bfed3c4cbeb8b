"""The 1-D Brusselator by the method of lines (issue 15), shared by the benchmarks and the
tests; importing it changes no JAX setting.

``u' = 1 + u²v - 4u + α(N+1)² Δu``, ``v' = 3u - u²v + α(N+1)² Δv`` on ``N`` interior
points, ``u = 1``, ``v = 3`` on the boundary; the state interleaves ``(u_i, v_i)``, so the
Jacobian is banded with half-width 2.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["brusselator", "brusselator_np", "brusselator_y0"]


def brusselator(y, t, alpha):
    """The right-hand side in JAX (``odeint``'s ``f(y, t, *args)``)."""
    u, v = y[0::2], y[1::2]
    a = alpha * (u.shape[0] + 1) ** 2
    one, three = jnp.ones(1, y.dtype), 3 * jnp.ones(1, y.dtype)
    up, vp = jnp.concatenate([one, u, one]), jnp.concatenate([three, v, three])
    du = 1 + u * u * v - 4 * u + a * (up[:-2] - 2 * u + up[2:])
    dv = 3 * u - u * u * v + a * (vp[:-2] - 2 * v + vp[2:])
    return jnp.stack([du, dv], 1).reshape(-1)


def brusselator_np(t, y, alpha):
    """The same in NumPy (SciPy's ``fun(t, y, *args)``)."""
    u, v = y[0::2], y[1::2]
    a = alpha * (u.size + 1) ** 2
    up, vp = np.concatenate([[1.0], u, [1.0]]), np.concatenate([[3.0], v, [3.0]])
    du = 1 + u * u * v - 4 * u + a * (up[:-2] - 2 * u + up[2:])
    dv = 3 * u - u * u * v + a * (vp[:-2] - 2 * v + vp[2:])
    return np.stack([du, dv], 1).reshape(-1)


def brusselator_y0(n):
    """``u = 1 + sin(2πx)``, ``v = 3`` at the ``n`` interior points."""
    x = np.arange(1, n + 1) / (n + 1)
    return np.stack([1 + np.sin(2 * np.pi * x), 3 * np.ones(n)], 1).reshape(-1)
