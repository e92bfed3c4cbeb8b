"""solvers._sparse: colouring, block cyclic reduction and block LU, their transposes
(issue 15, jac_sparsity).

Expected values: jax.jacfwd (the dense Jacobian, an independent computation of every
entry) and numpy.linalg.solve on the dense matrix; never the structured code itself.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers import _sparse
from solvers._sparse import Structure, structure


def _random_problem(rng, n, density):
    P = rng.random((n, n)) < density
    full = P | P.T | np.eye(n, dtype=bool)
    W = rng.standard_normal((n, n)) * full
    return P, W


def _check_colouring(P, W, x):
    n = P.shape[0]

    def f(v):
        return W @ jnp.sin(v) + v**2 * jnp.cos(v[::-1])[0]  # the last term: column 0 dense

    # The pattern must cover f's Jacobian: f's term through v[-1] touches every row.
    P = P.copy()
    P[:, n - 1] = True
    s = structure(P, n)
    # (one program: eagerly, each of their operations was compiled on its own, per pattern)
    got, want = jax.jit(lambda x: (s.dense(s.jacobian(f, x)), jax.jacfwd(f)(x)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    # No two columns of one colour share a row of the (symmetrised) pattern.
    full = P | P.T | np.eye(n, dtype=bool)
    perm = s.perm
    for c in range(s.num_colors):
        cols = perm[s.colors == c]
        assert np.all(full[:, cols].sum(axis=1) <= 1)
    return s


def test_colouring_exact_random_patterns(x64):
    rng = np.random.default_rng(0)
    for n, density in [(1, 0.5), (2, 0.5), (17, 0.1), (60, 0.03), (45, 0.3)]:
        P, W = _random_problem(rng, n, density)
        _check_colouring(P, W, jnp.asarray(rng.standard_normal(n)))


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, 40), density=st.floats(0.0, 0.4), seed=st.integers(0, 2**31 - 1))
def test_colouring_exact_hypothesis(n, density, seed):
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        P, W = _random_problem(rng, n, density)
        _check_colouring(P, W, jnp.asarray(rng.standard_normal(n)))


def test_band_colours_and_width():
    s = structure(2, 100)
    assert (s.bandwidth, s.num_colors) == (2, 5)
    assert structure(0, 7).num_colors == 1
    # A banded pattern given as a SciPy sparse matrix, scrambled: RCM restores the band.
    n = 50
    band = sp.diags([np.ones(n - abs(k)) for k in (-1, 0, 1)], [-1, 0, 1]).astype(bool)
    q = np.random.default_rng(1).permutation(n)
    s = structure(band.tocsr()[q][:, q], n)
    assert s.bandwidth == 1 and s.num_colors == 3


def _factors(s, A):
    """The factors of the matrix ``A`` (pattern ``s``), its Jacobian taken as the solvers
    take one. Called inside ``jax.jit`` by the tests: eagerly, each operation and loop of
    the Jacobian and the elimination was compiled on its own (310 programs for one
    hypothesis test)."""
    return s.factor(s.jacobian(lambda v: A @ v, jnp.zeros(A.shape[0], A.dtype)))


def _dense_case(rng, n, density, c):
    """``(s, W, A)``: the structure of a random pattern, its matrix ``W`` and
    ``A = I - c W`` (NumPy)."""
    P, W = _random_problem(rng, n, density)
    return structure(P, n), jnp.asarray(W), np.eye(n) - c * W


def _eye_minus_factors(s, c, W):
    """The factors of ``I - c W``, formed from ``W``'s blocks by ``eye_minus``. Called
    inside the tests' ``jax.jit``, with the solves (one program per case)."""
    return s.factor(s.eye_minus(c, s.jacobian(lambda v: W @ v, jnp.zeros(W.shape[0],
                                                                          W.dtype))))


@pytest.mark.parametrize("n,density,c", [(1, 1.0, 0.3), (30, 0.08, 0.2), (80, 0.02, 0.7),
                                         (200, 0.005, 0.1)])
def test_block_lu_solve_against_numpy(x64, n, density, c):
    rng = np.random.default_rng(n)
    s, W, A = _dense_case(rng, n, density, c)
    b = rng.standard_normal(n)

    @jax.jit
    def solves(W, b):
        factors = _eye_minus_factors(s, c, W)
        return (s.solve(factors, b), s.matvec(factors[1], b),
                s.apply_inverse(factors[0], b))

    x, ax, inv_b = solves(W, jnp.asarray(b))
    np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(ax, A @ b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(inv_b, np.linalg.solve(A, b), rtol=1e-10, atol=1e-11)


def test_transpose_solve(x64):
    """Reverse mode through the solve is the transposed solve (custom_linear_solve)."""
    rng = np.random.default_rng(3)
    n = 70
    s, W, A = _dense_case(rng, n, 0.04, 0.5)
    b = jnp.asarray(rng.standard_normal(n))
    w = rng.standard_normal(n)

    @jax.jit
    def derivatives(W, b, w):
        factors = _eye_minus_factors(s, 0.5, W)
        g = jax.grad(lambda b: jnp.dot(w, s.solve(factors, b)))(b)
        # the transpose's own code path (as a linear solve's transpose), directly
        xt = jax.linear_transpose(lambda v: s.solve(factors, v), b)(w)[0]
        # and the linear solve's tangent
        _, t = jax.jvp(lambda b: s.solve(factors, b), (b,), (w,))
        return g, xt, t

    g, xt, t = derivatives(W, b, jnp.asarray(w))
    np.testing.assert_allclose(g, np.linalg.solve(A.T, w), rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(xt, np.linalg.solve(A.T, w), rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(t, np.linalg.solve(A, w), rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("reduce_max,tail", [(0, 16), (1000, 0), (1000, 16), (1000, 10**6)])
@pytest.mark.parametrize("n,w", [(1, 0), (7, 1), (61, 2),
                                 pytest.param(200, 5, marks=pytest.mark.slow), (130, 20)])
def test_both_eliminations_against_numpy(x64, monkeypatch, reduce_max, tail, n, w):
    """Block LU (scan) and cyclic reduction (down to 1 block, to 16 unknowns, or none:
    all dense), for odd and even block counts: solve, transposed solve and jvp against
    NumPy on a nonsymmetric band with an unpivoted-LU-hostile (zero) leading entry."""
    monkeypatch.setattr(_sparse, "REDUCE_MAX_BLOCK", reduce_max)
    monkeypatch.setattr(_sparse, "DENSE_TAIL", tail)
    rng = np.random.default_rng(n + w)
    offsets = list(range(-min(w, n - 1), min(w, n - 1) + 1))
    W = sp.diags([rng.standard_normal(n - abs(k)) for k in offsets], offsets).toarray()
    A = np.eye(n) - 0.3 * W
    A[0, 0] = 0.0  # partial pivoting inside the first block is needed (when w > 0)
    if n == 1:
        A[0, 0] = 2.0
    s = Structure(w, n)
    b = rng.standard_normal(n)

    @jax.jit
    def solve_and_transpose(A, b):
        factors = _factors(s, A)
        g = jax.grad(lambda v: jnp.dot(b, s.solve(factors, v)))(jnp.zeros(n))
        return s.solve(factors, b), g

    x, g = solve_and_transpose(jnp.asarray(A), jnp.asarray(b))
    np.testing.assert_allclose(x, np.linalg.solve(A, b), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(g, np.linalg.solve(A.T, b), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("reduce_max", [0, 1000])
def test_singular_block_gives_nonfinite(x64, monkeypatch, reduce_max):
    """A singular diagonal block (no pivoting across blocks) is never a silent wrong
    answer: the solve is not finite (the callers' failure signal)."""
    monkeypatch.setattr(_sparse, "REDUCE_MAX_BLOCK", reduce_max)
    n = 40
    A = np.eye(n)
    A[4:8, 4:8] = 0.0  # the second diagonal block (B = 4, the given order) is zero...
    A[4:8, 8:12] = A[8:12, 4:8] = np.eye(4)  # ...but A is nonsingular
    assert abs(np.linalg.det(A)) > 0.5
    s = Structure(4, n)
    assert (s.block, s._identity) == (4, True)
    x = jax.jit(lambda A: s.solve(_factors(s, A), jnp.ones(n)))(jnp.asarray(A))
    assert not np.all(np.isfinite(np.asarray(x)))


@settings(max_examples=5, deadline=None)  # (each example compiles its own shapes)
@given(st.integers(1, 90), st.integers(0, 6), st.integers(0, 2**31 - 1))
def test_solve_property_diagonally_dominant(n, w, seed):
    """For block diagonally dominant bands (the stability class), the residual of the
    solve is at rounding level whatever the size, band and blocking."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        offsets = list(range(-min(w, n - 1), min(w, n - 1) + 1))
        W = sp.diags([rng.uniform(-1, 1, n - abs(k)) for k in offsets], offsets).toarray()
        A = W + np.diag(np.abs(W).sum(1) + 1.0)
        s = Structure(w, n)
        b = rng.standard_normal(n)
        x = np.asarray(jax.jit(lambda A, b: s.solve(_factors(s, A), b))(jnp.asarray(A),
                                                                         jnp.asarray(b)))
        assert np.max(np.abs(A @ x - b)) <= 1e-12 * (1 + np.max(np.abs(b)))


def test_large_band_solve_under_jit(x64):
    """n = 3000, half-width 3: O(n B) memory, matches a direct sparse solve. (The
    operator is applied by its diagonals: a dense (n, n) matrix closed over would be a
    72 MB constant compiled into the program.)"""
    n = 3000
    rng = np.random.default_rng(5)
    d = rng.standard_normal((7, n))
    offsets = list(range(-3, 4))
    Wsp = sp.diags([d[k + 3][: n - abs(k)] for k in offsets], offsets).tocsr()
    # coef[k][i] = W[i, i + k] (0 outside the matrix)
    coef = jnp.asarray(np.stack([np.pad(d[k + 3][: n - abs(k)], (max(-k, 0), max(k, 0)))
                                 for k in offsets]))

    def matvec(v):
        pad = jnp.pad(v, 3)
        return sum(coef[k + 3] * pad[3 + k: 3 + k + n] for k in offsets)

    x = jnp.asarray(rng.standard_normal(n))
    np.testing.assert_allclose(jax.jit(matvec)(x), Wsp @ np.asarray(x), rtol=1e-12,
                               atol=1e-12)  # (one program, not one per operation)
    s = structure(3, n)
    run = jax.jit(lambda b: s.solve(s.factor(s.eye_minus(0.1, s.jacobian(matvec, b))), b))
    A = (sp.eye(n) - 0.1 * Wsp).tocsc()
    np.testing.assert_allclose(run(x), sp.linalg.spsolve(A, np.asarray(x)), rtol=1e-9,
                               atol=1e-10)


def test_hashable_static():
    a, b = structure(np.eye(4, dtype=bool), 4), structure(0, 4)
    assert a == b and hash(a) == hash(b)
    assert structure(1, 4) != a
    assert structure(None, 4) is None
    assert structure(a, 4) is a


def test_a_pattern_is_prepared_once():
    # The reordering and colouring run once per pattern, whatever form it comes in; a
    # stored False entry is not part of the pattern.
    dense = np.eye(50, k=1, dtype=bool) | np.eye(50, dtype=bool)
    first = structure(dense, 50)
    assert structure(sp.csr_matrix(dense), 50) is first
    stored_false = sp.csr_matrix(dense)
    stored_false[0, 49] = False  # an explicit zero in the CSR data
    assert stored_false.nnz == first.n * 2 - 1 + 1
    assert structure(stored_false, 50) is first
    assert structure(np.eye(50, dtype=bool), 50) is not first


@pytest.mark.parametrize("bad,err,match", [
    (True, TypeError, "int .* or a boolean"),
    (-1, ValueError, "half-width must be >= 0"),
    (np.ones((3, 4), bool), ValueError, r"shape \(4, 4\)"),
    (np.ones((4, 4)), TypeError, "boolean array"),
    (np.ones(4, bool), ValueError, r"shape \(4, 4\)"),
])
def test_validation(bad, err, match):
    with pytest.raises(err, match=match):
        Structure(bad, 4)


def test_traced_pattern_refused():
    with pytest.raises(TypeError, match="must be concrete"):
        jax.jit(lambda p: Structure(p, 3))(jnp.eye(3, dtype=bool))


def test_doctests():
    failures, tried = doctest.testmod(_sparse)
    assert tried > 0 and failures == 0
