"""root(method="newton", jac_sparsity=...): structured Newton (issue 15).

2-D Bratu problem ``-Δu = λ exp(u)`` on the unit square (5-point stencil, zero boundary
values). Expected values: SciPy's ``optimize.root`` (MINPACK hybr, its own
finite-difference Jacobian) and central finite differences of SciPy solves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.sparse as sp

import solvers

M = 12  # grid points per side (144 unknowns)
LAM = 6.0


def bratu(u, lam, m=M, xp=jnp):
    """The residual; ``xp=np`` gives the float64 NumPy function SciPy's oracle solves."""
    h = 1.0 / (m + 1)
    U = u.reshape(m, m)
    P = xp.pad(U, 1)
    lap = (4 * U - P[:-2, 1:-1] - P[2:, 1:-1] - P[1:-1, :-2] - P[1:-1, 2:]) / h**2
    return (lap - lam * xp.exp(U)).reshape(-1)


def bratu_pattern(m=M):
    eye = sp.identity(m)
    T = sp.diags([np.ones(m - 1), np.ones(m), np.ones(m - 1)], [-1, 0, 1])
    return (sp.kron(eye, T) + sp.kron(T, eye)).astype(bool).tocsr()


def scipy_solution(lam):
    sol = scipy.optimize.root(bratu, np.zeros(M * M), args=(lam, M, np), method="hybr",
                              options={"xtol": 1e-13})
    assert sol.success
    return sol.x


def test_bratu_solution_and_gradient_against_scipy(x64):
    pat = bratu_pattern()
    u, info = solvers.root(bratu, jnp.zeros(M * M), LAM, jac_sparsity=pat, rtol=1e-12,
                           atol=1e-12, full_output=True)
    assert bool(info.converged)
    np.testing.assert_allclose(u, scipy_solution(LAM), rtol=1e-9, atol=1e-10)
    w = np.linspace(0.5, 1.5, M * M)

    def loss(lam):
        return jnp.dot(jnp.asarray(w), solvers.root(bratu, jnp.zeros(M * M), lam,
                                                     jac_sparsity=pat, rtol=1e-12,
                                                     atol=1e-12))

    eps = 1e-5
    fd = (w @ scipy_solution(LAM + eps) - w @ scipy_solution(LAM - eps)) / (2 * eps)
    g = jax.jit(jax.grad(loss))(LAM)  # (one program: eagerly, its pieces one by one)
    assert abs(float(g) - fd) / abs(fd) < 1e-6, (float(g), fd)


def test_banded_pytree_and_jvp_rule(x64):
    """A pytree unknown with jac_sparsity as a band; rule='jvp' (forward-mode IFT)."""

    def G(x, b):
        v = jnp.concatenate([x["a"], x["b"]])
        pad = jnp.pad(v, 1)
        r = 3 * v - pad[:-2] - pad[2:] + v**3 - b
        return {"a": r[:5], "b": r[5:]}

    b = jnp.linspace(0.0, 2.0, 9)
    x0 = {"a": jnp.zeros(5), "b": jnp.zeros(4)}
    x = solvers.root(G, x0, b, jac_sparsity=1, rtol=1e-12, atol=1e-12)
    G_flat = jax.jit(lambda v: jnp.concatenate(list(G({"a": v[:5], "b": v[5:]}, b).values())))
    ref = scipy.optimize.root(lambda v: np.asarray(G_flat(v)), np.zeros(9), method="hybr",
                              options={"xtol": 1e-13}).x
    np.testing.assert_allclose(jnp.concatenate([x["a"], x["b"]]), ref, rtol=1e-10,
                               atol=1e-12)
    # d x / d b by the implicit function theorem: J dx = db, J = tridiag(-1, 3 + 3x², -1).
    J = np.diag(3 + 3 * ref**2) - np.eye(9, k=1) - np.eye(9, k=-1)
    db = np.cos(np.arange(9.0))
    _, t = jax.jit(lambda b, db: jax.jvp(
        lambda b: solvers.root(G, x0, b, jac_sparsity=1, rule="jvp", linear_solver="gmres",
                               rtol=1e-12, atol=1e-12), (b,), (db,)))(b, jnp.asarray(db))
    np.testing.assert_allclose(jnp.concatenate([t["a"], t["b"]]), np.linalg.solve(J, db),
                               rtol=1e-8, atol=1e-10)


def test_a_pattern_missing_entries_fails_the_gradient_and_says_why(x64):
    # Pentadiagonal F declared tridiagonal: Newton still converges on the wrong Jacobian,
    # but the adjoint solve with it misses (its residual is checked with the true one).
    def G(x, b):
        pad = jnp.pad(x, 2)
        return 3 * x - pad[1:-3] - pad[3:-1] - 0.5 * pad[:-4] - 0.5 * pad[4:] + x**3 - b

    def total(b, width):
        return solvers.root(G, jnp.zeros(50), b, jac_sparsity=width).sum()

    grad = jax.jit(jax.grad(total), static_argnums=1)  # (one program per band)
    with pytest.raises(Exception, match="jac_sparsity's structured solve; a pattern that "
                                        "misses nonzero entries"):
        jax.block_until_ready(grad(jnp.ones(50), 1))
    g = grad(jnp.ones(50), 2)  # the right band: d sum(x*)/db = J⁻ᵀ 1
    x = solvers.root(G, jnp.zeros(50), jnp.ones(50), jac_sparsity=2)
    value, jac = jax.jit(lambda x, b: (G(x, b), jax.jacfwd(G)(x, b)))(x, jnp.ones(50))
    assert float(np.max(np.abs(np.asarray(value)))) < 1e-9  # (rtol 1e-8 on the step)
    jac = np.asarray(jac)
    np.testing.assert_allclose(g, np.linalg.solve(jac.T, np.ones(50)), rtol=1e-8)


def test_jac_sparsity_errors():
    F = lambda x: x**3 - 1.0  # noqa: E731
    with pytest.raises(ValueError, match="jac_sparsity= is for method='newton'"):
        solvers.root(F, jnp.ones(3), method="broyden", jac_sparsity=0)
    with pytest.raises(ValueError, match="leave `jacobian` at 'auto'"):
        solvers.root(F, jnp.ones(3), jacobian="dense", jac_sparsity=0)
    with pytest.raises(ValueError, match=r"`jac_sparsity` must have shape \(3, 3\)"):
        solvers.root(F, jnp.ones(3), jac_sparsity=np.eye(2, dtype=bool))


def test_sparse_residual_tolerance_is_the_dense_one(x64):
    """With jac_sparsity the per-equation residual test uses the Jacobian's blocks:
    ``|J| (atol' + rtol' |x|)`` row by row, against NumPy's product of the dense Jacobian
    (jax.jacfwd) in the original order, with the automatic ``atol'`` and with
    ``x_scale``'s, on the Bratu pattern (entries of both signs)."""
    import sys

    from solvers._sparse import structure

    root_module = sys.modules["solvers.root"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(M * M))

    def F(u):  # (off-diagonal entries -1/h², diagonal 4/h² - λ exp(u) - 3u²)
        return bratu(u, LAM) - u ** 3

    s = structure(bratu_pattern(), M * M)
    blocks = s.jacobian(F, x)
    J = np.abs(np.asarray(jax.jacfwd(F)(x)))
    rtol, atol, size0 = 1e-8, 1e-10, 0.5
    scale = np.exp(rng.standard_normal(M * M))
    for x_scale in (None, scale):
        tol = (jnp.float64(rtol), jnp.float64(atol), jnp.float64(size0),
               None if x_scale is None else jnp.asarray(x_scale))
        ops = root_module._Linear(F, "sparse", 1e-10, s, tol)
        got = np.asarray(ops.residual_tolerance(x, blocks))
        top = max(np.max(np.abs(np.asarray(x))), size0)
        a = min(atol, rtol * top) if x_scale is None else atol * x_scale
        np.testing.assert_allclose(got, J @ (a + rtol * np.abs(np.asarray(x))), rtol=1e-12)
