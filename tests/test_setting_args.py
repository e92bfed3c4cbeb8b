"""Non-array leaves in a solver's ``*args`` (issue 38): an Equinox module holds its
activation function as a leaf beside its weights, and diffrax takes such a module as
``args``. Every solver binds those settings into the function (``_checks.split_args``) and
traces the arrays alone: the values and gradients are those of the same solve with the
setting closed over, and a later call with an equal setting reuses the compiled solver.
(A dict of arrays and a function is the same pytree; real Equinox and Flax NNX modules:
tests/test_interop.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers


def _field(y, t, model):
    return model["act"](model["w"] @ y)


def _field_closed(y, t, w):
    return jnp.tanh(w @ y)


W = np.array([[-1.0, 0.5], [-0.3, -0.8]])
TS = np.array([0.0, 0.5, 1.0])


def _compiles(fn):
    count = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: count.append(1)
        if event.endswith("backend_compile_duration") else None)
    fn()
    return len(count)


def test_odeint_module_with_a_function_leaf(x64):
    w0 = jnp.asarray(W)  # (float64)

    def loss(w, act=jnp.tanh):
        ys = solvers.odeint(_field, jnp.ones(2), jnp.asarray(TS), {"w": w, "act": act})
        return jnp.sum(ys**2)

    def loss_closed(w):
        return jnp.sum(solvers.odeint(_field_closed, jnp.ones(2), jnp.asarray(TS), w) ** 2)

    np.testing.assert_allclose(loss(w0), loss_closed(w0), rtol=1e-12)
    # (one program for both gradients: eagerly, their pieces were compiled one by one)
    g, g_closed = jax.jit(lambda w: (jax.grad(loss)(w), jax.grad(loss_closed)(w)))(w0)
    np.testing.assert_allclose(g, g_closed, rtol=1e-10)
    e = np.zeros((2, 2))
    e[0, 1] = 1e-6
    fd = (loss(w0 + e) - loss(w0 - e)) / (2 * e[0, 1])
    np.testing.assert_allclose(g[0, 1], fd, rtol=1e-6)
    # Another dict with the same function and new weights: nothing compiled again.
    w1 = jax.block_until_ready(2 * w0)
    assert _compiles(lambda: jax.block_until_ready(loss(w1))) == 0
    # Another function: another solver.
    assert loss(w0, jnp.sin) != loss(w0)


def test_every_solver_takes_a_string_setting():
    def cube_or_square(x, a, kind):
        return x**3 - a if kind == "cube" else x**2 - a

    np.testing.assert_allclose(solvers.root(cube_or_square, 1.0, 8.0, "cube"), 2.0, rtol=1e-5)
    np.testing.assert_allclose(solvers.root(cube_or_square, 1.0, 9.0, "square"), 3.0,
                               rtol=1e-5)
    np.testing.assert_allclose(solvers.bisection(cube_or_square, 0.0, 10.0, 8.0, "cube"), 2.0,
                               rtol=1e-5)
    g = jax.jit(jax.grad(lambda a: solvers.root(cube_or_square, 1.0, a, "cube")))(8.0)
    np.testing.assert_allclose(g, 1 / 12, rtol=1e-4)
    x = solvers.fixed_point(lambda x, a, op: op(a - x) + x, 1.0, 2.0, jnp.tanh)
    np.testing.assert_allclose(x, 2.0, rtol=1e-5)
    x = solvers.minimize(lambda x, a, kind: jnp.sum((x - a) ** 2) if kind == "l2" else 0.0,
                         jnp.zeros(2), jnp.array([1.0, 2.0]), "l2")
    np.testing.assert_allclose(x, [1.0, 2.0], rtol=1e-4)
    x = solvers.least_squares(lambda x, a, kind: (x - a) if kind == "l2" else x,
                              jnp.zeros(2), jnp.array([1.0, 2.0]), "l2")
    np.testing.assert_allclose(x, [1.0, 2.0], rtol=1e-4)


def test_an_unhashable_setting_is_named():
    with pytest.raises(TypeError, match=r"`args\[0\]\['k'\]` must be an array, a number or a "
                                        r"hashable setting"):
        solvers.root(lambda x, d: x - 1.0, 0.0, {"k": {1, 2}})
