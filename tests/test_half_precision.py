"""16-bit floats (bfloat16, float16): every solver runs in the user's dtype at its default
tolerances (``4 eps`` / ``0.4 eps``), gradients included.

LAPACK and cuSOLVER factor no 16-bit matrices, so the dense factorisations (Newton's
Jacobian, the adjoint's dense solve, Levenberg–Marquardt's and Gauss–Newton's steps, the
stiff methods' iteration matrices) run in float32 and hand back the user's dtype; before,
these configurations failed while lowering ("Unsupported dtype bfloat16"). Oracles are
closed forms in float64 (linear problems, so that the answer is known exactly); the bound
is ``BOUND x rtol``, rtol the dtype's default. ODE error norms accumulate in float32, and
kvaerno5's stage solves stop no lower than 10 eps (both would never converge otherwise).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers
from implicit import _checks

N = 6
RNG = np.random.default_rng(0)
# Well conditioned (the bound is about the solvers, not the conditioning).
A64 = 2.0 * np.eye(N) + 0.2 * RNG.standard_normal((N, N)) / np.sqrt(N)
B64 = RNG.standard_normal(N)
M64 = 0.4 * RNG.standard_normal((N, N)) / np.sqrt(N)  # a contraction: x = M x + b
Q64 = A64 @ A64.T  # symmetric positive definite
DTYPES = [jnp.bfloat16, jnp.float16]
# The solver matrix in float16 too takes the default suite's time for the mechanism
# bfloat16 already exercises (the same float32 factorisations): `make test-slow`.
MATRIX_DTYPES = [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)]
BOUND = 10


def _rel(got, ref):
    got = np.asarray(got, np.float64)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def _linear_root(x, a, b):
    return a @ x - b


def _quadratic(x, q, b):
    return 0.5 * x @ q @ x - b @ x


def _contraction(x, m, b):
    return m @ x + b


def _same(m):
    return m


def _one_minus(m):  # x = M x + b: (I - M) x = b
    return np.eye(N) - m


CASES = {
    # name: (solve(matrix, b) -> x*, matrix, K(rounded matrix)): x* = K⁻¹ b
    "root newton": (lambda a, b: solvers.root(_linear_root, 0 * b, a, b), A64, _same),
    "root chord": (lambda a, b: solvers.root(_linear_root, 0 * b, a, b, method="chord"),
                   A64, _same),
    "root broyden": (lambda a, b: solvers.root(_linear_root, 0 * b, a, b, method="broyden"),
                     A64, _same),
    "root dogleg": (lambda a, b: solvers.root(_linear_root, 0 * b, a, b, method="dogleg"),
                    A64, _same),
    "fixed_point dense adjoint": (
        lambda m, b: solvers.fixed_point(_contraction, 0 * b, m, b, linear_solver="dense"),
        M64, _one_minus),
    "fixed_point anderson": (
        lambda m, b: solvers.fixed_point(_contraction, 0 * b, m, b, method="anderson"),
        M64, _one_minus),
    "minimize lbfgs": (lambda q, b: solvers.minimize(_quadratic, 0 * b, q, b), Q64, _same),
    "minimize newton-cg": (lambda q, b: solvers.minimize(_quadratic, 0 * b, q, b,
                                                         method="newton-cg"), Q64, _same),
    "least_squares levenberg-marquardt": (
        lambda a, b: solvers.least_squares(_linear_root, 0 * b, a, b), A64, _same),
    "least_squares gauss-newton": (
        lambda a, b: solvers.least_squares(_linear_root, 0 * b, a, b, method="gauss-newton"),
        A64, _same),
}


@pytest.mark.parametrize("dtype", MATRIX_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", list(CASES))
def test_solution_and_gradient_in_half_precision(name, dtype):
    solve, matrix, system = CASES[name]
    rtol = _checks.default_tolerances(dtype)[0]
    m, b = jnp.asarray(matrix, dtype), jnp.asarray(B64, dtype)
    # (the solution and the gradient of its sum in one program)
    x, g = jax.jit(lambda m, b: (solve(m, b), jax.grad(lambda b: jnp.sum(solve(m, b)))(b)))(m, b)
    assert x.dtype == dtype and g.dtype == dtype
    # The oracle for the matrix as rounded to the dtype (its rounding is the input's).
    k = system(np.asarray(m, np.float64))
    b64 = np.asarray(b, np.float64)
    assert _rel(x, np.linalg.solve(k, b64)) < BOUND * rtol
    assert _rel(g, np.linalg.solve(k.T, np.ones(N))) < BOUND * rtol


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("method", ["dopri5", "bdf", "kvaerno5"])
def test_odeint_in_half_precision(method, dtype):
    # y' = -k y: y(t) = exp(-k t) y0, d/dk sum y(1) = -sum y0 exp(-k).
    rtol = _checks.default_tolerances(dtype)[0]
    y0 = jnp.asarray(np.linspace(0.5, 1.5, N), dtype)
    ts = jnp.asarray([0.0, 0.5, 1.0], dtype)

    def final(k):
        return jnp.sum(solvers.odeint(lambda y, t, k: -k * y, y0, ts, k, method=method)[-1])

    k = jnp.asarray(0.7, dtype)
    value, g = jax.jit(jax.value_and_grad(final))(k)
    s = float(np.sum(np.asarray(y0, np.float64)))
    assert abs(float(value) - s * np.exp(-0.7)) < BOUND * rtol * s
    assert abs(float(g) + s * np.exp(-0.7)) < BOUND * rtol * s


def test_default_tolerances_follow_the_dtype():
    assert _checks.default_tolerances(jnp.float64) == (1e-8, 1e-10)
    assert _checks.default_tolerances(jnp.float32) == (1e-5, 1e-6)
    for dtype in DTYPES:
        eps = float(jnp.finfo(dtype).eps)
        assert _checks.default_tolerances(dtype) == (4 * eps, 0.4 * eps)


def _linear_ode(y, t, a):
    return a @ y


def test_kvaerno5_stage_solves_stop_at_rounding():
    # kvaerno5's stage solves stop at 1% of the error tolerance, floored at 10 eps: at rtol
    # 1e-7 in float32 the unfloored 1e-9 is below rounding, no stage solve converged and
    # the integration ended in step_underflow. Measured: 1.0e-6 off the closed form.
    import scipy.linalg

    rng = np.random.default_rng(0)
    a = -np.diag([1.0, 10.0, 100.0, 1000.0]) + 0.1 * rng.standard_normal((4, 4))
    ys = jax.jit(lambda a: solvers.odeint(_linear_ode, jnp.ones(4, jnp.float32),
                                          jnp.array([0.0, 2.0]), a, method="kvaerno5",
                                          rtol=1e-7, atol=1e-7))(jnp.asarray(a, jnp.float32))
    ref = scipy.linalg.expm(2.0 * a) @ np.ones(4)
    assert _rel(ys[-1], ref) < 1e-5
