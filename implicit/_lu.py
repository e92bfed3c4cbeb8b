"""Dense LU factorisation and solves: Newton's dense Jacobians, the stiff ODE methods'
iteration matrices.

XLA does not partition an LU factorisation. A matrix split over an Explicit mesh (the
Jacobian of one whole sharded state) is gathered first, so every device factors the
whole matrix, as a sharded ``jit`` on an Auto mesh does by itself; a solution comes back
split like its right-hand side. Elsewhere (one device, an Auto mesh, ``shard_map``, the
elements of a ``vmap``ped batch) the matrix is factored where it is.
"""

from __future__ import annotations

import jax

from implicit import _sharding

__all__ = ["factor", "solve"]


def factor(a):
    """The LU factors of the square matrix ``a``: ``(lu, permutation)``."""
    lu, _, permutation = jax.lax.linalg.lu(_sharding.gathered(a))
    return lu, permutation


def solve(factors, b):
    """``a⁻¹ b`` for the ``factors`` of ``a`` (:func:`factor`); ``b`` a vector."""
    lu, permutation = factors
    rhs = _sharding.gathered(b)[permutation.astype("int32"), None]
    y = jax.lax.linalg.triangular_solve(lu, rhs, left_side=True, lower=True,
                                        unit_diagonal=True)
    x = jax.lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)[:, 0]
    return _sharding.split_like(x, b)
