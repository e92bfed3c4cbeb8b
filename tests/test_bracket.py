"""Tests of solvers.bisection and solvers.chandrupatla (bracketed scalar roots, elementwise).

Expected values: cube roots from NumPy (float64) and their derivatives in closed form,
d a^(1/3)/da = 1 / (3 a^(2/3)), d² a^(1/3)/da² = -2/9 a^(-5/3).
"""

import doctest
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers

bracket_module = sys.modules["solvers.bracket"]

METHODS = {"bisection": solvers.bisection, "chandrupatla": solvers.chandrupatla}
both = pytest.mark.parametrize("method", list(METHODS))


def cube(x, a):
    return x**3 - a


def cbrt64(a):
    return np.cbrt(np.asarray(a, np.float64))


A_VALUES = np.linspace(0.1, 100.0, 1001)  # the benchmark range

# Shared jitted solvers (compiled once per method for the module).
SOLVE = {name: jax.jit(lambda a, m=m: m(cube, 0.0, 100.0, a)) for name, m in METHODS.items()}
GRAD = {
    name: jax.jit(jax.grad(lambda a, m=m: jnp.sum(m(cube, 0.0, 100.0, a))))
    for name, m in METHODS.items()
}


@both
def test_cube_roots_float32(method):
    a = jnp.asarray(A_VALUES, jnp.float32)
    x = SOLVE[method](a)
    assert x.dtype == jnp.float32 and x.shape == a.shape
    # Default float32 tolerances: width <= 1e-6 + 1e-5 |x|.
    np.testing.assert_allclose(x, cbrt64(a), rtol=1e-5, atol=1e-6)


@both
@pytest.mark.parametrize("tol", [1e-6, 1e-12])
def test_every_tolerance_is_reachable_in_float32(method, tol):
    # optimistix's Bisection with rtol = atol = 1e-6 never terminates on these in float32;
    # here the bracket stops when no float lies strictly inside it.
    x, info = METHODS[method](
        cube,
        0.0,
        100.0,
        jnp.asarray(A_VALUES, jnp.float32),
        rtol=tol,
        atol=tol,
        full_output=True,
    )
    assert bool(np.all(info.converged))  # (reductions in NumPy)
    assert int(np.max(info.num_steps)) < 100
    np.testing.assert_allclose(x, cbrt64(A_VALUES), rtol=4e-6)


@both
def test_float64(method, x64):
    x = METHODS[method](cube, 0.0, 100.0, jnp.asarray(A_VALUES))
    assert x.dtype == jnp.float64
    np.testing.assert_allclose(x, cbrt64(A_VALUES), rtol=1e-8, atol=1e-10)
    x = METHODS[method](cube, 0.0, 100.0, jnp.asarray(A_VALUES), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(x, cbrt64(A_VALUES), rtol=1e-14)


@both
def test_gradient_float32(method):
    a = jnp.asarray(A_VALUES[::10], jnp.float32)
    g = GRAD[method](a)
    np.testing.assert_allclose(g, 1 / (3 * cbrt64(a) ** 2), rtol=1e-4)


@pytest.mark.transforms("bisection, chandrupatla", "jit", "grad", "grad(grad)")
@both
def test_gradients_float64_grad_of_grad_and_bracket_ends(method, x64):
    m = METHODS[method]

    def root(a, lower=0.0, upper=10.0):
        return m(cube, lower, upper, a)

    @jax.jit
    def derivatives(a):
        return jax.grad(root)(a), jax.grad(jax.grad(root))(a), jax.grad(root, (1, 2))(a, 0.5, 10.0)

    g, gg, g_ends = derivatives(8.0)
    np.testing.assert_allclose(g, 1 / 12, rtol=1e-7)
    np.testing.assert_allclose(gg, -2 / 9 * 8.0 ** (-5 / 3), rtol=1e-7)
    np.testing.assert_array_equal(g_ends, (0.0, 0.0))


@pytest.mark.transforms("bisection, chandrupatla", "vmap", "jacrev")
@pytest.mark.transforms("bisection, chandrupatla", "jvp, jacfwd", "hessian", option='rule="jvp"')
@both
def test_vmap_jacrev_and_forward_mode(method, x64):
    m = METHODS[method]
    a = jnp.array([1.0, 8.0, 27.0])
    expected = np.diag(1 / (3 * np.array([1.0, 4.0, 9.0])))
    fwd = lambda a: m(cube, 0.0, 10.0, a, rule="jvp")  # noqa: E731

    @jax.jit
    def derivatives(a):
        batched = jax.vmap(lambda a: m(cube, 0.0, 10.0, a))(a)
        rev = jax.jacrev(lambda a: m(cube, 0.0, 10.0, a))(a)
        return batched, rev, jax.jacfwd(fwd)(a), jax.hessian(lambda a: jnp.sum(fwd(a)))(a)

    batched, rev, jac, hess = derivatives(a)
    np.testing.assert_allclose(batched, [1.0, 2.0, 3.0], rtol=1e-8)
    np.testing.assert_allclose(rev, expected, rtol=1e-8)
    np.testing.assert_allclose(jac, expected, rtol=1e-8)
    np.testing.assert_allclose(hess, np.diag(-2 / 9 * np.asarray(a) ** (-5 / 3)), rtol=1e-6)


@both
def test_broadcasting_parameters_pytrees_and_closures(method, x64):
    m = METHODS[method]

    # x² = p["scale"] * c, with lower an array, upper a scalar and c a closed-over tracer.
    def solve(p, c):
        return m(lambda x, p: x**2 - p["scale"] * c, jnp.zeros(3), 10.0, p)

    p = {"scale": jnp.array([1.0, 4.0, 9.0])}
    x, (g_p, g_c) = jax.jit(lambda p, c: (  # one program
        solve(p, c), jax.grad(lambda p, c: jnp.sum(solve(p, c)), argnums=(0, 1))(p, c)))(p, 4.0)
    np.testing.assert_allclose(x, [2.0, 4.0, 6.0], rtol=1e-8)
    # d x / d scale = c / (2 x); d x / d c = sum(scale) / (2 x) summed.
    np.testing.assert_allclose(g_p["scale"], 4.0 / (2 * np.array([2.0, 4.0, 6.0])), rtol=1e-8)
    np.testing.assert_allclose(
        g_c, np.sum(np.array([1.0, 4.0, 9.0]) / (2 * np.array([2.0, 4.0, 6.0]))), rtol=1e-8
    )


@both
def test_either_bracket_order_and_roots_at_the_ends(method):
    m = METHODS[method]
    np.testing.assert_allclose(m(cube, 10.0, 0.0, 8.0), 2.0, rtol=1e-5)
    assert float(m(cube, 2.0, 5.0, 8.0)) == 2.0  # (compared on the host)
    assert float(m(cube, -1.0, 2.0, 8.0)) == 2.0
    x = m(cube, 0, 10, 27)  # integer bracket and parameter are promoted
    assert x.dtype == jnp.float32
    np.testing.assert_allclose(x, 3.0, rtol=1e-5)


# --------------------------------------------------------------------------------------
# Bad brackets and other run-time failures
# --------------------------------------------------------------------------------------

BAD = jnp.array([1.0, 8.0, 27.0])  # bracket [3, 10]: only 27 has its cube root inside


@both
@pytest.mark.parametrize("jit", [False, True])
def test_bad_bracket_raises(method, jit):
    run = lambda a: METHODS[method](cube, 3.0, 10.0, a)  # noqa: E731
    if jit:
        run = jax.jit(run)
    with pytest.raises(Exception, match="the bracket has no sign change") as e:
        jax.block_until_ready(run(BAD))
    assert f"solvers.{method} did not converge" in str(e.value)
    if not jit:
        assert "2 of 3 batch elements failed; first at index (0,)" in str(e.value)


@both
def test_bad_bracket_nan_and_ignore(method):
    m = METHODS[method]
    x, info = m(cube, 3.0, 10.0, BAD, on_failure="nan", full_output=True)
    x = np.asarray(x)  # (indexed in NumPy)
    assert np.isnan(x[0]) and np.isnan(x[1])
    np.testing.assert_allclose(x[2], 3.0, rtol=1e-5)
    np.testing.assert_array_equal(info.converged, [False, False, True])
    assert list(info.status_name) == ["no_sign_change", "no_sign_change", "converged"]
    # "ignore" must not silently hand back an end of the bracket as if it were a root.
    x = np.asarray(m(cube, 3.0, 10.0, BAD, on_failure="ignore"))
    assert float(x[0]) != 10.0 and float(x[0]) != 3.0
    # Under vmap, the failed elements only.
    xs = np.asarray(jax.jit(jax.vmap(lambda a: m(cube, 3.0, 10.0, a, on_failure="nan")))(BAD))
    assert np.isnan(xs[0]) and np.isnan(xs[1]) and not np.isnan(xs[2])
    with pytest.raises(Exception, match="no sign change"):
        jax.block_until_ready(jax.vmap(lambda a: m(cube, 3.0, 10.0, a))(BAD))


@both
def test_non_finite_bracket_and_function(method):
    m = METHODS[method]
    with pytest.raises(solvers.ConvergenceError, match="no sign change"):
        jax.block_until_ready(m(cube, 0.0, jnp.inf, 8.0))
    # NaN inside the bracket is reported, not bisected around.
    F = lambda x: jnp.where(jnp.abs(x - 1.5) < 0.6, jnp.nan, x - 1.5)  # noqa: E731
    with pytest.raises(solvers.ConvergenceError, match="status 'nonfinite'"):
        jax.block_until_ready(m(F, 0.0, 4.0))


@both
@pytest.mark.parametrize("jit", [False, True])
def test_step_cap_is_reported(method, jit):
    run = lambda: METHODS[method](cube, 0.0, 100.0, 8.0, max_steps=2)  # noqa: E731
    if jit:
        run = jax.jit(run)
    with pytest.raises(Exception, match=r"status 'max_steps': max_steps=2 steps were not"):
        jax.block_until_ready(run())


def test_full_output_fields():
    a = jnp.array([1.0, 8.0, 27.0])
    # check_every=1: every step tested and recorded (a GPU's default tests every 4th)
    x, info = solvers.bisection(cube, 0.0, 10.0, a, full_output=True, max_steps=64,
                                check_every=1)
    assert isinstance(info, solvers.Info)
    assert info.converged.shape == a.shape and bool(np.all(info.converged))  # (NumPy)
    assert info.num_steps.shape == a.shape and int(np.min(info.num_steps)) > 10
    np.testing.assert_allclose(info.residual, np.abs(np.asarray(x, np.float64) ** 3
                                                     - np.asarray(a, np.float64)), atol=1e-4)
    history = np.asarray(info.residual_history)
    assert history.shape == (64,)
    k = int(np.max(info.num_steps))
    assert np.all(np.diff(history[: k - 1]) < 0)  # the widest bracket halves
    np.testing.assert_array_equal(info.status, [0, 0, 0])


# --------------------------------------------------------------------------------------
# Bad input and compilation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: solvers.bisection(None, 0.0, 1.0), TypeError, "`F` must be callable"),
        (lambda: solvers.bisection(cube, "0", 1.0, 1.0), TypeError, "`lower`"),
        (lambda: solvers.bisection(cube, 0.0, [1.0, 2.0], 1.0), TypeError, "`upper`"),
        (lambda: solvers.bisection(cube, 0.0, 1j, 1.0), TypeError, "`upper`"),
        (lambda: solvers.bisection(cube, jnp.zeros(2), jnp.ones(3), 1.0), ValueError, "broadcast"),
        (lambda: solvers.bisection(lambda x: (x, x), 0.0, 1.0), ValueError, "one array"),
        (lambda: solvers.bisection(lambda x: jnp.sum(x), jnp.zeros(2), 1.0), ValueError, "shape"),
        (lambda: solvers.bisection(lambda x: x > 0, 0.0, 1.0), ValueError, "dtype"),
        (lambda: solvers.bisection(cube, 0.0, 1.0, 1.0, rtol=-1.0), ValueError, "`rtol`"),
        (lambda: solvers.bisection(cube, 0.0, 1.0, 1.0, max_steps=0), ValueError, "max_steps"),
        (lambda: solvers.chandrupatla(cube, 0.0, 1.0, 1.0, rule="x"), ValueError, "`rule`"),
        (lambda: solvers.chandrupatla(cube, 0.0, 1.0, 1.0, on_failure=1), ValueError, "'raise'"),
        (lambda: solvers.chandrupatla(cube, 0.0, 1.0, {1, 2}), TypeError, "args"),
    ],
)
def test_bad_input_is_reported_at_call_time(call, error, match):
    with pytest.raises(error, match=match):
        jax.block_until_ready(call())


@both
def test_repeated_eager_calls_do_not_retrace(method):
    calls = []

    def F(x, a):
        calls.append(1)
        return x**3 - a

    METHODS[method](F, 0.0, 10.0, 2.0)
    traced = len(calls)
    for a in (3.0, 4.0):
        METHODS[method](F, 0.0, 10.0, a)
    assert len(calls) == traced


def test_adjoint_linear_solver_choice():
    a = jnp.array([1.0, 8.0])
    expected = 1 / (3 * np.array([1.0, 4.0]))
    for linear_solver in ("dense",):
        g = jax.jit(jax.grad(
            lambda a: jnp.sum(solvers.chandrupatla(cube, 0.0, 10.0, a, linear_solver=linear_solver))
        ))(a)
        np.testing.assert_allclose(g, expected, rtol=1e-4)


# --- expand=True: widening a bracket without a sign change ---------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_expand_finds_a_sign_change_elementwise(method, x64):
    solve = getattr(solvers, method)
    a = jnp.array([8.0, 2000.0, 1e9, -27.0, 0.001])  # roots 2, 12.6, 1000, -3, 0.1
    cube = lambda x, a: x**3 - a  # noqa: E731
    run = lambda a: solve(cube, 0.0, 10.0, a, expand=True)  # noqa: E731
    # Far from the bracket and in either order; vmapped.
    far = jax.vmap(lambda c: solve(lambda x, c: x - c, 1.0, 0.0, c, expand=True))
    x, g, x_far = jax.jit(lambda a, c: (run(a), jax.grad(lambda a: jnp.sum(run(a)))(a),
                                        far(c)))(a, jnp.array([1e6, -1e6, 0.5]))  # one program
    np.testing.assert_allclose(x, np.cbrt(np.asarray(a)), rtol=1e-7)
    np.testing.assert_allclose(g, 1 / (3 * np.cbrt(np.asarray(a)) ** 2), rtol=1e-6)
    np.testing.assert_allclose(x_far, [1e6, -1e6, 0.5], rtol=1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_expand_that_finds_nothing_fails_clearly(method):
    solve = getattr(solvers, method)
    no_root = lambda x, c: x**2 + c  # noqa: E731
    with pytest.raises(solvers.ConvergenceError, match="no_sign_change"):
        solve(no_root, 0.0, 1.0, 1.0, expand=True)
    # 'nan' marks exactly the element without a root (log: NaN once the end goes below 0).
    x, info = solve(lambda x, c: jnp.log(x) - c, 0.5, 1.0, jnp.array([2.0, -50.0]),
                    expand=True, on_failure="nan", full_output=True)
    np.testing.assert_allclose(x[0], np.exp(2.0), rtol=1e-5)
    assert np.isnan(x[1])
    assert list(info.status_name) == ["converged", "no_sign_change"]


def test_docstring_examples():
    failures, tried = doctest.testmod(bracket_module)
    assert tried > 0 and failures == 0


def test_large_problems_in_chunks(method="chandrupatla"):  # bisection shares the chunking
    # 40,000 elements: solved in chunks on CPU. `c` (shape (2,)) is used whole by F, `a`
    # elementwise; one element's bracket has no sign change.
    n = 40_000
    a = np.linspace(0.1, 100.0, n, dtype=np.float32)  # (inputs in NumPy)
    c = np.array([2.0, 0.0], np.float32)
    F = lambda x, a, c: c[0] * x**3 + c[1] - a  # noqa: E731

    solve = lambda a, c: METHODS[method](F, 0.0, 100.0, a, c, on_failure="nan",  # noqa: E731
                                         full_output=True)
    grad = jax.grad(lambda c, a: jnp.sum(METHODS[method](F, 0.0, 100.0, a, c)))
    bad = n // 2
    a_bad = a.copy()
    a_bad[bad] = -5.0
    (x, info), g_c = jax.jit(lambda a_bad, a, c: (solve(a_bad, c), grad(c, a)))(a_bad, a, c)
    expected = cbrt64(a / 2)
    good = np.arange(n) != bad
    np.testing.assert_allclose(np.asarray(x)[good], expected[good], rtol=2e-5)
    assert np.isnan(x[bad])
    assert info.converged.shape == (n,) and int(np.sum(~np.asarray(info.converged))) == 1
    assert info.status_name[bad] == "no_sign_change" and info.num_steps.shape == (n,)
    # d x / d c0 = -x³ / (3 c0 x²) = -x / (3 c0); d x / d c1 = -1 / (3 c0 x²).
    np.testing.assert_allclose(g_c[0], np.sum(-expected / 6), rtol=1e-4)
    np.testing.assert_allclose(g_c[1], np.sum(-1 / (6 * expected**2)), rtol=1e-4)


# check_every=1, compiled once per method for the three `every` below.
ONCE = {name: jax.jit(lambda a, m=m: m(cube, 0.0, 10.1, a, check_every=1, on_failure="ignore",
                                       full_output=True)) for name, m in METHODS.items()}


@both
@pytest.mark.parametrize("every", [2, 3, 4])
def test_several_steps_per_test_keep_the_bracket(method, every):
    # check_every > 1 (a GPU's default) runs several steps per loop trip. Unrolled into one
    # computation, XLA recomputed a stored F(x) in fusions with different roundings: near
    # the root the bracket was updated from both of its signs, lost the root, and ran to
    # max_steps (chandrupatla, a = 132 at every = 3; 164 steps for what takes 9 at every
    # = 1). Every element converges to the cube root, in a few more steps than every = 1.
    a = np.linspace(0.0, 1000.0, 1001, dtype=np.float32)
    solve = jax.jit(lambda a: METHODS[method](cube, 0.0, 10.1, a, check_every=every,
                                              on_failure="ignore", full_output=True))
    x, info = solve(a)
    _, once = ONCE[method](a)
    assert bool(np.all(info.converged))  # (reductions in NumPy)
    np.testing.assert_allclose(x, cbrt64(np.asarray(a, np.float64)), rtol=1e-5, atol=1e-6)
    assert int(np.max(info.num_steps)) <= int(np.max(once.num_steps)) + every
