"""The implicit-function-theorem engine: custom_root / custom_fixed_point and linear solvers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import implicit
import solvers
from implicit import custom_fixed_point, custom_root, linear

LINEAR = ["gmres", "bicgstab", "dense", "neumann", "jfb"]


def _newton_update(x, a):
    return 0.5 * (x + a / x)


def _while_fixed_point(f, x0, a):
    # The seed notebook's loop: iterate until successive iterates agree to 1e-6.
    def cond(carry):
        prev, x = carry
        return jnp.abs(prev - x) > 1e-6

    def body(carry):
        return carry[1], f(carry[1], a)

    return jax.lax.while_loop(cond, body, (x0, f(x0, a)))[1]


def _newton_sqrt(rule="vjp", linear_solver="gmres"):
    solver = custom_fixed_point(_newton_update, rule=rule, linear_solver=linear_solver)(
        lambda x0, a: _while_fixed_point(_newton_update, x0, a)
    )
    return lambda a: solver(a, a)


@pytest.mark.transforms("custom_root, custom_fixed_point", "jit", "vmap", "grad", "grad(grad)")
@pytest.mark.parametrize("linear_solver", LINEAR)
def test_seed_newton_sqrt_numbers(linear_solver):
    # The notebook's values: sqrt(2), 1/(2 sqrt 2), -1/(4 * 2^1.5), computed independently.
    # (One program for the four: called eagerly, each transformation compiled its own.)
    newton_sqrt = _newton_sqrt(linear_solver=linear_solver)

    @jax.jit
    def transformed(a, batch):
        return (newton_sqrt(a), jax.grad(newton_sqrt)(a), jax.grad(jax.grad(newton_sqrt))(a),
                jax.vmap(newton_sqrt)(batch))

    batch = np.arange(1.0, 5.0, dtype=np.float32)
    value, grad, grad2, batched = transformed(2.0, batch)
    np.testing.assert_allclose(value, np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(grad, 0.5 / np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(grad2, -0.25 * 2.0**-1.5, rtol=1e-5)
    np.testing.assert_allclose(batched, np.sqrt(batch), rtol=1e-6)


@pytest.mark.transforms("custom_root, custom_fixed_point", "jvp, jacfwd", "hessian",
                        option='rule="jvp"')
@pytest.mark.parametrize("linear_solver", ["gmres", "bicgstab", "dense"])
def test_jvp_rule_forward_mode(linear_solver):
    newton_sqrt = _newton_sqrt(rule="jvp", linear_solver=linear_solver)

    @jax.jit  # (one program for the five)
    def transformed(a, a_dot):
        return (jax.jvp(newton_sqrt, (a,), (a_dot,)), jax.jacfwd(newton_sqrt)(a),
                jax.hessian(newton_sqrt)(a), jax.grad(newton_sqrt)(a))

    (value, tangent), jacfwd, hessian, grad = transformed(2.0, 3.0)
    np.testing.assert_allclose(value, np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(tangent, 3.0 * 0.5 / np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(jacfwd, 0.5 / np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(hessian, -0.25 * 2.0**-1.5, rtol=1e-5)
    np.testing.assert_allclose(grad, 0.5 / np.sqrt(2.0), rtol=1e-6)


def test_forward_mode_of_a_vjp_rule_says_to_pass_rule_jvp():
    # (JAX's own words: "can't apply forward-mode autodiff (jvp) to a custom_vjp function")
    newton_sqrt = _newton_sqrt()
    for forward in (jax.jacfwd, jax.hessian, lambda f: lambda a: jax.jvp(f, (a,), (1.0,))):
        with pytest.raises(TypeError, match=r"custom_root\(rule='vjp'\).*needs rule='jvp'"):
            forward(newton_sqrt)(2.0)


def _linear_system_solver(rule, linear_solver):
    # Residual A x - b(theta) with a pytree unknown; solution by a dense solve (the
    # solver is opaque to the engine: its derivative must come from the IFT).
    def residual(x, params):
        A = params["A"]
        r = A @ x["u"] + 0.1 * jnp.eye(A.shape[0], 2) @ x["v"] - params["b"]
        s = 2.0 * x["v"] - x["u"][:2] - params["c"]
        return {"u": r, "v": s}

    @custom_root(residual, rule=rule, linear_solver=linear_solver, rtol=1e-7)
    def solve(x0, params):
        del x0
        A, b, c = params["A"], params["b"], params["c"]
        n = A.shape[0]
        big = jnp.zeros((n + 2, n + 2))
        big = big.at[:n, :n].set(A).at[:n, n:].set(0.1 * jnp.eye(n, 2))
        big = big.at[n:, :2].set(-jnp.eye(2)).at[n:, n:].set(2.0 * jnp.eye(2))
        sol = jnp.linalg.solve(big, jnp.concatenate([b, c]))
        return {"u": sol[:n], "v": sol[n:]}

    return solve


def _params(n=4, seed=0):
    rng = np.random.default_rng(seed)
    A = np.eye(n) * 3.0 + 0.3 * rng.standard_normal((n, n))
    return {"A": jnp.asarray(A), "b": jnp.asarray(rng.standard_normal(n)),
            "c": jnp.asarray(rng.standard_normal(2))}


def _reference_loss(p):
    # Independent: differentiate straight through a dense solve of the same system.
    n = p["A"].shape[0]
    big = jnp.zeros((n + 2, n + 2))
    big = big.at[:n, :n].set(p["A"]).at[:n, n:].set(0.1 * jnp.eye(n, 2))
    big = big.at[n:, :2].set(-jnp.eye(2)).at[n:, n:].set(2.0 * jnp.eye(2))
    sol = jnp.linalg.solve(big, jnp.concatenate([p["b"], p["c"]]))
    return jnp.sum(jnp.sin(sol))


# (module level: compiled once for every case that uses it)
_reference_loss_grad = jax.jit(jax.grad(_reference_loss))


@pytest.mark.parametrize(
    "rule,linear_solver",
    [("vjp", "gmres"), ("vjp", "bicgstab"), ("vjp", "dense"), ("jvp", "gmres"), ("jvp", "dense"),
     ("vjp", lambda matvec, b: linear.solve("dense", matvec, b, rtol=1e-6, atol=0.0))],
)
@pytest.mark.transforms("custom_root, custom_fixed_point", "jacrev")
def test_pytree_gradients_match_direct_differentiation(rule, linear_solver):
    params = _params()
    solve = _linear_system_solver(rule, linear_solver)
    x0 = {"u": np.zeros(4, np.float32), "v": np.zeros(2, np.float32)}

    def loss(p):
        x = solve(x0, p)
        return jnp.sum(jnp.sin(x["u"])) + jnp.sum(jnp.sin(x["v"]))

    @jax.jit  # (one program for both)
    def transformed(p):
        return (jax.grad(loss)(p), jax.jacrev(lambda b: solve(x0, {**p, "b": b})["u"])(p["b"]))

    grads, jac = transformed(params)
    expected = _reference_loss_grad(params)
    for key in params:
        np.testing.assert_allclose(grads[key], expected[key], rtol=2e-4, atol=2e-5)
    # jacrev of the whole solution agrees with jacfwd of the reference-free direct solve.
    assert jac.shape == (4, 4) and np.all(np.isfinite(jac))


def test_initial_guess_gets_zero_cotangent():
    newton = custom_fixed_point(_newton_update)(
        lambda x0, a: _while_fixed_point(_newton_update, x0, a)
    )
    g_x0, g_a = jax.jit(jax.grad(lambda x0, a: newton(x0, a), argnums=(0, 1)))(1.0, 2.0)
    assert g_x0 == 0.0
    np.testing.assert_allclose(g_a, 0.5 / np.sqrt(2.0), rtol=1e-6)


@pytest.mark.parametrize("rule", ["vjp", "jvp"])
def test_closed_over_traced_values_get_derivatives(rule):
    def outer(theta):
        def mapping(x, a):
            return 0.5 * (x + theta * a / x)  # fixed point sqrt(theta * a)

        solver = custom_fixed_point(mapping, rule=rule)(
            lambda x0, a: jax.lax.fori_loop(0, 40, lambda _, x: mapping(x, a), x0)
        )
        return solver(1.0, 2.0)

    expected = 0.5 * 2.0 / np.sqrt(2.0 * 3.0)  # d/dθ sqrt(2θ) at θ=3
    np.testing.assert_allclose(jax.grad(outer)(3.0), expected, rtol=1e-5)  # (eagerly)
    # (under jit, and jacfwd in the same program)
    transformed = jax.jit(lambda t: (jax.grad(outer)(t),
                                     jax.jacfwd(outer)(t) if rule == "jvp" else None))
    grad, jacfwd = transformed(3.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)
    if rule == "jvp":
        np.testing.assert_allclose(jacfwd, expected, rtol=1e-5)


@pytest.mark.parametrize("rule", ["vjp", "jvp"])
def test_has_aux_passes_aux_through(rule):
    def solver(x0, a):
        x = jax.lax.fori_loop(0, 40, lambda _, x: _newton_update(x, a), x0)
        return x, {"steps": jnp.int32(40), "last": x}

    solve = custom_fixed_point(_newton_update, has_aux=True, rule=rule)(solver)
    (x, aux), g = jax.jit(lambda a: (solve(1.0, a), jax.grad(lambda a: solve(1.0, a)[0])(a)))(2.0)
    assert int(aux["steps"]) == 40
    np.testing.assert_allclose(g, 0.5 / np.sqrt(2.0), rtol=1e-6)


def _cholesky_solve_of(a, rule):
    """A custom_root whose linear_solver closes over a Cholesky factor of the
    differentiated input ``a`` (symmetric positive definite; JAX's custom_root test
    with a solve closure, ported)."""
    chol = jnp.linalg.cholesky(a)

    def linear_solver(matvec, b):  # exact for A = a (symmetric: A = Aᵀ)
        return jax.scipy.linalg.cho_solve((chol, True), b)

    @custom_root(lambda x, a, b: a @ x - b, linear_solver=linear_solver, rule=rule)
    def solve(x0, a, b):
        return jnp.linalg.solve(a, b)

    return solve


@pytest.mark.parametrize("rule", ["vjp", "jvp"])
def test_linear_solver_closing_over_a_traced_factor(x64, rule):
    """No leaked tracer: the callable's closed-over values are hoisted at the forward
    call (as lax.custom_root does). First and second derivatives match the
    differentiated direct solve ``x = sym(a)⁻¹ b``."""
    rng = np.random.default_rng(0)
    m = rng.standard_normal((3, 3))
    a, b = jnp.asarray(m @ m.T + 3 * np.eye(3)), jnp.asarray(rng.standard_normal(3))

    def ours(a, b):
        a = (a + a.T) / 2
        return _cholesky_solve_of(a, rule)(jnp.zeros(3), a, b)

    def exact(a, b):
        return jnp.linalg.solve((a + a.T) / 2, b)

    def loss(solve):
        return lambda a, b: jnp.sum(jnp.sin(solve(a, b)))

    hess = jax.hessian(loss(ours), argnums=1) if rule == "jvp" else jax.jacrev(
        jax.grad(loss(ours), argnums=1), argnums=1)

    @jax.jit  # (the references, and all but the eager derivative, in one program)
    def transformed(a, b):
        return (jax.grad(loss(ours), argnums=(0, 1))(a, b),
                jax.grad(loss(exact), argnums=(0, 1))(a, b),
                hess(a, b), jax.hessian(loss(exact), argnums=1)(a, b),
                jax.jacfwd(ours)(a, b) if rule == "jvp" else None, jax.jacfwd(exact)(a, b))

    got, want, got_hess, want_hess, got_jacfwd, want_jacfwd = transformed(a, b)
    # Eagerly (the tracer of grad's own trace reaches the closed-over factor), and jitted.
    for g, w in ((jax.grad(loss(ours))(a, b), want[0]), *zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    # Second order: the adjoint solve's transpose is the tangent solve. (rule="jvp", jitted:
    # the failure probe's operator carries no tangent, see ift._jvp_tangent.)
    np.testing.assert_allclose(got_hess, want_hess, rtol=1e-9, atol=1e-12)
    if rule == "jvp":
        np.testing.assert_allclose(got_jacfwd, want_jacfwd, rtol=1e-10, atol=1e-12)


def test_scipy_solver_through_pure_callback(x64):
    # A user's SciPy solver becomes differentiable by the decorator alone.
    def residual(x, a):
        return x**3 + a * x - 1.0

    def scipy_solve(x0, a):
        def host(x0, a):
            sol = scipy.optimize.root(lambda x: x**3 + a * x - 1.0, x0, tol=1e-13)
            return np.asarray(sol.x, dtype=np.float64)

        return jax.pure_callback(host, jax.ShapeDtypeStruct(x0.shape, x0.dtype), x0, a,
                                 vmap_method="sequential")

    solve = custom_root(residual)(scipy_solve)
    a = jnp.array(2.0)
    x = np.asarray(solve(jnp.zeros(1), a))
    # dx/da = -x / (3x^2 + a) from the implicit function theorem by hand.
    expected = -x[0] / (3 * x[0] ** 2 + 2.0)
    np.testing.assert_allclose(jax.grad(lambda a: solve(jnp.zeros(1), a)[0])(a), expected,
                               rtol=1e-9)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda a: solve(jnp.zeros(1), a)[0]))(a),
                               expected, rtol=1e-9)


def test_vmap_of_grad_and_batched_solve():
    newton_sqrt = _newton_sqrt()
    a = jnp.array([1.0, 2.0, 9.0])
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(newton_sqrt)))(a), 0.5 / np.sqrt(a),
                               rtol=1e-6)


@pytest.mark.parametrize("method", ["gmres", "bicgstab", "cg", "dense"])
def test_linear_solve_methods(method):
    rng = np.random.default_rng(1)
    M = rng.standard_normal((6, 6))
    A = jnp.asarray(M @ M.T + 6 * np.eye(6))  # SPD so cg applies
    b = {"p": jnp.asarray(rng.standard_normal(4)), "q": jnp.asarray(rng.standard_normal(2))}

    def matvec(v):
        flat = jnp.concatenate([v["p"], v["q"]])
        out = A @ flat
        return {"p": out[:4], "q": out[4:]}

    x = jax.jit(lambda b: linear.solve(method, matvec, b, rtol=1e-6, atol=0.0))(b)
    expected = np.linalg.solve(np.asarray(A), np.concatenate([b["p"], b["q"]]))
    np.testing.assert_allclose(np.concatenate([x["p"], x["q"]]), expected, rtol=1e-4, atol=1e-5)


def test_neumann_and_jfb_semantics():
    # For F(x) = f(x) - x the system is (J - I) w = b: Neumann sums the series, JFB takes -b.
    J = np.array([[0.5, 0.1], [0.0, 0.3]], np.float32)
    b = np.array([1.0, -2.0], np.float32)
    matvec = lambda w: J @ w - w  # noqa: E731
    diverging = lambda w: 1.5 * w - w  # noqa: E731  (J = 1.5 I)

    @jax.jit  # (one program for the three)
    def solves(b):
        return (linear.solve("neumann", matvec, b, rtol=1e-7, atol=0.0),
                linear.solve("jfb", matvec, b, rtol=1e-7, atol=0.0),
                linear.solve("neumann", diverging, b, rtol=1e-7, atol=0.0))

    w, jfb, diverged = solves(b)
    np.testing.assert_allclose(w, np.linalg.solve(J - np.eye(2), b), rtol=1e-5)
    np.testing.assert_allclose(jfb, -b)
    # A divergent Neumann series is reported as NaN, never as a silent wrong number.
    assert np.all(np.isnan(diverged))


def test_decorator_bad_input():
    with pytest.raises(TypeError, match="`residual` must be callable"):
        jax.block_until_ready(custom_root(3.0))
    with pytest.raises(ValueError, match="unknown `linear_solver`='lu'.*'gmres'"):
        jax.block_until_ready(custom_root(lambda x: x, linear_solver="lu"))
    with pytest.raises(ValueError, match="unknown `rule`='fwd'.*'vjp', 'jvp'"):
        jax.block_until_ready(custom_root(lambda x: x, rule="fwd"))
    with pytest.raises(ValueError, match="rule='jvp'"):
        jax.block_until_ready(custom_fixed_point(lambda x: x, rule="jvp", linear_solver="neumann"))
    with pytest.raises(ValueError, match="`rtol` must be a positive"):
        jax.block_until_ready(custom_root(lambda x: x, rtol=-1.0))
    with pytest.raises(TypeError, match="`solver` must be callable"):
        jax.block_until_ready(custom_root(lambda x: x)("not a solver"))
    # A residual whose output does not match the unknown's shape is caught at trace time.
    solve = custom_root(lambda x, a: jnp.sum(x) - a)(lambda x0, a: x0)
    with pytest.raises(ValueError, match="residual\\(x0, \\*args\\).*shape"):
        jax.block_until_ready(solve(jnp.zeros(3), 1.0))
    bad_solver = custom_root(lambda x, a: x - a)(lambda x0, a: jnp.zeros(2))
    with pytest.raises(ValueError, match="solver's solution.*shape"):
        jax.block_until_ready(bad_solver(jnp.zeros(3), 1.0))


def test_public_names():
    assert implicit.custom_root is custom_root
    assert implicit.custom_fixed_point is custom_fixed_point
    assert set(linear.LINEAR_SOLVERS) == {
        "gmres", "bicgstab", "cg", "dense", "diagonal", "neumann", "jfb"
    }
    assert implicit.AdjointSolveError is solvers.AdjointSolveError


def test_adjoint_solve_failure_is_loud():
    # x = 1.5 x - a has the fixed point 2a, but the Neumann series of J = 1.5 diverges:
    # the gradient must not come back as a silent NaN or a wrong number.
    mapping = lambda x, a: 1.5 * x - a
    solve = custom_fixed_point(mapping, linear_solver="neumann")(lambda x0, a: 2.0 * a)
    with pytest.raises(Exception, match="adjoint linear solve.*'neumann'.*did not converge"):
        jax.block_until_ready(jax.grad(solve, argnums=1)(0.0, 1.0))
    quiet = custom_fixed_point(mapping, linear_solver="neumann", on_failure="nan")(
        lambda x0, a: 2.0 * a
    )
    # GMRES handles the same system: d(2a)/da = 2.
    exact = custom_fixed_point(mapping)(lambda x0, a: 2.0 * a)
    g_quiet, g_exact = jax.jit(lambda a: (jax.grad(quiet, argnums=1)(0.0, a),
                                          jax.grad(exact, argnums=1)(0.0, a)))(1.0)
    assert np.isnan(g_quiet)
    np.testing.assert_allclose(g_exact, 2.0, rtol=1e-6)


def _rank2_quadratic_argmin(rule, linear_solver, on_failure):
    # argmin of 0.5 xᵀHx - aᵀx with H of rank 2 (rotated): a plane of minimisers, so
    # dx*/da does not exist; the solver returns the minimum-norm one, H⁺a.
    q = np.linalg.qr(np.random.default_rng(1).standard_normal((4, 4)))[0]
    h = jnp.asarray(q[:, :2] @ np.diag([1.0, 3.0]) @ q[:, :2].T)
    grad_f = lambda x, a: h @ x - a  # noqa: E731
    solve = custom_root(grad_f, rule=rule, linear_solver=linear_solver, on_failure=on_failure)(
        lambda x0, a: jnp.linalg.pinv(h) @ a
    )
    return lambda a: solve(jnp.zeros(4), a).sum(), np.asarray(h) @ np.ones(4)


@pytest.mark.parametrize("linear_solver", ["dense", "gmres", "bicgstab"])
def test_singular_tangent_solve_of_a_jvp_rule_is_loud(x64, linear_solver):
    # The rule="jvp" tangent solve cannot be checked on the tangents (it must stay linear
    # in them); a probe solve with the same matrix is. Before, a singular system gave
    # finite garbage, 1e16 (dense LU) to 1e50 (BiCGSTAB), to jax.jacfwd and jax.grad.
    total, a = _rank2_quadratic_argmin("jvp", linear_solver, "raise")
    for transform in (jax.jacfwd, jax.grad):
        with pytest.raises(Exception, match=rf"tangent linear solve \(linear_solver="
                                            rf"'{linear_solver}'\) did not converge"):
            jax.block_until_ready(transform(total)(a))
    quiet, a = _rank2_quadratic_argmin("jvp", linear_solver, "nan")
    # (grad: the NaN scale, transposed; one program for both)
    for derivative in jax.jit(lambda a: (jax.jacfwd(quiet)(a), jax.grad(quiet)(a)))(a):
        assert np.all(np.isnan(derivative))


def test_jvp_rule_probe_passes_a_nonsingular_system(x64):
    # x* = A⁻¹ a for a nonsingular A: dx*/da = A⁻¹, in forward and reverse mode, with the
    # probe check on (on_failure="raise", the default).
    A = jnp.asarray(np.eye(3) * 2.0 + np.triu(np.ones((3, 3)), 1))
    for linear_solver in ("dense", "gmres"):
        solve = custom_root(lambda x, a: A @ x - a, rule="jvp", linear_solver=linear_solver)(
            lambda x0, a: jnp.linalg.solve(A, a)
        )
        expected = np.linalg.inv(np.asarray(A))
        f = lambda a: solve(jnp.zeros(3), a)  # noqa: E731
        # (one program for both)
        for jac in jax.jit(lambda a: (jax.jacfwd(f)(a), jax.jacrev(f)(a)))(np.ones(3)):
            np.testing.assert_allclose(jac, expected, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("method", ["gmres", "bicgstab", "cg", "dense"])
def test_non_finite_right_hand_side_gives_nan_not_zero(method):
    # A Krylov loop stopped at once on a NaN right-hand side and returned its zero start:
    # an upstream NaN cotangent came back as a zero gradient.
    A = np.array([[3.0, 1.0], [1.0, 2.0]], np.float32)
    solve = jax.jit(lambda b: linear.solve(method, lambda v: A @ v, b, rtol=1e-6, atol=0.0))
    for bad in (np.nan, np.inf):
        x = solve(np.array([bad, 1.0], np.float32))
        assert not np.any(np.isfinite(x))


# --- the solver's own approximate inverse for the adjoint (preconditioner=True) -----------


def _linear_system(seed, n=6):
    rng = np.random.default_rng(seed)
    a = np.eye(n) * 3 + rng.standard_normal((n, n)) * 0.4
    return jnp.asarray(a), jnp.asarray(rng.standard_normal(n))


@pytest.mark.parametrize("quality", ["exact", "close", "useless"])
def test_refined_solves_to_tolerance_whatever_the_approximate_inverse(x64, quality):
    """linear.refined: exact inverse (one step), a nearby matrix's inverse (a few), and
    one under which refinement diverges (the fallback solves it): always the solution,
    against NumPy."""
    a, b = _linear_system(0)
    near = {"exact": a, "close": a + 0.01, "useless": -a}[quality]
    x = _refined_solve(near, a, b)
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-10, atol=1e-12)


@jax.jit  # (module level: one program for every quality)
def _refined_solve(near, a, b):
    inv = jnp.linalg.inv(near)
    solve = linear.refined(lambda v: inv @ v, "gmres", rtol=1e-12, atol=0.0)
    return linear.solve(solve, lambda v: a @ v, b, rtol=1e-12, atol=0.0)


def test_refined_under_vmap_rescues_only_what_failed(x64):
    """A batch where refinement converges for some elements and not for others: each
    element gets its own solution (the fallback's loop is masked per element)."""
    a, b = _linear_system(1)
    scales = jnp.asarray([1.0, 1.0, -1.0, 1.0])  # element 2: a diverging approximation

    def one(scale, rhs):
        inv = jnp.linalg.inv(scale * a)
        solve = linear.refined(lambda v: inv @ v, "dense", rtol=1e-12, atol=0.0)
        return linear.solve(solve, lambda v: a @ v, rhs, rtol=1e-12, atol=0.0)

    b = np.asarray(b)
    rhs = np.stack([b, 2 * b, -b, b + 1])
    x = jax.jit(jax.vmap(one))(scales, rhs)
    np.testing.assert_allclose(x, np.linalg.solve(a, rhs.T).T, rtol=1e-10,
                               atol=1e-12)


def _solver_with_preconditioner(perturb):
    """Newton on A x + x³ = b with the transpose of a (perturbed) Jacobian at the
    solution returned as the adjoint's preconditioner."""

    def residual(x, a, b):
        return a @ x + x**3 - b

    @custom_root(residual, linear_solver="dense", preconditioner=True, rtol=1e-12)
    def solver(x0, a, b):
        def step(_, x):
            return x - jnp.linalg.solve(a + jnp.diag(3 * x**2), residual(x, a, b))

        x = jax.lax.fori_loop(0, 30, step, x0)
        jac = a + jnp.diag(3 * x**2) + perturb
        return x, jax.tree_util.Partial(lambda m, v: jnp.linalg.solve(m.T, v), jac)

    return solver


@pytest.mark.parametrize("perturb", [0.0, 1e-3, 50.0])
def test_custom_root_preconditioner_gives_the_exact_gradient(x64, perturb):
    """custom_root(preconditioner=True): the gradient equals the closed form
    -(∂F/∂x)⁻ᵀ-based one whatever the preconditioner's quality (exact, close, far:
    refinement diverges and linear_solver takes over), under jit and vmap, with the
    preconditioner not part of the output; second derivatives against finite
    differences of the first."""
    a, b = _linear_system(2)
    x, g, gs, h, d_plus, d_minus = _preconditioned_derivatives(perturb, a, b)
    assert x.shape == b.shape  # P is not returned
    a, b, x = np.asarray(a), np.asarray(b), np.asarray(x)
    np.testing.assert_allclose(a @ x + x**3, b, atol=1e-12)
    jac = a + np.diag(3 * x**2)
    np.testing.assert_allclose(g, np.linalg.solve(jac.T, np.ones(b.shape)), rtol=1e-10)
    np.testing.assert_allclose(gs[0], g, rtol=1e-12)
    np.testing.assert_allclose(h, (d_plus - d_minus) / 2e-5, rtol=1e-6)


@jax.jit  # (module level, the perturbation an argument: one program for every case)
def _preconditioned_derivatives(perturb, a, b):
    """The solution, its gradient (under jit), the gradients of a batch of two (vmap),
    the second derivative along b, and the first at s = 1 ± 1e-5 (finite differences)."""
    solver = _solver_with_preconditioner(perturb)
    x0 = jnp.zeros_like(b)
    g = jax.grad(lambda b: jnp.sum(solver(x0, a, b)))(b)
    gs = jax.vmap(jax.grad(lambda b: jnp.sum(solver(x0, a, b))))(jnp.stack([b, 0.5 * b]))
    h = jax.grad(lambda s: jax.grad(lambda s: jnp.sum(solver(x0, a, s * b)))(s))(1.0)
    d = jax.grad(lambda s: jnp.sum(solver(x0, a, s * b)))
    return solver(x0, a, b), g, gs, h, d(1.0 + 1e-5), d(1.0 - 1e-5)


def test_preconditioner_leaves_jfb_an_approximation(x64):
    """linear_solver="jfb" stays Jacobian-free backpropagation with a preconditioner: the
    gradient is what jfb gives, not the exact one."""
    a, b = _linear_system(3)

    def residual(x, b):
        return a @ x - b

    @custom_root(residual, linear_solver="jfb", preconditioner=True)
    def solver(x0, b):
        return jnp.linalg.solve(a, b), jax.tree_util.Partial(lambda v: jnp.linalg.solve(a.T, v))

    g = jax.jit(jax.grad(lambda b: jnp.sum(solver(jnp.zeros_like(b), b))))(b)
    # jfb: w = -ḡ, and b̄ = -(∂F/∂b)ᵀ w = -ḡ (the exact gradient is a⁻ᵀ ḡ)
    np.testing.assert_allclose(g, -np.ones(b.shape), rtol=1e-12)
    assert not np.allclose(g, np.linalg.solve(np.asarray(a).T, np.ones(b.shape)))
