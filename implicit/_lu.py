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

Up to :data:`GAUSS_JORDAN_MAX` unknowns (the small stiff systems of chemical kinetics:
Robertson has 3) neither uses LAPACK: the inverse comes from Gauss–Jordan elimination with
partial pivoting written as elementwise operations, which XLA fuses into a few kernels,
where LAPACK's LU and its triangular solves are a call each (in a ``while_loop`` on CPU:
0.68 against 1.16 µs per factorisation at n = 3, 0.97 against 1.17 at n = 4, and slower
from n = 5 on). A solve is then one matrix-vector product, and :func:`factor` returns the
inverse (its permutation ``None``).

LAPACK (and cuSOLVER) factor no 16-bit floats: a float16 or bfloat16 matrix is factored
in float32 (:func:`factorable`), its factors stay float32, and a solve returns its
right-hand side's dtype. (Gauss–Jordan's few unknowns too, so that the factors' dtype
does not depend on the size.)

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

__all__ = ["factor", "factorable", "solve", "solve_transpose", "iteration_factor",
           "iteration_solve", "factor_solve", "with_permutation", "inverse",
           "solve_positive_definite", "inverses", "INVERSE_MAX", "GAUSS_JORDAN_MAX"]

#: The largest iteration matrix inverted by :func:`iteration_factor` (larger: LU).
INVERSE_MAX = 64

#: The largest matrix inverted by Gauss–Jordan elimination (:func:`inverse`) instead of
#: factored by LAPACK (:func:`factor`, :func:`iteration_factor`).
GAUSS_JORDAN_MAX = 4


def factorable(a):
    """``a`` in a dtype LAPACK factors: 16-bit floats as float32."""
    return a.astype(jnp.float32) if jnp.finfo(a.dtype).bits < 32 else a


def _like(x, b):
    """The solution ``x`` of a solve in ``b``'s dtype, split like ``b``."""
    return _sharding.split_like(x.astype(b.dtype), b)


def _gauss_jordan(m, pivoting):
    """``[a | r] -> [I | a⁻¹ r]`` for ``m = [a | r]`` (``a`` n x n), unrolled over the
    columns with elementwise operations and selects (no LAPACK call, no scatter). With
    ``pivoting``, each column's largest entry on or below the diagonal is swapped into
    place first. An exactly zero pivot gives non-finite entries, as an LU's solves do."""
    n = m.shape[0]
    rows = jnp.arange(n)[:, None]
    for j in range(n):
        if pivoting:
            p = jnp.argmax(jnp.where(rows[:, 0] >= j, jnp.abs(m[:, j]), -1.0))
            row_j = jnp.sum(jnp.where(rows == p, m, 0.0), axis=0)
            m = jnp.where(rows == p, m[j], m)
        else:
            row_j = m[j]
        pivot_row = row_j / row_j[j]
        # (row j set by an update at a static index, not a select on a `rows == j` mask: in
        # a loop XLA hoists such constant masks out of the body, each one more buffer the
        # loop takes in and one more kernel to launch before it)
        m = (m - m[:, j : j + 1] * pivot_row).at[j].set(pivot_row)
    return m


def inverse(a):
    """The inverse of the small square matrix ``a`` by Gauss–Jordan elimination with
    partial pivoting (:func:`_gauss_jordan`; a nearly singular ``a``: huge entries)."""
    n = a.shape[-1]
    return _gauss_jordan(jnp.concatenate([a, jnp.eye(n, dtype=a.dtype)], axis=-1),
                         pivoting=True)[:, n:]


@jax.custom_jvp
def inverses(a):
    """The inverses of a batch ``(..., n, n)`` of square matrices, each by LU with partial
    pivoting inside it: the LU of ``[a | I]``, whose right part comes back as ``L⁻¹ P``
    (LAPACK swaps its rows as it eliminates), then one triangular solve with ``U``.
    ``jnp.linalg.inv`` forms the permutation ``P`` from the pivots instead, a loop of
    ``n`` small steps on CPU, and its derivative factors again: in the block-tridiagonal
    solves of ``jac_sparsity`` (an inverse per level of the cyclic reduction, in the
    forward loop, the replay and the backward pass) that was 181 of the 978 computations
    of the ODE page's ``bdf`` example. (Gauss–Jordan, :func:`inverse`, is no cheaper to
    compile batched: its pivot searches are a reduction each.) The derivative is
    ``-a⁻¹ da a⁻¹``. A singular matrix: non-finite entries. On a GPU/TPU,
    ``jnp.linalg.inv``: cuBLAS factors a batch of small matrices in one call only when
    they are square (a batch of ``n x 2n`` ones would be factored one by one), and
    there the permutation is a kernel of its own, not a loop."""
    if _sharding.on_accelerator():
        return jnp.linalg.inv(a)
    n = a.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape)
    lu, _, _ = jax.lax.linalg.lu(jnp.concatenate([a, eye], axis=-1))
    return jax.lax.linalg.triangular_solve(lu[..., :n], lu[..., n:], left_side=True,
                                           lower=False)


@inverses.defjvp
def _inverses_jvp(primals, tangents):
    (a,), (da,) = primals, tangents
    x = inverses(a)
    return x, -_sharding.matmul(x, _sharding.matmul(da, x))


def solve_positive_definite(a, b):
    """``a⁻¹ b`` for a small symmetric positive definite ``a`` (Anderson acceleration's
    ridged Gram matrix): Gauss–Jordan elimination without pivoting, which is stable for
    positive definite matrices (no reduction at all: at n = 5 LAPACK's LU, its pivots'
    permutation and two triangular solves are about 50 kernels in a ``while_loop``
    body). A zero pivot (a singular ``a``) gives non-finite values."""
    n = a.shape[-1]
    return _gauss_jordan(jnp.concatenate([a, b[:, None]], axis=-1), pivoting=False)[:, n]


def factor(a):
    """The factors of the square matrix ``a`` for :func:`solve`: ``(lu, permutation)``, its
    LU; up to :data:`GAUSS_JORDAN_MAX` unknowns ``(a⁻¹, None)``."""
    a = factorable(_sharding.gathered(a))
    if a.shape[-1] <= GAUSS_JORDAN_MAX:
        return inverse(a), None
    lu, _, permutation = jax.lax.linalg.lu(a)
    return lu, permutation


def factor_solve(a, b):
    """``(a⁻¹ b, factors)``: one solve, and the factors of ``a`` for more
    (:func:`with_permutation` makes them :func:`factor`'s). The LU is that of the augmented
    ``[a | b]``: LAPACK applies its row interchanges to ``b`` as it eliminates, so that
    column comes back as ``L⁻¹ P b`` and one triangular solve ends the solve, without the
    permutation, which on CPU is formed from the pivots by a loop of ``n`` small steps
    (4.6 of 16.8 µs per solve at n = 64 in a ``while_loop``; the augmented solve: 11.8).
    ``factors``: ``(lu, pivots)``; up to :data:`GAUSS_JORDAN_MAX` unknowns
    ``(a⁻¹, None)``."""
    a = factorable(_sharding.gathered(a))
    n = a.shape[-1]
    if n <= GAUSS_JORDAN_MAX:
        factors = inverse(a), None
        return solve(factors, b), factors
    augmented = jnp.concatenate([a, _sharding.gathered(b)[:, None].astype(a.dtype)], axis=-1)
    lu, pivots, _ = jax.lax.linalg.lu(augmented)
    x = jax.lax.linalg.triangular_solve(lu[:, :n], lu[:, n:], left_side=True, lower=False)
    return _like(x[:, 0], b), (lu[:, :n], pivots)


def with_permutation(factors):
    """:func:`factor_solve`'s ``(lu, pivots)`` as :func:`factor`'s ``(lu, permutation)``
    (the inverse form passes through)."""
    lu, pivots = factors
    if pivots is None:
        return factors
    return lu, jax.lax.linalg.lu_pivots_to_permutation(pivots, lu.shape[-1])


def solve(factors, b):
    """``a⁻¹ b`` for the ``factors`` of ``a`` (:func:`factor`); ``b`` a vector."""
    lu, permutation = factors
    if permutation is None:  # the inverse
        return iteration_solve((lu,), b)
    rhs = _sharding.gathered(b)[permutation.astype("int32"), None].astype(lu.dtype)
    y = jax.lax.linalg.triangular_solve(lu, rhs, left_side=True, lower=True,
                                        unit_diagonal=True)
    x = jax.lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)[:, 0]
    return _like(x, b)


def solve_transpose(factors, b):
    """``a⁻ᵀ b`` for the ``factors`` of ``a`` (:func:`factor`); ``b`` a vector.

    With ``p a = l u``: ``aᵀ = uᵀ lᵀ p``, so ``aᵀ x = b`` is ``uᵀ y = b``, ``lᵀ z = y``,
    ``x = pᵀ z``.
    """
    lu, permutation = factors
    if permutation is None:  # the inverse
        return iteration_solve((lu.T,), b)
    y = jax.lax.linalg.triangular_solve(lu, _sharding.gathered(b)[:, None].astype(lu.dtype),
                                        left_side=True, lower=False, transpose_a=True)
    z = jax.lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True,
                                        unit_diagonal=True)[:, 0]
    x = jnp.zeros_like(z).at[permutation.astype("int32")].set(z)
    return _like(x, b)


def iteration_factor(a):
    """The factors of an iteration matrix ``a`` for :func:`iteration_solve`, every leaf
    floating (a multistep cache is differentiated through): ``(a⁻¹,)`` for up to
    :data:`INVERSE_MAX` unknowns, else the LU factors and the permutation (as floats)."""
    lu, permutation = factor(a)
    if permutation is None:  # (already the inverse: Gauss–Jordan)
        return (lu,)
    if a.shape[-1] <= INVERSE_MAX:
        eye = jnp.eye(a.shape[-1], dtype=lu.dtype)[permutation]
        y = jax.lax.linalg.triangular_solve(lu, eye, left_side=True, lower=True,
                                            unit_diagonal=True)
        return (jax.lax.linalg.triangular_solve(lu, y, left_side=True, lower=False),)
    return lu, permutation.astype(lu.dtype)


def iteration_solve(factors, b):
    """``a⁻¹ b`` for ``factors = iteration_factor(a)``; ``b`` a vector."""
    if len(factors) == 1:
        x = _sharding.matmul(factors[0], _sharding.gathered(b).astype(factors[0].dtype))
        return _like(x, b)
    return solve(factors, b)
