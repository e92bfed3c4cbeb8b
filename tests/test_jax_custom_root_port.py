"""JAX's own ``lax.custom_root`` tests (``tests/custom_root_test.py``), ported to
:func:`implicit.custom_root` (issue 38 item 7: "JAX's custom_root tests pass unchanged in
spirit").

The mapping: JAX's ``custom_root(f, x0, solve, tangent_solve)`` with ``f`` closing over the
inputs is ``custom_root(residual, linear_solver=..., rule="jvp")(solver)(x0, *inputs)``
here; ``tangent_solve(g, y)`` (a solve with the linear map ``g``) is the ``linear_solver``
callable ``(matvec, b)``, closing over values of the inputs where JAX's does (a Cholesky
factor, a precomputed solution). ``rule="jvp"``: ``check_grads``' default modes are forward
and reverse, to second order, against finite differences. Slow (``check_grads`` runs
every transformation eagerly, each compiling its own programs); the same behaviours are in
the default suite through tests/test_ift.py (closures, has_aux, Hessians).
"""

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from jax.test_util import check_grads

from implicit import custom_root

pytestmark = pytest.mark.slow


def hdot(a, b):
    return jax.lax.dot(a, b, precision=jax.lax.Precision.HIGHEST)


def binary_search(func, x0, low=0.0, high=100.0):
    del x0

    def cond(state):
        low, high = state
        mid = 0.5 * (low + high)
        return (low < mid) & (mid < high)

    def body(state):
        low, high = state
        mid = 0.5 * (low + high)
        upper = func(mid) > 0
        return jnp.where(upper, low, mid), jnp.where(upper, mid, high)

    return jax.lax.while_loop(cond, body, (low, high))[0]


def newton_raphson(func, x0):
    def cond(state):
        it, _, fx, _ = state
        return (jnp.max(jnp.abs(fx)) > 1e-16) & (it < 20)

    def body(state):
        it, x, fx, dfx = state
        step = jnp.linalg.solve(dfx.reshape((-1, fx.size)), fx.ravel()).reshape(fx.shape)
        x = x - step
        return it + 1, x, func(x), jax.jacobian(func)(x)

    return jax.lax.while_loop(cond, body, (0, x0, func(x0), jax.jacobian(func)(x0)))[1]


def jacobian_solve(matvec, b):  # JAX's vector_solve / tangent_solve: J from the linear map
    J = jax.jacobian(matvec)(b).reshape(-1, b.size)
    return jnp.linalg.solve(J, b.ravel()).reshape(b.shape)


@pytest.mark.parametrize("method", [binary_search, newton_raphson], ids=lambda m: m.__name__)
def test_custom_root_scalar(x64, method):
    def residual(y, x):
        return y**2 - x**3

    @custom_root(residual, linear_solver=lambda matvec, b: b / matvec(1.0), rule="jvp")
    def solve(y0, x):
        return method(lambda y: residual(y, x), y0)

    def sqrt_cubed(x):
        return solve(1.0, x)

    value, grad = jax.value_and_grad(sqrt_cubed)(5.0)
    np.testing.assert_allclose(value, 5**1.5, rtol=1e-6)
    np.testing.assert_allclose(grad, 1.5 * 5**0.5, rtol=1e-7)
    check_grads(sqrt_cubed, (5.0,), order=2, rtol=1e-3)
    inputs = jnp.array([4.0, 5.0])
    np.testing.assert_allclose(jax.vmap(sqrt_cubed)(inputs), inputs**1.5, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(sqrt_cubed)(5.0), 5**1.5, rtol=1e-7)


def test_custom_root_vector_with_solve_closure(x64):
    def linear_solve(a, b):
        solution = jnp.linalg.solve(a, b)  # (the solver closes over it, as JAX's oracle)

        @custom_root(lambda y, a, b: hdot(a, y) - b, linear_solver=jacobian_solve,
                     rule="jvp")
        def solve(y0, a, b):
            return solution

        return solve(jnp.zeros_like(b), a, b)

    rng = np.random.default_rng(0)
    a, b = jnp.asarray(rng.standard_normal((2, 2))), jnp.asarray(rng.standard_normal(2))
    check_grads(linear_solve, (a, b), order=2, atol=1e-11)
    np.testing.assert_allclose(jax.jit(linear_solve)(a, b), np.linalg.solve(a, b),
                               rtol=1e-12)


def test_custom_root_vector_nonlinear(x64):
    def residual(x, y):  # zero if and only if x == y
        return (x - y) * (x**2 + y**2 + 1)

    @custom_root(residual, linear_solver=jacobian_solve, rule="jvp")
    def solve(x0, y):
        return newton_raphson(lambda x: residual(x, y), x0)

    def nonlinear_solve(y):
        return solve(-jnp.ones_like(y), y)

    y = jnp.asarray(np.random.default_rng(1).standard_normal((3, 1)))
    check_grads(nonlinear_solve, (y,), order=2, rtol=1e-3)
    np.testing.assert_allclose(jax.jit(nonlinear_solve)(y), y, rtol=1e-5, atol=1e-5)


def _cholesky_root(a, b, aux=None):
    factors = jsp.linalg.cho_factor(a)

    def cho_solve(matvec, rhs):  # (a closes over the factor of the differentiated a)
        return jsp.linalg.cho_solve(factors, rhs)

    @custom_root(lambda x, a, b: hdot(a, x) - b, linear_solver=cho_solve, rule="jvp",
                 has_aux=aux is not None)
    def solve(x0, a, b):
        x = jsp.linalg.cho_solve(factors, b)
        return x if aux is None else (x, aux)

    return solve(b, a, b)


def test_custom_root_with_custom_linear_solve(x64):
    rng = np.random.default_rng(2)
    a, b = jnp.asarray(rng.standard_normal((2, 2))), jnp.asarray(rng.standard_normal(2))
    expected = np.linalg.solve(a @ a.T, b)
    np.testing.assert_allclose(_cholesky_root(hdot(a, a.T), b), expected, rtol=1e-10)
    np.testing.assert_allclose(jax.jit(_cholesky_root)(hdot(a, a.T), b), expected,
                               rtol=1e-10)
    check_grads(lambda x, y: _cholesky_root(hdot(x, x.T), y), (a, b), order=2)


def test_custom_root_with_aux(x64):
    aux = {"converged": np.array(1.0), "nfev": np.array(12345.0),
           "grad": np.array([1.0, 2.0, 3.0])}
    # (the draw of the test above: a a^T's condition number 88; another draw, 1.5e4, put
    # the finite differences themselves 9e-5 off jnp.linalg.solve's exact derivatives)
    rng = np.random.default_rng(2)
    a, b = jnp.asarray(rng.standard_normal((2, 2))), jnp.asarray(rng.standard_normal(2))
    expected = np.linalg.solve(a @ a.T, b)
    x, got_aux = _cholesky_root(hdot(a, a.T), b, aux)
    x_jit, got_aux_jit = jax.jit(lambda a, b: _cholesky_root(a, b, aux))(hdot(a, a.T), b)
    np.testing.assert_allclose(x, expected, rtol=1e-10)
    np.testing.assert_allclose(x_jit, expected, rtol=1e-10)
    for k in aux:
        np.testing.assert_array_equal(got_aux_jit[k], aux[k])
    check_grads(lambda x, y: _cholesky_root(hdot(x, x.T), y, aux)[0], (a, b), order=2,
                rtol=3e-5)
    fwd_val, fwd_aux = jax.jacfwd(lambda x, y: _cholesky_root(hdot(x, x.T), y, aux),
                                  argnums=(0, 1))(a, b)
    want = jax.jacfwd(lambda x, y: jnp.linalg.solve(hdot(x, x.T), y), argnums=(0, 1))(a, b)
    for g, w in zip(fwd_val, want):
        np.testing.assert_allclose(g, w, rtol=5e-12, atol=1e-13)
    for leaf in jax.tree.leaves(fwd_aux):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
