"""Unit tests of implicit._host.host_check: the run-time failure report from compiled code.

``host_check(ok, host, operands)`` calls ``host(operands)`` on the host only when
``not all(ok)``, once per ``vmap`` batch, and returns ``True``. Each test counts the
host calls with a plain Python list, so "skipped at run time" and "one call per batch"
are observed rather than assumed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicit._host import host_check


class Recorder:
    """A host function that records what it was called with (and never raises)."""

    def __init__(self):
        self.calls = []

    def __call__(self, operands):
        # Copy to NumPy now: the buffers are only guaranteed alive during the call.
        self.calls.append(jax.tree.map(np.array, operands))


def guarded(host):
    """x -> x where every x > 0, reported to ``host`` otherwise; the flag gates the output."""

    def f(x):
        flag = host_check(x > 0, host, {"x": x, "n": jnp.int32(7)})
        return jnp.where(flag, x, jnp.nan)

    return f


def boom(operands):
    raise ValueError(f"host says no: x={np.asarray(operands['x']).tolist()}")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_returns_true_and_skips_the_host_when_ok(jit):
    host = Recorder()
    check = lambda x: host_check(x > 0, host, {"x": x})  # noqa: E731
    check = jax.jit(check) if jit else check
    flag = jax.block_until_ready(check(jnp.array([1.0, 2.0, 3.0])))
    assert flag.shape == () and flag.dtype == jnp.bool_ and bool(flag)
    assert host.calls == []  # skipped at run time, not merely traced away
    # The same compiled function does call the host once something fails.
    flag = jax.block_until_ready(check(jnp.array([1.0, -2.0, 3.0])))
    assert bool(flag)
    assert len(host.calls) == 1


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_calls_the_host_with_the_operands_when_not_ok(jit):
    host = Recorder()
    f = jax.jit(guarded(host)) if jit else guarded(host)
    x = jnp.array([1.0, -2.0, 3.0])
    out = jax.block_until_ready(f(x))
    np.testing.assert_array_equal(out, x)  # the flag is True: values pass through
    assert len(host.calls) == 1
    (operands,) = host.calls
    assert set(operands) == {"x", "n"}  # the pytree structure is kept
    np.testing.assert_array_equal(operands["x"], [1.0, -2.0, 3.0])
    assert operands["x"].dtype == np.float32
    assert operands["n"].shape == () and int(operands["n"]) == 7


def test_scalar_ok_and_non_array_operands():
    host = Recorder()
    assert bool(host_check(jnp.bool_(False), host, (1.5, jnp.arange(2))))
    assert len(host.calls) == 1
    first, second = host.calls[0]
    assert float(first) == 1.5
    np.testing.assert_array_equal(second, [0, 1])


@pytest.mark.parametrize("jit", [False, True], ids=["vmap", "jit-vmap"])
def test_vmap_makes_one_host_call_per_batch(jit):
    host = Recorder()
    f = jax.vmap(guarded(host))
    f = jax.jit(f) if jit else f
    xs = jnp.array([[1.0, -2.0], [1.0, 1.0], [-1.0, -1.0], [3.0, 4.0]])
    out = jax.block_until_ready(f(xs))
    np.testing.assert_array_equal(out, xs)
    # Two of the four elements fail: still one call, which sees the whole batch.
    assert len(host.calls) == 1
    np.testing.assert_array_equal(host.calls[0]["x"], xs)
    # An unbatched operand is broadcast along the batch axis.
    np.testing.assert_array_equal(host.calls[0]["n"], [7, 7, 7, 7])
    # A batch where every element is fine makes no call at all.
    jax.block_until_ready(f(jnp.ones((4, 2))))
    assert len(host.calls) == 1


def test_nested_vmap_makes_one_host_call():
    host = Recorder()
    f = jax.jit(jax.vmap(jax.vmap(guarded(host))))
    xs = -jnp.ones((2, 3, 2))
    jax.block_until_ready(f(xs))
    assert len(host.calls) == 1
    assert host.calls[0]["x"].shape == (2, 3, 2)
    assert host.calls[0]["n"].shape == (2, 3)


@pytest.mark.parametrize("transform", ["eager", "jit", "jit-vmap"])
def test_the_hosts_exception_surfaces_with_its_message(transform):
    f = guarded(boom)
    x = jnp.array([1.0, -2.0])
    if transform == "jit":
        f = jax.jit(f)
    elif transform == "jit-vmap":
        f, x = jax.jit(jax.vmap(f)), jnp.stack([x, x])
    # Block inside the raises block: on GPU the callback runs asynchronously.
    with pytest.raises(Exception, match=r"host says no: x=\[.*-2\.0"):
        jax.block_until_ready(f(x))


def test_exception_surfaces_from_a_batched_jitted_call():
    f = jax.jit(jax.vmap(guarded(boom)))
    ok = jax.block_until_ready(f(jnp.ones((3, 2))))  # no failure: no host call, no raise
    np.testing.assert_array_equal(ok, jnp.ones((3, 2)))
    with pytest.raises(Exception, match=r"host says no: x=\[\[1\.0, 1\.0\], \[1\.0, -1\.0\]\]"):
        jax.block_until_ready(f(jnp.array([[1.0, 1.0], [1.0, -1.0]])))


def test_grad_flows_around_the_check_not_through_it():
    # pure_callback has no derivative rule: without host_check's stop_gradient on the
    # operands, grad and jvp of anything that checks a traced value would fail to trace.
    host = Recorder()
    loss = lambda x: jnp.sum(guarded(host)(x) ** 2)  # noqa: E731
    x = jnp.array([1.0, -2.0, 3.0])
    np.testing.assert_array_equal(jax.grad(loss)(x), 2 * x)
    assert len(host.calls) == 1  # the forward pass of grad ran the check once
    np.testing.assert_array_equal(host.calls[0]["x"], x)  # primal values, not tangents
    primal, tangent = jax.jvp(guarded(host), (x,), (jnp.ones(3),))
    np.testing.assert_array_equal(primal, x)
    np.testing.assert_array_equal(tangent, jnp.ones(3))
    # Second order and batched gradients too.
    cube = lambda x: guarded(host)(x) ** 3  # noqa: E731
    assert float(jax.grad(jax.grad(cube))(2.0)) == 12.0
    grads = jax.jit(jax.vmap(jax.grad(loss)))(jnp.stack([x, -x]))
    np.testing.assert_array_equal(grads, 2 * jnp.stack([x, -x]))


def test_the_check_itself_has_zero_derivative():
    # The flag is a boolean computed from stop-gradient operands: a function of x that
    # uses the check only through the flag has zero derivative in x.
    host = Recorder()

    def gated_constant(x):
        return jnp.where(host_check(x < 0, host, {"x": x * 3.0}), 5.0, 0.0)

    assert float(jax.grad(gated_constant)(1.0)) == 0.0
    assert len(host.calls) == 1 and float(host.calls[0]["x"]) == 3.0
