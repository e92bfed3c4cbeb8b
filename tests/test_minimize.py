"""Tests of solvers.minimize: minima, implicit derivatives, transformations, failures.

Expected values never come from the code under test: minimisers and their derivatives
are known in closed form (quadratics, ridge regression, Rosenbrock) or come from
float64 central finite differences of a closed-form solution.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers

METHODS = ("lbfgs", "bfgs", "gradient", "newton-cg")
# The fast run covers each method once (Rosenbrock, max_steps); the rest is `slow`.
SLOW = pytest.mark.slow

# Quadratic 0.5 xᵀA x - bᵀx: argmin A⁻¹ b, d x*/d b = A⁻¹.
A = np.array([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])
B = np.array([1.0, -2.0, 0.5])


def quadratic(x, a, b):
    return 0.5 * x @ a @ x - b @ x


def _adam():
    import optax

    return optax.adam(0.05)


ADAM = _adam()  # created once: compiled solvers are cached per transformation object


def rosenbrock(x):
    return 100.0 * (x[1] - x[0] ** 2) ** 2 + (1.0 - x[0]) ** 2


# Ridge regression: argmin 0.5 ||X w - y||² + 0.5 lam ||w||² = (XᵀX + lam I)⁻¹ Xᵀy,
# dw/dlam = -(XᵀX + lam I)⁻¹ w.
RNG = np.random.default_rng(0)
X_DATA = RNG.normal(size=(20, 4))
Y_DATA = RNG.normal(size=20)


def ridge(w, lam, x, y):
    return 0.5 * jnp.sum((x @ w - y) ** 2) + 0.5 * lam * jnp.sum(w**2)


def ridge_solution(lam):
    m = X_DATA.T @ X_DATA + lam * np.eye(4)
    w = np.linalg.solve(m, X_DATA.T @ Y_DATA)
    return w, -np.linalg.solve(m, w)


@pytest.mark.transforms("minimize", "jacrev")
@pytest.mark.parametrize("method", [METHODS[0]] + [pytest.param(m, marks=SLOW)
                                                    for m in METHODS[1:]])
def test_quadratic_minimum_and_gradient(method, x64):
    a, b = jnp.asarray(A), jnp.asarray(B)

    def solve(b):
        return solvers.minimize(quadratic, jnp.zeros(3), a, b, method=method)

    x, jac = jax.jit(lambda b: (solve(b), jax.jacrev(solve)(b)))(b)  # one program
    np.testing.assert_allclose(x, np.linalg.solve(A, B), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(jac, np.linalg.inv(A), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("method", ("lbfgs", "bfgs", "newton-cg"))
def test_rosenbrock(method, x64):
    x, info = solvers.minimize(rosenbrock, jnp.array([-1.2, 1.0]), method=method,
                               full_output=True)
    np.testing.assert_allclose(x, [1.0, 1.0], atol=1e-5)
    assert bool(info.converged) and info.status_name == "converged"
    assert 0 < int(info.num_steps) < 200


def test_rosenbrock_float32_lbfgs():
    x = solvers.minimize(rosenbrock, jnp.array([-1.2, 1.0]))
    assert x.dtype == jnp.float32
    np.testing.assert_allclose(x, [1.0, 1.0], atol=2e-3)


def test_ridge_gradient_wrt_regularisation(x64):
    x, y = jnp.asarray(X_DATA), jnp.asarray(Y_DATA)
    solve = lambda lam: solvers.minimize(ridge, jnp.zeros(4), lam, x, y)  # noqa: E731
    w_expected, dw_expected = ridge_solution(0.3)
    w, dw = jax.jit(lambda lam: (solve(lam), jax.jacrev(solve)(lam)))(0.3)  # one program
    np.testing.assert_allclose(w, w_expected, rtol=1e-7)
    np.testing.assert_allclose(dw, dw_expected, rtol=1e-6)


@SLOW
def test_ridge_forward_mode_with_jvp_rule(x64):
    x, y = jnp.asarray(X_DATA), jnp.asarray(Y_DATA)
    _, dw_expected = ridge_solution(0.3)
    np.testing.assert_allclose(jax.jacfwd(lambda lam: solvers.minimize(
        ridge, jnp.zeros(4), lam, x, y, rule="jvp"))(0.3), dw_expected, rtol=1e-6)


@SLOW
def test_gradient_matches_finite_differences(x64):
    # A non-quadratic objective: compare with central differences of the solution.
    def fun(x, theta):
        return jnp.sum(jnp.cosh(x - theta[0])) + theta[1] * jnp.sum(x**4) - theta[2] * x[0]

    theta = jnp.array([0.3, 0.5, 1.2])
    loss = lambda th: jnp.sum(solvers.minimize(fun, jnp.zeros(3), th) ** 2)  # noqa: E731
    grad = jax.grad(loss)(theta)
    eps = 1e-5
    fd = [(loss(theta.at[i].add(eps)) - loss(theta.at[i].add(-eps))) / (2 * eps)
          for i in range(3)]
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)


@pytest.mark.transforms("minimize", "jit", "vmap", "grad", "grad(grad)")
def test_jit_vmap_and_grad_of_grad(x64):
    a = jnp.asarray(A)
    bs = jnp.stack([jnp.asarray(B), 2.0 * jnp.asarray(B)])
    solve = jax.jit(lambda b: solvers.minimize(quadratic, jnp.zeros(3), a, b))
    # d²/ds² of sum(x*(s b))² = 2 |A⁻¹ b|² (x* is linear in s).
    f = lambda s: jnp.sum(solvers.minimize(quadratic, jnp.zeros(3), a, s * bs[0]) ** 2)  # noqa: E731
    xs, gg = jax.jit(lambda bs, s: (jax.vmap(solve)(bs), jax.grad(jax.grad(f))(s)))(bs, 1.0)
    np.testing.assert_allclose(xs, np.linalg.solve(A, np.asarray(bs).T).T, rtol=1e-6)
    expected = 2 * np.sum(np.linalg.solve(A, B) ** 2)
    np.testing.assert_allclose(gg, expected, rtol=1e-6)


@pytest.mark.transforms("minimize", "jvp, jacfwd", "hessian", option='rule="jvp"')
def test_forward_mode_and_hessian_with_jvp_rule(x64):
    # x*(b) = A⁻¹ b: jacfwd is A⁻¹, and the Hessian of |x*(b)|² is 2 A⁻ᵀ A⁻¹.
    a = jnp.asarray(A)

    def solve(b):
        return solvers.minimize(quadratic, jnp.zeros(3), a, b, rule="jvp")

    jac, hess = jax.jit(lambda b: (jax.jacfwd(solve)(b),
                                   jax.hessian(lambda b: jnp.sum(solve(b) ** 2))(b)))(B)
    inv = np.linalg.inv(A)
    np.testing.assert_allclose(jac, inv, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(hess, 2 * inv.T @ inv, rtol=1e-6, atol=1e-8)


def test_pytree_guess_and_closed_over_parameter(x64):
    def fun(p, scale):
        return jnp.sum((p["a"] - target) ** 2) + scale * (p["b"] - 1.0) ** 2 + p["b"] ** 4

    def loss(t):
        nonlocal target
        target = t
        p = solvers.minimize(fun, {"a": jnp.zeros(2), "b": 0.0}, 2.0)
        return jnp.sum(p["a"] ** 2) + p["b"]

    target = None
    t0 = jnp.array([0.5, -1.0])
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(t0), 2 * t0, rtol=1e-6)


def test_has_aux_returns_aux_at_the_solution(x64):
    def fun(x, b):
        value = 0.5 * jnp.sum((x - b) ** 2)
        return value, {"value": value, "double": 2 * x}

    b = jnp.array([1.0, 2.0])
    jac = jax.jacrev(lambda b: solvers.minimize(fun, jnp.zeros(2), b, has_aux=True)[1]["double"])
    (x, aux, info), jac_b = jax.jit(lambda b: (  # one program
        solvers.minimize(fun, jnp.zeros(2), b, has_aux=True, full_output=True), jac(b)))(b)
    assert bool(info.converged)
    np.testing.assert_allclose(x, b, rtol=1e-8)
    np.testing.assert_allclose(aux["double"], 2 * b, rtol=1e-8)
    # aux is differentiable through x*: d(2 x*)/db = 2 I.
    np.testing.assert_allclose(jac_b, 2 * np.eye(2), rtol=1e-8)


def test_guess_at_the_minimum_takes_zero_steps():
    x, info = solvers.minimize(lambda x: jnp.sum(x**2), jnp.zeros(3), full_output=True)
    assert int(info.num_steps) == 0 and bool(info.converged)


def test_max_steps_raises_and_names_the_solver():
    with pytest.raises(solvers.ConvergenceError, match=r"solvers.minimize\(method='gradient'\)"
                       r".*max_steps"):
        solvers.minimize(rosenbrock, jnp.array([-1.2, 1.0]), method="gradient", max_steps=5)
    # Under jit the run-time error carries the same message.
    with pytest.raises(Exception, match=r"solvers.minimize\(method='lbfgs'\) did not converge"):
        jax.block_until_ready(jax.jit(lambda x0: solvers.minimize(
            rosenbrock, x0, max_steps=3))(jnp.array([-1.2, 1.0])))


def test_nan_objective_and_nan_policy():
    fun = lambda x, c: jnp.sum((x - 1.0) ** 2) + jnp.log(c)  # noqa: E731
    x, info = solvers.minimize(fun, jnp.zeros(2), -1.0, on_failure="ignore",
                               full_output=True)
    assert info.status_name == "nonfinite"
    # 'nan' marks exactly the failed batch elements.
    xs = jax.jit(jax.vmap(lambda c: solvers.minimize(fun, jnp.zeros(2), c, on_failure="nan")))(
        jnp.array([2.0, -1.0]))
    np.testing.assert_allclose(xs[0], [1.0, 1.0], rtol=1e-4)
    assert np.all(np.isnan(xs[1]))


def test_bad_input():
    with pytest.raises(TypeError, match="`fun` must be callable"):
        solvers.minimize(3.0, jnp.zeros(2))
    with pytest.raises(ValueError, match=r"`fun` must return a scalar \(shape \(\)\).*\(2,\)"):
        solvers.minimize(lambda x: x**2, jnp.zeros(2))
    with pytest.raises(ValueError, match="has_aux=True must return a pair"):
        solvers.minimize(lambda x: jnp.sum(x), jnp.zeros(2), has_aux=True)
    with pytest.raises(ValueError, match=r"unknown `method`='newton'.*'lbfgs', 'bfgs'"):
        solvers.minimize(lambda x: jnp.sum(x**2), jnp.zeros(2), method="newton")
    with pytest.raises(ValueError, match="rtol"):
        solvers.minimize(lambda x: jnp.sum(x**2), jnp.zeros(2), rtol=-1.0)


def test_optax_transformation_runs_to_convergence(x64):
    import optax

    a, b = jnp.asarray(A), jnp.asarray(B)
    (x, info), jac = jax.jit(lambda b: (  # one program
        solvers.minimize(quadratic, jnp.zeros(3), a, b, method=ADAM, max_steps=5000,
                         full_output=True),
        jax.jacrev(lambda b: solvers.minimize(quadratic, jnp.zeros(3), a, b, method=ADAM,
                                              max_steps=5000))(b)))(b)
    assert bool(info.converged)
    np.testing.assert_allclose(x, np.linalg.solve(A, B), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(jac, np.linalg.inv(A), rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="or an optax GradientTransformation"):
        solvers.minimize(quadratic, jnp.zeros(3), a, b, method=optax)


@SLOW
def test_optax_transformation_with_extra_args():
    import optax

    # A transformation that takes extra arguments (optax's own L-BFGS with line search),
    # on a pytree guess.
    fun = lambda p: rosenbrock(jnp.stack([p["u"], p["v"]]))  # noqa: E731
    p = solvers.minimize(fun, {"u": -1.2, "v": 1.0}, method=optax.lbfgs())
    np.testing.assert_allclose([p["u"], p["v"]], [1.0, 1.0], atol=2e-3)


def test_auto_linear_solver():
    from solvers.minimize import auto_linear_solver

    assert auto_linear_solver(jnp.zeros(10), "raise") == "dense"
    assert auto_linear_solver(jnp.zeros(100), "raise") == "cg"
    assert auto_linear_solver(jnp.zeros(100), "ignore") == "gmres"


# --- box bounds ------------------------------------------------------------------------------


def _boxed(x, c):
    return 0.5 * jnp.sum((x - c) ** 2) + 0.1 * jnp.sum(x**4)


@pytest.mark.parametrize("method", [*METHODS, ADAM])
def test_bounds_solution_and_implicit_derivative(method, x64):
    # Separable: each x_i minimises 0.5 (x - c_i)^2 + 0.1 x^4 on [0, 1]. Free coordinates
    # solve x + 0.4 x^3 = c (dx/dc = 1 / (1 + 1.2 x^2)); c_0 < 0 and c_2 > 1.4 put x_0 and
    # x_2 on a bound (dx/dc = 0 there, dx/d(bound) = 1).
    c = jnp.array([-1.0, 0.5, 2.0, 0.3])
    solve = jax.jit(lambda c, hi: solvers.minimize(_boxed, jnp.full(4, 0.5), c, method=method,
                                                   lower=0.0, upper=hi, max_steps=5000))
    x = np.asarray(solve(c, 1.0))
    free = np.array([np.roots([0.4, 0, 1, -ci]).real[np.abs(np.roots([0.4, 0, 1, -ci]).imag)
                                                        < 1e-12][0] for ci in (0.5, 0.3)])
    np.testing.assert_allclose(x, [0.0, free[0], 1.0, free[1]], atol=1e-6)
    if method != ADAM:  # (derivatives: once is enough)
        return
    jac, g_hi = jax.jit(lambda c, hi: (jax.jacobian(solve)(c, hi),  # one program
                                       jax.grad(lambda hi: solve(c, hi)[2])(hi)))(c, 1.0)
    jac = np.asarray(jac)
    np.testing.assert_allclose(np.diag(jac), [0.0, *(1 / (1 + 1.2 * free**2))][:2] +
                               [0.0, 1 / (1 + 1.2 * free[1] ** 2)], atol=1e-6)
    np.testing.assert_allclose(jac - np.diag(np.diag(jac)), 0.0, atol=1e-8)
    np.testing.assert_allclose(g_hi, 1.0, rtol=1e-8)


@pytest.mark.parametrize("method", METHODS)
def test_coupled_bounds_nonnegative_least_squares_against_scipy_nnls(method, x64):
    # min 0.5 |A x - b|² with x >= 0 at the default tolerances: a Hessian AᵀA that couples
    # the free coordinates to the active ones (newton-cg solved with the whole Hessian, not
    # its free block, and stagnated: float64, 1 of these 8; float32, 3).
    import scipy.optimize

    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 40, 15))
    b = rng.standard_normal((8, 40))

    def solve(a, b):
        return solvers.minimize(lambda x, a, b: 0.5 * jnp.sum((a @ x - b) ** 2),
                                jnp.full(15, 0.5), a, b, method=method, lower=0.0,
                                max_steps=5000)

    xs = np.asarray(jax.jit(jax.vmap(solve))(jnp.asarray(a), jnp.asarray(b)))
    for x, ai, bi in zip(xs, a, b):
        np.testing.assert_allclose(x, scipy.optimize.nnls(ai, bi)[0], atol=1e-6)


def test_singular_hessian_at_the_minimum_has_no_gradient_and_says_so(x64):
    # 0.5 xᵀHx - aᵀx with H of rank 2 (in a rotated basis): a plane of minimisers, no
    # implicit gradient. The dense adjoint's LU returned a finite "gradient" of 1e16.
    q = np.linalg.qr(np.random.default_rng(1).standard_normal((4, 4)))[0]
    h = jnp.asarray(q[:, :2] @ np.diag([1.0, 3.0]) @ q[:, :2].T)

    def total(a):
        return solvers.minimize(lambda x, a: 0.5 * x @ h @ x - a @ x, jnp.zeros(4), a).sum()

    with pytest.raises(Exception, match=r"linear_solver='dense'\) did not converge"):
        jax.block_until_ready(jax.grad(total)(h @ jnp.ones(4)))


def test_bounds_rosenbrock_against_scipy_lbfgsb(x64):
    import scipy.optimize

    def rosen(x):
        return 100.0 * (x[1] - x[0] ** 2) ** 2 + (1.0 - x[0]) ** 2

    lower, upper = np.array([-2.0, -2.0]), np.array([0.5, 2.0])
    ref = scipy.optimize.minimize(lambda x: float(rosen(x)), np.array([-1.2, 1.0]),
                                  jac=lambda x: np.array([  # closed form, in NumPy
                                      -400.0 * x[0] * (x[1] - x[0] ** 2) - 2 * (1.0 - x[0]),
                                      200.0 * (x[1] - x[0] ** 2)]),
                                  method="L-BFGS-B", bounds=list(zip(lower, upper)),
                                  options={"ftol": 1e-15, "gtol": 1e-12}).x
    for method in ("lbfgs", "bfgs"):
        x = solvers.minimize(rosen, jnp.array([-1.2, 1.0]), method=method,
                             lower=jnp.asarray(lower), upper=jnp.asarray(upper))
        np.testing.assert_allclose(x, ref, atol=1e-6)
        assert float(x[0]) == 0.5  # on the bound


def test_inactive_bounds_change_nothing_and_bad_bounds_are_reported(x64):
    a, b = jnp.asarray(A), jnp.asarray(B)
    x, g = jax.jit(lambda b: (  # one program
        solvers.minimize(quadratic, jnp.zeros(3), a, b, lower=-10.0, upper=10.0),
        jax.jacobian(lambda b: solvers.minimize(quadratic, jnp.zeros(3), a, b,
                                                lower=-10.0))(b)))(b)
    np.testing.assert_allclose(x, np.linalg.solve(A, B), rtol=1e-7)
    np.testing.assert_allclose(g, np.linalg.inv(A), rtol=1e-6)
    with pytest.raises(ValueError, match="`upper` must be a scalar or a pytree shaped like x0"):
        solvers.minimize(quadratic, jnp.zeros(3), a, b, upper=jnp.zeros(2))
    # An empty box: refused at call time (it returned lower, clipped, with no error).
    with pytest.raises(ValueError, match=r"`lower` must be <= `upper`.*lower\[1\] = 2.0"):
        solvers.minimize(quadratic, jnp.zeros(3), a, b, lower=jnp.array([0.0, 2.0, 0.0]),
                         upper=1.0)
    with pytest.raises(ValueError, match=r"`lower` must be <= `upper`.*nan"):
        solvers.root(lambda x: x - 1.0, jnp.zeros(2), lower=jnp.nan)
    # 0-d bounds too (np.argwhere found nothing in a 0-d array: 0.0 came back converged).
    with pytest.raises(ValueError, match=r"`lower` must be <= `upper`.*lower = 10.0"):
        solvers.minimize(lambda x: (x - 1.0) ** 2, 2.0, lower=10, upper=0)
    # Mis-shaped bounds are refused, not broadcast ((1,) was broadcast to a (2,) unknown).
    with pytest.raises(ValueError, match=r"`lower` must be a scalar or a pytree shaped "
                                         r"like x0: lower has shape \(1,\)"):
        solvers.minimize(quadratic, jnp.zeros(3), a, b, lower=jnp.zeros(1))
    with pytest.raises(ValueError, match=r"`upper`.*upper\['b'\] has shape \(3,\)"):
        solvers.minimize(lambda x: x["a"] ** 2 + jnp.sum(x["b"] ** 2),
                         {"a": 1.0, "b": jnp.ones(2)}, upper={"a": 2.0, "b": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"`lower`.*structure"):
        solvers.minimize(lambda x: x["a"] ** 2, {"a": 1.0}, lower={"c": 0.0})
