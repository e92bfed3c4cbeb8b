"""solvers.odeint: accuracy, adjoint gradients, transformations, failures, bad input.

Expected values come from closed forms, float64 central finite differences of the
solution at tight tolerances, SciPy's Radau, or the reference values of DESIGN.md.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import solvers
from solvers import _status
from solvers.ode import odeint

# --- problems (module level: one compiled solver per function object) ----------------


def decay(y, t, k):
    return -k * y


def oscillator(y, t, w):
    return jnp.stack([y[1], -(w**2) * y[0]])


def lotka_volterra(y, t, alpha, beta, gamma, delta):
    x, z = y
    return jnp.stack([alpha * x - beta * x * z, -gamma * z + delta * x * z])


def van_der_pol(y, t, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


def robertson(y, t, k1, k2, k3):
    a, b, c = y
    return jnp.stack([-k1 * a + k3 * b * c, k1 * a - k2 * b * b - k3 * b * c, k2 * b * b])


ROBERTSON_K = (0.04, 3e7, 1e4)
ROBERTSON_REF = np.array([1.7865921142e-02, 7.2747514685e-08, 9.8213400611e-01])
LV_PARAMS = (1.5, 1.0, 3.0, 1.0)
LV_LOSS_REF = 842.503898308
LV_GRAD_REF = np.array([32.87985, -541.66745, 504.66100, -1777.73152])


def central_difference(fn, x, h):
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e.flat[i] = h
        grad.flat[i] = (float(fn(jnp.asarray(x + e))) - float(fn(jnp.asarray(x - e)))) / (2 * h)
    return grad


# --- forward accuracy -------------------------------------------------------------------


@pytest.mark.parametrize("method", ["dopri5", "tsit5", "kvaerno5"])
def test_exponential_decay(x64, method):
    ts = jnp.linspace(0.0, 5.0, 11)
    ys = odeint(decay, 2.0, ts, 0.7, method=method, rtol=1e-9, atol=1e-12)
    assert ys.shape == (11,) and ys.dtype == jnp.float64
    assert ys[0] == 2.0
    # kvaerno5's outputs come from a cubic Hermite interpolant (order 3, not 4).
    rtol = 1e-7 if method == "kvaerno5" else 2e-8
    np.testing.assert_allclose(ys, 2.0 * np.exp(-0.7 * np.asarray(ts)), rtol=rtol)


def test_float32_by_default():
    ys = odeint(decay, 1.0, jnp.array([0.0, 1.0]), 1.0)
    assert ys.dtype == jnp.float32
    np.testing.assert_allclose(ys[-1], np.exp(-1.0), rtol=2e-5)


@pytest.mark.parametrize("method", ["dopri5", "tsit5"])
def test_harmonic_oscillator_dense_output(x64, method):
    # 401 outputs, far more than steps: every output comes from the method's own
    # interpolant, which must be accurate to about the tolerance (linear interpolation
    # between steps would be off by ~1e-2 here).
    ts = jnp.linspace(0.0, 10.0, 401)
    ys, info = odeint(
        oscillator, jnp.array([1.0, 0.0]), ts, 2.0, method=method, rtol=1e-7, atol=1e-9,
        full_output=True,
    )
    assert int(info.num_accepted) < 200
    t = np.asarray(ts)
    np.testing.assert_allclose(ys[:, 0], np.cos(2 * t), atol=2e-6)
    np.testing.assert_allclose(ys[:, 1], -2 * np.sin(2 * t), atol=4e-6)


def test_output_times_do_not_shorten_steps(x64):
    y0 = jnp.array([1.0, 0.0])
    _, few = odeint(oscillator, y0, jnp.array([0.0, 10.0]), 2.0, full_output=True)
    _, many = odeint(oscillator, y0, jnp.linspace(0.0, 10.0, 300), 2.0, full_output=True)
    assert int(few.num_steps) == int(many.num_steps)
    assert int(few.num_fevals) == int(many.num_fevals)


def test_robertson_matches_scipy_radau(x64):
    from scipy.integrate import solve_ivp

    ts = np.array([0.0, 1e-3, 1.0, 1e2, 1e4, 1e5])
    k1, k2, k3 = ROBERTSON_K

    def f(t, y):
        a, b, c = y
        return [-k1 * a + k3 * b * c, k1 * a - k2 * b * b - k3 * b * c, k2 * b * b]

    def jac(t, y):
        a, b, c = y
        return [[-k1, k3 * c, k3 * b], [k1, -2 * k2 * b - k3 * c, -k3 * b], [0, 2 * k2 * b, 0]]

    ref = solve_ivp(
        f, (0.0, 1e5), [1.0, 0.0, 0.0], method="Radau", t_eval=ts, rtol=1e-9, atol=1e-14, jac=jac
    ).y.T
    np.testing.assert_allclose(ref[-1], ROBERTSON_REF, rtol=1e-8)  # the reference itself
    ys, info = odeint(
        robertson, jnp.array([1.0, 0.0, 0.0]), jnp.asarray(ts), *ROBERTSON_K,
        method="kvaerno5", rtol=1e-7, atol=1e-12, full_output=True,
    )
    assert bool(info.converged) and int(info.num_steps) < 400
    assert int(info.num_jacobians) <= int(info.num_steps)  # one Jacobian per step at most
    np.testing.assert_allclose(ys, ref, rtol=2e-5, atol=1e-12)


def test_van_der_pol_stiff(x64):
    ys, info = odeint(
        van_der_pol, jnp.array([2.0, 0.0]), jnp.array([0.0, 3000.0]), 1000.0,
        method="kvaerno5", rtol=1e-7, atol=1e-9, full_output=True,
    )
    np.testing.assert_allclose(ys[-1, 0], -1.51060694, rtol=1e-5)
    np.testing.assert_allclose(ys[-1, 1], 1.17838e-3, rtol=1e-4)
    assert int(info.num_steps) < 2000


# --- gradients ----------------------------------------------------------------------------


def lv_loss(params, method="dopri5", rtol=1e-6, atol=1e-6, **kw):
    ys = odeint(
        lotka_volterra, jnp.array([1.0, 1.0]), jnp.linspace(0.0, 10.0, 50), *params,
        method=method, rtol=rtol, atol=atol, **kw,
    )
    return jnp.sum(ys**2)


@pytest.mark.parametrize("method", ["dopri5", "tsit5"])
def test_lotka_volterra_gradient_matches_reference(x64, method):
    p = jnp.array(LV_PARAMS)
    (value, grad), grad_loose = jax.jit(lambda p: (
        jax.value_and_grad(lv_loss)(p, method, 1e-10, 1e-10), jax.grad(lv_loss)(p, method)
    ))(p)
    np.testing.assert_allclose(value, LV_LOSS_REF, rtol=1e-9)
    np.testing.assert_allclose(grad, LV_GRAD_REF, rtol=2e-6, atol=2e-3)
    # At the benchmark's tolerance the continuous adjoint is good to about rtol.
    grad = grad_loose
    assert np.max(np.abs(grad - LV_GRAD_REF)) / np.max(np.abs(LV_GRAD_REF)) < 5e-5


def test_lotka_volterra_gradient_matches_finite_differences(x64):
    p = np.array(LV_PARAMS)
    fd = central_difference(lambda q: lv_loss(q, rtol=1e-12, atol=1e-12), p, 1e-5)
    grad = jax.grad(lv_loss)(jnp.asarray(p), "dopri5", 1e-10, 1e-10)
    np.testing.assert_allclose(grad, fd, rtol=1e-6)


def test_van_der_pol_gradient_matches_finite_differences(x64):
    ts = jnp.linspace(0.0, 6.0, 13)

    def loss(theta, rtol=1e-9):
        mu, y00 = theta
        ys = odeint(van_der_pol, jnp.stack([y00, 0.0]), ts, mu, rtol=rtol, atol=rtol)
        return jnp.sum(ys[:, 0] ** 3)

    theta = np.array([1.5, 2.0])
    fd = central_difference(jax.jit(lambda q: loss(q, 1e-12)), theta, 1e-5)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(jnp.asarray(theta)), fd, rtol=1e-6)


def test_gradient_with_respect_to_times_and_initial_state(x64):
    # y = y0 exp(-k (t - t0)): every cotangent in closed form.
    ts = jnp.array([0.5, 1.0, 2.0, 3.5])
    k = 0.8

    def loss(y0, ts):
        return jnp.sum(jnp.arange(1.0, 5.0) * odeint(decay, y0, ts, k, rtol=1e-10, atol=1e-12))

    y0 = 1.5
    g_y0, g_ts = jax.jit(jax.grad(loss, argnums=(0, 1)))(y0, ts)
    t = np.asarray(ts)
    w = np.arange(1.0, 5.0)
    e = np.exp(-k * (t - t[0]))
    np.testing.assert_allclose(g_y0, np.sum(w * e), rtol=1e-8)
    expected_ts = -k * y0 * w * e
    expected_ts[0] = k * y0 * np.sum(w[1:] * e[1:])
    np.testing.assert_allclose(g_ts, expected_ts, rtol=1e-8)


def test_robertson_gradient_interpolating_adjoint(x64):
    # The state equation is unstable backwards in time: the default adjoint of the stiff
    # method re-integrates it forwards and interpolates instead (backsolve fails here).
    ts = jnp.array([0.0, 1.0, 1e5])
    y0 = jnp.array([1.0, 0.0, 0.0])

    def loss(logk, rtol=1e-7, atol=1e-12):
        # A small window: the forward solution is recomputed in several pieces.
        ys = odeint(robertson, y0, ts, *jnp.exp(logk), method="kvaerno5", rtol=rtol, atol=atol,
                    adjoint_window=16)
        return ys[-1, 0] + 1e4 * ys[-1, 1] + ys[1, 0]

    logk = np.log(np.array(ROBERTSON_K))
    fd = central_difference(jax.jit(lambda q: loss(q, 1e-11, 1e-16)), logk, 1e-5)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(jnp.asarray(logk)), fd, rtol=1e-5)


@pytest.mark.slow
def test_interpolating_adjoint_with_small_window(x64):
    # A window far smaller than the number of steps: the forward is recomputed in pieces.
    p = jnp.array(LV_PARAMS)
    grad = jax.grad(lv_loss)(p, "dopri5", 1e-10, 1e-10, adjoint="interpolate", adjoint_window=5)
    np.testing.assert_allclose(grad, LV_GRAD_REF, rtol=2e-6, atol=2e-3)


def test_adjoint_tolerances_knob(x64):
    # With an accurate forward pass, the backward tolerances set the gradient's error
    # (of the continuous adjoints: the discrete one has no backward tolerances).
    p = jnp.array(LV_PARAMS)

    # The tolerances are traced: one program for both.
    grad = jax.jit(jax.grad(lambda p, tol: lv_loss(p, "dopri5", 1e-10, 1e-10, adjoint="backsolve",
                                                   adjoint_rtol=tol, adjoint_atol=tol)))

    def err(adjoint_tol):
        g = grad(p, adjoint_tol)
        return np.max(np.abs(g - LV_GRAD_REF)) / np.max(np.abs(LV_GRAD_REF))

    assert err(1e-4) > 3e-5  # a loose backward pass shows
    assert err(1e-8) < 2e-8  # (the reference itself is good to ~3e-9)


# --- pytrees, closures, transformations ---------------------------------------------------


class State(NamedTuple):
    x: jnp.ndarray
    v: jnp.ndarray


def test_pytree_state_and_args(x64):
    def f(y, t, p):
        return State(y.v, -p["w"] ** 2 * y.x)

    ts = jnp.linspace(0.0, 2.0, 5)
    y0 = State(jnp.array([1.0, 2.0]), jnp.zeros(2))
    ys = odeint(f, y0, ts, {"w": 1.3}, rtol=1e-10, atol=1e-12)
    assert isinstance(ys, State) and ys.x.shape == (5, 2)
    expected = np.cos(1.3 * np.asarray(ts))[:, None] * np.array([1.0, 2.0])
    np.testing.assert_allclose(ys.x, expected, rtol=1e-8, atol=1e-10)
    grad = jax.jit(jax.grad(lambda p: odeint(f, y0, ts, p, rtol=1e-10, atol=1e-12).x[-1, 0]))(
        {"w": 1.3}
    )
    np.testing.assert_allclose(grad["w"], -2.0 * np.sin(2.6), rtol=1e-7)


def test_gradient_through_closure(x64):
    def loss(w):
        return odeint(lambda y, t: jnp.stack([y[1], -(w**2) * y[0]]), jnp.array([1.0, 0.0]),
                      jnp.array([0.0, 2.0]), rtol=1e-10, atol=1e-12)[-1, 0]

    np.testing.assert_allclose(jax.jit(jax.grad(loss))(1.3), -2.0 * np.sin(2.6), rtol=1e-7)


@pytest.mark.transforms("odeint", "jit", "vmap", "grad")
def test_vmap_over_initial_conditions_and_jit(x64):
    ts = jnp.array([0.0, 1.0, 2.0])
    y0s = jnp.array([1.0, 2.0, 3.0])
    ys, grads = jax.jit(lambda y0s: (
        jax.vmap(lambda y0: odeint(decay, y0, ts, 0.5, rtol=1e-10, atol=1e-12))(y0s),
        jax.vmap(jax.grad(lambda y0: odeint(decay, y0, ts, 0.5)[-1]))(y0s),
    ))(y0s)
    np.testing.assert_allclose(ys, y0s[:, None] * np.exp(-0.5 * np.asarray(ts)), rtol=1e-8)
    np.testing.assert_allclose(grads, np.exp(-1.0) * np.ones(3), rtol=1e-7)


def test_grad_of_grad_through_backsolve(x64):
    # d²/dk² y(2) for y = exp(-k t): 4 exp(-2k).
    def final(k):
        return odeint(decay, 1.0, jnp.array([0.0, 1.0, 2.0]), k, rtol=1e-10, atol=1e-12,
                      adjoint="backsolve")[-1]

    np.testing.assert_allclose(jax.grad(jax.grad(final))(0.7), 4 * np.exp(-1.4), rtol=1e-6)


@pytest.mark.transforms("odeint", "jacrev")
def test_jacrev_matches_matrix_exponential(x64):
    A = jnp.array([[-1.0, 2.0], [0.5, -3.0]])
    J = jax.jit(jax.jacrev(
        lambda y0: odeint(lambda y, t: A @ y, y0, jnp.array([0.0, 2.0]), rtol=1e-10,
                          atol=1e-12)[-1]
    ))(jnp.array([1.0, 1.0]))
    np.testing.assert_allclose(J, scipy.linalg.expm(2 * np.asarray(A)), rtol=1e-7)


@pytest.mark.slow
def test_higher_order_through_interpolating_adjoint_is_refused(x64):
    def final(k):
        return odeint(decay, 1.0, jnp.array([0.0, 1.0]), k, method="kvaerno5",
                      adjoint="interpolate")[-1]

    with pytest.raises(NotImplementedError, match="adjoint='backsolve'"):
        # refused while tracing: nothing is compiled
        jax.block_until_ready(jax.grad(jax.grad(final))(0.7))


def test_tolerances_are_traced_and_calls_compile_once(x64):
    traces = []

    def f(y, t, k):
        traces.append(1)
        return -k * y

    ts = jnp.array([0.0, 1.0])
    a = odeint(f, 1.0, ts, 1.0, rtol=1e-4, atol=1e-6)
    n = len(traces)
    b = odeint(f, 1.0, ts, 1.0, rtol=1e-10, atol=1e-12)
    c = odeint(f, 2.0, ts, 0.5, rtol=1e-10, atol=1e-12)
    assert len(traces) == n  # new tolerances and values: no re-trace
    np.testing.assert_allclose([a[-1], b[-1], c[-1]], np.exp([-1, -1, -0.5]) * [1, 1, 2],
                               rtol=1e-4)


@pytest.mark.slow
def test_memory_does_not_depend_on_max_steps(x64):
    from benchmarks._common import temp_memory_bytes

    sizes = []
    for max_steps in (100, 100_000):
        fn = jax.grad(lambda p, m=max_steps: lv_loss(p, max_steps=m))
        sizes.append(temp_memory_bytes(jax.jit(fn).lower(jnp.array(LV_PARAMS)).compile()))
    if sizes[0] is None:
        pytest.skip("no memory analysis on this backend")
    assert sizes[0] == sizes[1]


# --- failures -----------------------------------------------------------------------------

ROB_Y0 = jnp.array([1.0, 0.0, 0.0])
ROB_TS = jnp.array([0.0, 1e5])


def test_explicit_method_on_stiff_problem_fails_loudly(x64):
    with pytest.raises(solvers.ConvergenceError, match=r"max_steps=300.*failed at t=.*stiff"):
        jax.block_until_ready(odeint(robertson, ROB_Y0, ROB_TS, *ROBERTSON_K, max_steps=300))
    with pytest.raises(Exception, match=r"max_steps=300.*failed at t="):  # under jit too
        jax.block_until_ready(
            jax.jit(lambda: odeint(robertson, ROB_Y0, ROB_TS, *ROBERTSON_K, max_steps=300))()
        )


def test_default_max_steps_also_fails_loudly(x64):
    with pytest.raises(solvers.ConvergenceError, match="max_steps=10000"):
        jax.block_until_ready(odeint(robertson, ROB_Y0, ROB_TS, *ROBERTSON_K))


def test_on_failure_nan_and_ignore(x64):
    ts = jnp.array([0.0, 1e-3, 1.0, 1e5])
    ys = odeint(robertson, ROB_Y0, ts, *ROBERTSON_K, max_steps=300, on_failure="nan")
    assert np.all(np.isnan(ys))
    ys, info = odeint(robertson, ROB_Y0, ts, *ROBERTSON_K, max_steps=300, on_failure="ignore",
                      full_output=True)
    assert not bool(info.converged) and int(info.num_steps) == 300
    assert int(info.status) == _status.MAX_STEPS and info.status_name == "max_steps"
    assert 1e-3 < float(info.t_final) < 1e5
    assert np.all(np.isfinite(ys[:2])) and np.all(np.isnan(ys[3]))  # reached / not reached


def test_vmap_failure_is_per_element(x64):
    blow_up = lambda y, t: y**2  # noqa: E731  (y0 / (1 - y0 t): infinite at t = 1 / y0)
    ys = jax.vmap(lambda y0: odeint(blow_up, y0, jnp.array([0.0, 2.0]), on_failure="nan"))(
        jnp.array([0.1, 1.0])
    )
    np.testing.assert_allclose(ys[0], [0.1, 0.125], rtol=1e-7)
    assert np.all(np.isnan(ys[1]))


def test_nonfinite_state_raises(x64):
    with pytest.raises(solvers.ConvergenceError, match=r"non-finite.*failed at t=1\b"):
        jax.block_until_ready(odeint(lambda y, t: y**2, 1.0, jnp.array([0.0, 2.0])))
    with pytest.raises(solvers.ConvergenceError, match=r"non-finite.*at t=0.5\b"):
        jax.block_until_ready(
            odeint(lambda y, t: jnp.where(t > 0.5, jnp.nan, -y), 1.0, jnp.array([0.0, 1.0]))
        )


def test_backward_failure_follows_on_failure(x64):
    # The forward pass fits in max_steps; the much tighter backward pass does not.
    def loss(k, on_failure):
        ys = odeint(decay, 1.0, jnp.array([0.0, 10.0]), k, rtol=1e-3, atol=1e-3, max_steps=40,
                    adjoint="backsolve", adjoint_rtol=1e-13, adjoint_atol=1e-13,
                    on_failure=on_failure)
        return ys[-1]

    assert np.isnan(jax.grad(loss)(0.5, "nan"))
    with pytest.raises(Exception, match=r"adjoint \(backward\) integration failed at t="):
        jax.block_until_ready(jax.grad(loss)(0.5, "raise"))


def test_full_output_counts(x64):
    _, info = odeint(lotka_volterra, jnp.array([1.0, 1.0]), jnp.linspace(0.0, 10.0, 50),
                     *LV_PARAMS, rtol=1e-6, atol=1e-6, full_output=True)
    assert bool(info.converged) and int(info.status) == 0 and float(info.t_final) == 10.0
    assert info.status_name == "converged"
    assert int(info.num_steps) == int(info.num_accepted) + int(info.num_rejected)
    # FSAL: six evaluations per attempted step, plus the first derivative and initial step.
    assert int(info.num_fevals) == 6 * int(info.num_steps) + 2
    assert float(info.residual) <= 1.0


# --- failure messages and statuses ------------------------------------------------------------


def _message(fn, *args, error=solvers.ConvergenceError):
    # (A backward pass raises from a host callback: JAX re-raises it as its runtime error.)
    with pytest.raises(error) as excinfo:
        jax.block_until_ready(fn(*args))
    return str(excinfo.value)


def test_max_steps_message_names_solver_status_and_time(x64):
    msg = _message(lambda: odeint(robertson, ROB_Y0, ROB_TS, *ROBERTSON_K, max_steps=300))
    assert msg.startswith("solvers.odeint(method='dopri5') did not converge: status 'max_steps'")
    assert "failed at t=" in msg
    assert "after 300 steps" in msg and "'max_steps'" in msg
    assert "increase max_steps" in msg and "method='kvaerno5'" in msg
    msg = _message(lambda: odeint(robertson, ROB_Y0, ROB_TS, *ROBERTSON_K, method="kvaerno5",
                                  max_steps=5))
    assert msg.startswith("solvers.odeint(method='kvaerno5') did not converge")
    assert "failed at t=" in msg
    assert "'max_steps'" in msg and "try method=" not in msg


@pytest.mark.parametrize("method", ["dopri5", "kvaerno5"])
def test_nan_right_hand_side_does_not_ask_for_more_steps(x64, method):
    msg = _message(lambda: odeint(lambda y, t: jnp.nan * y, 1.0, jnp.array([0.0, 1.0]),
                                  method=method))
    assert msg.startswith(f"solvers.odeint(method={method!r}) did not converge")
    assert "failed at t=0 " in msg
    assert "'nonfinite'" in msg and "non-finite" in msg
    assert "max_steps" not in msg


def test_nan_at_the_step_budget_is_reported_as_nonfinite(x64):
    # f is NaN past t = 0.5: the controller shrinks the step there until it underflows.
    # Cut the run short while it is doing so: the budget is spent on non-finite steps,
    # which more steps would not cure.
    def f(y, t):
        return jnp.where(t > 0.5, jnp.nan, -y)

    ts = jnp.array([0.0, 1.0])
    _, full = odeint(f, 1.0, ts, on_failure="ignore", full_output=True)
    assert int(full.status) == _status.NONFINITE and int(full.num_rejected) > 5
    budget = int(full.num_steps) - 3
    _, info = odeint(f, 1.0, ts, max_steps=budget, on_failure="ignore", full_output=True)
    assert int(info.num_steps) == budget and int(info.status) == _status.NONFINITE
    msg = _message(lambda: odeint(f, 1.0, ts, max_steps=budget))
    assert "'nonfinite'" in msg and "at t=0.5" in msg
    assert "increase max_steps" not in msg


def test_step_underflow_in_float32_says_float64_resolves_shorter_steps(x64):
    # y' = y² from y(1000) = 1 blows up at t = 1001. In float32, near t = 1000 a step under
    # 10 eps |t| ~ 1.2e-3 cannot be told from t: the steps underflow before the blow-up,
    # and the message says so. In float64 the integration reaches the blow-up itself.
    ts = np.array([1000.0, 1002.0])
    msg = _message(lambda: odeint(lambda y, t: y**2, jnp.float32(1.0), ts.astype("float32")))
    assert "'step_underflow'" in msg, msg
    assert "in float32 a step shorter than 10 eps |t| = 0.0012" in msg, msg
    assert "jax_enable_x64" in msg
    msg = _message(lambda: odeint(lambda y, t: y**2, 1.0, jnp.asarray(ts)))
    assert "'nonfinite'" in msg and "failed at t=1001 " in msg and "float32" not in msg, msg


def test_backward_nan_message(x64):
    # The forward pass is finite; the right-hand side's derivative is not (d/dy sqrt(0)).
    def f(y, t, k):
        return -k * y + 0.0 * jnp.sqrt(y - y)

    ts = jnp.array([0.0, 1.0])
    np.testing.assert_allclose(odeint(f, 1.0, ts, 0.5, rtol=1e-10, atol=1e-12)[-1],
                               np.exp(-0.5), rtol=1e-8)
    msg = _message(jax.grad(lambda k: odeint(f, 1.0, ts, k)[-1]), 0.5, error=Exception)
    assert "solvers.odeint(method='dopri5'): the adjoint (backward) integration" in msg
    assert "'nonfinite'" in msg and "increase max_steps" not in msg



@pytest.mark.parametrize("adjoint", ["discrete", "interpolate"])
def test_kvaerno5_backward_failure_follows_on_failure(x64, adjoint):
    # The forward pass (and its Jacobian in y) is finite; the derivative in k is not
    # (d/dk sqrt(k - k)): the backward pass of kvaerno5 fails by on_failure, status
    # 'nonfinite', never a number (issue 10).
    def f(y, t, k):
        return -k * y + 0.0 * jnp.sqrt(k - k)

    ts = jnp.array([0.0, 1.0])

    def loss(k, on_failure):
        return odeint(f, 1.0, ts, k, method="kvaerno5", adjoint=adjoint,
                      on_failure=on_failure)[-1]

    assert np.isnan(jax.grad(loss)(0.5, "nan"))
    msg = _message(jax.grad(loss), 0.5, "raise", error=Exception)
    assert "solvers.odeint(method='kvaerno5'): the adjoint (backward) integration" in msg
    assert "'nonfinite'" in msg


def test_kvaerno5_interpolating_backward_out_of_steps(x64):
    # The forward pass fits in max_steps; the much tighter backward integration does not.
    def loss(k, on_failure):
        return odeint(decay, 1.0, jnp.array([0.0, 10.0]), k, method="kvaerno5", rtol=1e-3,
                      atol=1e-3, max_steps=20, adjoint="interpolate", adjoint_rtol=1e-13,
                      adjoint_atol=1e-13, on_failure=on_failure)[-1]

    assert np.isnan(jax.grad(loss)(0.5, "nan"))
    msg = _message(jax.grad(loss), 0.5, "raise", error=Exception)
    assert "the adjoint (backward) integration failed at t=" in msg and "'max_steps'" in msg


# --- traced output times: checked at run time ---------------------------------------------------

BAD_TS = [[0.0, 1.0, 0.5], [1.0, 0.5, 0.0], [0.0, 1.0, 1.0], [0.0, np.nan, 1.0]]


def exp_decay(y, t):
    return -y


# One program per policy, shared by the BAD_TS cases (traced times of one shape).
_TS_RAISE = jax.jit(lambda ts: odeint(exp_decay, 1.0, ts, max_steps=10))
_TS_NAN = jax.jit(lambda ts: odeint(exp_decay, 1.0, ts, max_steps=10, on_failure="nan"))
_TS_IGNORE = jax.jit(lambda ts: odeint(exp_decay, 1.0, ts, max_steps=10, on_failure="ignore",
                                       full_output=True))
_TS_GRADS = {on_failure: jax.jit(jax.grad(lambda y0, ts, on_failure=on_failure: jnp.sum(
    odeint(exp_decay, y0, ts, max_steps=10, on_failure=on_failure)[:2]))) for on_failure in (
    "nan", "ignore")}


@pytest.mark.parametrize("ts", BAD_TS)
def test_traced_ts_not_increasing(ts):
    ts = jnp.array(ts)
    # raise: the message says what is wrong (under jit the error surfaces at the call).
    with pytest.raises(Exception, match="`ts` must be strictly increasing"):
        jax.block_until_ready(_TS_RAISE(ts))
    # nan: every output.
    assert np.all(np.isnan(_TS_NAN(ts)))
    # ignore: y0, then NaN; no step taken.
    ys, info = _TS_IGNORE(ts)
    assert float(ys[0]) == 1.0 and np.all(np.isnan(ys[1:]))
    assert not bool(info.converged) and int(info.status) == _status.INVALID_INPUT
    assert info.status_name == "invalid_input"
    assert int(info.num_steps) == 0
    # Gradients are NaN too, whatever on_failure.
    for grad in _TS_GRADS.values():
        assert np.isnan(grad(1.0, ts))


def test_traced_ts_valid_and_invalid_in_one_batch():
    batch = jnp.array([[0.0, 0.5, 1.0], [0.0, 1.0, 0.5], [0.0, 2.0, 3.0]])
    ys = jax.jit(jax.vmap(lambda ts: odeint(exp_decay, 1.0, ts, on_failure="nan")))(batch)
    np.testing.assert_allclose(ys[0], np.exp(-np.array([0.0, 0.5, 1.0])), rtol=2e-5)
    np.testing.assert_allclose(ys[2], np.exp(-np.array([0.0, 2.0, 3.0])), rtol=2e-5)
    assert np.all(np.isnan(ys[1]))
    with pytest.raises(Exception, match=r"1 of 3 batch elements failed.*strictly increasing"):
        jax.block_until_ready(jax.jit(jax.vmap(lambda ts: odeint(exp_decay, 1.0, ts)))(batch))


def test_interpolating_adjoint_with_traced_ts(x64):
    # kvaerno5's default adjoint (the one with its own while_loop) under jit with traced ts.
    ts = jnp.array([0.0, 0.5, 1.0])
    g = jax.jit(jax.grad(lambda k, ts: odeint(decay, 1.0, ts, k, method="kvaerno5",
                                              rtol=1e-8, atol=1e-10)[-1]))(0.5, ts)
    np.testing.assert_allclose(g, -np.exp(-0.5), rtol=1e-5)
    g = jax.jit(jax.grad(lambda k, ts: odeint(decay, 1.0, ts, k, method="kvaerno5",
                                              on_failure="nan")[-1]))(0.5, ts[::-1])
    assert np.isnan(g)


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(f=1.0), TypeError, "`f` must be callable"),
        (dict(y0="a"), TypeError, "`y0` must be a floating array"),
        (dict(ts=jnp.zeros((2, 2))), ValueError, "`ts` must be a non-empty 1-D"),
        (dict(ts=jnp.array([0.0, 2.0, 1.0])), ValueError, r"strictly increasing: ts\[1\]=2.0"),
        (dict(ts=jnp.array([0.0, 1.0, 1.0])), ValueError, "strictly increasing"),
        (dict(ts="abc"), TypeError, "`ts`"),
        (dict(method="rk4"), ValueError, "'dopri5', 'tsit5', 'kvaerno5'"),
        (dict(adjoint="exact"), ValueError, "'backsolve', 'interpolate'"),
        (dict(rtol=0.0), ValueError, "`rtol` must be a positive"),
        (dict(atol=-1.0), ValueError, "`atol` must be a positive"),
        (dict(adjoint_rtol=0.0), ValueError, "`adjoint_rtol`"),
        (dict(max_steps=0), ValueError, "`max_steps` must be a positive int"),
        (dict(max_steps=10.5), TypeError, "`max_steps` must be a positive int"),
        (dict(on_failure="warn"), ValueError, "'raise', 'nan', 'ignore'"),
        (dict(args=({"a"},)), TypeError, r"`args\[0\]` must be an array"),
        (dict(f=lambda y, t, k: jnp.zeros(3)), ValueError, r"f\(y0, t, \*args\) must have"),
        (dict(f=lambda y, t, k: (y, y)), ValueError, "same pytree structure"),
        (dict(f=lambda y, t, k: jnp.zeros(2, jnp.int32)), ValueError, "dtype"),
    ],
)
def test_bad_input(kwargs, error, match):
    call = dict(f=decay, y0=jnp.ones(2), ts=jnp.array([0.0, 1.0]), args=(1.0,))
    call.update(kwargs)
    f, y0, ts, args = (call.pop(key) for key in ("f", "y0", "ts", "args"))
    with pytest.raises(error, match=match):
        jax.block_until_ready(odeint(f, y0, ts, *args, **call))


def test_rhs_that_ravels_to_the_state_is_accepted_as_jax_odeint_does(x64):
    # JAX's own odeint example: a list [dtheta, domega] for an array state (it ravels).
    # Oracle: the same system written with an array output.
    def pend_list(y, t, b, c):
        theta, omega = y
        return [omega, -b * omega - c * jnp.sin(theta)]

    def pend_array(y, t, b, c):
        return jnp.stack(pend_list(y, t, b, c))

    ts = jnp.linspace(0.0, 10.0, 5)
    y0 = jnp.array([jnp.pi - 0.1, 0.0])
    # (the trajectory and the gradient of its last angle as one program per field: two
    # compilations, not four)
    def run(f, b):
        ys, vjp = jax.vjp(lambda b: solvers.odeint(f, y0, ts, b, 5.0, rtol=1e-10, atol=1e-10), b)
        return ys, vjp(jnp.zeros_like(ys).at[-1, 0].set(1.0))[0]

    (ys_list, g_list), (ys_array, g_array) = (jax.jit(run, static_argnums=0)(f, 0.25)
                                              for f in (pend_list, pend_array))
    np.testing.assert_allclose(ys_list, ys_array, rtol=1e-12)
    np.testing.assert_allclose(g_list, g_array, rtol=1e-10)
    with pytest.raises(ValueError, match="must have the same pytree structure as y0"):
        solvers.odeint(lambda y, t: [y[0]], y0, ts)  # one entry short: not the state


def test_max_step_bounds_the_steps_so_a_pulse_is_not_stepped_over(x64):
    # y' = -y + pulse(t), y(0) = 0, a Gaussian pulse of width w at t = 5: the zero
    # solution lets the steps grow past the pulse. y(10) = w sqrt(pi) e^{-5} (1 + O(w²)).
    w = 1e-3

    def f(y, t):
        return -y + jnp.exp(-(((t - 5.0) / w) ** 2))

    ts = jnp.array([0.0, 10.0])
    exact = w * math.sqrt(math.pi) * math.exp(-5.0)
    ys, info = solvers.odeint(f, 0.0, ts, max_step=w / 2, rtol=1e-8, atol=1e-12,
                              max_steps=100_000, full_output=True)
    np.testing.assert_allclose(float(ys[-1]), exact, rtol=1e-5)
    assert int(info.num_steps) >= 10.0 / (w / 2)
    free = solvers.odeint(f, 0.0, ts, rtol=1e-8, atol=1e-12)
    assert abs(float(free[-1]) - exact) > 0.5 * exact  # strode over it (why max_step exists)
    with pytest.raises(ValueError, match="max_step"):
        solvers.odeint(f, 0.0, ts, max_step=-1.0)
