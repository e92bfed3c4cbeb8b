"""Dense LU factorisation and solves: Newton's dense Jacobians, the stiff ODE methods'
iteration matrices.

An iteration matrix (a simplified Newton iteration's: factored once, solved with many
times) of up to :data:`INVERSE_MAX` unknowns is inverted instead (:func:`iteration_factor`):
a solve is then one matrix-vector product. On CPU XLA's triangular solve costs about
0.3 µs even at n = 3, where the product of a 3 x 3 matrix costs 0.01 µs (0.35 µs against
2.8 µs for the pair of triangular solves at n = 64; measured in a ``while_loop``). The
inverse's rounding error (about ``cond(A)`` times the precision) only changes the
iteration's contraction rate, not the point it converges to: the residual is computed
exactly. One-off solves (Newton's steps with a fresh Jacobian, implicit derivatives) keep
the LU.

XLA does not partition an LU factorisation. A matrix split over an Explicit mesh (the
Jacobian of one whole sharded state) is gathered first, so every device factors the
whole matrix, as a sharded ``jit`` on an Auto mesh does by itself; a solution comes back
split like its right-hand side. Elsewhere (one device, an Auto mesh, ``shard_map``, the
elements of a ``vmap``ped batch) the matrix is factored where it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from implicit import _sharding

__all__ = ["factor", "solve", "solve_transpose", "iteration_factor", "iteration_solve",
           "INVERSE_MAX"]

#: The largest iteration matrix inverted by :func:`iteration_factor` (larger: LU).
INVERSE_MAX = 64


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


def solve_transpose(factors, b):
    """``a⁻ᵀ b`` for the ``factors`` of ``a`` (:func:`factor`); ``b`` a vector.

    With ``p a = l u``: ``aᵀ = uᵀ lᵀ p``, so ``aᵀ x = b`` is ``uᵀ y = b``, ``lᵀ z = y``,
    ``x = pᵀ z``.
    """
    lu, permutation = factors
    y = jax.lax.linalg.triangular_solve(lu, _sharding.gathered(b)[:, None], left_side=True,
                                        lower=False, transpose_a=True)
    z = jax.lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True,
                                        unit_diagonal=True)[:, 0]
    x = jnp.zeros_like(z).at[permutation.astype("int32")].set(z)
    return _sharding.split_like(x, b)


def iteration_factor(a):
    """The factors of an iteration matrix ``a`` for :func:`iteration_solve`, every leaf
    floating (a multistep cache is differentiated through): ``(a⁻¹,)`` for up to
    :data:`INVERSE_MAX` unknowns, else the LU factors and the permutation (as floats)."""
    if a.shape[-1] <= INVERSE_MAX:
        lu, permutation = factor(a)
        eye = jnp.eye(a.shape[-1], dtype=lu.dtype)[permutation]
        y = jax.lax.linalg.triangular_solve(lu, eye, left_side=True, lower=True,
                                            unit_diagonal=True)
        return (jax.lax.linalg.triangular_solve(lu, y, left_side=True, lower=False),)
    lu, permutation = factor(a)
    return lu, permutation.astype(lu.dtype)


def iteration_solve(factors, b):
    """``a⁻¹ b`` for ``factors = iteration_factor(a)``; ``b`` a vector."""
    if len(factors) == 1:
        x = jnp.matmul(factors[0], _sharding.gathered(b), precision=jax.lax.Precision.HIGHEST)
        return _sharding.split_like(x, b)
    return solve(factors, b)
