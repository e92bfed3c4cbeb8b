"""The solver runner: termination, statuses, messages and dispatch, tested directly and
through the reproducers of the termination issue (one test each)."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import implicit
import solvers
from solvers import _runner, _status

# --- the runner's loop, with toy methods -------------------------------------------------


#: The states of every toy method, its last one repeated up to here (a toy method repeats
#: its last state anyway): the same shapes for every toy, so that one compiled run serves
#: every toy with the same runner options.
_TOY_STATES = 600


def _toy(errors, scales=None, status=None, confirmed=None):
    """The states of a method whose k-th state reports errors[k] (and scales[k],
    status[k], ...), for :func:`_run`."""
    n = len(errors)
    assert n <= _TOY_STATES
    scales = np.ones(n) if scales is None else scales
    status = np.full(n, _status.RUNNING) if status is None else status
    confirmed = np.ones(n, bool) if confirmed is None else confirmed

    def padded(values, dtype):
        values = np.asarray(values, dtype)
        return np.concatenate([values, np.repeat(values[-1:], _TOY_STATES - n)])

    return (padded(errors, np.float32), padded(scales, np.float32), padded(status, np.int32),
            padded(confirmed, bool))


def _toy_method(errors, scales, status, confirmed):
    def terminate(k):
        k = jnp.minimum(k, errors.shape[0] - 1)
        return _runner.Progress(errors[k], scales[k], status[k], confirmed[k])

    return _runner.Method(init=lambda x0: jnp.int32(0), step=lambda k: k + 1,
                          terminate=terminate)


@functools.partial(jax.jit, static_argnames=("max_steps", "record_history",
                                             "stagnation_window", "check_every"))
def _run(states, max_steps=100, record_history=False,
         stagnation_window=_runner.STAGNATION_WINDOW, check_every=1):
    """The runner on the toy method of these ``states`` (module level and jitted: one
    program per set of options, shared by the tests; eagerly, every toy's loop and each
    of its operations compiled on its own)."""
    rtol, atol = jnp.float32(1e-3), jnp.float32(0.0)
    return _runner.iterate(_toy_method(*states), None, rtol=rtol, atol=atol,
                           max_steps=max_steps, record_history=record_history,
                           stagnation_window=stagnation_window, check_every=check_every)


def test_a_guess_that_passes_takes_zero_steps():
    state, info = _run(_toy([0.0, 1.0]))
    assert int(info.num_steps) == 0 and info.status_name == "converged" and bool(info.converged)


def test_converges_at_the_first_state_that_passes():
    _, info = _run(_toy([1.0, 0.5, 1e-4, 1.0]))
    assert int(info.num_steps) == 2 and info.status_name == "converged"
    np.testing.assert_allclose(info.residual, 1e-4)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_error_or_scale_is_nonfinite_never_converged(bad):
    # inf <= atol + rtol * inf would pass the plain test: the runner must not accept it.
    _, info = _run(_toy([1.0, bad]))
    assert info.status_name == "nonfinite" and not bool(info.converged)
    _, info = _run(_toy([1.0, 1.0], scales=[1.0, bad]))
    assert info.status_name == "nonfinite"


def test_max_steps():
    _, info = _run(_toy(np.linspace(1.0, 0.5, 200)), max_steps=10)
    assert info.status_name == "max_steps" and int(info.num_steps) == 10


def test_stagnation_after_a_window_without_a_new_smallest_error():
    errors = np.r_[1.0, 0.5, np.full(200, 0.6)]  # never below 0.5 again
    _, info = _run(_toy(errors), max_steps=500)
    assert info.status_name == "stagnated"
    assert int(info.num_steps) == 1 + _runner.STAGNATION_WINDOW


def test_a_plateau_after_a_long_descent_is_not_stagnation():
    # A damped fixed-point iteration (tanh map, spectral radius 1.6, damping 0.3) fell for
    # 124 steps, sat on a plateau for 74 (its smallest error not beaten), then converged:
    # a fixed window of 50 called it stagnated. The window now lasts at least as many
    # steps as led to the smallest error.
    descent = np.geomspace(1.0, 0.02, 124)
    errors = np.r_[descent, np.full(74, 0.025), np.geomspace(0.02, 1e-4, 50)]
    _, info = _run(_toy(errors), max_steps=500)
    assert info.status_name == "converged", info.status_name
    # A plateau that lasts is still a floor: after as many steps again (the smallest
    # error is the guess's descent's last, at step 123).
    _, info = _run(_toy(np.r_[descent, np.full(400, 0.025)]), max_steps=500)
    assert info.status_name == "stagnated" and int(info.num_steps) == 2 * 123


def test_a_growing_error_is_not_stagnation():
    # A divergence is left to become non-finite (or reach max_steps), not called stagnation.
    _, info = _run(_toy(2.0 ** np.arange(100)), max_steps=90)
    assert info.status_name == "max_steps"


def test_stagnation_can_be_switched_off():
    _, info = _run(_toy(np.full(200, 1.0)), max_steps=120, stagnation_window=None)
    assert info.status_name == "max_steps"


def test_a_method_failure_status_ends_the_solve():
    status = [_status.RUNNING, _status.SINGULAR]
    _, info = _run(_toy([1.0, 1e-9], status=status))
    assert info.status_name == "singular" and int(info.num_steps) == 1


def test_an_unconfirmed_pass_does_not_end_the_solve():
    _, info = _run(_toy([1.0, 0.0, 0.0], confirmed=[True, False, True]))
    assert int(info.num_steps) == 2 and info.status_name == "converged"


def test_history():
    _, info = _run(_toy([1.0, 0.5, 0.25, 1e-4]), max_steps=5, record_history=True)
    np.testing.assert_allclose(info.residual_history[:3], [0.5, 0.25, 1e-4])
    assert np.all(np.isnan(info.residual_history[3:]))


# --- check_every: several steps per convergence test ---------------------------------------


def test_check_every_tests_after_each_trip_and_the_guess_first():
    # errors[k] is the error after k steps; the test passes from step 5 on.
    errors = [1.0, 0.5, 0.1, 0.05, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0]
    for every, steps in [(1, 5), (2, 6), (3, 6), (4, 8)]:
        _, info = _run(_toy(errors), check_every=every)
        assert int(info.num_steps) == steps and info.status_name == "converged", every
    _, info = _run(_toy([0.0, 1.0]), check_every=4)  # the guess: zero steps
    assert int(info.num_steps) == 0


def test_check_every_history_and_max_steps():
    _, info = _run(_toy(np.linspace(1.0, 0.5, 50)), max_steps=10, check_every=4,
                   record_history=True)
    # max_steps is reached after a whole trip: 12 steps; errors recorded where tested.
    assert info.status_name == "max_steps" and int(info.num_steps) == 12
    h = np.asarray(info.residual_history)
    expected = np.linspace(1.0, 0.5, 50)
    np.testing.assert_allclose(h[[3, 7]], expected[[4, 8]])
    assert np.isnan(np.delete(h, [3, 7])).all()


def test_check_every_stagnation_window_counts_steps():
    errors = np.r_[1.0, 0.5, np.full(400, 0.6)]
    _, info = _run(_toy(errors), max_steps=500, check_every=5)
    assert info.status_name == "stagnated"
    assert int(info.num_steps) == 5 + _runner.STAGNATION_WINDOW


def _a_cos(x, a):
    return a * jnp.cos(x)


@functools.partial(jax.jit, static_argnames="every")
def _check_every_solves(a, cubes, every):
    """The solves and gradients below, with check_every=every, in one program (eagerly,
    each compiled its own, and the gradients' every operation too)."""
    solve = lambda a: solvers.fixed_point(_a_cos, 0.3, a, check_every=every)  # noqa: E731
    _, info = solvers.fixed_point(_a_cos, jnp.float32(0.7390851332151607), a,
                                  check_every=every, full_output=True)
    roots = jax.vmap(lambda a: solvers.bisection(_cube, 0.0, 10.0, a, check_every=every))
    grad = jax.grad(lambda a: jnp.sum(solvers.chandrupatla(_cube, 0.0, 10.0, a,
                                                            check_every=every)))
    return (solve(a), jax.grad(solve)(a), info.num_steps,
            solvers.root(_cube, jnp.ones(3), cubes, check_every=every), roots(cubes),
            grad(cubes))


@pytest.mark.parametrize("every", [1, 3, 4])
def test_check_every_gives_the_same_solutions_and_gradients(every):
    # cos fixed point (Dottie number) and its derivative in a: x = a cos x,
    # dx/da = cos x / (1 + a sin x); cube roots of 8, 27, 64 and their derivatives.
    x, g, num_steps, roots, bisected, g_cubes = _check_every_solves(
        1.0, np.array([8.0, 27.0, 64.0], np.float32), every=every)
    x = float(x)
    np.testing.assert_allclose(x, 0.7390851332151607, rtol=2e-5)
    np.testing.assert_allclose(float(g), math.cos(x) / (1 + math.sin(x)), rtol=1e-4)
    # A fixed-point guess is returned after zero steps.
    assert int(num_steps) == 0
    np.testing.assert_allclose(roots, [2.0, 3.0, 4.0], rtol=1e-5)
    np.testing.assert_allclose(bisected, [2.0, 3.0, 4.0], rtol=1e-5)
    np.testing.assert_allclose(g_cubes, 1 / (3 * np.array([2.0, 3.0, 4.0]) ** 2), rtol=1e-4)


def test_check_every_failures_still_raise():
    with pytest.raises(Exception, match="status .nonfinite."):
        jax.block_until_ready(jax.jit(lambda x0: solvers.fixed_point(
            lambda x: 2 * x + 1, x0, check_every=4))(0.0))
    with pytest.raises(solvers.ConvergenceError, match="max_steps"):
        solvers.fixed_point(lambda x: jnp.cos(x), 0.3, max_steps=5, check_every=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_check_every_must_be_a_positive_int(bad):
    with pytest.raises((TypeError, ValueError), match="check_every"):
        solvers.fixed_point(lambda x: x, 0.0, check_every=bad)


def test_check_every_default_is_one_on_cpu():
    assert _runner.options(lambda x: x, "f", rtol=None, atol=None, max_steps=3,
                           on_failure="raise", full_output=False,
                           check_every=None).check_every == 1


def test_status_names():
    assert solvers.STATUSES[0] == "converged"
    assert solvers.status_name(0) == "converged"
    assert list(solvers.status_name(np.array([1, 2, 6]))) == ["max_steps", "nonfinite",
                                                              "no_sign_change"]


# --- messages --------------------------------------------------------------------------


def _message(code):
    info = _runner.Info(np.bool_(False), np.int32(7), np.float32(np.nan), None, np.int32(code))
    return _runner.failure_message(info, solver="solvers.test", max_steps=7)


@pytest.mark.parametrize("code", range(1, len(solvers.STATUSES)))
def test_every_status_has_its_own_message(code):
    text = _message(code)
    assert text.startswith("solvers.test did not converge: status '")
    assert solvers.STATUSES[code] in text and "unknown status" not in text
    # Only running out of steps suggests more steps.
    assert ("increase max_steps" in text) == (code == _status.MAX_STEPS)


def test_precision_hint_on_accelerators(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "JAX_DEFAULT_MATMUL_PRECISION=highest" in _message(_status.STAGNATED)
    with jax.default_matmul_precision("highest"):
        assert "JAX_DEFAULT_MATMUL_PRECISION" not in _message(_status.STAGNATED)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert "JAX_DEFAULT_MATMUL_PRECISION" not in _message(_status.STAGNATED)


# --- the reproducers -------------------------------------------------------------


def _double(x):
    return 2 * x + 1


# (Anderson on 2x + 1 is not here: a secant method on a linear map, it finds the fixed
# point x = -1 that plain iteration runs away from; see the next test.)
@pytest.mark.parametrize(
    "f, x0, method",
    [(_double, 0.0, "iterate")]
    + [(f, 0.0, m) for f in (jnp.log, lambda x: 1 / x, jnp.exp) for m in ("iterate", "anderson")],
    ids=["2x+1-iterate", "log-iterate", "log-anderson", "1/x-iterate", "1/x-anderson",
         "exp-iterate", "exp-anderson"],
)
def test_divergence_to_inf_is_never_converged(f, x0, method):
    x, info = solvers.fixed_point(f, x0, method=method, on_failure="ignore", full_output=True)
    assert not bool(info.converged) and info.status_name in ("nonfinite", "stagnated")
    with pytest.raises(solvers.ConvergenceError):
        solvers.fixed_point(f, x0, method=method)
    with pytest.raises(Exception, match="did not converge"):
        jax.block_until_ready(jax.jit(lambda x0: solvers.fixed_point(f, x0, method=method))(x0))


def _affine(x, a):
    return a * x + 1


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("a", [1.5, 2.0, 3.0, 5.0, -4.0])
def test_anderson_finds_repelling_fixed_points_of_linear_maps(a, x64):
    # x = a x + 1 has the fixed point 1 / (1 - a), repelling for |a| > 1: plain iteration
    # does not converge, Anderson (a secant method) does, in two or three steps. (Its
    # history of 1-d residuals is rank-deficient: with a ridge below float32's rounding,
    # the solve broke down into plain steps, 6 steps on a CPU and 11 on an H200.)
    with jax.enable_x64(x64):
        # (check_every=1: the step count as on CPU; a GPU's default tests every 4th step)
        x, info = solvers.fixed_point(_affine, 0.0, a, method="anderson", full_output=True,
                                      check_every=1)
        assert bool(info.converged) and int(info.num_steps) <= 4
        # (to 10x the default rtol: 1e-5 in float32, 1e-8 in float64)
        np.testing.assert_allclose(float(x), 1 / (1 - a), rtol=1e-7 if x64 else 1e-4)
        _, info = solvers.fixed_point(_affine, 0.0, a, on_failure="ignore", full_output=True)
        assert not bool(info.converged)


def test_diverging_batch_element_is_nan_under_vmap():
    x, info = jax.jit(jax.vmap(
        lambda a: solvers.fixed_point(_affine, 0.0, a, on_failure="nan", full_output=True)
    ))(np.array([0.5, 2.0], np.float32))
    np.testing.assert_allclose(x[0], 2.0, rtol=1e-4)  # 1 / (1 - a)
    assert np.isnan(x[1]) and list(info.status_name) == ["converged", "nonfinite"]


def _square(x):
    return x**2


def test_an_exact_root_is_accepted_before_any_step():
    # The Jacobian is singular there: a Newton step would fail. (One program for the three.)
    methods = ("newton", "chord", "broyden")
    solves = jax.jit(lambda x0: [solvers.root(_square, x0, method=method, full_output=True)
                                 for method in methods])
    for x, info in solves(0.0):
        assert float(x) == 0.0 and int(info.num_steps) == 0 and bool(info.converged)


def _inverse(x):
    return 1 / x


@pytest.mark.parametrize("method", ["bisection", "chandrupatla"])
def test_a_pole_is_not_a_root(method):
    solve = getattr(solvers, method)
    x, info = solve(_inverse, -1.0, 2.0, on_failure="ignore", full_output=True)
    assert info.status_name == "discontinuity"
    with pytest.raises(solvers.ConvergenceError, match="discontinuity"):
        solve(_inverse, -1.0, 2.0)
    # A genuine root next to a pole-free bracket is fine.
    assert bool(solve(_cube, 0.0, 10.0, 8.0, full_output=True)[1].converged)


def _cube(x, a):
    return x**3 - a


def test_one_failed_element_leaves_the_other_gradients_finite():
    a = np.array([8.0, 2000.0, 27.0], np.float32)
    # (one program for both)
    grads = jax.jit(lambda a: [
        jax.grad(lambda a: jnp.nansum(method(_cube, 0.0, 10.0, a, on_failure="nan")))(a)
        for method in (solvers.bisection, solvers.chandrupatla)])(a)
    for g in grads:
        np.testing.assert_allclose(np.asarray(g)[[0, 2]],
                                   1 / (3 * np.array([8.0, 27.0]) ** (2 / 3)), rtol=1e-4)
        assert np.isnan(g[1])


def _cos_plus(x, t):
    return jnp.cos(x) + t


def test_ignore_gives_the_ift_gradient_at_the_returned_point():
    # Plain iteration oscillates (f'(x*) = -sin(x*) ~ -1): truncated at 50 steps.
    solve = lambda t: solvers.fixed_point(_cos_plus, 0.3, t, max_steps=50,  # noqa: E731
                                          on_failure="ignore")
    t = math.pi / 2
    x, g = (float(v) for v in jax.jit(lambda t: (solve(t), jax.grad(solve)(t)))(t))
    # IFT at x: residual cos(x) + t - x, so dx/dt = 1 / (1 + sin x).
    np.testing.assert_allclose(g, 1 / (1 + math.sin(x)), rtol=1e-4)


def _tanh_layer(z, W, b):
    return jnp.tanh(W @ z + b)


def test_truncated_deq_gradient_is_finite_and_ift_at_the_point():
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.standard_normal((8, 8)) / 2, jnp.float32)  # not a contraction
    b = jnp.asarray(rng.standard_normal(8), jnp.float32)

    def loss(b):
        z = solvers.fixed_point(_tanh_layer, jnp.zeros(8), W, b, max_steps=10,
                                on_failure="ignore")
        return jnp.sum(z), z

    (value, z), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(b)
    assert np.all(np.isfinite(g))
    # IFT at the returned z: dz/db = (I - D W)^-1 D with D = diag(1 - tanh(W z + b)^2).
    z64, W64, b64 = (np.asarray(v, np.float64) for v in (z, W, b))
    D = np.diag(1 - np.tanh(W64 @ z64 + b64) ** 2)
    expected = np.linalg.solve(np.eye(8) - D @ W64, D).T @ np.ones(8)
    np.testing.assert_allclose(g, expected, rtol=2e-3, atol=1e-4)


def test_full_output_under_jit_raises_the_library_message():
    run = jax.jit(lambda x0: solvers.fixed_point(_double, x0, full_output=True))
    with pytest.raises(Exception, match="solvers.fixed_point.*status 'nonfinite'"):
        jax.block_until_ready(run(0.0))


def test_numpy_float64_guess_follows_jax_dtype_rules():
    b = np.array([1.0, 2.0])
    x = implicit.custom_root(lambda x: 2 * x - b)(lambda x0: x0 / 2)(np.array([1.0, 2.0]))
    assert x.dtype == jnp.zeros(()).dtype
    np.testing.assert_allclose(x, [0.5, 1.0])
    x = solvers.fixed_point(lambda x: 0.5 * x + 1, np.array([1.0, 2.0]))
    assert x.dtype == jnp.zeros(()).dtype


def _halve_plus_one(x):
    return jnp.asarray(x) * 0.5 + 1


def test_list_guess_with_array_output_says_so():
    with pytest.raises(ValueError, match=r"Python list of scalars.*jnp.array\(x0\)"):
        solvers.fixed_point(_halve_plus_one, [1.0, 2.0])


def test_wrong_number_of_arguments_names_the_function():
    with pytest.raises(TypeError, match=r"f is called with 2 positional arguments"):
        solvers.fixed_point(lambda x, a, b: x, 1.0, 2.0)
    with pytest.raises(TypeError, match=r"F is called with 1 positional arguments"):
        solvers.root(lambda x, a: x - a, 1.0)
    with pytest.raises(TypeError, match=r"F is called with 1 positional arguments"):
        solvers.bisection(lambda x, a: x - a, 0.0, 1.0)


def test_broyden_stale_step_is_not_convergence():
    # From x0 = 0.5 a Broyden step that happens to be tiny once passed the test with
    # |F| = 33 (float32, no line search). Over a grid, every converged answer is a root.
    a = np.linspace(1.0, 100.0, 40, dtype=np.float32)
    x0 = np.linspace(0.1, 6.0, 23, dtype=np.float32)
    A, X0 = (v.ravel() for v in np.meshgrid(a, x0))
    solve = jax.jit(jax.vmap(lambda x0, a: solvers.root(
        _cube, x0, a, method="broyden", line_search=False, on_failure="ignore",
        full_output=True)))
    x, info = solve(X0, A)
    ok = np.asarray(info.converged)
    assert ok.mean() > 0.9
    np.testing.assert_allclose(np.asarray(x)[ok], np.cbrt(A)[ok], rtol=1e-4)
    x, info = solvers.root(_cube, 0.5, 33.0, method="broyden", line_search=False,
                           full_output=True)
    np.testing.assert_allclose(x, 33.0 ** (1 / 3), rtol=1e-5)


def _sqrt_update(x, a):
    return 0.5 * (x + a / x)


def test_forward_mode_needs_rule_jvp_and_says_so():
    with pytest.raises(TypeError, match="rule='jvp'"):
        jax.jacfwd(lambda a: solvers.fixed_point(_sqrt_update, a, a))(2.0)
    g = jax.jit(jax.jacfwd(lambda a: solvers.fixed_point(_sqrt_update, a, a, rule="jvp")))(2.0)
    np.testing.assert_allclose(g, 1 / (2 * math.sqrt(2.0)), rtol=1e-5)
    with pytest.raises(TypeError, match="reverse mode only"):
        jax.jacfwd(lambda y0: solvers.odeint(lambda y, t: -y, y0, jnp.array([0.0, 1.0])))(1.0)


def test_a_fresh_function_per_call_warns_once():
    def newton_sqrt(a):
        return solvers.fixed_point(lambda x, a: 0.5 * (x + a / x), a, a)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for a in (2.0, 3.0, 4.0, 5.0, 6.0):
            newton_sqrt(a)
    recompiles = [w for w in caught if "compiled again" in str(w.message)]
    assert len(recompiles) == 1 and "test_runner.py" in str(recompiles[0].message)
    # The same function object is compiled once and never warned about.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for a in (2.0, 3.0, 4.0, 5.0):
            solvers.fixed_point(_sqrt_update, a, a)
    assert not [w for w in caught if "compiled again" in str(w.message)]


@pytest.mark.parametrize("name", ["fixed_point", "root newton", "root broyden", "minimize",
                                  "least_squares", "bisection", "odeint dopri5",
                                  "odeint kvaerno5", "odeint bdf"])
def test_an_empty_unknown_is_solved_as_empty(name):
    # Nothing to solve: an empty result (and gradient), as for any array op; before, the
    # max-norms of root, minimize, least_squares and kvaerno5 had no identity ("zero-size
    # array to reduction operation max").
    empty = jnp.ones(0)
    ts = jnp.array([0.0, 1.0])
    solve = {
        "fixed_point": lambda a: solvers.fixed_point(lambda x, a: x / 2 + a, empty, a),
        "root newton": lambda a: solvers.root(lambda x, a: x - a, empty, a),
        "root broyden": lambda a: solvers.root(lambda x, a: x - a, empty, a, method="broyden"),
        "minimize": lambda a: solvers.minimize(lambda x, a: jnp.sum((x - a) ** 2), empty, a),
        "least_squares": lambda a: solvers.least_squares(lambda x, a: x - a, empty, a),
        "bisection": lambda a: solvers.bisection(lambda x, a: x - a, empty - 2, empty + 1, a),
        "odeint dopri5": lambda a: solvers.odeint(lambda y, t, a: -a * y, empty, ts, a)[-1],
        "odeint kvaerno5": lambda a: solvers.odeint(lambda y, t, a: -a * y, empty, ts, a,
                                                    method="kvaerno5")[-1],
        "odeint bdf": lambda a: solvers.odeint(lambda y, t, a: -a * y, empty, ts, a,
                                               method="bdf")[-1],
    }[name]
    # (the result and the gradient in one program)
    x, g = jax.jit(lambda a: (solve(a), jax.grad(lambda a: jnp.sum(solve(a)))(a)))(empty)
    assert x.shape == (0,)
    assert g.shape == (0,)
