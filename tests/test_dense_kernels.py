"""The small dense kernels of the stiff methods: ``implicit._lu``'s iteration-matrix
factors (an explicit inverse up to ``INVERSE_MAX`` unknowns, LU past it; by Gauss–Jordan
elimination up to ``GAUSS_JORDAN_MAX``) and
``solvers.ode._small.matmul`` (a fused product below ``FUSED_MAX``, a dot past it; under
``vmap`` the fused product is a sum of scaled rows).

Expected values come from NumPy (float64 solves and products), never from the code under
test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from implicit import _lu
from solvers.ode import _small


# The kernels under test, jitted once (module level): one program per shape and dtype,
# shared by the examples and tests that use it (the factors and both solves in one, so
# that a property test's sizes reuse the programs of the examples). Eagerly, each of their
# operations was compiled on its own.
_inverse = jax.jit(_lu.inverse)
_solve_positive_definite = jax.jit(_lu.solve_positive_definite)
_matmul = jax.jit(_small.matmul)


@jax.jit
def _factor_solves(a, b):
    """``(factor(a), a⁻¹ b, a⁻ᵀ b)`` from the factors."""
    factors = _lu.factor(a)
    return factors, _lu.solve(factors, b), _lu.solve_transpose(factors, b)


@jax.jit
def _iteration_factor_solve(a, b):
    """``(iteration_factor(a), a⁻¹ b)`` from the factors."""
    factors = _lu.iteration_factor(a)
    return factors, _lu.iteration_solve(factors, b)


@jax.jit
def _factor_solve_forms(a, b, c, bs):
    """factor_solve's ``a⁻¹ b``; its factors with the permutation formed, solving and
    transpose-solving ``c``; factor_solve batched (vmap) over the rows of ``bs``."""
    x, factors = _lu.factor_solve(a, b)
    factors = _lu.with_permutation(factors)
    xs = jax.vmap(lambda v: _lu.factor_solve(a, v)[0])(bs)
    return x, _lu.solve(factors, c), _lu.solve_transpose(factors, c), xs


def _matrix(n, seed, dominance=3.0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n)) / np.sqrt(n) + dominance * np.eye(n)


@pytest.mark.parametrize("n", [1, 3, _lu.INVERSE_MAX, _lu.INVERSE_MAX + 6])
def test_iteration_factor_solves_like_numpy(x64, n):
    a = _matrix(n, n)
    b = np.random.default_rng(n + 1).standard_normal(n)
    factors, x = _iteration_factor_solve(a, b)
    # An inverse (one factor) up to INVERSE_MAX, the LU and its permutation past it;
    # every leaf floating (bdf's cache is differentiated through).
    assert len(factors) == (1 if n <= _lu.INVERSE_MAX else 2)
    assert all(jnp.issubdtype(f.dtype, jnp.floating) for f in factors)
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a, b), rtol=1e-12, atol=1e-12)


def test_iteration_factor_needs_a_pivot(x64):
    # A zero leading entry: the inverse comes from the pivoted LU, not a plain elimination.
    a = np.array([[0.0, 2.0, 1.0], [1.0, 1.0, 0.0], [3.0, 0.0, 1.0]])
    b = np.array([1.0, 2.0, 3.0])
    _, x = _iteration_factor_solve(a, b)
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a, b), rtol=1e-13)


def _needs_pivots(n, seed):
    """A well-conditioned matrix whose unpivoted elimination breaks down: a zero leading
    entry, and a tiny first pivot after the leading rows are swapped back."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    a = np.roll(q, 1, axis=0)
    a[0, 0] = 0.0 if n > 1 else 1.0
    return a


@pytest.mark.parametrize("n", range(1, _lu.GAUSS_JORDAN_MAX + 1))
def test_gauss_jordan_inverse_like_numpy(x64, n):
    """_lu.inverse (unrolled Gauss–Jordan) against NumPy's inverse, on matrices that need
    their pivots (an unpivoted elimination divides by 0 or by 1e-20)."""
    mats = [_matrix(n, n), _needs_pivots(n, n), _matrix(n, n + 1, dominance=0.0)]
    if n == 2:
        mats.append(np.array([[1e-20, 1.0], [1.0, 1.0]]))
    for a in mats:
        inv = np.asarray(_inverse(jnp.asarray(a)))
        ref = np.linalg.inv(a)
        tol = 1e-14 * np.linalg.cond(a) * np.max(np.abs(ref))
        np.testing.assert_allclose(inv, ref, rtol=0, atol=tol)


def test_gauss_jordan_singular_is_not_finite(x64):
    # As an LU's solves: a matrix whose elimination meets an exactly zero pivot gives
    # non-finite entries, never a number.
    for a in (np.zeros((3, 3)), np.array([[1.0, 2.0], [2.0, 4.0]]),
              np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 1.0, 1.0]])):
        assert not np.all(np.isfinite(np.asarray(_inverse(jnp.asarray(a)))))


def test_gauss_jordan_under_vmap_and_jvp(x64):
    mats = np.stack([_needs_pivots(3, s) + 0.1 * s * np.eye(3) for s in range(4)])
    a, da = mats[1], np.random.default_rng(5).standard_normal((3, 3))
    inv, (_, tangent) = jax.jit(  # (one program for both)
        lambda mats, a, da: (jax.vmap(_lu.inverse)(mats), jax.jvp(_lu.inverse, (a,), (da,)))
    )(mats, a, da)
    np.testing.assert_allclose(np.asarray(inv), np.linalg.inv(mats), atol=1e-13)
    # d(A⁻¹) = -A⁻¹ dA A⁻¹ (the closed form).
    ai = np.linalg.inv(a)
    np.testing.assert_allclose(np.asarray(tangent), -ai @ da @ ai, atol=1e-12)


@pytest.mark.parametrize("accelerator", [False, True])
def test_batched_inverses_like_numpy(x64, accelerator, monkeypatch):
    """_lu.inverses (on CPU the LU of [a | I], no permutation formed; on an accelerator
    jnp.linalg.inv: the blocks of jac_sparsity's cyclic reduction) against NumPy,
    batched, on blocks that need their pivots; its jvp against the closed form
    -A⁻¹ dA A⁻¹, its gradient (reverse mode through the custom jvp) against float64
    central differences; a singular block gives non-finite entries (that block only)."""
    from implicit import _sharding

    monkeypatch.setattr(_sharding, "on_accelerator", lambda: accelerator)
    mats = np.stack([_needs_pivots(4, s) + 0.1 * s * np.eye(4) for s in range(3)]
                    + [_matrix(4, 7, dominance=0.0)])
    da = np.random.default_rng(3).standard_normal(mats.shape)
    w = np.random.default_rng(4).standard_normal(mats.shape)
    sing = mats.copy()
    sing[1] = np.array([[1.0, 2.0, 3.0, 4.0]] * 4)

    def loss(m):
        return jnp.sum(jnp.asarray(w) * _lu.inverses(m))

    inv, (_, tangent), grad, inv_sing = jax.jit(
        lambda m, dm, s: (_lu.inverses(m), jax.jvp(_lu.inverses, (m,), (dm,)),
                          jax.grad(loss)(m), _lu.inverses(s)))(mats, da, sing)
    ref = np.linalg.inv(mats)
    np.testing.assert_allclose(np.asarray(inv), ref, atol=1e-12)
    np.testing.assert_allclose(np.asarray(tangent), -ref @ da @ ref, atol=1e-11)
    eps, fd = 1e-6, np.zeros_like(mats)
    for idx in np.ndindex(mats.shape):
        e = np.zeros_like(mats)
        e[idx] = eps
        up, down = np.linalg.inv(mats + e), np.linalg.inv(mats - e)
        fd[idx] = np.sum(w * (up - down)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(grad), fd, rtol=1e-6, atol=1e-7)
    inv_sing = np.asarray(inv_sing)
    assert not np.all(np.isfinite(inv_sing[1]))
    np.testing.assert_allclose(np.delete(inv_sing, 1, 0), np.delete(ref, 1, 0), atol=1e-12)


@pytest.mark.parametrize("n", [2, _lu.GAUSS_JORDAN_MAX, _lu.GAUSS_JORDAN_MAX + 1])
def test_factor_solve_both_forms(x64, n):
    """_lu.factor is the inverse up to GAUSS_JORDAN_MAX unknowns, the LU past it; solve
    and solve_transpose agree with NumPy either way, on a matrix that needs pivots."""
    a = _needs_pivots(n, 3)
    b = np.random.default_rng(4).standard_normal(n)
    factors, x, x_transpose = _factor_solves(a, b)
    assert (factors[1] is None) == (n <= _lu.GAUSS_JORDAN_MAX)
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a, b), atol=1e-13)
    np.testing.assert_allclose(np.asarray(x_transpose), np.linalg.solve(a.T, b), atol=1e-13)


@pytest.mark.parametrize("n", [2, 5, 17, 64])
def test_factor_solve_like_numpy(x64, n):
    """_lu.factor_solve (the LU of [a | b]: no permutation formed) against NumPy, on a
    matrix that needs its pivots; its factors, with the permutation formed
    (with_permutation), solve and transpose-solve other right-hand sides."""
    a = _needs_pivots(n, n)
    b, c = np.random.default_rng(n).standard_normal((2, n))
    bs = np.random.default_rng(n + 1).standard_normal((3, n))
    x, x_c, x_c_transpose, xs = _factor_solve_forms(a, b, c, bs)
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a, b), atol=1e-12)
    np.testing.assert_allclose(np.asarray(x_c), np.linalg.solve(a, c), atol=1e-12)
    np.testing.assert_allclose(np.asarray(x_c_transpose), np.linalg.solve(a.T, c), atol=1e-12)
    # Batched (vmap), as under a vmapped root.
    np.testing.assert_allclose(np.asarray(xs), np.linalg.solve(a, bs.T).T, atol=1e-12)


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, _lu.GAUSS_JORDAN_MAX), seed=st.integers(0, 2**31 - 1))
def test_gauss_jordan_residual_property(n, seed):
    # Any (not diagonally dominant) Gaussian matrix: the solve's residual is at rounding
    # level relative to |a| |x| (partial pivoting).
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        a = rng.standard_normal((n, n))
        b = rng.standard_normal(n)
        x = np.asarray(_factor_solves(a, b)[1])
    assert np.max(np.abs(a @ x - b)) <= 1e-13 * np.linalg.cond(a) * (
        1 + np.max(np.abs(a)) * np.max(np.abs(x)))


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 2**31 - 1), rank=st.integers(1, 8))
def test_solve_positive_definite_property(n, seed, rank):
    # Anderson's systems: a Gram matrix G Gᵀ (rank-deficient when the history is longer
    # than the residuals are independent) plus a small relative ridge, positive definite;
    # its solve (unpivoted elimination) against NumPy's, to the conditioning.
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        g = rng.standard_normal((n, min(rank, n)))
        a = g @ g.T + 1e-6 * np.max(np.diag(g @ g.T)) * np.eye(n)
        b = rng.standard_normal(n)
        x = np.asarray(_solve_positive_definite(jnp.asarray(a), jnp.asarray(b)))
    ref = np.linalg.solve(a, b)
    assert np.max(np.abs(x - ref)) <= 1e-14 * np.linalg.cond(a) * np.max(np.abs(ref))


def test_solve_positive_definite_zero_pivot_is_not_finite(x64):
    a = np.array([[1.0, 2.0], [2.0, 4.0]])  # G Gᵀ of rank 1, no ridge
    x = np.asarray(_solve_positive_definite(a, np.ones(2)))
    assert not np.all(np.isfinite(x))


@pytest.mark.parametrize("n", [1, 3, 17])
def test_solve_transpose_like_numpy(x64, n):
    """_lu.solve_transpose: aᵀ x = b from a's LU, against NumPy; the second matrix needs
    its pivots (a zero leading entry), so a dropped or inverted permutation fails."""
    for a in (_matrix(n, n + 7), np.roll(_matrix(n, n + 8, dominance=0.0) + np.eye(n), 1, 0)):
        if n == 1:
            a = np.array([[2.5]])
        b = np.random.default_rng(n).standard_normal(n)
        x = _factor_solves(a, b)[2]
        np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a.T, b), rtol=1e-11,
                                   atol=1e-12)


def test_iteration_solve_float32_keeps_full_precision():
    # float32: the product is not left to a reduced-precision matmul (TF32 on GPUs).
    a = _matrix(8, 0).astype(np.float32)
    b = np.arange(1.0, 9.0, dtype=np.float32)
    _, x = _iteration_factor_solve(a, b)
    assert x.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a.astype(np.float64), b),
                               rtol=2e-5)


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_iteration_solve_residual_property(n, seed):
    # Diagonally dominant matrices: the residual of the solve is at rounding level.
    with jax.enable_x64(True):
        a = _matrix(n, seed)
        b = np.random.default_rng(seed + 1).standard_normal(n)
        x = np.asarray(_iteration_factor_solve(a, b)[1])
    assert np.max(np.abs(a @ x - b)) <= 1e-12 * (1 + np.max(np.abs(b)))


@pytest.mark.parametrize("shape", [((6, 6), (6, 3)), ((5, 5), (5, 64)), ((6, 6), (6, 65)),
                                   ((8, 8), (8, 2000)), ((6,), (6, 3)), ((3, 4), (4,)),
                                   ((12,), (12, 200))])
def test_small_matmul_matches_numpy(x64, shape):
    (sa, sb) = shape
    rng = np.random.default_rng(len(sa) * 10 + sb[-1])
    A, B = rng.standard_normal(sa), rng.standard_normal(sb)
    out = _matmul(A, B)
    assert out.shape == (A @ B).shape
    np.testing.assert_allclose(np.asarray(out), A @ B, rtol=1e-13, atol=1e-13)


def test_small_matmul_is_differentiable(x64):
    A = np.random.default_rng(0).standard_normal((5, 6))
    B = np.random.default_rng(1).standard_normal((6, 3))
    g = jax.jit(jax.grad(lambda B: jnp.sum(_small.matmul(A, B) ** 2)))(B)
    np.testing.assert_allclose(np.asarray(g), 2 * A.T @ (A @ B), rtol=1e-13)


@pytest.mark.parametrize("batched", ["A", "B", "both"])
def test_small_matmul_under_vmap(x64, batched):
    # The batched rule (a sum of k scaled rows, not the reduction XLA:CPU hands to
    # YNNPACK): the same products, either operand or both batched, and under two vmaps.
    rng = np.random.default_rng(3)
    A, B = rng.standard_normal((7, 6, 4)), rng.standard_normal((7, 4, 3))
    axes = {"A": (0, None), "B": (None, 0), "both": (0, 0)}[batched]
    a, b = (A if axes[0] == 0 else A[0]), (B if axes[1] == 0 else B[0])
    out = jax.jit(jax.vmap(_small.matmul, in_axes=axes))(a, b)
    expected = np.einsum("...ij,...jk->...ik", a, b) if batched == "both" else (
        np.einsum("bij,jk->bik", a, b) if batched == "A" else np.einsum("ij,bjk->bik", a, b))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-13, atol=1e-13)
    nested = jax.jit(jax.vmap(jax.vmap(_small.matmul)))(A.reshape(7, 1, 6, 4),
                                                        B.reshape(7, 1, 4, 3))
    np.testing.assert_allclose(np.asarray(nested).reshape(7, 6, 3),
                               np.einsum("bij,bjk->bik", A, B), rtol=1e-13, atol=1e-13)


def test_small_matmul_derivatives_under_vmap_and_broadcast_axes(x64):
    # jvp, grad and the Hessian-vector product (jacfwd of grad, vmapped over the basis) of
    # a batched product, with a leading axis of A broadcast against B's.
    rng = np.random.default_rng(4)
    A, B = rng.standard_normal((1, 5, 6)), rng.standard_normal((3, 6, 2))
    np.testing.assert_allclose(np.asarray(jax.jit(_small.matmul)(A, B)), A @ B, rtol=1e-13)
    loss = lambda B: jnp.sum(jnp.sin(jax.vmap(lambda b: _small.matmul(A[0], b))(B)))  # noqa: E731
    g = jax.jit(jax.grad(loss))(B)
    np.testing.assert_allclose(np.asarray(g), np.einsum("ij,bik->bjk", A[0], np.cos(A[0] @ B)),
                               rtol=1e-12)
    V = rng.standard_normal(B.shape)
    _, t = jax.jit(lambda B, V: jax.jvp(loss, (B,), (V,)))(B, V)
    np.testing.assert_allclose(float(t), np.sum(np.cos(A[0] @ B) * (A[0] @ V)), rtol=1e-12)
    H = jax.jit(jax.hessian(loss))(B).reshape(B.size, B.size)
    hv = H @ V.ravel()
    expected = np.einsum("ij,bik->bjk", A[0], -np.sin(A[0] @ B) * (A[0] @ V)).ravel()
    np.testing.assert_allclose(hv, expected, rtol=1e-11, atol=1e-12)
