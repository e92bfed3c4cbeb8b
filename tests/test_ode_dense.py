"""odeint's dense output (``dense=``), non-terminal events and complex states.

Oracles are closed forms: ``y(t) = expm(A t) y0`` for a linear system (SciPy's ``expm``),
``y = y0 exp(-k t)`` and its derivatives, the zeros ``k π`` of ``sin`` and
``π/2 + k π`` of ``cos``. Nothing here takes an expected value from the code under test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import solvers
from solvers.ode import odeint

A = np.array([[-0.1, 1.0], [-1.0, -0.1]])  # a decaying rotation: eigenvalues -0.1 ± i
Y0 = np.array([1.0, 0.5])


def linear(y, t, a):
    return a @ y


def decay(y, t, k):
    return -k * y


def oscillator(y, t):
    return jnp.stack([y[1], -y[0]])


def position(y, t):
    return y[0]


def both(y, t):
    return y  # (sin t, cos t) from (0, 1)


def exact(t):
    return np.stack([scipy.linalg.expm(A * s) @ Y0 for s in np.ravel(t)])


@functools.partial(jax.jit, static_argnames=("method", "ts", "points"))
def dense_curve(rtol, method, ts, points):
    """The dense output on ``points`` times over ``ts``: one program per method, rtol traced."""
    _, info = odeint(linear, jnp.array(Y0), jnp.array(ts), jnp.array(A), method=method,
                     rtol=rtol, atol=rtol * 1e-2, dense=True, full_output=True)
    return info.solution.evaluate(np.linspace(ts[0], ts[-1], points)), info


@functools.lru_cache
def exact_curve(ts, points):
    """``exact`` on the grid of ``dense_curve`` (401 expm: computed once per grid)."""
    return exact(np.linspace(ts[0], ts[-1], points))


def dense_error(method, rtol, ts=(0.0, 10.0), points=401):
    ys, info = dense_curve(rtol, method, ts, points)
    return np.max(np.abs(np.asarray(ys) - exact_curve(ts, points))), info


# --- dense output ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["dopri5", "tsit5", "kvaerno5", "bdf"])
def test_dense_matches_expm_between_steps(x64, method):
    err, info = dense_error(method, 1e-8)
    sol = info.solution
    assert bool(sol.complete) and float(sol.t_start) == 0.0 and float(sol.t_end) == 10.0
    # Many evaluation points per step: the interpolant is checked between the steps.
    assert int(sol.num_kept) == int(info.num_accepted) < 401
    # Global error at rtol 1e-8 (bdf: low order, looser).
    assert err < (1e-5 if method == "bdf" else 1e-6), err


@pytest.mark.parametrize("method", ["dopri5", "tsit5"])
def test_dense_error_shrinks_with_rtol(x64, method):
    # A 5(4) pair with a quartic continuous extension: local interpolation error
    # O(h^5) with h ~ rtol^(1/5), so the dense output's error is about proportional to
    # rtol (slope 1 in log-log), as the solution's at the steps.
    rtols = np.array([1e-4, 1e-6, 1e-8, 1e-10])
    errs = np.array([dense_error(method, r)[0] for r in rtols])
    assert np.all(np.diff(errs) < 0), errs
    slope = np.polyfit(np.log10(rtols), np.log10(errs), 1)[0]
    assert 0.7 < slope < 1.3, (slope, errs)
    assert errs[-1] < 1e-8


def test_dense_jit_and_vmap_over_y0(x64):
    t = np.linspace(0.0, 5.0, 33)

    @jax.jit
    def curve(y0):
        _, info = odeint(linear, y0, jnp.array([0.0, 5.0]), jnp.array(A), rtol=1e-9,
                         atol=1e-11, dense=256, full_output=True)
        return info.solution.evaluate(t)

    y0s = jnp.array([[1.0, 0.5], [0.0, 1.0], [-2.0, 0.3]])
    got = np.asarray(jax.vmap(curve)(y0s))
    assert got.shape == (3, 33, 2)
    for y0, g in zip(np.asarray(y0s), got):
        want = np.stack([scipy.linalg.expm(A * s) @ y0 for s in np.asarray(t)])
        np.testing.assert_allclose(g, want, atol=1e-8)


def test_dense_batched_solution_evaluates_under_vmap(x64):
    def solve(k):
        return odeint(decay, 1.0, jnp.array([0.0, 2.0]), k, rtol=1e-10, atol=1e-12,
                      dense=128, full_output=True)[1].solution

    ks = jnp.array([0.5, 1.0, 2.0])
    @jax.jit  # one program: the batched solve and its evaluation
    def run(ks):
        sols = jax.vmap(solve)(ks)  # a batched pytree
        return jax.vmap(lambda s: s.evaluate(jnp.array([0.5, 1.5])))(sols)

    got = run(ks)
    want = np.exp(-np.outer(np.asarray(ks), [0.5, 1.5]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-8)


@pytest.mark.parametrize("adjoint", ["discrete", "backsolve", "interpolate"])
def test_dense_grad_at_fixed_time_closed_form(x64, adjoint):
    # y = y0 exp(-k t): dy/dy0 = exp(-k t), dy/dk = -t y, dy/dt = -k y.
    def y_at(y0, k, t):
        _, info = odeint(decay, y0, jnp.array([0.0, 3.0]), k, rtol=1e-10, atol=1e-12,
                         adjoint=adjoint, dense=128, full_output=True)
        return info.solution.evaluate(t)

    y0, k, t = 2.0, 0.7, 1.234
    y = y0 * np.exp(-k * t)
    g = jax.jit(jax.grad(y_at, argnums=(0, 1, 2)))(y0, k, t)
    np.testing.assert_allclose([float(v) for v in g], [np.exp(-k * t), -t * y, -k * y],
                               rtol=1e-7)


def test_dense_grad_linear_system_wrt_y0_and_matrix(x64):
    # L = c · y(t) = c · expm(A t) y0: dL/dy0 = expm(A t)^T c; dL/dA by central differences
    # of the closed form (float64).
    c, t = np.array([0.3, -1.2]), 2.7

    def loss(y0, a):
        _, info = odeint(linear, y0, jnp.array([0.0, 4.0]), a, rtol=1e-10, atol=1e-12,
                         dense=256, full_output=True)
        return jnp.dot(jnp.array(c), info.solution.evaluate(t))

    g_y0, g_a = jax.jit(jax.grad(loss, argnums=(0, 1)))(Y0, A)
    np.testing.assert_allclose(np.asarray(g_y0), scipy.linalg.expm(A * t).T @ c, rtol=1e-7)
    want = np.zeros((2, 2))
    eps = 1e-6
    for i in range(2):
        for j in range(2):
            d = np.zeros((2, 2))
            d[i, j] = eps
            want[i, j] = (c @ scipy.linalg.expm((A + d) * t) @ Y0
                          - c @ scipy.linalg.expm((A - d) * t) @ Y0) / (2 * eps)
    np.testing.assert_allclose(np.asarray(g_a), want, rtol=1e-6, atol=1e-9)


def test_dense_outside_span_is_nan_and_so_is_its_gradient(x64):
    def y_at(k, t):
        _, info = odeint(decay, 1.0, jnp.array([0.0, 2.0]), k, dense=64, full_output=True)
        return info.solution.evaluate(t)

    # One compile: the values at times before, at and inside the span, at its end and
    # after it, and the derivative of each (jacrev: each row is the gradient of a loss
    # using that value alone, while the others in the batch are NaN).
    # (The values ride along as jacrev's aux: one forward solve.)
    ts = jnp.array([-0.5, 0.0, 1.0, 2.0, 2.5])

    def y_at_aux(k):
        y = y_at(k, ts)
        return y, y

    jac, vals = map(np.asarray, jax.jit(jax.jacrev(y_at_aux, has_aux=True))(0.5))
    assert np.isnan(vals[0]) and np.isnan(vals[4])
    np.testing.assert_allclose(vals[1:4], np.exp(-0.5 * np.array([0.0, 1.0, 2.0])), rtol=1e-5)
    assert np.isnan(jac[0]) and np.isnan(jac[4])
    # d/dk exp(-k t) = -t exp(-k t): 0 at t0 itself (y = y0).
    np.testing.assert_allclose(jac[1], 0.0, atol=1e-12)
    np.testing.assert_allclose(jac[2:4], -np.array([1.0, 2.0]) * np.exp(-0.5 * np.array(
        [1.0, 2.0])), rtol=1e-5)


def test_dense_capacity_too_small_says_so(x64):
    @jax.jit  # one program: the solve and the evaluations inside and before its start
    def run(k):
        _, info = odeint(decay, 1.0, jnp.array([0.0, 20.0]), k, rtol=1e-10, atol=1e-12,
                         dense=4, full_output=True)
        sol = info.solution
        inside = jnp.linspace(sol.t_start, 20.0, 9)
        before = jnp.stack([0.0, 0.5 * sol.t_start])
        return info, inside, sol.evaluate(inside), sol.evaluate(before)

    info, inside, at_inside, before = run(0.5)
    sol = info.solution
    assert int(info.num_accepted) > 4
    assert not bool(sol.complete) and int(sol.num_kept) == 4
    t_start = float(sol.t_start)
    assert 0.0 < t_start < 20.0
    np.testing.assert_allclose(np.asarray(inside), np.linspace(t_start, 20.0, 9), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(at_inside), np.exp(-0.5 * np.asarray(inside)),
                               rtol=1e-8)
    assert np.all(np.isnan(np.asarray(before)))


def test_dense_ring_buffer_across_chunks_and_under_vmap(x64):
    """The record is filled in chunks of RECORD_CHUNK accepted steps (an outer loop), and
    B = 100 is no multiple of it: with more than B steps the chunks wrap around the ring.
    Kept are exactly the last B steps, contiguous (each starts where the one before
    ends), at the closed form; the same per element under vmap, where each element
    takes its own number of steps."""
    from solvers.ode._integrate import RECORD_CHUNK

    assert 100 % RECORD_CHUNK and 100 > RECORD_CHUNK

    def one(k):
        _, info = odeint(decay, 1.0, jnp.array([0.0, 0.5, 40.0]), k, rtol=1e-10,
                         atol=1e-12, dense=100, full_output=True)
        sol = info.solution
        inside = jnp.linspace(sol.t_start, 40.0, 7)
        return info.num_accepted, sol.complete, sol.record.s, sol.record.h, inside, \
            sol.evaluate(inside)

    ks = np.array([0.5, 0.3, 0.8])
    n_acc, complete, s, h, inside, at = jax.jit(jax.vmap(one))(jnp.asarray(ks))
    for j, k in enumerate(ks):
        assert int(n_acc[j]) > 100 + RECORD_CHUNK and not bool(complete[j])
        np.testing.assert_allclose(s[j, 1:], s[j, :-1] + h[j, :-1], rtol=1e-14)
        np.testing.assert_allclose(s[j, -1] + h[j, -1], 40.0, rtol=1e-14)
        np.testing.assert_allclose(at[j], np.exp(-k * np.asarray(inside[j])), rtol=1e-8,
                                   atol=1e-11)
    assert len(set(np.asarray(n_acc).tolist())) > 1  # (their own numbers of steps)


def test_dense_true_keeps_every_step(x64):
    _, info = jax.jit(lambda k: odeint(decay, 1.0, jnp.array([0.0, 20.0]), k, dense=True,
                                       max_steps=500, full_output=True))(0.5)
    assert info.solution.record.s.shape == (500,)
    assert bool(info.solution.complete)


def test_dense_with_terminal_event_covers_up_to_the_event(x64):
    # y = exp(-k t) falls to c at t_e = log(1/c)/k; the solution covers [0, t_e].
    k, c = 0.5, 0.25
    t_e = np.log(1 / c) / k
    t = np.linspace(0.0, t_e, 11)

    @jax.jit  # one program: the solve and the evaluations up to and past the event
    def run(k):
        _, info = odeint(decay, 1.0, jnp.array([0.0, 10.0]), k, event=lambda y, t, k: y - c,
                         rtol=1e-10, atol=1e-12, dense=128, full_output=True)
        sol = info.solution
        return sol.t_end, sol.evaluate(t), sol.evaluate(t_e + 0.1)

    t_end, inside, past = run(k)
    np.testing.assert_allclose(float(t_end), t_e, rtol=1e-9)
    np.testing.assert_allclose(np.asarray(inside), np.exp(-k * t), rtol=1e-8)
    assert np.isnan(float(past))


def test_dense_pytree_state_and_times_array_shape(x64):
    def f(y, t):
        return {"x": y["v"], "v": -y["x"]}

    t = np.linspace(0.0, 3.0, 6).reshape(2, 3)

    @jax.jit  # one program: the solve and its evaluation
    def run(y0):
        _, info = odeint(f, y0, jnp.array([0.0, 3.0]), rtol=1e-10, atol=1e-12, dense=128,
                         full_output=True)
        return info.solution.evaluate(jnp.array(t))

    ys = run({"x": 0.0, "v": 1.0})
    assert ys["x"].shape == (2, 3)
    np.testing.assert_allclose(np.asarray(ys["x"]), np.sin(t), atol=1e-9)
    np.testing.assert_allclose(np.asarray(ys["v"]), np.cos(t), atol=1e-9)


def test_dense_failure_nan_covers_nothing(x64):
    @jax.jit  # one program: the solve and its evaluation
    def run(k):
        _, info = odeint(decay, 1.0, jnp.array([0.0, 10.0]), k, max_steps=3,
                         on_failure="nan", dense=16, full_output=True)
        return info.converged, info.solution.evaluate(jnp.array([0.0, 0.01, 5.0]))

    converged, ys = run(0.5)
    assert not bool(converged)
    assert np.all(np.isnan(np.asarray(ys)))


def test_dense_failure_raises_under_jit_when_only_the_solution_is_used(x64):
    """on_failure="raise" (the default) also guards the dense output: under jit, a
    caller that uses only info.solution still gets the error (the check is not dropped
    as dead code with the unused outputs)."""

    @jax.jit
    def at(k):
        _, info = odeint(decay, 1.0, jnp.array([0.0, 10.0]), k, max_steps=3, dense=16,
                         full_output=True)
        return info.solution.evaluate(5.0)

    with pytest.raises(Exception, match="did not converge"):
        jax.block_until_ready(at(0.5))


def test_dense_bad_input():
    ts = jnp.array([0.0, 1.0])
    with pytest.raises(ValueError, match="full_output=True"):
        odeint(decay, 1.0, ts, 0.5, dense=8)
    with pytest.raises(ValueError, match="adjoint='forward'"):
        odeint(decay, 1.0, ts, 0.5, dense=8, adjoint="forward", full_output=True)
    with pytest.raises(ValueError, match="dense"):
        odeint(decay, 1.0, ts, 0.5, dense=0, full_output=True)


def test_without_dense_info_solution_is_none():
    _, info = jax.jit(lambda k: odeint(decay, 1.0, jnp.array([0.0, 1.0]), k,
                                       full_output=True))(0.5)
    assert info.solution is None and info.num_events is None


# --- non-terminal events --------------------------------------------------------------


@pytest.mark.parametrize("method", ["dopri5", "tsit5", "kvaerno5"])
def test_nonterminal_sine_zeros_are_k_pi(x64, method):
    # y = (sin t, cos t): sin crosses zero at k π; the integration goes on to the end.
    ys, info = to_numpy(jax.jit(lambda y0: odeint(
        oscillator, y0, jnp.array([0.0, 5.0, 20.0]), event=position, event_terminal=False,
        max_events=10, method=method, rtol=1e-10, atol=1e-12, full_output=True))(
            jnp.array([0.0, 1.0])))
    assert bool(info.converged) and float(info.t_final) == 20.0
    np.testing.assert_allclose(np.asarray(ys[-1]), [np.sin(20.0), np.cos(20.0)], atol=1e-7)
    n = int(info.num_events)
    assert n == 6  # π .. 6π < 20
    np.testing.assert_allclose(np.asarray(info.event_time[:n]), np.pi * np.arange(1, 7),
                               rtol=1e-8)
    assert np.all(np.isinf(np.asarray(info.event_time[n:])))
    assert np.all(np.asarray(info.event_index[:n]) == 0)
    assert np.all(np.asarray(info.event_index[n:]) == -1)
    # The state there: sin = 0, cos = ±1 alternately.
    np.testing.assert_allclose(np.asarray(info.event_state[:n, 1]), (-1.0) ** np.arange(1, 7),
                               atol=1e-7)
    assert np.all(np.isnan(np.asarray(info.event_state[n:])))


def to_numpy(tree):
    """The outputs as NumPy arrays (slicing them then compiles nothing)."""
    return jax.tree.map(np.asarray, tree)


def thresholds(y, t, k):
    return y - jnp.array([0.8, 0.5, 0.3, 0.1])


def test_nonterminal_kvaerno5_crossings_are_refined_on_its_own_steps(x64):
    # Four thresholds of y = exp(-k t), crossed at log(1/c)/k. kvaerno5's crossings are
    # refined on a step of the method (its cubic Hermite continuous extension is two orders
    # below its steps): at rtol = 1e-6 the extension's roots were up to 1.2e-6 (relative)
    # off, refined they are within 1.1e-7.
    k, cs = 0.7, np.array([0.8, 0.5, 0.3, 0.1])
    _, info = to_numpy(jax.jit(lambda k: odeint(
        decay, 1.0, jnp.array([0.0, 10.0]), k, event=thresholds, event_terminal=False,
        max_events=8, method="kvaerno5", rtol=1e-6, atol=1e-12, full_output=True))(k))
    t_exact = np.log(1 / cs) / k
    assert int(info.num_events) == 4
    np.testing.assert_array_equal(np.asarray(info.event_index[:4]), [0, 1, 2, 3])
    np.testing.assert_array_less(np.abs(np.asarray(info.event_time[:4]) - t_exact) / t_exact,
                                 2e-7)
    np.testing.assert_allclose(np.asarray(info.event_state[:4]), cs, rtol=1e-12)


def test_nonterminal_direction_and_several_components_in_time_order(x64):
    # Rising zeros of sin: 2π, 4π; of both sin and cos, merged in time order.
    y0, ts = jnp.array([0.0, 1.0]), jnp.array([0.0, 13.0])

    @jax.jit  # one program: both solves
    def run(y0):
        return (odeint(oscillator, y0, ts, event=position, event_terminal=False,
                       event_direction="rising", rtol=1e-10, atol=1e-12, full_output=True)[1],
                odeint(oscillator, y0, ts, event=both, event_terminal=False, rtol=1e-10,
                       atol=1e-12, full_output=True)[1])

    info, info_both = to_numpy(run(y0))
    assert int(info.num_events) == 2
    np.testing.assert_allclose(np.asarray(info.event_time[:2]), [2 * np.pi, 4 * np.pi],
                               rtol=1e-8)
    info = info_both
    want = np.sort(np.r_[np.pi * np.arange(1, 5), np.pi / 2 + np.pi * np.arange(0, 4)])
    want_index = np.where(np.isclose(want % np.pi, 0), 0, 1)
    n = int(info.num_events)
    assert n == len(want)
    np.testing.assert_allclose(np.asarray(info.event_time[:n]), want, rtol=1e-8)
    np.testing.assert_array_equal(np.asarray(info.event_index[:n]), want_index)


def test_nonterminal_more_crossings_than_kept_are_counted(x64):
    _, info = odeint(oscillator, jnp.array([0.0, 1.0]), jnp.array([0.0, 20.0]),
                     event=position, event_terminal=False, max_events=3, rtol=1e-10,
                     atol=1e-12, full_output=True)
    assert int(info.num_events) == 6 and info.event_time.shape == (3,)
    np.testing.assert_allclose(np.asarray(info.event_time), np.pi * np.arange(1, 4),
                               rtol=1e-8)


def test_nonterminal_jit_vmap_and_outputs_still_differentiable(x64):
    # y = (sin(w t), w cos(w t))-like: x'' = -w² x, x(0) = 0, x'(0) = 1: zeros k π / w.
    def spring(y, t, w):
        return jnp.stack([y[1], -w**2 * y[0]])

    def zeros(w):
        ys, info = odeint(spring, jnp.array([0.0, 1.0]), jnp.array([0.0, 5.0]), w,
                          event=lambda y, t, w: y[0], event_terminal=False, max_events=8,
                          rtol=1e-10, atol=1e-12, full_output=True)
        return info.event_time, info.num_events, ys[-1, 0]

    ws = jnp.array([1.0, 2.0])

    @jax.jit  # one program: the vmapped solves and the gradient
    def run(ws, w):
        return jax.vmap(zeros)(ws), jax.grad(lambda w: zeros(w)[2])(w)

    (times, counts, _), g = run(ws, 2.0)
    for w, row, n in zip(np.asarray(ws), np.asarray(times), np.asarray(counts)):
        k = np.arange(1, 9)
        want = k * np.pi / w
        want = want[want < 5.0]
        assert n == len(want)
        np.testing.assert_allclose(row[:n], want, rtol=1e-8)
    # The outputs keep their gradient: x(T) = sin(w T) / w.
    w, T = 2.0, 5.0
    np.testing.assert_allclose(float(g), T * np.cos(w * T) / w - np.sin(w * T) / w**2,
                               rtol=1e-6)


def test_nonterminal_bad_input():
    ts = jnp.array([0.0, 1.0])
    with pytest.raises(ValueError, match="event"):
        odeint(decay, 1.0, ts, 0.5, event_terminal=False)
    with pytest.raises(TypeError, match="event_terminal"):
        odeint(decay, 1.0, ts, 0.5, event=lambda y, t, k: y, event_terminal="no")
    with pytest.raises(ValueError, match="max_events"):
        odeint(decay, 1.0, ts, 0.5, event=lambda y, t, k: y, event_terminal=False,
               max_events=0)


# --- complex states -------------------------------------------------------------------


def test_complex_state_error_says_how_to_integrate_it():
    with pytest.raises(TypeError) as err:
        odeint(lambda y, t: -1j * y, jnp.array([1.0 + 0.0j]), jnp.array([0.0, 1.0]))
    msg = str(err.value)
    assert "complex" in msg and "float32" in msg and "float64" in msg
    assert "y.real" in msg or "z0.real" in msg


def test_complex_split_into_real_and_imaginary_parts(x64):
    # z' = -i ω z: z(t) = z0 exp(-i ω t), integrated as (Re z, Im z).
    w, z0 = 2.0, 1.0 + 0.5j

    def f(y, t):
        dz = -1j * w * (y[0] + 1j * y[1])
        return jnp.stack([dz.real, dz.imag])

    ts = np.linspace(0.0, 3.0, 7)
    ys = np.asarray(jax.jit(lambda y0: odeint(f, y0, ts, rtol=1e-10, atol=1e-12))(
        jnp.array([z0.real, z0.imag])))
    want = z0 * np.exp(-1j * w * ts)
    np.testing.assert_allclose(np.asarray(ys[:, 0] + 1j * ys[:, 1]), want, atol=1e-8)


def test_solvers_exports_odesolution():
    assert solvers.ode.ODESolution is not None
