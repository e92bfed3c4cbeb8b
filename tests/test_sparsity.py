"""``jac_sparsity="auto"``: the Jacobian's pattern read from the function's jaxpr
(solvers/_sparsity.py). The patterns are checked against Jacobians at random points (a
pattern may never miss a nonzero) and against the known structure where it is exact; the
solvers are checked to build the same program as with the pattern given by hand."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import solvers
from solvers._sparsity import jacobian_pattern

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks._brusselator import brusselator, brusselator_y0  # noqa: E402


@functools.cache
def _jacobian(f):
    """``jax.jacfwd(f)``, jitted once per function (eagerly, each of its operations was
    compiled on its own, for every function and point)."""
    return jax.jit(jax.jacfwd(f))


def _jac_nonzeros(f, x, *args, points=3):
    """Where the Jacobian is nonzero at any of a few random points (float64 NumPy)."""
    with jax.enable_x64(True):
        nz = 0
        for seed in range(points):
            xr = np.random.default_rng(seed).normal(size=np.shape(x))
            J = _jacobian(f)(xr, *args)
            nz = nz | (np.asarray(J).reshape(np.size(J) // np.size(x), np.size(x)) != 0)
        return nz


def _covers(pattern, f, x, *args):
    nz = _jac_nonzeros(f, x, *args)
    missing = nz & ~pattern.toarray()
    assert not missing.any(), f"pattern misses entries at {np.argwhere(missing)}"


def test_brusselator_pattern_is_its_stencil():
    n = 6  # 12 states, interleaved (u_i, v_i): within the band |i - j| <= 2
    p = jacobian_pattern(brusselator, jnp.asarray(brusselator_y0(n)), 0.0, 0.02)
    _covers(p, brusselator, jnp.asarray(brusselator_y0(n)), 0.0, 0.02)
    i, j = p.nonzero()
    assert np.max(np.abs(i - j)) == 2
    # exact: every entry it has is nonzero somewhere (u-u, v-v neighbours, u-v couplings)
    nz = _jac_nonzeros(brusselator, jnp.asarray(brusselator_y0(n)), 0.0, 0.02)
    assert np.array_equal(p.toarray(), nz)


def test_both_branches_of_a_where_are_in_the_pattern():
    # At any one point only one branch's derivative is nonzero: a probe at a point (or a
    # NaN tangent) misses the other; the pattern may not.
    f = lambda y: jnp.where(y[0] > 0, y[1], y[2]) * jnp.ones(3)  # noqa: E731
    p = jacobian_pattern(f, jnp.ones(3))
    assert p.toarray()[:, 1:].all()
    g = lambda y: jax.lax.cond(y[0] > 0, lambda y: 2 * y, lambda y: jnp.roll(y, 1), y)  # noqa: E731
    # (2y, or roll(y, 1): entry (i, i - 1))
    assert np.array_equal(jacobian_pattern(g, jnp.ones(3)).toarray(),
                          np.eye(3, dtype=bool) | np.roll(np.eye(3, dtype=bool), -1, axis=1))


def test_products_with_constant_matrices_keep_their_zeros():
    A = sp.random(8, 8, density=0.2, random_state=1, format="csr") + sp.identity(8)
    dense = np.asarray(A.toarray())
    p = jacobian_pattern(lambda y: jnp.asarray(dense) @ y + jnp.eye(8) @ y ** 3, jnp.ones(8))
    assert np.array_equal(p.toarray(), dense != 0)


def test_pytrees_gathers_pads_and_reductions():
    def f(y):
        u, v = y["u"], y["v"]
        return {"a": u * v[::-1], "b": v.at[1].set(u[0]), "c": jnp.pad(u[1:], (1, 0)),
                "d": jnp.sum(u)[None] + v[jnp.array([0])]}

    y = {"u": jnp.ones(2), "v": jnp.ones(2)}
    expected = np.array([[1, 0, 0, 1], [0, 1, 1, 0],   # a = u * v[::-1]
                         [0, 0, 1, 0], [1, 0, 0, 0],   # b = v with b[1] = u[0]
                         [0, 0, 0, 0], [0, 1, 0, 0],   # c = (0, u[1])
                         [1, 1, 1, 0]], bool)          # d = u0 + u1 + v0
    assert np.array_equal(jacobian_pattern(f, y).toarray(), expected)


@settings(max_examples=10, deadline=None)
@given(shifts=st.lists(st.integers(-3, 3), min_size=1, max_size=3),
       power=st.sampled_from([1, 2, 3]), n=st.integers(5, 9))
def test_stencils_never_miss_an_entry(shifts, power, n):
    def f(y):
        out = y ** power
        for k, s in enumerate(shifts):
            out = out + (k + 1) * jnp.roll(y, s) * jnp.tanh(jnp.roll(y, -s))
        return out

    y = np.ones(n, np.float32)  # (its shape and dtype only)
    p = jacobian_pattern(f, y)
    _covers(p, f, y)
    expected = np.eye(n, dtype=bool)
    for s in shifts:
        expected |= np.roll(np.eye(n, dtype=bool), -s, axis=1) | np.roll(
            np.eye(n, dtype=bool), s, axis=1)
    assert np.array_equal(p.toarray(), expected)


def test_a_dense_result_is_refused_naming_what_was_not_followed():
    with pytest.raises(ValueError, match=r"jac_sparsity='auto'.*cumsum"):
        jacobian_pattern(jnp.cumsum, jnp.ones(8))
    with pytest.raises(ValueError, match="jac_sparsity. must be 'auto'"):
        solvers.root(lambda x: x, jnp.ones(3), jac_sparsity="band")


def test_root_auto_solves_and_differentiates_as_the_pattern_given():
    def F(x, b):  # tridiagonal: 2x_i - x_{i-1} - x_{i+1} + x_i^3 = b
        return 2 * x - jnp.pad(x[:-1], (1, 0)) - jnp.pad(x[1:], (0, 1)) + x ** 3 - b

    b = np.linspace(0.5, 1.5, 12, dtype=np.float32)
    solve = lambda b, s: solvers.root(F, jnp.zeros(12), b, jac_sparsity=s)  # noqa: E731
    # the same program as with the band given by hand
    assert str(jax.make_jaxpr(lambda b: solve(b, "auto"))(b)) == str(
        jax.make_jaxpr(lambda b: solve(b, 1))(b))

    @jax.jit  # (one program for the solve and its vjp)
    def solve_and_vjp(b):
        x, vjp = jax.vjp(lambda b: solve(b, "auto"), b)
        return x, vjp(jnp.ones(12))[0]

    x, g = (np.asarray(v, np.float64) for v in solve_and_vjp(b))
    # (F and its Jacobian at x in NumPy: tridiagonal, 2 + 3 x_i^2 on the diagonal, -1 off it)
    off = np.diag(np.ones(11), 1) + np.diag(np.ones(11), -1)
    np.testing.assert_allclose(2 * x - off @ x + x**3 - b, 0, atol=1e-4)
    # d x*/d b = J^{-1}: the gradient of sum(x*) solves J^T g = 1
    J = np.diag(2 + 3 * x**2) - off
    np.testing.assert_allclose(g, np.linalg.solve(J.T, np.ones(12)), rtol=1e-3)


def test_odeint_auto_traces_the_program_of_the_band():
    y0 = jnp.asarray(brusselator_y0(5), jnp.float32)
    ts = jnp.array([0.0, 0.1])
    for method in ("bdf", "kvaerno5"):
        def run(a, s, method=method):
            return solvers.odeint(brusselator, y0, ts, a, method=method, jac_sparsity=s)

        auto = str(jax.make_jaxpr(lambda a: run(a, "auto"))(0.02))
        given_ = str(jax.make_jaxpr(lambda a: run(a, jacobian_pattern(
            brusselator, y0, 0.0, 0.02)))(0.02))
        assert auto == given_
