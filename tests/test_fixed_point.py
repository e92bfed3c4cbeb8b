"""solvers.fixed_point: values, implicit gradients, transformations, failure, bad input."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers


def newton_update(x, a):
    return 0.5 * (x + a / x)


def newton_sqrt(a):
    return solvers.fixed_point(newton_update, a, a)


@pytest.mark.transforms("fixed_point", "jit", "vmap", "grad", "grad(grad)")
def test_seed_notebook_numbers():
    # The notebook prints 1.4142135, 0.35355338 and -0.088388346 (float32).
    x = newton_sqrt(2.0)
    assert x.dtype == jnp.float32
    np.testing.assert_allclose(x, 1.4142135, rtol=1e-7)
    # (one program for the three: eagerly, the gradients' operations compiled one by one)
    grad, grad2, batched = jax.jit(
        lambda a, batch: (jax.grad(newton_sqrt)(a), jax.grad(jax.grad(newton_sqrt))(a),
                          jax.vmap(newton_sqrt)(batch))
    )(2.0, np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    np.testing.assert_allclose(grad, 0.35355338, rtol=1e-7)
    np.testing.assert_allclose(grad2, -0.088388346, rtol=1e-6)
    np.testing.assert_allclose(batched, [1.0, 1.4142135, 1.7320509, 2.0], rtol=1e-7)


def tanh_layer(z, params, x):
    return jnp.tanh(params["W"] @ z + params["U"] @ x + params["b"])


def _layer_problem(seed=0, n=6):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    params = {
        "W": jnp.asarray(0.8 * Q),
        "U": jnp.asarray(rng.standard_normal((n, 3))),
        "b": jnp.asarray(rng.standard_normal(n)),
    }
    return params, jnp.asarray(rng.standard_normal(3))


def _central_difference(loss, params, h=1e-6):
    grads = {}
    for key, value in params.items():
        flat = np.asarray(value, dtype=np.float64).ravel()
        g = np.zeros_like(flat)
        for i in range(flat.size):
            for sign in (1, -1):
                p = flat.copy()
                p[i] += sign * h
                shifted = {**params, key: jnp.asarray(p.reshape(value.shape))}
                g[i] += sign * float(loss(shifted)) / (2 * h)
        grads[key] = g.reshape(value.shape)
    return grads


@pytest.mark.parametrize(
    "method,linear_solver",
    [("iterate", "gmres"), ("anderson", "gmres"), ("iterate", "bicgstab"),
     ("anderson", "dense"), ("iterate", "neumann")],
)
def test_tanh_layer_gradients_match_finite_differences(x64, method, linear_solver):
    params, x = _layer_problem()
    scale = jnp.asarray(1.3)  # closed over, traced when differentiated

    def loss(params, scale=scale):
        f = lambda z, params, x: scale * tanh_layer(z, params, x)
        z = solvers.fixed_point(
            f, jnp.zeros(6), params, x, method=method, linear_solver=linear_solver,
            rtol=1e-12, atol=1e-14, max_steps=5000,
        )
        return jnp.sum(z**2) + jnp.sum(jnp.sin(z))

    grads = jax.jit(jax.grad(loss))(params)
    # (the finite differences' losses, in params and in scale: one program)
    loss_at = jax.jit(lambda params, s: loss(params, s))
    reference = _central_difference(lambda params: loss_at(params, scale), params)
    for key in params:
        np.testing.assert_allclose(grads[key], reference[key], rtol=1e-6, atol=1e-8)
    # The closed-over scale gets its derivative too. (Jitted: eagerly, each call's fresh
    # map compiled a solver of its own, and the gradient's operations one by one.)
    g_scale = jax.jit(jax.grad(lambda s: loss(params, s)))(scale)
    h = 1e-6
    fd = (loss_at(params, scale + h) - loss_at(params, scale - h)) / (2 * h)
    np.testing.assert_allclose(g_scale, fd, rtol=1e-6)


def test_float32_slow_contraction_default_adjoint_against_float64_ift():
    # tanh(W x + c) with W = 0.99 Q (Q orthogonal): the Jacobian's spectral radius at the
    # fixed point is 0.971. In float32 the default Neumann adjoint's residual floors at
    # about eps / (1 - 0.971), 4x above its tolerance (rtol / 10): it ran to max_steps
    # and raised. It now stops at its floor, within the 10x slack iterative solves get.
    rng = np.random.default_rng(1)
    w64 = 0.99 * np.linalg.qr(rng.standard_normal((30, 30)))[0]
    c64 = 0.1 * rng.standard_normal(30)
    w, c = jnp.asarray(w64, jnp.float32), jnp.asarray(c64, jnp.float32)

    def loss(c):
        return jnp.sum(solvers.fixed_point(lambda x, w, c: jnp.tanh(w @ x + c),
                                           jnp.zeros(30), w, c, max_steps=5000) ** 2)

    g = np.asarray(jax.jit(jax.grad(loss))(c), np.float64)
    w64, c64 = np.asarray(w, np.float64), np.asarray(c, np.float64)  # (the rounded data)
    x = np.zeros(30)
    for _ in range(100_000):
        x, previous = np.tanh(w64 @ x + c64), x
        if np.max(np.abs(x - previous)) < 1e-15:
            break
    s = 1.0 - x**2
    want = s * np.linalg.solve((np.eye(30) - s[:, None] * w64).T, 2.0 * x)
    np.testing.assert_allclose(g, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


def test_pytree_state_and_namedtuple():
    class State(NamedTuple):
        u: jnp.ndarray
        v: dict

    def f(s, a):
        return State(0.5 * jnp.cos(s.u) + a, {"w": 0.25 * s.v["w"] + a})

    s0 = State(jnp.zeros(3), {"w": jnp.zeros(())})
    s = solvers.fixed_point(f, s0, 0.2, method="anderson")
    assert isinstance(s, State)
    np.testing.assert_allclose(s.u, 0.5 * np.cos(np.asarray(s.u)) + 0.2, atol=1e-5)
    np.testing.assert_allclose(s.v["w"], 0.2 / 0.75, rtol=1e-5)
    # d w*/d a = 1 / 0.75 for the second component.
    g = jax.jit(jax.grad(lambda a: solvers.fixed_point(f, s0, a).v["w"]))(0.2)
    np.testing.assert_allclose(g, 1 / 0.75, rtol=1e-5)


@pytest.mark.transforms("fixed_point", "jvp, jacfwd", "hessian", option='rule="jvp"')
def test_jvp_rule_forward_mode_and_hessian():
    f = lambda x, a: 0.5 * (x + a / x)
    sqrt = lambda a: solvers.fixed_point(f, a, a, rule="jvp")
    a = np.array([1.0, 4.0, 9.0], np.float32)
    jacfwd, hessian, jacrev = jax.jit(  # (one program for the three)
        lambda s, a: (jax.jacfwd(sqrt)(s), jax.hessian(sqrt)(s), jax.jacrev(jax.vmap(sqrt))(a))
    )(4.0, a)
    np.testing.assert_allclose(jacfwd, 0.25, rtol=1e-6)
    np.testing.assert_allclose(hessian, -0.25 * 4.0**-1.5, rtol=1e-5)
    np.testing.assert_allclose(jacrev, np.diag(0.5 / np.sqrt(a)), rtol=1e-6)


def test_anderson_beats_plain_iteration_on_a_slow_contraction():
    # A symmetric contraction with spectral radius 0.97 (real spectrum: the case
    # Anderson is made for; a rotation-like spectrum defeats any Krylov-type method).
    rng = np.random.default_rng(3)
    S = rng.standard_normal((20, 20))
    S = S + S.T
    A = jnp.asarray(0.97 * S / np.abs(np.linalg.eigvalsh(S)).max())
    b = jnp.asarray(rng.standard_normal(20))
    f = lambda x, A, b: A @ x + b
    (x_it, info_it), (x_an, info_an) = jax.jit(lambda A, b: (  # (one program for both)
        solvers.fixed_point(f, jnp.zeros(20), A, b, full_output=True, max_steps=2000),
        solvers.fixed_point(f, jnp.zeros(20), A, b, method="anderson", full_output=True)
    ))(A, b)
    exact = np.linalg.solve(np.eye(20) - np.asarray(A), np.asarray(b))
    np.testing.assert_allclose(x_an, exact, rtol=1e-3, atol=1e-3)
    assert bool(info_an.converged) and bool(info_it.converged)
    assert int(info_an.num_steps) * 4 < int(info_it.num_steps)


def test_full_output_info_and_history():
    # check_every=1: every step tested and recorded (a GPU's default tests every 4th)
    x, info = solvers.fixed_point(newton_update, 2.0, 2.0, full_output=True, max_steps=50,
                                  check_every=1)
    assert isinstance(info, solvers.Info)
    assert bool(info.converged)
    k = int(info.num_steps)
    assert 1 <= k < 50
    history = np.asarray(info.residual_history)
    assert history.shape == (50,)
    assert np.all(np.isfinite(history[:k])) and np.all(np.isnan(history[k:]))
    np.testing.assert_allclose(history[k - 1], info.residual)
    assert info.residual <= 1e-5 * 1.5 + 1e-6
    # Batched solves give batched info.
    _, binfo = jax.jit(jax.vmap(
        lambda a: solvers.fixed_point(newton_update, a, a, full_output=True)
    ))(np.array([1.0, 100.0], np.float32))
    assert binfo.num_steps.shape == (2,) and binfo.num_steps[1] > binfo.num_steps[0]


def _slow(x, a):
    return 0.999 * x + a


def test_non_convergence_raises_eagerly_with_details():
    with pytest.raises(solvers.ConvergenceError) as err:
        jax.block_until_ready(solvers.fixed_point(_slow, 0.0, 1.0, max_steps=7))
    message = str(err.value)
    assert "solvers.fixed_point(method='iterate') did not converge" in message
    assert "7 steps" in message and "final residual" in message


def test_non_convergence_raises_under_jit_and_vmap():
    jitted = jax.jit(lambda a: solvers.fixed_point(_slow, 0.0, a, max_steps=5))
    with pytest.raises(Exception, match="did not converge.*5 steps"):
        jax.block_until_ready(jitted(1.0))
    batched = jax.vmap(lambda a: solvers.fixed_point(_slow, 0.0, a, max_steps=5))
    with pytest.raises(Exception, match="did not converge"):
        jax.block_until_ready(batched(jnp.array([0.0, 1.0])))


def test_on_failure_nan_marks_only_failed_batch_elements():
    # a = 0 converges at once (x = 0 is the fixed point); a = 1 needs thousands of steps.
    out = jax.jit(jax.vmap(
        lambda a: solvers.fixed_point(_slow, 0.0, a, max_steps=20, on_failure="nan")
    ))(np.array([0.0, 1.0], np.float32))
    assert out[0] == 0.0 and np.isnan(out[1])
    # The guess is tested first, then 3 steps; the result is the next iterate after the
    # last one tested (f there is already known): x_4 = 1 + 0.999 + 0.999^2 + 0.999^3.
    # (check_every=1: a GPU's default tests every 4th step, so may run max_steps + 3.)
    last = solvers.fixed_point(_slow, 0.0, 1.0, max_steps=3, on_failure="ignore",
                               check_every=1)
    np.testing.assert_allclose(last, 1.0 + 0.999 + 0.999**2 + 0.999**3, rtol=1e-6)


def test_non_finite_residual_is_reported():
    with pytest.raises(solvers.ConvergenceError, match="non-finite"):
        jax.block_until_ready(solvers.fixed_point(lambda x, a: jnp.log(x - a), 0.5, 1.0))


def test_gradient_memory_and_tracing_do_not_depend_on_steps():
    calls = []

    def f(x, a):
        calls.append(1)
        return 0.5 * (x + a / x)

    solvers.fixed_point(f, 2.0, 2.0)
    traced = len(calls)
    for a in (3.0, 5.0, 7.0):
        solvers.fixed_point(f, a, a)
    assert len(calls) == traced, "repeated eager calls re-traced the user function"
    grad = jax.grad(lambda a: solvers.fixed_point(f, a, a))
    grad(2.0)
    traced = len(calls)
    grad(3.0)
    assert len(calls) == traced


def test_different_tolerances_do_not_recompile():
    calls = []

    def f(x, a):
        calls.append(1)
        return 0.5 * (x + a / x)

    solvers.fixed_point(f, 2.0, 2.0, rtol=1e-3, damping=0.8, linear_solver="gmres")
    traced = len(calls)
    solvers.fixed_point(f, 2.0, 2.0, rtol=1e-6, atol=1e-7, damping=0.9, linear_solver="gmres")
    assert len(calls) == traced
    # damping=1 (the default) is plain iteration, a program of its own (no damping pass),
    # compiled once too.
    solvers.fixed_point(f, 2.0, 2.0, rtol=1e-3, linear_solver="gmres")
    traced = len(calls)
    solvers.fixed_point(f, 2.0, 2.0, rtol=1e-6, atol=1e-7, linear_solver="gmres")
    assert len(calls) == traced


def test_float64_defaults(x64):
    x = solvers.fixed_point(newton_update, 2.0, 2.0)
    assert x.dtype == jnp.float64
    np.testing.assert_allclose(x, np.sqrt(2.0), rtol=1e-12)


def _mixed_map(x, a):
    return {"p": (0.5 * jnp.cos(a * x["p"])).astype(jnp.float32), "q": 0.3 * jnp.sin(x["q"] + a)}


@pytest.mark.transforms("fixed_point", "jacrev")
@pytest.mark.parametrize("rule", ["vjp", "jvp"])
def test_mixed_precision_pytree_follows_its_coarsest_leaf(x64, rule):
    # A float32 leaf in a float64 pytree: the adjoint solve, held to float64's tolerance,
    # never met it through the float32 leaf's rounding; every gradient raised (residual
    # 6e-8 against 1e-9). Reference: the same map solved and differentiated in float64 throughout,
    # by the dense implicit function theorem.
    x0 = {"p": np.zeros(2, np.float32), "q": np.zeros(3)}
    solve = lambda a: solvers.fixed_point(_mixed_map, x0, a, rule=rule, linear_solver="gmres")  # noqa: E731
    flat = lambda x: jnp.concatenate([x["p"].astype(jnp.float64), x["q"]])  # noqa: E731
    solution = lambda a: flat(solve(a))  # noqa: E731
    x, jac = jax.jit(lambda a: (  # (one program for both)
        solve(a), jax.jacfwd(solution)(a) if rule == "jvp" else jax.jacrev(solution)(a)
    ))(0.7)
    assert x["p"].dtype == jnp.float32 and x["q"].dtype == jnp.float64

    a = 0.7  # the map in float64, on the flat vector, and its derivatives (closed forms)
    z = np.zeros(5)
    for _ in range(200):
        z = np.concatenate([0.5 * np.cos(a * z[:2]), 0.3 * np.sin(z[2:] + a)])
    dz = np.diag(np.concatenate([-0.5 * a * np.sin(a * z[:2]), 0.3 * np.cos(z[2:] + a)]))
    da = np.concatenate([-0.5 * z[:2] * np.sin(a * z[:2]), 0.3 * np.cos(z[2:] + a)])
    expected = np.linalg.solve(np.eye(5) - dz, da)
    np.testing.assert_allclose(np.concatenate([x["p"], x["q"]]), z, atol=1e-5)
    np.testing.assert_allclose(jac, expected, atol=1e-5)


def test_int_initial_guess_is_promoted():
    x = solvers.fixed_point(lambda x: 0.5 * x + 1.0, 0)
    assert x.dtype == jnp.float32
    np.testing.assert_allclose(x, 2.0, rtol=1e-5)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: solvers.fixed_point("f", 1.0), TypeError, "`f` must be callable"),
        (lambda: solvers.fixed_point(lambda x: x, "1.0"), TypeError, "`x0` must be a floating"),
        (lambda: solvers.fixed_point(lambda x: x, None), ValueError, "`x0` must contain"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, method="newton"), ValueError,
         "unknown `method`='newton'; valid values are: 'iterate', 'anderson'"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, linear_solver="lu"), ValueError,
         "unknown `linear_solver`='lu'; valid values are: 'auto', 'gmres', 'bicgstab'"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, rtol=0.0), ValueError,
         "`rtol` must be a positive"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, atol=-1.0), ValueError,
         "`atol` must be a positive"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, max_steps=0), ValueError,
         "`max_steps` must be a positive int"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, max_steps=2.5), TypeError,
         "`max_steps` must be a positive int"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, damping=1.5), ValueError,
         "`damping` must be in"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, on_failure="warn"), ValueError,
         "unknown `on_failure`='warn'"),
        (lambda: solvers.fixed_point(lambda x: x, 1.0, rule="fwd"), ValueError, "unknown `rule`"),
        (lambda: solvers.fixed_point(lambda x, s: x, 1.0, {"name"}), TypeError,
         "`args\\[0\\]` must be an array"),
        (lambda: solvers.fixed_point(lambda x: jnp.zeros(3), jnp.zeros(2)), ValueError,
         "f\\(x0, \\*args\\) must have the shape of x0: got \\(3,\\), expected \\(2,\\)"),
        (lambda: solvers.fixed_point(lambda x: (x, x), jnp.zeros(2)), ValueError,
         "same pytree structure"),
        (lambda: solvers.fixed_point(lambda x: x.astype(jnp.int32), jnp.zeros(2)), ValueError,
         "dtype"),
    ],
)
def test_bad_input_is_rejected_at_call_time(call, error, match):
    with pytest.raises(error, match=match):
        jax.block_until_ready(call())
