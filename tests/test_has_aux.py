"""``has_aux=True`` for root, fixed_point and least_squares (as minimize's): the function
returns ``(value, aux)``; the solve uses the value, ``aux`` at the solution is returned
(after ``x*``, before ``info``) and is differentiable through ``x*`` by the implicit
function theorem. Expected values are closed forms or float64 central differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers


def cube_root(x, a):  # x* = a^(1/3); aux x*² = a^(2/3)
    return x**3 - a, {"square": x**2}


def test_root_returns_aux_at_the_root_and_its_gradient(x64):
    a = jnp.array([8.0, 27.0])
    x, aux = solvers.root(cube_root, jnp.ones(2), a, has_aux=True)
    np.testing.assert_allclose(x, [2.0, 3.0], rtol=1e-10)
    np.testing.assert_allclose(aux["square"], [4.0, 9.0], rtol=1e-10)
    x, aux, info = solvers.root(cube_root, jnp.ones(2), a, has_aux=True, full_output=True)
    assert bool(info.converged) and info.status_name == "converged"
    # d a^(2/3) / da = (2/3) a^(-1/3), through x* (the aux is a function of x alone).
    jac = jax.jacrev(lambda a: solvers.root(cube_root, jnp.ones(2), a, has_aux=True)[1]["square"])
    # Under vmap, each element's own aux. (Both in one program.)
    batched = jax.vmap(lambda a: solvers.root(cube_root, 1.0, a, has_aux=True))
    jac_a, (xs, auxs) = jax.jit(lambda a: (jac(a), batched(a)))(a)
    np.testing.assert_allclose(jac_a, np.diag(2 / 3 * np.asarray(a) ** (-1 / 3)), rtol=1e-8)
    np.testing.assert_allclose(auxs["square"], [4.0, 9.0], rtol=1e-10)


def layer(x, a):  # x = cos(x)/2 + a; aux: the residual's parts and a (not of x)
    return 0.5 * jnp.cos(x) + a, (jnp.sin(x), a)


def test_fixed_point_returns_aux_under_jit_and_its_gradient(x64):
    x, (s, a_out) = jax.jit(lambda a: solvers.fixed_point(layer, 0.0, a, has_aux=True))(0.3)
    np.testing.assert_allclose(x, 0.5 * np.cos(x) + 0.3, rtol=1e-7)  # (rtol 1e-8)
    np.testing.assert_allclose(s, np.sin(x), rtol=1e-10)
    assert float(a_out) == 0.3

    def loss(a):
        x, (s, a_out) = solvers.fixed_point(layer, 0.0, a, has_aux=True)
        return s + a_out**2

    # Closed form: dx/da = 1 / (1 + sin(x)/2); d/da [sin(x) + a²] = cos(x) dx/da + 2a.
    expected = np.cos(x) / (1 + 0.5 * np.sin(x)) + 0.6
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(0.3), expected, rtol=1e-7)


def fit(p, y):  # residuals of p0 exp(-p1 t) against y; aux: the fitted curve
    t = jnp.arange(4.0)
    curve = p[0] * jnp.exp(-p[1] * t)
    return curve - y, curve


def test_least_squares_returns_aux_and_its_gradient(x64):
    y = jnp.array([2.0, 1.1, 0.75, 0.4])
    p, curve, info = solvers.least_squares(fit, jnp.ones(2), y, has_aux=True,
                                           full_output=True)
    assert bool(info.converged)
    np.testing.assert_allclose(curve, p[0] * np.exp(-p[1] * np.arange(4.0)), rtol=1e-12)

    def loss(y):
        return jnp.sum(solvers.least_squares(fit, jnp.ones(2), y, has_aux=True)[1] ** 2)

    g = jax.jit(jax.grad(loss))(y)
    eps = 1e-6
    loss = jax.jit(loss)  # (one program for the differences, not one per operation)
    e = np.eye(4) * eps
    fd = [(loss(y + e[i]) - loss(y - e[i])) / (2 * eps) for i in range(4)]
    np.testing.assert_allclose(g, fd, rtol=1e-6)


@pytest.mark.parametrize("solve", [
    lambda f: solvers.root(f, jnp.zeros(2), has_aux=True),
    lambda f: solvers.fixed_point(f, jnp.zeros(2), has_aux=True),
    lambda f: solvers.least_squares(f, jnp.zeros(2), has_aux=True),
])
def test_has_aux_bad_input(solve):
    with pytest.raises(ValueError, match="has_aux=True must return a pair"):
        solve(lambda x: x - 1.0)
    with pytest.raises(TypeError, match="`has_aux` must be True or False"):
        solvers.root(lambda x: x - 1.0, 0.0, has_aux="yes")
