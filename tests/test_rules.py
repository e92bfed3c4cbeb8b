"""Tests of implicit.rules: each rule against its mathematical derivative."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit import rules
from implicit.rules import (
    clip_gradient,
    debug_backward,
    log1pexp,
    with_derivative,
    x_over_1p_sqrt,
)


def _central_diff(f, x, h=1e-6):
    """Float64 NumPy central difference of a NumPy function (independent of JAX)."""
    x = np.asarray(x, dtype=np.float64)
    return (f(x + h) - f(x - h)) / (2 * h)


def _sigmoid64(x):
    x = np.asarray(x, dtype=np.float64)
    return np.exp(-np.logaddexp(0.0, -x))  # e^x / (1 + e^x), no overflow


# --------------------------------------------------------------------------------------
# log1pexp
# --------------------------------------------------------------------------------------


def test_log1pexp_matches_notebook_float32():
    x = jnp.float32(3.0)
    y = log1pexp(x)
    g = jax.grad(log1pexp)(x)
    assert y.dtype == g.dtype == jnp.float32
    assert y == np.float32(3.0485873)
    assert g == np.float32(0.95257413)
    assert jax.jit(log1pexp)(x) == y
    batched = jax.vmap(jax.jit(jax.grad(log1pexp)))(jnp.arange(3, dtype=jnp.float32))
    np.testing.assert_allclose(batched, [0.5, 0.7310586, 0.8807971], rtol=1e-6)


def test_naive_log1pexp_is_nan_where_the_rule_is_not():
    naive = lambda x: jnp.log(1.0 + jnp.exp(x))
    assert np.isnan(jax.grad(naive)(jnp.float32(100.0)))
    assert jax.grad(log1pexp)(jnp.float32(100.0)) == 1.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_log1pexp_large_arguments(dtype):
    with jax.enable_x64(dtype == "float64"):
        xs = jnp.array([100.0, 1000.0, -1000.0, -100.0], dtype=dtype)
        all_orders = lambda x: (log1pexp(x), jax.grad(log1pexp)(x), jax.grad(jax.grad(log1pexp))(x))
        values, grads, hess = jax.jit(jax.vmap(all_orders))(xs)
        assert values.dtype == grads.dtype == hess.dtype == jnp.dtype(dtype)
    tiny = float(jnp.finfo(dtype).tiny)  # XLA on CPU flushes subnormals to zero
    expected_values = np.logaddexp(0.0, np.asarray(xs, np.float64))
    np.testing.assert_allclose(values, expected_values, rtol=1e-6, atol=tiny)
    np.testing.assert_array_equal(grads[:3], [1.0, 1.0, 0.0])
    np.testing.assert_allclose(grads[3], np.exp(-100.0), rtol=1e-5, atol=tiny)
    # Second derivative e^x / (1 + e^x)^2: finite everywhere, e^-100 at x = +-100.
    np.testing.assert_allclose(
        hess, [np.exp(-100.0), 0.0, 0.0, np.exp(-100.0)], rtol=1e-5, atol=tiny
    )


def test_log1pexp_float64_against_formula_and_finite_differences(x64):
    xs = jnp.linspace(-30.0, 30.0, 13)
    assert xs.dtype == jnp.float64
    f64 = lambda x: np.logaddexp(0.0, x)
    np.testing.assert_allclose(log1pexp(xs), f64(np.asarray(xs)), rtol=1e-14)
    grads = jax.jit(jax.vmap(jax.grad(log1pexp)))(xs)
    np.testing.assert_allclose(grads, _sigmoid64(xs), rtol=1e-13, atol=1e-300)
    np.testing.assert_allclose(grads, _central_diff(f64, xs), rtol=1e-8, atol=1e-12)
    # Second derivative sigmoid(x) (1 - sigmoid(x)) = sigmoid(x) sigmoid(-x), accurate
    # to full relative precision even where 1 - sigmoid(x) cancels (x = 30).
    second = jax.jit(jax.vmap(jax.grad(jax.grad(log1pexp))))(xs)
    np.testing.assert_allclose(second, _sigmoid64(xs) * _sigmoid64(-xs), rtol=1e-12)
    # Finite differences of sigmoid where they are accurate (x <= 0), and evenness.
    neg = np.asarray(xs) <= 0
    np.testing.assert_allclose(second[neg], _central_diff(_sigmoid64, xs[neg]), rtol=1e-7)
    np.testing.assert_allclose(second, second[::-1], rtol=1e-14)


def test_log1pexp_second_derivative_float32_no_cancellation():
    x = jnp.float32(20.0)  # sigmoid(20) rounds to 1 in float32; 1 - sigmoid would be 0
    second = jax.grad(jax.grad(log1pexp))(x)
    np.testing.assert_allclose(second, np.exp(-20.0) / (1 + np.exp(-20.0)) ** 2, rtol=1e-5)


def test_log1pexp_jvp_and_arrays():
    xs = jnp.array([-2.0, 0.0, 3.0], dtype=jnp.float32)
    tangent = jnp.array([1.0, 2.0, -1.0], dtype=jnp.float32)
    y, y_dot = jax.jvp(log1pexp, (xs,), (tangent,))
    np.testing.assert_allclose(y, np.logaddexp(0.0, np.asarray(xs, np.float64)), rtol=1e-6)
    np.testing.assert_allclose(y_dot, _sigmoid64(xs) * np.asarray(tangent), rtol=1e-6)
    # Reverse mode through a vector-valued use.
    g = jax.grad(lambda x: jnp.sum(log1pexp(x)))(xs)
    np.testing.assert_allclose(g, _sigmoid64(xs), rtol=1e-6)


# --------------------------------------------------------------------------------------
# with_derivative / x_over_1p_sqrt (differentiation convention)
# --------------------------------------------------------------------------------------


def _f64(x):
    return x / (1 + np.sqrt(x))


def _df64(x):
    s = np.sqrt(x)
    return (s + 2) / (2 * (s + 1) ** 2)


def test_x_over_1p_sqrt_one_sided_derivative_at_zero():
    naive = lambda x: x / (1 + jnp.sqrt(x))
    assert np.isnan(jax.grad(naive)(0.0))
    assert jax.grad(x_over_1p_sqrt)(0.0) == 1.0
    assert jax.jit(jax.grad(x_over_1p_sqrt))(jnp.float32(0.0)) == 1.0
    _, t = jax.jvp(x_over_1p_sqrt, (0.0,), (2.0,))
    assert t == 2.0
    assert x_over_1p_sqrt.__name__ == "x_over_1p_sqrt"


def test_x_over_1p_sqrt_against_formula_and_finite_differences(x64):
    xs = jnp.array([0.0, 1e-4, 0.25, 1.0, 4.0, 100.0])
    np.testing.assert_allclose(x_over_1p_sqrt(xs), _f64(np.asarray(xs)), rtol=1e-15)
    grads = jax.jit(jax.vmap(jax.grad(x_over_1p_sqrt)))(xs)
    assert grads.dtype == jnp.float64
    np.testing.assert_allclose(grads, _df64(np.asarray(xs)), rtol=1e-14)
    # Independent check away from the boundary: finite differences of the NumPy f.
    interior = np.asarray(xs[1:])
    np.testing.assert_allclose(grads[1:], _central_diff(_f64, interior, h=1e-7), rtol=1e-6)
    # One-sided (right) finite difference at 0 tends to 1.
    h = 1e-12
    assert abs((_f64(h) - _f64(0.0)) / h - grads[0]) < 1e-5
    # Second derivative (autodiff of the given derivative) away from 0.
    second = jax.jit(jax.vmap(jax.grad(jax.grad(x_over_1p_sqrt))))(xs[2:])
    np.testing.assert_allclose(second, _central_diff(_df64, np.asarray(xs[2:])), rtol=1e-6)


def test_with_derivative_convention_and_dtypes():
    # |x| with the convention d|x|/dx = 1 at 0 (autodiff of jnp.abs gives 1 too, so use
    # a function whose autodiff at 0 is wrong: x * sign(x) has derivative 0 there).
    abs_ = with_derivative(lambda x: x * jnp.sign(x), lambda x: jnp.where(x >= 0, 1.0, -1.0))
    xs = jnp.array([-2.0, 0.0, 3.0], dtype=jnp.float32)
    np.testing.assert_array_equal(abs_(xs), [2.0, 0.0, 3.0])
    np.testing.assert_array_equal(jax.vmap(jax.grad(abs_))(xs), [-1.0, 1.0, 1.0])
    # A constant derivative broadcasts, and the tangent keeps the primal's dtype.
    twice = with_derivative(lambda x: 2 * x, lambda x: 2.0)
    g = jax.grad(lambda x: jnp.sum(twice(x)))(xs)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, [2.0, 2.0, 2.0])


def test_with_derivative_keeps_metadata_and_checks_arguments():
    def cube(x):
        """Cube."""
        return x**3

    f = with_derivative(cube, lambda x: 3 * x**2)
    assert f.__name__ == "cube" and f.__doc__ == "Cube."
    assert jax.grad(f)(2.0) == 12.0
    with pytest.raises(TypeError, match="fun"):
        jax.block_until_ready(with_derivative(1.0, lambda x: x))
    with pytest.raises(TypeError, match="deriv"):
        jax.block_until_ready(with_derivative(cube, None))


# --------------------------------------------------------------------------------------
# clip_gradient
# --------------------------------------------------------------------------------------


def test_clip_gradient_identity_and_clipped_cotangent():
    x = jnp.array([0.0, 1.0, 2.0, 3.0])
    w = jnp.array([-3.0, -0.2, 0.5, 4.0])
    assert clip_gradient(x, -1.0, 1.0) is x or np.array_equal(clip_gradient(x, -1.0, 1.0), x)
    loss = lambda x, lo, hi: jnp.sum(w * clip_gradient(x, lo, hi))
    gx, glo, ghi = jax.grad(loss, argnums=(0, 1, 2))(x, -1.0, 1.0)
    np.testing.assert_allclose(gx, [-1.0, -0.2, 0.5, 1.0], rtol=1e-7)
    assert glo == 0.0 and ghi == 0.0
    # The notebook's clip_sin: derivative clip(cos(x), -0.75, 0.75).
    clip_sin = lambda t: jnp.sin(clip_gradient(t, -0.75, 0.75))
    ts = jnp.linspace(0.0, 10.0, 11)
    np.testing.assert_array_equal(clip_sin(ts), jnp.sin(ts))
    d = jax.jit(jax.vmap(jax.grad(clip_sin)))(ts)
    np.testing.assert_allclose(d, np.clip(np.cos(np.asarray(ts)), -0.75, 0.75), rtol=1e-6)
    # Second derivative: d/dt clip(cos t) = -sin t inside the bounds, 0 outside.
    dd = jax.jit(jax.vmap(jax.grad(jax.grad(clip_sin))))(ts)
    cos = np.cos(np.asarray(ts))
    expected = np.where(np.abs(cos) < 0.75, -np.sin(np.asarray(ts)), 0.0)
    np.testing.assert_allclose(dd, expected, rtol=1e-5, atol=1e-7)


def test_clip_gradient_pytree_and_one_sided_bounds():
    params = {"a": jnp.float32(1.0), "b": (jnp.arange(3.0), jnp.ones((2, 2)))}

    def loss(p):
        q = clip_gradient(p, None, 0.5)  # upper bound only
        return 4 * q["a"] + jnp.sum(q["b"][0] * jnp.array([-2.0, 0.1, 7.0])) + jnp.sum(q["b"][1])

    g = jax.grad(loss)(params)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(params)
    assert g["a"] == 0.5
    np.testing.assert_allclose(g["b"][0], [-2.0, 0.1, 0.5])
    np.testing.assert_array_equal(g["b"][1], np.full((2, 2), 0.5))
    out = clip_gradient(params, -1.0, 1.0)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, out, params))


def test_clip_gradient_traced_and_batched_bounds():
    f = lambda x, lo, hi: jnp.sum(3.0 * clip_gradient(x, lo, hi))
    # Traced bounds under jit.
    gx = jax.jit(jax.grad(f))(jnp.ones(2), jnp.float32(-1.0), jnp.float32(2.0))
    np.testing.assert_array_equal(gx, [2.0, 2.0])
    # Batched bounds under vmap (one bound per batch element), zero cotangent for them.
    los = -jnp.arange(3.0)
    his = jnp.array([0.5, 1.0, 5.0])
    gx, glo, ghi = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2))))(jnp.ones((3, 2)), los, his)
    np.testing.assert_array_equal(gx, [[0.5, 0.5], [1.0, 1.0], [3.0, 3.0]])
    np.testing.assert_array_equal(glo, np.zeros(3))
    np.testing.assert_array_equal(ghi, np.zeros(3))
    # Integer bounds are fine too (their cotangent is symbolic zero).
    np.testing.assert_array_equal(jax.grad(f)(jnp.ones(2), -1, 1), [1.0, 1.0])


def test_clip_gradient_is_reverse_mode_only():
    with pytest.raises(TypeError):
        jax.block_until_ready(jax.jvp(lambda x: clip_gradient(x, -1.0, 1.0), (1.0,), (1.0,)))


# --------------------------------------------------------------------------------------
# debug_backward
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_debug_backward_sees_primal_and_cotangent(jit):
    seen = []
    record = lambda x, g: seen.append((np.asarray(x), np.asarray(g)))

    def foo(x):
        y = debug_backward(x**2, record)
        return jnp.sin(y)

    grad = jax.grad(foo)
    if jit:
        grad = jax.jit(grad)
    g = grad(jnp.float32(3.0))
    jax.effects_barrier()
    assert len(seen) == 1
    x_seen, g_seen = seen[0]
    np.testing.assert_allclose(x_seen, 9.0)
    np.testing.assert_allclose(g_seen, np.cos(9.0), rtol=1e-6)
    # The cotangent passes through unchanged: same gradient as without the hook.
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sin(x**2))(jnp.float32(3.0)))
    assert foo(jnp.float32(3.0)) == jnp.sin(jnp.float32(9.0))  # identity forward


def test_debug_backward_pytree_and_vmap():
    seen = []
    record = lambda x, g: seen.append((x, g))
    params = {"w": jnp.arange(3.0), "b": jnp.float32(2.0)}

    def loss(p):
        q = debug_backward(p, record)
        return jnp.sum(q["w"] ** 2) * q["b"]

    g = jax.jit(jax.grad(loss))(params)
    jax.effects_barrier()
    assert len(seen) == 1
    x_seen, g_seen = seen[0]
    assert set(x_seen) == set(g_seen) == {"w", "b"}
    np.testing.assert_array_equal(x_seen["w"], [0.0, 1.0, 2.0])
    assert x_seen["b"] == 2.0
    np.testing.assert_array_equal(g_seen["w"], [0.0, 4.0, 8.0])  # 2 w b
    assert g_seen["b"] == 5.0  # sum w^2
    np.testing.assert_array_equal(g["w"], g_seen["w"])
    # Under vmap the callback runs once per batch element.
    seen.clear()
    xs = jnp.arange(3.0)
    gs = jax.vmap(jax.grad(lambda x: jnp.sin(debug_backward(x, record))))(xs)
    jax.effects_barrier()
    assert len(seen) == 3
    np.testing.assert_allclose(sorted(float(x) for x, _ in seen), [0.0, 1.0, 2.0])
    np.testing.assert_allclose(gs, np.cos(np.asarray(xs)), rtol=1e-6)


def test_debug_backward_checks_fn():
    with pytest.raises(TypeError, match="fn"):
        jax.block_until_ready(debug_backward(1.0, "not callable"))


# --------------------------------------------------------------------------------------
# Docstring examples
# --------------------------------------------------------------------------------------


def test_docstring_examples_run():
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(rules) if t.examples]
    names = {t.name.rsplit(".", 1)[-1] for t in tests}
    assert set(rules.__all__) <= names
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    with jax.enable_x64(False):
        for t in tests:
            runner.run(t)
    assert runner.summarize(verbose=False).failed == 0
