"""Tests of solvers.least_squares: fits, implicit derivatives, transformations, failures.

Expected values never come from the code under test: exact-data fits recover the
parameters that generated the data, NIST's certified values for Misra1a, and derivatives
with respect to the data from central finite differences of SciPy's fits (float64).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import solvers

METHODS = ("levenberg-marquardt", "gauss-newton")
SLOW = pytest.mark.slow
# The fast run covers Gauss-Newton on the exact-data fit; its other cases are `slow`.
LM_FAST = ["levenberg-marquardt", pytest.param("gauss-newton", marks=SLOW)]

T = np.linspace(0.0, 3.0, 12)
P_TRUE = np.array([2.5, 1.3])


def exp_fit(p, t, y):
    return p[0] * jnp.exp(-p[1] * t) - y


# NIST StRD Misra1a (lower difficulty): y = b1 (1 - exp(-b2 x)).
MISRA_X = np.array([77.6, 114.9, 141.1, 190.8, 239.9, 289.0, 332.8, 378.4, 434.8, 477.3,
                    536.8, 593.1, 689.1, 760.0])
MISRA_Y = np.array([10.07, 14.73, 17.94, 23.93, 29.61, 35.18, 40.02, 44.82, 50.76, 55.05,
                    61.01, 66.40, 75.47, 81.78])
MISRA_CERTIFIED = np.array([2.3894212918e02, 5.5015643181e-04])
MISRA_START1 = np.array([500.0, 1e-4])


def misra(b, x, y):
    return b[0] * (1.0 - jnp.exp(-b[1] * x)) - y


def misra_data_jacobian(b):
    """d b*/d y = H⁻¹ Jᵀ (the implicit function theorem on Jᵀr = 0, as ∂r/∂y = -I), with
    the Hessian H = JᵀJ + Σ rᵢ ∇²rᵢ of 0.5 ||r||² written out by hand."""
    x = MISRA_X
    e = np.exp(-b[1] * x)
    r = b[0] * (1.0 - e) - MISRA_Y
    jac = np.stack([1.0 - e, b[0] * x * e], axis=1)
    second = np.array([[0.0, np.sum(r * x * e)], [np.sum(r * x * e), -np.sum(r * b[0] * x**2 * e)]])
    return np.linalg.solve(jac.T @ jac + second, jac.T)


def scipy_exp_fit(y):
    fun = lambda p: p[0] * np.exp(-p[1] * T) - y  # noqa: E731
    return scipy.optimize.least_squares(fun, P_TRUE, method="lm", xtol=1e-15, ftol=1e-15,
                                        gtol=1e-15).x


@pytest.mark.parametrize("method", METHODS)
def test_exponential_fit_with_exact_data(method):
    y = P_TRUE[0] * np.exp(-P_TRUE[1] * T)
    p, info = solvers.least_squares(exp_fit, jnp.ones(2), T, y, method=method,
                                    full_output=True)
    np.testing.assert_allclose(p, P_TRUE, rtol=1e-4)
    assert bool(info.converged) and int(info.num_steps) > 0


def test_the_step_the_test_measured_is_taken(x64):
    # Converged on the Gauss-Newton step h at x, the solver returns x + h: on exact data
    # (quadratic convergence) 1.6e-12 from the parameters at rtol 1e-3, where x was
    # 1.8e-6 away (its step, which the test had just computed, not taken).
    y = P_TRUE[0] * np.exp(-P_TRUE[1] * T)
    for method in METHODS:
        p = solvers.least_squares(exp_fit, jnp.ones(2), T, y, method=method, rtol=1e-3,
                                  atol=1e-30)
        np.testing.assert_allclose(p, P_TRUE, rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", LM_FAST)
def test_nist_misra1a_from_start_1(method, x64):
    b, info = solvers.least_squares(misra, jnp.asarray(MISRA_START1), MISRA_X, MISRA_Y,
                                    method=method, full_output=True)
    np.testing.assert_allclose(b, MISRA_CERTIFIED, rtol=1e-8)
    b = np.asarray(b)  # the residual in NumPy
    rss = float(np.sum((b[0] * (1.0 - np.exp(-b[1] * MISRA_X)) - MISRA_Y) ** 2))
    np.testing.assert_allclose(rss, 1.2455138894e-01, rtol=1e-9)


@pytest.mark.transforms("least_squares", "jacrev")
def test_misra1a_gradient_wrt_data(x64):
    jac = jax.jit(jax.jacrev(lambda y: solvers.least_squares(
        misra, jnp.asarray(MISRA_START1), MISRA_X, y)))(jnp.asarray(MISRA_Y))
    # (The Hessian's condition number is about 6e13: central differences of fits lose
    # too many digits here, so the oracle is the closed-form formula.)
    np.testing.assert_allclose(jac, misra_data_jacobian(MISRA_CERTIFIED), rtol=1e-5)


@pytest.mark.parametrize("method", LM_FAST)
def test_gradient_wrt_noisy_data_vs_finite_differences(method, x64):
    y = P_TRUE[0] * np.exp(-P_TRUE[1] * T) + 0.05 * np.sin(7 * T)
    jac = jax.jit(jax.jacrev(lambda y: solvers.least_squares(exp_fit, jnp.ones(2), T, y,
                                                             method=method)))(jnp.asarray(y))
    eps = 1e-4
    fd = np.stack([(scipy_exp_fit(y + eps * e) - scipy_exp_fit(y - eps * e)) / (2 * eps)
                   for e in np.eye(len(y))], axis=1)
    # (SciPy's fits limit the differences to about 1e-5.)
    np.testing.assert_allclose(jac, fd, rtol=1e-4, atol=2e-5)


@SLOW
@pytest.mark.parametrize("method", METHODS)
def test_linear_least_squares_gradient_closed_form(method, x64):
    # Residual X w - y: w* = X⁺ y, dw*/dy = X⁺ (and a pytree residual works).
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 3))
    y = rng.normal(size=10)

    def residual(w, y):
        r = x @ w - y
        return {"head": r[:4], "tail": r[4:]}

    solve = lambda y: solvers.least_squares(residual, jnp.zeros(3), y, method=method)  # noqa: E731
    np.testing.assert_allclose(solve(y), np.linalg.lstsq(x, y, rcond=None)[0], rtol=1e-8)
    np.testing.assert_allclose(jax.jacrev(solve)(y), np.linalg.pinv(x), rtol=1e-7, atol=1e-10)


# Noisy curve fits: the minimum has non-zero residuals, where the decrease of 0.5 |r|²
# falls below its rounding before the step test passes (Levenberg-Marquardt then stalled
# with 'no_decrease': 6 of these 18 fits in float32 at the default tolerances, 13 in
# float64 at rtol 1e-12).
FIT_T = np.linspace(0.0, 3.0, 20)
FIT_MODELS = {  # xp: jnp for the solver, np for SciPy's reference fits
    "exp": (lambda x, t, xp=jnp: x[0] * xp.exp(-x[1] * t) + x[2], [2.0, 1.3, 0.2]),
    "gauss": (lambda x, t, xp=jnp: x[0] * xp.exp(-((t - x[1]) ** 2) / (2 * x[2] ** 2)),
              [1.0, 1.5, 0.6]),
    "rational": (lambda x, t, xp=jnp: (x[0] + x[1] * t) / (1 + x[2] * t), [1.0, 0.5, 0.3]),
}


@pytest.mark.transforms("least_squares", "vmap")
@pytest.mark.parametrize("model", FIT_MODELS)
@pytest.mark.parametrize("dtype, rtol, close", [("float32", None, 1e-3),
                                                ("float64", 1e-12, 1e-6)])
def test_noisy_fits_converge_to_scipys_minimum(model, dtype, rtol, close, x64):
    m, truth = FIT_MODELS[model]
    truth = np.asarray(truth)
    rng = np.random.default_rng(0)
    ys = m(truth, FIT_T, np)[None] + 0.05 * rng.standard_normal((6, FIT_T.size))
    t = jnp.asarray(FIT_T, dtype)

    def fit(y):
        return solvers.least_squares(lambda x, y: m(x, t) - y, jnp.asarray(1.3 * truth, dtype),
                                     y, rtol=rtol, atol=None if rtol is None else 1e-14)

    xs = np.asarray(jax.jit(jax.vmap(fit))(jnp.asarray(ys, dtype)))  # raises if one fails
    if dtype == "float64":  # the model and its Jacobian at the fits: one program
        values, jacs = jax.jit(jax.vmap(lambda x: (m(x, FIT_T), jax.jacfwd(m)(x, FIT_T))))(xs)
    for i, (x, y) in enumerate(zip(xs, ys)):
        ref = scipy.optimize.least_squares(lambda p: m(p, FIT_T, np) - y, 1.3 * truth,
                                           method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15).x
        np.testing.assert_allclose(x, ref, rtol=close, atol=close)
        if dtype == "float64":  # stationary (SciPy stops at |Jᵀr| ~ 1e-9 here)
            residual = np.asarray(values[i]) - y
            jac = np.asarray(jacs[i])
            scale = np.linalg.norm(jac) * np.linalg.norm(residual)
            assert np.max(np.abs(jac.T @ residual)) <= 1e-10 * scale


def test_minimum_with_zero_jacobian_converges_on_the_first_order_condition(x64):
    # r = (x - a)² + 5: at the minimum x = a, J = 0 and r = 5, so the Gauss-Newton step
    # -r/J that the test measured grows without bound while Jᵀr -> 0 (from [0, 1] the
    # solve ended `no_decrease` at |Jᵀr| = 4e-15). A guess at the minimum (J = 0 exactly)
    # is returned after zero steps.
    solve = jax.jit(jax.vmap(lambda x0, a: solvers.least_squares(
        lambda x, a: (x - a) ** 2 + 5.0, x0, a, full_output=True), in_axes=(0, None)))
    x, info = solve(jnp.array([[0.0, 1.0], [np.pi, np.pi]]), jnp.pi)
    assert list(info.status_name) == ["converged", "converged"]
    assert int(info.num_steps[1]) == 0
    np.testing.assert_allclose(x, np.pi, rtol=1e-12)


# Madsen and Nielsen's scaled Meyer fit (Introduction to Optimization and Data Fitting,
# example 6.21; jaxopt's test): cond(J) about 6e8 on the way from (40, 50, 30).
MEYER_T = np.linspace(0.5, 1.25, 16)
MEYER_Y = np.array([34780, 28610, 23650, 19630, 16370, 13720, 11540, 9744, 8261, 7030, 6005,
                    5147, 4427, 3820, 3307, 2872.0])


def meyer(c, t, y):
    return 1e-3 * y - c[0] * jnp.exp(10 * c[1] / (t + c[2]) - 13)


def test_damping_is_the_initial_levenberg_marquardt_damping(x64):
    # One step from x0: h = -(JᵀJ + damping diag(JᵀJ))⁻¹ Jᵀr, written out with NumPy.
    x0 = np.array([40.0, 50.0, 30.0])
    e = np.exp(10 * x0[1] / (MEYER_T + x0[2]) - 13)  # r and J in closed form (NumPy)
    r = 1e-3 * MEYER_Y - x0[0] * e
    jac = np.stack([-e, -x0[0] * e * 10 / (MEYER_T + x0[2]),
                    x0[0] * e * 10 * x0[1] / (MEYER_T + x0[2]) ** 2], axis=1)
    step = jax.jit(lambda damping: solvers.least_squares(
        meyer, jnp.asarray(x0), MEYER_T, MEYER_Y, damping=damping, max_steps=1,
        on_failure="ignore"))
    for damping in (1e-3, 10.0):
        h = -np.linalg.solve(jac.T @ jac + damping * np.diag(np.sum(jac**2, 0)), jac.T @ r)
        np.testing.assert_allclose(step(damping) - x0, h, rtol=1e-6)
    with pytest.raises(ValueError, match="`damping` must be a positive finite number"):
        solvers.least_squares(meyer, jnp.asarray(x0), MEYER_T, MEYER_Y, damping=-1.0)
    with pytest.raises(ValueError, match="`damping` is Levenberg.*'gauss-newton'"):
        solvers.least_squares(meyer, jnp.asarray(x0), MEYER_T, MEYER_Y, damping=10.0,
                              method="gauss-newton")


def test_x_scale_settles_a_small_unknown_to_its_own_size(x64):
    """Residuals (x1 - 2, (x2 - 1e-12)²): Gauss–Newton's step on the second halves the
    error each time, and the first-order test cannot pass before the step test (Jᵀr is
    (x2 - c)³ against a rounding bound of the same order), so the step test decides:
    without ``x_scale`` x2 is settled to ``atol`` (1e-10, 100x its size), with its size
    given to ``rtol`` of it (the closed form's 1e-12)."""
    c = 1e-12

    @jax.jit
    def fit(x_scale):
        return solvers.least_squares(lambda x: jnp.stack([x[0] - 2.0, (x[1] - c) ** 2]),
                                     jnp.array([1.0, 1e-9]), x_scale=x_scale,
                                     max_steps=400, full_output=True)

    (x, info), (xs, info_s) = fit(None), fit(jnp.array([1.0, c]))
    assert bool(info.converged) and bool(info_s.converged)
    assert abs(float(x[1]) - c) > 10 * c
    assert abs(float(xs[1]) - c) <= 1e-6 * c
    with pytest.raises(ValueError, match="`x_scale` must be positive"):
        solvers.least_squares(lambda x: x - 1.0, jnp.ones(2), x_scale=jnp.array([1.0, -2.0]))


def test_scaled_meyer_fit_is_solved_in_float64(x64):
    # SciPy's MINPACK: (2.48177814, 6.1813464, 3.45223636), 0.5 |r|² = 4.3972928e-05. The
    # step solved the normal equations (cond 4e17: beyond float64) and the runner called
    # the solve `stagnated` after 50 steps as the Gauss-Newton step grew while the cost
    # fell (282 at the end).
    x, info = solvers.least_squares(meyer, jnp.array([40.0, 50.0, 30.0]), MEYER_T, MEYER_Y,
                                    max_steps=2000, full_output=True)
    np.testing.assert_allclose(x, [2.48177814, 6.1813464, 3.45223636], rtol=1e-7)
    assert info.status_name == "converged"


@pytest.mark.transforms("least_squares", "jit", "grad", "grad(grad)")
@pytest.mark.transforms("least_squares", "jvp, jacfwd", "hessian", option='rule="jvp"')
def test_every_mode_of_differentiation_on_scaled_data(x64):
    # Exact data scaled by s: p*(s) = (s a, b), so d p*/ds = (a, 0) and d²(a*²)/ds² = 2 a².
    y = jnp.asarray(P_TRUE[0] * np.exp(-P_TRUE[1] * T))

    def solve(s, rule="vjp"):
        return solvers.least_squares(exp_fit, jnp.ones(2), T, s * y, rule=rule)

    def a_squared(s, rule="vjp"):
        return solve(s, rule)[0] ** 2

    @jax.jit
    def derivatives(s):
        return (jax.grad(a_squared)(s), jax.grad(jax.grad(a_squared))(s),
                jax.jacfwd(lambda s: solve(s, "jvp"))(s),
                jax.hessian(lambda s: a_squared(s, "jvp"))(s))

    g, gg, jac, hess = derivatives(1.0)
    a = P_TRUE[0]
    np.testing.assert_allclose(g, 2 * a**2, rtol=1e-7)
    np.testing.assert_allclose(gg, 2 * a**2, rtol=1e-6)
    np.testing.assert_allclose(jac, [a, 0.0], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(hess, 2 * a**2, rtol=1e-6)


def test_residual_with_custom_vjp(x64):
    # A custom_vjp residual has no forward mode: its Jacobian is formed in reverse mode
    # (jacfwd failed, and the message advised rule='jvp', which failed alike). At exact
    # data dp*/dy = J⁺ (the implicit function theorem on Jᵀr = 0 with r = 0).
    t = jnp.asarray(T)

    @jax.custom_vjp
    def model(p):
        return p[0] * jnp.exp(-p[1] * t)

    def model_fwd(p):
        return model(p), p

    def model_bwd(p, ct):
        e = jnp.exp(-p[1] * t)
        return (jnp.stack([jnp.sum(ct * e), -jnp.sum(ct * p[0] * t * e)]),)

    model.defvjp(model_fwd, model_bwd)
    y = jnp.asarray(P_TRUE[0] * np.exp(-P_TRUE[1] * T))
    e = np.exp(-P_TRUE[1] * T)
    expected = np.linalg.pinv(np.stack([e, -P_TRUE[0] * T * e], axis=1))

    def solve(y, rule="vjp", method="levenberg-marquardt"):
        return solvers.least_squares(lambda p, y: model(p) - y, jnp.ones(2), y, rule=rule,
                                     method=method)

    p, jac = jax.jit(lambda y: (solve(y, method="gauss-newton"), jax.jacrev(solve)(y)))(y)
    np.testing.assert_allclose(p, P_TRUE, rtol=1e-8)
    np.testing.assert_allclose(jac, expected, rtol=1e-6, atol=1e-9)
    # Forward mode through a custom_vjp is impossible: the message says what works.
    with pytest.raises(TypeError, match=r"rule='jvp'.*custom_vjp has no forward mode.*"
                                        r"reverse mode \(jax.grad, jax.jacrev\)"):
        jax.jacfwd(solve)(y)
    with pytest.raises(TypeError, match=r"forward rule: a residual written with "
                                        r"jax.custom_vjp has no forward mode"):
        jax.jacfwd(lambda y: solve(y, "jvp"))(y)


def test_scaled_meyer_fit_in_float32_is_solved_or_fails_loudly():
    # lstsq dropped two singular values (cond(J) 6e8 > 1/eps): the Gauss-Newton step
    # the test measured was tiny while the true one is huge, and the solve reported
    # 'converged' at (1.2e-5, 55.6, 19.8), cost 255 against 4.4e-5.
    solve = jax.jit(lambda damping: solvers.least_squares(
        meyer, jnp.array([40.0, 50.0, 30.0]), MEYER_T, MEYER_Y, damping=damping,
        max_steps=2000, on_failure="ignore", full_output=True))
    for damping in (1e-3, 10.0):
        x, info = solve(damping)
        cost = 0.5 * float(np.sum(np.asarray(meyer(np.asarray(x, np.float64), MEYER_T,
                                                     MEYER_Y)) ** 2))
        if info.status_name == "converged":
            np.testing.assert_allclose(x, [2.48177814, 6.1813464, 3.45223636], rtol=1e-3)
        assert cost < 1e-4 or info.status_name != "converged", (damping, cost)


def bvp(x):
    """SciPy's least_squares test problem: a discrete boundary-value problem on a 10 x 10
    grid, ``Δu + u³`` with zero boundary values."""
    n = 10
    u = jnp.zeros((n + 2, n + 2), x.dtype).at[1:-1, 1:-1].set(x.reshape(n, n))
    x = x.reshape(n, n)
    return (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4 * x + x**3).ravel()


def test_gauss_newton_reaches_scipys_cost_on_its_boundary_value_problem(x64):
    # A line search along the Gauss-Newton step stalled at cost 19.8 (|Jᵀr| 8.9) after
    # 1000 steps: J is nearly singular there and the step almost orthogonal to the
    # gradient. In a dogleg trust region it reaches SciPy's local minimum.
    fun, jac = jax.jit(bvp), jax.jit(jax.jacfwd(bvp))  # (compiled once for SciPy's calls)
    ref = scipy.optimize.least_squares(lambda x: np.asarray(fun(x)), np.ones(100),
                                       jac=lambda x: np.asarray(jac(x)))
    x = jax.jit(lambda x0: solvers.least_squares(bvp, x0, method="gauss-newton",
                                                 max_steps=100, on_failure="ignore"))(
        jnp.ones(100))
    cost = 0.5 * float(np.sum(np.asarray(fun(x)) ** 2))
    assert ref.cost < 0.2874 and cost < 1.001 * ref.cost, (cost, ref.cost)


def test_underdetermined_fit_has_no_gradient_and_says_so(x64):
    # 2 residuals, 4 unknowns: a line of minimisers, where JᵀJ is singular and the
    # implicit gradient does not exist. The dense adjoint's LU still returned finite
    # values (rounding leaves its pivots non-zero) that solve nothing: a gradient of
    # O(1) garbage, with no error. Now its residual (3.3 x norm(b)) is checked; the
    # message was also unreadable under jacrev ("only 0-dimensional arrays can be
    # converted to Python scalars": its operands come batched there).
    rng = np.random.default_rng(0)
    a, b = jnp.asarray(rng.standard_normal((2, 4))), jnp.asarray(rng.standard_normal(2))

    def fit(b, **kw):
        return solvers.least_squares(lambda x, b: a @ x - b, jnp.zeros(4), b, **kw)

    for method in METHODS:
        with pytest.raises(Exception, match=r"adjoint linear solve \(linear_solver='dense'\) "
                                            r"did not converge: relative residual .*4 of 4"):
            jax.block_until_ready(jax.jacrev(lambda b: fit(b, method=method))(b))
        assert np.all(np.isnan(jax.jit(jax.jacrev(
            lambda b: fit(b, method=method, on_failure="nan")))(b)))


def test_jit_vmap(x64):
    ys = np.stack([P_TRUE[0] * np.exp(-P_TRUE[1] * T), 2.0 * np.exp(-0.5 * T)])
    solve = jax.jit(lambda y: solvers.least_squares(exp_fit, jnp.ones(2), T, y))
    np.testing.assert_allclose(jax.vmap(solve)(ys), [P_TRUE, [2.0, 0.5]], rtol=1e-7)


@SLOW
def test_pytree_guess_and_grad_of_grad(x64):
    ys = jnp.stack([P_TRUE[0] * jnp.exp(-P_TRUE[1] * T), 2.0 * jnp.exp(-0.5 * T)])

    def residual(p, t, y):
        return p["a"] * jnp.exp(-p["b"] * t) - y

    p = solvers.least_squares(residual, {"a": 1.0, "b": 1.0}, T, ys[0])
    np.testing.assert_allclose([p["a"], p["b"]], P_TRUE, rtol=1e-7)
    # Scaling the data by s scales a* by s: d²(a*²)/ds² = 2 a*².
    f = lambda s: solvers.least_squares(exp_fit, jnp.ones(2), T, s * ys[0])[0] ** 2  # noqa: E731
    np.testing.assert_allclose(jax.grad(jax.grad(f))(1.0), 2 * P_TRUE[0] ** 2, rtol=1e-6)


@SLOW
def test_closed_over_data(x64):
    def loss(y):
        fit = lambda p: exp_fit(p, T, y)  # noqa: E731
        return solvers.least_squares(fit, jnp.ones(2))[0]

    y = P_TRUE[0] * np.exp(-P_TRUE[1] * T)
    # a* is linear in the data's scale at exact data: grad · y = a*.
    np.testing.assert_allclose(jnp.dot(jax.grad(loss)(jnp.asarray(y)), y), P_TRUE[0],
                               rtol=1e-7)


def test_failures():
    y = jnp.asarray(P_TRUE[0] * np.exp(-P_TRUE[1] * T))
    with pytest.raises(solvers.ConvergenceError,
                       match=r"solvers.least_squares\(method='levenberg-marquardt'\).*max_steps"):
        solvers.least_squares(exp_fit, jnp.array([10.0, -2.0]), T, y, max_steps=2)
    t = jnp.asarray(T)
    nan_fit = lambda p, c: exp_fit(p, t, y) * jnp.sqrt(c)  # noqa: E731
    ps, info = jax.jit(jax.vmap(lambda c: solvers.least_squares(
        nan_fit, jnp.ones(2), c, on_failure="nan", full_output=True)))(jnp.array([1.0, -1.0]))
    assert list(info.status_name) == ["converged", "nonfinite"]
    np.testing.assert_allclose(ps[0], P_TRUE, rtol=1e-4)
    assert np.all(np.isnan(ps[1]))


def test_bad_input():
    with pytest.raises(TypeError, match="`residual` must be callable"):
        solvers.least_squares("r", jnp.zeros(2))
    with pytest.raises(ValueError, match=r"unknown `method`='lm'.*'levenberg-marquardt'"):
        solvers.least_squares(lambda x: x, jnp.zeros(2), method="lm")
    with pytest.raises(ValueError, match="real floating"):
        solvers.least_squares(lambda x: x > 0, jnp.zeros(2))
