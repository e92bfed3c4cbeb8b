"""Property-based tests (hypothesis): random problems against independent oracles.

The oracles never call the code under test: ``numpy.linalg.solve`` for linear fixed
points, ``scipy.linalg.expm`` and ``expm_frechet`` (float64) for linear ODEs, and the
closed forms of a polynomial built from its roots. Every tolerance is derived in a
comment from the solver's stopping test, so each assertion can fail.

Compilation is the cost, so every solver call is jitted once at module level with the
random data as traced arguments; hypothesis draws only arrays (a few shapes at most).
Examples are derandomized by default (the same examples on every run, no flaky CI);
``HYPOTHESIS_EXPLORE=1`` draws fresh random ones, and more of them.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import solvers

EXPLORE = os.environ.get("HYPOTHESIS_EXPLORE") == "1"


def examples(n):
    """Settings for one property: ``n`` examples, no deadline (the first compiles)."""
    return settings(
        max_examples=5 * n if EXPLORE else n,
        deadline=None,
        derandomize=not EXPLORE,
        database=None,
        print_blob=True,
    )


F32_EPS = float(np.finfo(np.float32).eps)
RTOL32, ATOL32 = 1e-5, 1e-6  # the solvers' documented float32 defaults


def uniform(shape, lo=-1.0, hi=1.0):
    return hnp.arrays(np.float64, shape, elements=st.floats(lo, hi, allow_subnormal=False))


# --------------------------------------------------------------------------------------
# (a) contractive linear fixed points x = A x + b
# --------------------------------------------------------------------------------------


def linear_map(x, A, b):
    return A @ x + b


def _fixed_point_loss(A, b, c, method):
    x = solvers.fixed_point(linear_map, jnp.zeros_like(b), A, b, method=method)
    return jnp.sum(c * x), x


fixed_point_value_and_grad = jax.jit(
    jax.value_and_grad(_fixed_point_loss, argnums=(0, 1), has_aux=True),
    static_argnames="method",
)


@st.composite
def contractive_problems(draw):
    """(A, b, c) in float32 with ||A||_2 <= 0.9, n in 2..6."""
    n = draw(st.integers(2, 6))
    raw = draw(uniform((n, n)))
    norm = np.linalg.norm(raw, 2)
    scale = draw(st.floats(0.0, 0.9))
    A = raw * (scale / norm) if norm > 1e-3 else np.zeros((n, n))
    # Round to float32 first: the oracle solves the problem the solver actually sees.
    return (
        A.astype(np.float32),
        draw(uniform((n,))).astype(np.float32),
        draw(uniform((n,))).astype(np.float32),
    )


@pytest.mark.parametrize("method", ["iterate", "anderson"])
@examples(12)
@given(problem=contractive_problems())
def test_linear_fixed_point_and_its_gradients_match_numpy(method, problem):
    A, b, c = problem
    (_, x), (grad_A, grad_b) = fixed_point_value_and_grad(A, b, c, method=method)
    A64, b64, c64 = (v.astype(np.float64) for v in (A, b, c))
    I_minus_A = np.eye(len(b)) - A64
    x_ref = np.linalg.solve(I_minus_A, b64)
    w_ref = np.linalg.solve(I_minus_A.T, c64)  # (I - A)^{-T} c
    # The solver stops when max|f(x) - x| <= atol + rtol max|f(x)|; since
    # x - x* = -(I - A)^{-1} (f(x) - x), the error is at most ||(I - A)^{-1}||_inf times
    # that (plus float32 round-off in evaluating f: (n + 2) eps (|A||x| + |b|)).
    k_inf = np.linalg.norm(np.linalg.inv(I_minus_A), np.inf)
    roundoff = (len(b) + 2) * F32_EPS * np.max(np.abs(A64) @ np.abs(x_ref) + np.abs(b64))
    x_bound = k_inf * (ATOL32 + RTOL32 * 1.01 * np.max(np.abs(x_ref)) + roundoff)
    np.testing.assert_array_less(np.abs(np.asarray(x, np.float64) - x_ref), x_bound)
    # d sum(c x*) / db = (I - A)^{-T} c. The adjoint solve stops at a relative residual of
    # rtol / 10 = 1e-6 and cond(I - A) <= 1.9 / 0.1 = 19, so its relative error is below
    # 2e-5 (plus float32 round-off); 1e-4 leaves margin and still catches a wrong rule.
    np.testing.assert_allclose(grad_b, w_ref, rtol=0, atol=1e-4 * np.max(np.abs(w_ref)) + 1e-7)
    # d sum(c x*) / dA = outer(w, x*): evaluated at the computed x, whose error adds
    # max|w| * x_bound to each entry.
    grad_A_ref = np.outer(w_ref, x_ref)
    atol_A = 1e-4 * np.max(np.abs(grad_A_ref)) + np.max(np.abs(w_ref)) * x_bound + 1e-7
    np.testing.assert_allclose(grad_A, grad_A_ref, rtol=0, atol=atol_A)


# --------------------------------------------------------------------------------------
# (b) linear ODEs y' = M y (float64, scoped)
# --------------------------------------------------------------------------------------

ODE_RTOL, ODE_ATOL = 1e-9, 1e-11


def linear_rhs(y, t, M):
    return M @ y


def _ode_end(y0, M, c, T, method):
    ts = jnp.stack([jnp.zeros_like(T), 0.5 * T, T])
    ys = solvers.odeint(linear_rhs, y0, ts, M, method=method, rtol=ODE_RTOL, atol=ODE_ATOL)
    return jnp.dot(c, ys[-1]), ys[-1]


ode_value_and_grad = jax.jit(
    jax.value_and_grad(_ode_end, argnums=(0, 1), has_aux=True), static_argnames="method"
)


@st.composite
def linear_odes(draw):
    """(y0, M, c, T) with M = P diag(lam) P^{-1}, lam in [-5, -0.1], cond(P) <= 3."""
    n = draw(st.integers(2, 4))
    lam = draw(uniform((n,), -5.0, -0.1))
    E = draw(uniform((n, n)))
    norm = np.linalg.norm(E, 2)
    P = np.eye(n) + (0.5 / norm) * E if norm > 1e-3 else np.eye(n)  # ||P - I|| <= 0.5
    M = P @ np.diag(lam) @ np.linalg.inv(P)
    return draw(uniform((n,))), M, draw(uniform((n,))), draw(st.floats(0.5, 2.0))


@pytest.mark.parametrize("method", ["dopri5", pytest.param("tsit5", marks=pytest.mark.slow)])
@examples(6)
@given(problem=linear_odes())
def test_linear_ode_and_its_gradients_match_expm(method, problem):
    y0, M, c, T = problem
    with jax.enable_x64(True):
        (_, y_T), (grad_y0, grad_M) = ode_value_and_grad(
            y0, M, c, np.float64(T), method=method
        )
        y_T, grad_y0, grad_M = (np.asarray(v) for v in (y_T, grad_y0, grad_M))
    assert y_T.dtype == np.float64  # the scope really switched x64 on
    expMT = scipy.linalg.expm(M * T)
    # |y(t)| <= cond(P) |y0| <= 3 * 2: global errors of a 5th-order pair held to a local
    # rtol of 1e-9 stay within a few hundred times rtol on these smooth, non-stiff
    # (|lam| T <= 10) problems; 1e-6 of the solution's scale catches any wrong formula.
    scale = np.max(np.abs(y0)) + 1e-3
    np.testing.assert_allclose(y_T, expMT @ y0, rtol=0, atol=1e-6 * scale)
    # d c.y(T) / dy0 = expm(M T)^T c (adjoint integrated with the same tolerances).
    g_ref = expMT.T @ c
    np.testing.assert_allclose(grad_y0, g_ref, rtol=0, atol=1e-6 * (np.max(np.abs(c)) + 1e-3))
    # d c.y(T) / dM = T L((M T)^T, c y0^T), L the Frechet derivative of expm (adjoint
    # identity <L(X, E), G> = <E, L(X^T, G)>).
    grad_M_ref = T * scipy.linalg.expm_frechet((M * T).T, np.outer(c, y0), compute_expm=False)
    atol_M = 1e-6 * (np.max(np.abs(grad_M_ref)) + np.max(np.abs(c)) * scale)
    np.testing.assert_allclose(grad_M, grad_M_ref, rtol=0, atol=atol_M)


def test_x64_scope_did_not_leak():
    assert jnp.asarray(1.0).dtype == jnp.float32


# --------------------------------------------------------------------------------------
# (c) roots of random polynomials p(x) = prod(x - r_i) + shift (shift = 0)
# --------------------------------------------------------------------------------------


def _poly(x, roots, shift):
    """p_i(x_i) = prod_j (x_i - roots_j) + shift_i: one decoupled equation per root."""
    return jnp.prod(x[:, None] - roots[None, :], axis=1) + shift


def _bracketed(method):
    def solve(roots, shift, half_width):
        F = lambda x, shift: _poly(x, roots, shift)  # noqa: E731  closes over roots
        x = method(F, roots - half_width, roots + half_width, shift)
        return jnp.sum(x), x

    return jax.jit(jax.value_and_grad(solve, argnums=1, has_aux=True))


def _newton_solve(roots, shift, offset):
    x = solvers.root(_poly, roots + offset, roots, shift, method="newton")
    return jnp.sum(x), x


POLY_SOLVERS = {
    "bisection": _bracketed(solvers.bisection),
    "chandrupatla": _bracketed(solvers.chandrupatla),
    "newton": jax.jit(jax.value_and_grad(_newton_solve, argnums=1, has_aux=True)),
}


@st.composite
def separated_roots(draw):
    """2..4 float32 roots in [-3, 3], pairwise at least 0.5 apart, and their min gap."""
    k = draw(st.integers(2, 4))
    gaps = draw(uniform((k - 1,), 0.5, 2.0))
    start = draw(st.floats(-3.0, max(-3.0, 3.0 - float(np.sum(gaps)))))
    roots = (start + np.concatenate([[0.0], np.cumsum(gaps)])).astype(np.float32)
    order = draw(st.permutations(range(k)))  # the solvers must not rely on sorted roots
    roots = roots[list(order)]
    diffs = np.abs(roots[:, None] - roots[None, :]) + np.diag(np.full(k, np.inf))
    return roots, float(diffs.min())


@pytest.mark.parametrize("method", list(POLY_SOLVERS))
@examples(12)
@given(problem=separated_roots(), offset_fraction=st.floats(-0.1, 0.1))
def test_polynomial_roots_and_their_derivative(method, problem, offset_fraction):
    roots, gap = problem
    k = len(roots)
    shift = np.zeros(k, np.float32)
    third = np.full(k, gap / 3, np.float32)
    offset = np.full(k, offset_fraction * gap, np.float32)
    start = offset if method == "newton" else third
    (_, x), d_shift = POLY_SOLVERS[method](roots, shift, start)
    r = roots.astype(np.float64)
    # Closed forms: p'(r_i) = prod_{j != i} (r_i - r_j), p''(r_i) / p'(r_i) = 2 sum 1/(r_i - r_j).
    diffs = r[:, None] - r[None, :] + np.eye(k)
    dp = np.prod(diffs, axis=1)
    curvature = 2 * np.sum(1 / diffs - np.eye(k), axis=1)
    # Bracketed methods stop when the bracket is narrower than atol + rtol |x| and return
    # a point inside it; Newton stops when its (contraction-scaled) step is below that,
    # and converges quadratically, so its error is far smaller. The float32 roots are
    # exact roots of the float32 product, whose sign is exact near them.
    x_tol = ATOL32 + RTOL32 * np.abs(r) + 2 * F32_EPS * np.abs(r)
    np.testing.assert_array_less(np.abs(np.asarray(x, np.float64) - r), x_tol)
    # d x_i / d shift_i = -1 / p'(r_i) (implicit function theorem in closed form),
    # evaluated by the solver at x, which moves it by |p''/p'| |x - r| relatively.
    expected = -1 / dp
    rel_tol = np.abs(curvature) * x_tol + 1e-5
    np.testing.assert_array_less(np.abs(np.asarray(d_shift, np.float64) - expected),
                                 rel_tol * np.abs(expected))


# --------------------------------------------------------------------------------------
# (d) vmap == Python loop and (e) jit == eager, for fixed_point, root, bisection, odeint
# --------------------------------------------------------------------------------------


def cos_map(x, a):
    return jnp.cos(a * x)


def cubic(x, a):
    return x**3 + x - a


def decay(y, t, k):
    return -k * y


def solve_fixed_point(a):
    return solvers.fixed_point(cos_map, jnp.zeros(3), a)


def solve_root(a):
    return solvers.root(cubic, jnp.zeros(3), a)


def solve_bisection(a):
    return solvers.bisection(cubic, -5.0, 5.0, a)


def solve_odeint(k):
    return solvers.odeint(decay, jnp.ones(3), jnp.linspace(0.0, 2.0, 4), k)


SOLVES = {
    "fixed_point": solve_fixed_point,
    "root": solve_root,
    "bisection": solve_bisection,
    "odeint": solve_odeint,
}
# Each parameter is a vector of 3, one value per unknown (all problems are decoupled):
# a in [0.1, 0.9] keeps x -> cos(a x) contractive; cubic has one real root for any a;
# decay rates k in [0.1, 3].
PARAMETER_RANGE = {
    "fixed_point": (0.1, 0.9),
    "root": (-5.0, 5.0),
    "bisection": (-5.0, 5.0),
    "odeint": (0.1, 3.0),
}
BATCHED = {name: jax.jit(jax.vmap(solve)) for name, solve in SOLVES.items()}
JITTED = {name: jax.jit(solve) for name, solve in SOLVES.items()}

# Batched and single solves are the same arithmetic, except that XLA may vectorise or
# fuse the batched one differently: agreement to a few float32 ulps of the solution's
# scale (32 eps ~ 4e-6 relative). A batch that kept stepping its converged elements or
# mixed elements up would differ by up to the solver tolerance (1e-5) or by O(1).
ROUNDOFF = 32 * F32_EPS


@pytest.mark.parametrize("name", list(SOLVES))
@examples(6)
@given(data=st.data())
def test_vmap_equals_a_loop_of_single_solves(name, data):
    lo, hi = PARAMETER_RANGE[name]
    params = data.draw(uniform((4, 3), lo, hi)).astype(np.float32)
    batched = np.asarray(BATCHED[name](params))
    looped = np.stack([np.asarray(JITTED[name](p)) for p in params])
    assert batched.shape == looped.shape
    np.testing.assert_allclose(batched, looped, rtol=ROUNDOFF, atol=ROUNDOFF)


@pytest.mark.parametrize("name", list(SOLVES))
@examples(4)
@given(data=st.data())
def test_jit_equals_eager(name, data):
    lo, hi = PARAMETER_RANGE[name]
    param = data.draw(uniform((3,), lo, hi)).astype(np.float32)
    eager = np.asarray(SOLVES[name](param))
    jitted = np.asarray(JITTED[name](param))
    # The eager call compiles the same solver; only XLA's fusion of the outer jit can
    # change the rounding.
    np.testing.assert_allclose(jitted, eager, rtol=ROUNDOFF, atol=ROUNDOFF)
