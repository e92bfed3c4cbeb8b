"""Models from the libraries JAX users hold them in (issue 38 item 5): an Equinox module
and a Flax NNX module passed to the solvers as arguments (array leaves differentiated,
their activation functions and static fields passed through), under ``jax.jit``,
``eqx.filter_jit``/``nnx.jit`` and ``jax.grad``/``nnx.grad``; the gradients against
float64 central differences of the same solve with the weights closed over."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import solvers

TS = np.array([0.0, 0.5, 1.0])
Y0 = np.array([1.0, 0.5])


def _central(loss, w, h=1e-6):
    """Central differences of ``loss(w)`` (float64 NumPy) in every entry of ``w``."""
    w = np.asarray(w, np.float64)
    g = np.zeros_like(w)
    for i in np.ndindex(w.shape):
        e = np.zeros_like(w)
        e[i] = h
        g[i] = (loss(w + e) - loss(w - e)) / (2 * h)
    return g


def _plain_field(y, t, w, b):
    return jnp.tanh(w @ y + b)


@jax.jit  # (defined once: one program for every test's differences)
def _closed_solve(w, bias):
    return jnp.sum(solvers.odeint(_plain_field, jnp.asarray(Y0), jnp.asarray(TS), w, bias,
                                  rtol=1e-10, atol=1e-10)[-1])


def _closed_loss(bias):
    """The same solve with plain arrays, field tanh(W y + b): a function of W."""
    return lambda w: float(_closed_solve(jnp.asarray(w), jnp.asarray(bias)))


def _mlp_field(y, t, m):
    return m(y)


def test_equinox_module_as_odeint_args(x64):
    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    model = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a,
                         model)

    def field(y, t, m):
        return jnp.tanh(m(y))

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(m):
        return jnp.sum(solvers.odeint(field, jnp.asarray(Y0), jnp.asarray(TS), m,
                                      rtol=1e-10, atol=1e-10)[-1])

    g = grad(model)
    expected = _central(_closed_loss(np.asarray(model.bias)), model.weight)
    np.testing.assert_allclose(g.weight, expected, rtol=1e-5, atol=1e-8)

    # An eqx.nn.MLP (its activation a leaf that is a function) in a jitted optax step.
    mlp = eqx.nn.MLP(2, 2, 4, 1, activation=jnp.tanh, key=jax.random.key(1))
    mlp = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, mlp)
    opt = optax.sgd(0.1)

    def loss(m):
        return jnp.sum(solvers.odeint(_mlp_field, jnp.asarray(Y0), jnp.asarray(TS), m)[-1] ** 2)

    @eqx.filter_jit
    def step(m, state):
        value, g = eqx.filter_value_and_grad(loss)(m)
        updates, state = opt.update(g, state)
        return eqx.apply_updates(m, updates), state, value

    state = opt.init(eqx.filter(mlp, eqx.is_inexact_array))
    _, _, v0 = step(mlp, state)
    m1, state, _ = step(*step(mlp, state)[:2])
    assert float(step(m1, state)[2]) < float(v0)  # loss(m1), from the same program


def test_flax_nnx_module_as_args(x64):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0), param_dtype=jnp.float64)

    def field(y, t, m):
        return jnp.tanh(m(y))

    def loss(m):
        return jnp.sum(solvers.odeint(field, jnp.asarray(Y0), jnp.asarray(TS), m,
                                      rtol=1e-10, atol=1e-10)[-1])

    expected = _central(_closed_loss(np.asarray(model.bias[...])),
                        np.asarray(model.kernel[...]).T)
    # the module itself as the argument, under nnx.jit and nnx.grad
    g = nnx.jit(nnx.grad(loss))(model)
    np.testing.assert_allclose(np.asarray(g.kernel[...]).T, expected, rtol=1e-5, atol=1e-8)
    # the functional split: a State of arrays, merged inside f, under jax.jit
    graphdef, params = nnx.split(model)

    def field_split(y, t, p):
        return jnp.tanh(nnx.merge(graphdef, p)(y))

    g = jax.jit(jax.grad(lambda p: jnp.sum(solvers.odeint(
        field_split, jnp.asarray(Y0), jnp.asarray(TS), p, rtol=1e-10, atol=1e-10)[-1])))(params)
    np.testing.assert_allclose(np.asarray(g["kernel"][...]).T, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", ["fixed_point", "root"])
def test_flax_nnx_layer_equilibrium(kind, x64):
    # x* = 0.5 tanh(W x* + b) + 0.1: d sum(x*)/d b against central differences
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(2), param_dtype=jnp.float64)

    def solve(m):
        if kind == "fixed_point":
            return solvers.fixed_point(lambda x, m: 0.5 * jnp.tanh(m(x)) + 0.1, jnp.zeros(2), m)
        return solvers.root(lambda x, m: 0.5 * jnp.tanh(m(x)) + 0.1 - x, jnp.zeros(2), m)

    g = nnx.jit(nnx.grad(lambda m: jnp.sum(solve(m))))(model)
    W = np.asarray(model.kernel[...])

    def closed(b):
        x = np.zeros(2)
        for _ in range(200):
            x = 0.5 * np.tanh(x @ W + b) + 0.1
        return float(np.sum(x))

    expected = _central(closed, np.asarray(model.bias[...]))
    np.testing.assert_allclose(g.bias[...], expected, rtol=1e-6, atol=1e-9)
