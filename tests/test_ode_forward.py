"""odeint's forward mode (``adjoint="forward"``, issue 14): jvp, jacfwd, hessian.

Expected values come from closed forms (``expm`` and its Fréchet derivative for
``y' = A y``; ``y = y0 / (1 + k y0 t)`` for ``y' = -k y²``, differentiated by JAX as a
formula), float64 central finite differences of the solution or of its gradient, the
reference values of DESIGN.md, and the discrete adjoint (reverse mode), which
differentiates the same computed solution.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from solvers.ode import odeint

METHODS = ("dopri5", "tsit5", "kvaerno5")
# The costly tests (about 30 s, compilation mostly) run tsit5 in the slow set only.
FAST_METHODS = ("dopri5", pytest.param("tsit5", marks=pytest.mark.slow), "kvaerno5")
TOL = dict(rtol=1e-9, atol=1e-11)


def lotka_volterra(y, t, alpha, beta, gamma, delta):
    x, z = y
    return jnp.stack([alpha * x - beta * x * z, -gamma * z + delta * x * z])


def linear(y, t, A):
    return A @ y


def riccati(y, t, k):
    return -k * y**2


def decay(y, t, k):
    return -k * y


LV_PARAMS = np.array([1.5, 1.0, 3.0, 1.0])  # float64 under the x64 fixture
LV_GRAD_REF = np.array([32.87985, -541.66745, 504.66100, -1777.73152])


def lv_outputs(p, y0, ts, method, adjoint):
    return odeint(lotka_volterra, y0, ts, *p, method=method, adjoint=adjoint, **TOL)


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.parametrize("method", FAST_METHODS)
def test_jacfwd_matches_jacrev_of_the_discrete_adjoint(x64, method):
    # Both differentiate the computed solution with the step sizes held fixed; the
    # discrete adjoint may retake a step as substeps (its adjoint error check), so they
    # agree to that (measured 8e-10 at these tolerances on dopri5, 2e-15 on tsit5 and
    # kvaerno5; 1e-7 when the check was scaled wrongly and refined most steps).
    ts = jnp.linspace(0.0, 10.0, 20)
    y0 = jnp.array([1.0, 1.0])
    fwd, rev = jax.jit(lambda p, y0: (
        jax.jacfwd(lambda p, y0: lv_outputs(p, y0, ts, method, "forward"), (0, 1))(p, y0),
        jax.jacrev(lambda p, y0: lv_outputs(p, y0, ts, method, "discrete"), (0, 1))(p, y0),
    ))(LV_PARAMS, y0)
    for a, b in zip(fwd, rev):
        assert rel(a, b) < 1e-8


def test_discrete_adjoint_retakes_no_smooth_step_as_substeps(x64):
    # The discrete adjoint's own error check (the cotangent through the embedded pair's
    # error estimate) retakes a step as substeps only where the step does not resolve
    # the linearised dynamics; on Lotka–Volterra at rtol 1e-8 none is retaken, so it is
    # the derivative of the computed solution: forward sensitivities (the same steps,
    # differentiated forwards) agree to rounding. Measured 1.2e-15; 8.7e-8 when the
    # check held the FSAL first stage fixed (an O(h) estimate: 177 of 207 steps retaken).
    ts = jnp.linspace(0.0, 10.0, 50)

    def loss(p, adjoint):
        ys = odeint(lotka_volterra, jnp.array([1.0, 1.0]), ts, *p, adjoint=adjoint,
                    rtol=1e-8, atol=1e-8)
        return jnp.sum(ys**2)

    g_fwd, g_rev = jax.jit(lambda p: (jax.grad(loss)(p, "forward"),
                                      jax.grad(loss)(p, "discrete")))(LV_PARAMS)
    assert rel(g_rev, g_fwd) < 1e-12


def test_lotka_volterra_gradient_reference_by_forward_sensitivities(x64):
    ts = jnp.linspace(0.0, 10.0, 50)

    def loss(p):
        ys = odeint(lotka_volterra, jnp.array([1.0, 1.0]), ts, *p, adjoint="forward",
                    rtol=1e-10, atol=1e-10)
        return jnp.sum(ys**2)

    # Reverse mode through the forward sensitivities (their linear map, transposed).
    g_rev, g_fwd = jax.jit(lambda p: (jax.grad(loss)(p), jax.jacfwd(loss)(p)))(LV_PARAMS)
    np.testing.assert_allclose(g_rev, LV_GRAD_REF, rtol=1e-6)
    np.testing.assert_allclose(g_fwd, LV_GRAD_REF, rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_jvp_matches_central_differences(x64, method):
    # One jvp with tangents in y0, the parameters and the output times together.
    ts = jnp.array([0.0, 0.7, 1.9, 3.0])
    y0 = jnp.array([1.2, 0.8])
    dp = jnp.array([0.3, -0.2, 0.1, 0.4])
    dy0 = jnp.array([-0.5, 0.7])
    dts = jnp.array([0.2, -0.3, 0.1, 0.25])

    def fn(p, y0, ts, adjoint="forward", tol=TOL):
        return odeint(lotka_volterra, y0, ts, *p, method=method, adjoint=adjoint, **tol)

    tight = dict(rtol=1e-12, atol=1e-13)
    eps = 1e-5

    @jax.jit
    def run(p, y0, ts):
        # The jvp, the primal by the discrete adjoint and the differences in one program.
        plus = fn(p + eps * dp, y0 + eps * dy0, ts + eps * dts, "discrete", tight)
        minus = fn(p - eps * dp, y0 - eps * dy0, ts - eps * dts, "discrete", tight)
        return jax.jvp(fn, (p, y0, ts), (dp, dy0, dts)), fn(p, y0, ts, "discrete"), plus, minus

    (ys, dys), ys_discrete, plus, minus = run(jnp.asarray(LV_PARAMS), y0, ts)
    fd = (plus - minus) / (2 * eps)
    np.testing.assert_allclose(ys, ys_discrete, rtol=1e-12)
    assert dys.dtype == jnp.float64
    assert rel(dys, fd) < 1e-6
    np.testing.assert_array_equal(dys[0], dy0)


@pytest.mark.parametrize("method", METHODS)
def test_linear_system_sensitivities_match_expm(x64, method):
    # y(T) = expm(A T) y0: dy/dy0 = expm(A T), dy/dA[E] = expm_frechet(A T, E T) y0.
    A = jnp.array([[-0.5, 1.0, 0.0], [-1.0, -0.3, 0.2], [0.1, 0.0, -2.0]])
    y0 = jnp.array([1.0, -0.5, 0.3])
    T = 2.0
    ts = jnp.array([0.0, T])

    def final(A, y0):
        return odeint(linear, y0, ts, A, method=method, adjoint="forward", **TOL)[-1]

    dA, dy0 = jax.jit(jax.jacfwd(final, (0, 1)))(A, y0)
    An, y0n = np.asarray(A), np.asarray(y0)
    np.testing.assert_allclose(dy0, scipy.linalg.expm(An * T), rtol=1e-6, atol=1e-9)
    expected = np.zeros((3, 3, 3))
    for i in range(3):
        for j in range(3):
            E = np.zeros((3, 3))
            E[i, j] = 1.0
            _, dexp = scipy.linalg.expm_frechet(An * T, E * T)
            expected[:, i, j] = dexp @ y0n
    np.testing.assert_allclose(dA, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("method", FAST_METHODS)
def test_hessian_matches_closed_form(x64, method):
    # y' = -k y²: y(T) = y0 / (1 + k y0 T); jax.hessian (forward over reverse) and
    # jacfwd(jacfwd) against the formula's Hessian in (k, y0). kvaerno5's stage values
    # need a second chord correction for this (with one: 100% off).
    ts = jnp.array([0.0, 0.5, 2.0])

    def exact(p):
        k, y0 = p
        return y0 / (1 + k * y0 * ts[-1])

    def final(p):
        return odeint(riccati, p[1], ts, p[0], method=method, adjoint="forward",
                      rtol=1e-10, atol=1e-12)[-1]

    p = jnp.array([1.3, 0.8])
    expected, H, H_fwd = jax.jit(lambda p: (
        jax.hessian(exact)(p), jax.hessian(final)(p), jax.jacfwd(jax.jacfwd(final))(p)
    ))(p)
    assert rel(H, expected) < 1e-7
    assert rel(H_fwd, expected) < 1e-7


def _rotation(y, t, a, b):  # y' = [[-a, b], [-b, -a]] y: y(t) = e^{-at} R(bt) y0
    return jnp.stack([-a * y[0] + b * y[1], -b * y[0] - a * y[1]])


@pytest.mark.transforms("odeint", "hessian")
@pytest.mark.parametrize("method", [pytest.param("dopri5", marks=pytest.mark.slow),
                                    pytest.param("tsit5", marks=pytest.mark.slow),
                                    "kvaerno5", "bdf"])
def test_hessian_through_the_default_adjoint(x64, method):
    # (dopri5 in CI: test_second_derivatives_in_every_input_through_the_default_adjoint.)
    # Forward over reverse through the discrete adjoint (its tangent-linear: a second-order
    # adjoint), the steps held fixed: the Hessian of the computed map, so symmetric, and
    # the closed form's within 100x the tolerance (adjoint="forward"'s too, to 1e-15:
    # the same steps), the same whatever the checkpoints (adjoint_window=4: the tangents
    # go through several replayed segments). L = c·y(T) = e^{-aT} q(bT), q(θ) = c·R(θ) y0.
    T, y0, c = 1.5, np.array([1.0, 0.5]), np.array([0.3, -0.7])

    def loss(p, **kw):
        ys = odeint(_rotation, jnp.asarray(y0), jnp.array([0.0, 0.5, T]), p[0], p[1],
                    method=method, rtol=1e-10, atol=1e-12, **kw)
        return jnp.dot(jnp.asarray(c), ys[-1])

    a, b = 0.4, 1.3
    rot = np.array([[np.cos(b * T), np.sin(b * T)], [-np.sin(b * T), np.cos(b * T)]])
    drot = np.array([[-np.sin(b * T), np.cos(b * T)],
                             [-np.cos(b * T), -np.sin(b * T)]])
    q, dq, e = c @ rot @ y0, c @ drot @ y0, np.exp(-a * T)
    exact = T**2 * e * np.array([[q, -dq], [-dq, -q]])
    p = jnp.array([a, b])
    H = jax.jit(jax.hessian(loss))(p)
    assert rel(H, exact) < 1e-8
    np.testing.assert_allclose(H, H.T, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tsit5", "kvaerno5", "bdf"])
def test_reverse_over_reverse_through_the_default_adjoint(x64, method):
    # The second-order rules are the same code for every method (each method's own part,
    # its steps' tangent-linear, is jax.hessian's, above); in CI for dopri5 (below).
    T, y0, c = 1.5, np.array([1.0, 0.5]), np.array([0.3, -0.7])

    def loss(p):
        ys = odeint(_rotation, jnp.asarray(y0), jnp.array([0.0, 0.5, T]), p[0], p[1],
                    method=method, rtol=1e-10, atol=1e-12)
        return jnp.dot(jnp.asarray(c), ys[-1])

    p = jnp.array([0.4, 1.3])
    np.testing.assert_allclose(jax.jit(jax.jacrev(jax.jacrev(loss)))(p),
                               jax.jit(jax.hessian(loss))(p), rtol=1e-6, atol=1e-12)


@pytest.mark.transforms("odeint", "grad(grad)", "hessian")
def test_second_derivatives_in_every_input_through_the_default_adjoint(x64):
    # y' = -k y + c t: every input differentiated twice, y0, the output times (the first
    # one too) and the parameters, against the closed form differentiated by JAX as a
    # formula; jax.hessian (forward over reverse) and reverse over reverse agree with it,
    # the latter with adjoint_window=4 (the tangents go through several replayed segments).
    def exact_y(y0, t0, t, k, c):
        e = jnp.exp(-k * (t - t0))
        return y0 * e + c * ((t - 1 / k) - (t0 - 1 / k) * e) / k

    w = jnp.array([0.3, -1.1, 0.7])

    def loss_of(solve):
        def loss(p):
            y0, t0, t1, t2, k, c = p
            ys = solve(y0, jnp.stack([t0, t1, t2]), k, c)
            return jnp.dot(w, ys) + 0.5 * jnp.sum(ys**2)
        return loss

    def ours(**kw):
        return loss_of(lambda y0, ts, k, c: odeint(lambda y, t, k, c: -k * y + c * t, y0,
                                                    ts, k, c, rtol=1e-10, atol=1e-12, **kw))

    exact = loss_of(lambda y0, ts, k, c: exact_y(y0, ts[0], ts, k, c))
    p = jnp.array([1.3, 0.2, 0.9, 1.7, 0.8, 0.4])
    H = jax.hessian(exact)(p)
    # (One program: the rules' pieces are traced once.)
    H_fwd, H_rev = jax.jit(lambda p: (jax.hessian(ours())(p),
                                      jax.jacrev(jax.jacrev(ours(adjoint_window=4)))(p)))(p)
    assert rel(H_fwd, H) < 1e-8
    np.testing.assert_allclose(H_fwd, H_fwd.T, rtol=1e-12, atol=1e-14)
    assert rel(H_rev, H) < 1e-8


def test_third_derivatives_through_the_default_adjoint_name_the_option(x64):
    def final(k):
        return odeint(decay, 1.0, jnp.array([0.0, 1.0]), k)[-1]

    for third in (jax.grad(jax.grad(jax.grad(final))), jax.jacfwd(jax.hessian(final))):
        with pytest.raises(NotImplementedError, match="adjoint='forward'"):
            third(0.5)


@pytest.mark.slow
def test_third_derivative_of_the_stiff_method(x64):
    ts = jnp.array([0.0, 2.0])

    def exact(p):
        k, y0 = p
        return y0 / (1 + k * y0 * ts[-1])

    def final(p):
        return odeint(riccati, p[1], ts, p[0], method="kvaerno5", adjoint="forward",
                      rtol=1e-10, atol=1e-12)[-1]

    p = jnp.array([1.3, 0.8])
    third = jax.jacfwd(jax.hessian(final))(p)
    assert rel(third, jax.jacfwd(jax.hessian(exact))(p)) < 1e-6


@pytest.mark.slow
def test_hessian_of_lotka_volterra_loss_matches_differences_of_the_gradient(x64):
    ts = jnp.linspace(0.0, 10.0, 50)
    y0 = jnp.array([1.0, 1.0])

    def loss(p, adjoint="forward"):
        ys = odeint(lotka_volterra, y0, ts, *p, adjoint=adjoint, rtol=1e-10, atol=1e-10)
        return jnp.sum(ys**2)

    H = jax.hessian(loss)(LV_PARAMS)
    grad = jax.jit(jax.grad(lambda p: loss(p, "discrete")))
    eps = 1e-5
    fd = np.stack([(grad(LV_PARAMS + eps * e) - grad(LV_PARAMS - eps * e)) / (2 * eps)
                   for e in np.eye(4)])
    assert rel(H, fd) < 1e-6
    np.testing.assert_allclose(H, H.T, rtol=1e-9, atol=1e-9 * float(jnp.max(jnp.abs(H))))


@pytest.mark.transforms("odeint", "jvp, jacfwd", option='adjoint="forward"')
def test_forward_mode_under_jit_and_vmap(x64):
    ts = jnp.array([0.0, 0.5, 1.5])
    ks = jnp.array([0.3, 0.7, 1.1])

    def outputs(k, y0):
        return odeint(decay, y0, ts, k, adjoint="forward", **TOL)

    # d/dk y0 exp(-k t) = -t y0 exp(-k t); d/dy0 = exp(-k t).
    dk, (_, dy) = jax.jit(lambda ks: (
        jax.vmap(jax.jacfwd(outputs), (0, None))(ks, 2.0),
        jax.vmap(lambda k: jax.jvp(lambda y0: outputs(k, y0), (2.0,), (1.0,)))(ks),
    ))(ks)
    tsn, ksn = np.asarray(ts), np.asarray(ks)
    expected = -tsn[None] * 2.0 * np.exp(-ksn[:, None] * tsn[None])
    np.testing.assert_allclose(dk, expected, rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(dy, np.exp(-ksn[:, None] * tsn[None]), rtol=1e-7)


def test_forward_mode_through_closures_and_pytrees(x64):
    ts = jnp.array([0.0, 1.0])

    def final(k):
        def f(y, t):  # closes over k
            return {"a": -k * y["a"], "b": y["a"]}

        return odeint(f, {"a": 1.0, "b": 0.0}, ts, adjoint="forward", **TOL)["b"][-1]

    # b(1) = (1 - exp(-k)) / k.
    k = 0.8
    expected = (k * np.exp(-k) - (1 - np.exp(-k))) / k**2  # its derivative, by hand
    np.testing.assert_allclose(jax.jit(jax.jacfwd(final))(k), expected, rtol=1e-7)


def test_forward_mode_of_a_reverse_adjoint_names_the_option():
    def final(y0, method="dopri5"):
        return odeint(decay, y0, jnp.array([0.0, 1.0]), 0.5, method=method)[-1]

    # (Refused while tracing: under jit nothing is compiled first.)
    with pytest.raises(TypeError, match="adjoint='forward'"):
        jax.jit(jax.jacfwd(final))(1.0)
    np.testing.assert_allclose(
        jax.jit(jax.hessian(lambda k: odeint(decay, 1.0, jnp.array([0.0, 1.0]), k,
                                             adjoint="forward")[-1]))(0.5),
        np.exp(-0.5), rtol=1e-4,
    )


def test_forward_mode_failure_follows_on_failure(x64):
    def final(k, on_failure):
        return odeint(decay, 1.0, jnp.array([0.0, 10.0]), k, adjoint="forward",
                      max_steps=3, on_failure=on_failure)[-1]

    # Under a transformation the check runs in a host callback: a runtime error
    # carrying the ConvergenceError's message.
    with pytest.raises(Exception, match=r"did not converge: status 'max_steps'"):
        jax.block_until_ready(jax.jvp(lambda k: final(k, "raise"), (0.5,), (1.0,)))
    y, dy = jax.jvp(lambda k: final(k, "nan"), (0.5,), (1.0,))
    assert np.isnan(y) and np.isnan(dy)


def test_forward_with_bdf_or_an_event_is_refused_clearly():
    f = lambda y, t: -y  # noqa: E731
    ts = jnp.array([0.0, 1.0])
    with pytest.raises(ValueError, match="adjoint='forward' supports.*forward_adaptive"):
        odeint(f, 1.0, ts, method="bdf", adjoint="forward")
    with pytest.raises(ValueError, match="event= is differentiated in reverse mode"):
        odeint(f, 1.0, ts, adjoint="forward", event=lambda y, t: y - 0.5)


def test_forward_mode_with_bdf_names_forward_adaptive(x64):
    # bdf's reverse adjoint refused by forward mode names the adjoint that works for bdf
    # ('forward' does not), and that one gives d/dk exp(-k) = -exp(-k).
    def final(k, **kw):
        return odeint(lambda y, t, k: -k * y, 1.0, jnp.array([0.0, 1.0]), k, method="bdf",
                      rtol=1e-10, atol=1e-12, **kw)[-1]

    with pytest.raises(TypeError, match="adjoint='forward_adaptive'"):
        jax.jacfwd(final)(2.0)
    np.testing.assert_allclose(jax.jacfwd(lambda k: final(k, adjoint="forward_adaptive"))(2.0),
                               -np.exp(-2.0), rtol=1e-7)
