"""odeint's terminal events (``event=``): crossing times, states and their gradients.

Oracles are closed forms: exponential decay to a threshold (``t_e = log(y0/c)/k``), a
falling body's impact (``t = sqrt(2h/g)``, ``v = -sqrt(2gh)``), a bouncing ball's bounce
times with restitution ``e`` (``t_n = t_1 + 2 v_1 (e + ... + e^(n-1)) / g``), a cosine's
zeros; or float64 central finite differences of the event time found at tight
tolerances. Nothing here takes an expected value from the code under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers
from solvers.ode import odeint

# --- problems (module level: one compiled solver per function object) ------------------


def decay(y, t, k, c):
    return -k * y


def below(y, t, k, c):
    return y - c


def fall(y, t, g):
    return jnp.stack([y[1], -g])


def height(y, t, g):
    return y[0]


def oscillator(y, t):
    return jnp.stack([y[1], -y[0]])


def position(y, t):
    return y[0]


TS = np.linspace(0.0, 5.0, 6)


# --- exponential decay to a threshold ---------------------------------------------------


@pytest.mark.parametrize(
    "method", ["dopri5", "tsit5", pytest.param("kvaerno5", marks=pytest.mark.slow)]
)
def test_exponential_threshold_time_state_and_gradients(x64, method):
    y0, k, c = 2.0, 0.7, 0.3
    t_exact = np.log(y0 / c) / k
    ts = jnp.array([0.0, 1.0, 2.0, 5.0, 10.0])

    def outputs(y0, k, c):
        ys, info = odeint(decay, y0, ts, k, c, event=below, method=method, full_output=True)
        return jnp.stack([info.event_time, info.event_state, ys[-1]]), (ys, info)

    # One compilation: the Jacobian of (t_e, y_e, ys[-1]) with the outputs as aux.
    jac, (ys, info) = jax.jit(jax.jacrev(outputs, argnums=(0, 1, 2), has_aux=True))(y0, k, c)
    ys, ts = np.asarray(ys), np.asarray(ts)
    np.testing.assert_allclose(info.event_time, t_exact, rtol=1e-7)
    np.testing.assert_allclose(info.event_state, c, rtol=1e-7)
    assert int(info.event_index) == 0 and bool(info.converged)
    np.testing.assert_allclose(info.t_final, info.event_time)
    # Rows before the event follow the solution; rows past it hold the event state.
    np.testing.assert_allclose(ys[:3], y0 * np.exp(-k * np.asarray(ts[:3])), rtol=1e-7)
    np.testing.assert_allclose(ys[3:], c, rtol=1e-7)
    jac = np.asarray(jac).T  # rows: t_e, y_e, ys[-1]; columns: y0, k, c
    expected = (1 / (k * y0), -np.log(y0 / c) / k**2, -1 / (k * c))
    np.testing.assert_allclose(jac[0], expected, rtol=1e-6)
    # The state at the event is c whatever y0 and k: y_e moves with t_e and cancels.
    np.testing.assert_allclose(jac[1], (0.0, 0.0, 1.0), atol=1e-7)
    np.testing.assert_allclose(jac[2], (0.0, 0.0, 1.0), atol=1e-7)


def test_kvaerno5_crossing_is_refined_on_its_own_step(x64):
    # kvaerno5's continuous extension is a cubic Hermite, two orders below its steps; the
    # crossing is refined on a step of the method itself. At rtol = 1e-6 the continuous
    # extension's root was 1.6e-6 to 2.4e-6 (relative) from t_e = log(y0/c)/k on these
    # four, above rtol; refined it is within 1.2e-8 to 8e-8.
    y0 = jnp.array([2.0, 1.0, 3.0, 1.0])
    k = jnp.array([0.7, 1.0, 0.3, 2.0])
    c = jnp.array([0.3, 0.25, 1.0, 0.5])
    t_exact = np.log(np.asarray(y0) / np.asarray(c)) / np.asarray(k)
    ts = jnp.array([0.0, 10.0])

    def event_time(y0, k, c):
        _, info = odeint(decay, y0, ts, k, c, event=below, method="kvaerno5", rtol=1e-6,
                         atol=1e-12, full_output=True)
        return info.event_time, info

    (t_e, info), dk = jax.jit(jax.vmap(jax.value_and_grad(event_time, argnums=1,
                                                          has_aux=True)))(y0, k, c)
    assert np.all(np.asarray(info.converged))
    np.testing.assert_array_less(np.abs(np.asarray(t_e) - t_exact) / t_exact, 2e-7)
    np.testing.assert_allclose(info.event_state, c, rtol=1e-12)  # on the surface
    np.testing.assert_allclose(dk, -t_exact / np.asarray(k), rtol=1e-6)


def test_threshold_closed_over_is_differentiated(x64):
    def event_time(c):
        ys, info = odeint(decay, 1.0, TS, 0.5, 0.0, event=lambda y, t, k, _: y - c,
                          full_output=True)
        return info.event_time

    t_e, g = jax.jit(jax.value_and_grad(event_time))(0.25)
    np.testing.assert_allclose(t_e, np.log(4) / 0.5, rtol=1e-7)
    np.testing.assert_allclose(g, -1 / (0.5 * 0.25), rtol=1e-6)


@pytest.mark.parametrize("adjoint", ["discrete", "backsolve", "interpolate"])
def test_every_adjoint(x64, adjoint):
    def event_time(k):
        return odeint(decay, 1.0, TS, k, 0.25, event=below, adjoint=adjoint,
                      full_output=True)[1].event_time

    np.testing.assert_allclose(jax.jit(jax.grad(event_time))(0.5), -np.log(4) / 0.25,
                               rtol=1e-6)


@pytest.mark.transforms("odeint", "hessian")
@pytest.mark.parametrize(
    "method", ["dopri5", pytest.param("kvaerno5", marks=pytest.mark.slow),
               pytest.param("bdf", marks=pytest.mark.slow)]
)
def test_second_derivatives_of_the_event_time_state_and_rows(x64, method):
    """jax.hessian (forward over reverse) of the event time, the state there and a row
    before it, and jacrev of grad (reverse over reverse) of the event time, in the start,
    the rate and the threshold (closed over by the event function): closed forms of
    ``y0 exp(-k t)`` falling to ``c``, ``t_e = log(y0 / c) / k``."""
    y0, k, c = 2.0, 0.7, 0.3
    ts = jnp.array([0.0, 1.0, 2.0, 5.0])

    def outputs(p):
        y0, k, c = p
        ys, info = odeint(decay, y0, ts, k, 0.0, event=lambda y, t, k, _: y - c,
                          method=method, rtol=1e-9, atol=1e-12, full_output=True)
        return jnp.stack([info.event_time, ys[1], info.event_state])

    p = jnp.array([y0, k, c])
    hessian = np.asarray(jax.jit(jax.hessian(outputs))(p))
    rev_rev = np.asarray(jax.jit(jax.jacrev(jax.grad(lambda p: outputs(p)[0])))(p))
    L, e = np.log(y0 / c), np.exp(-k)
    expected = np.array([
        [[-1 / (k * y0**2), -1 / (k**2 * y0), 0.0],  # t_e
         [-1 / (k**2 * y0), 2 * L / k**3, 1 / (k**2 * c)],
         [0.0, 1 / (k**2 * c), 1 / (k * c**2)]],
        [[0.0, -e, 0.0], [-e, y0 * e, 0.0], [0.0, 0.0, 0.0]],  # y(1) = y0 exp(-k)
        np.zeros((3, 3)),  # y(t_e) = c
    ])
    for got in (hessian, rev_rev[None]):
        np.testing.assert_allclose(got, expected[: len(got)], rtol=1e-6, atol=1e-7)


# --- a falling body -----------------------------------------------------------------------


def impact(h, g):
    ys, info = odeint(fall, jnp.stack([h, 0.0 * h]), TS, g, event=height, full_output=True)
    return info.event_time, info.event_state[1], ys


def test_falling_body_impact_time_velocity_and_gradients(x64):
    h, g = 10.0, 9.81

    def outputs(h, g):
        t, v, ys = impact(h, g)
        return jnp.stack([t, v]), (jnp.stack([t, v]), ys)

    jac, (tv, ys) = jax.jit(jax.jacrev(outputs, argnums=(0, 1), has_aux=True))(h, g)
    tv, ys = np.asarray(tv), np.asarray(ys)
    t, v = np.sqrt(2 * h / g), -np.sqrt(2 * g * h)
    np.testing.assert_allclose(tv, [t, v], rtol=1e-8)
    np.testing.assert_allclose(ys[2:], np.broadcast_to([0.0, v], ys[2:].shape), atol=1e-8)
    expected = (
        (1 / np.sqrt(2 * h * g), -np.sqrt(2 * h) / (2 * g**1.5)),
        (-np.sqrt(g / (2 * h)), -np.sqrt(h / (2 * g))),
    )
    np.testing.assert_allclose(np.asarray(jac, float).T, expected, rtol=1e-7)


@pytest.mark.slow
def test_gradient_of_rows_before_and_past_the_event_matches_finite_differences(x64):
    def loss(p):
        h, g = p
        ys = impact(h, g)[2]
        return jnp.sum(ys[:, 0] ** 2 + ys[:, 1] * ys[:, 0] + ys[:, 1])

    def loss_tight(p):
        ys = odeint(fall, jnp.stack([p[0], 0.0]), TS, p[1], event=height, rtol=1e-12,
                    atol=1e-12)
        return jnp.sum(ys[:, 0] ** 2 + ys[:, 1] * ys[:, 0] + ys[:, 1])

    # Rows 0..2 before the impact at t = 2.02 (h = 20), rows 3.. hold the impact state.
    p = jnp.array([20.0, 9.81])
    fd = [(float(loss_tight(p + e)) - float(loss_tight(p - e))) / 2e-5
          for e in 1e-5 * np.eye(2)]
    np.testing.assert_allclose(jax.grad(loss)(p), fd, rtol=1e-6)


# --- a bouncing ball, restarted by the user ------------------------------------------------


def bounce_times(h, e, g=9.81, n=3):
    y, t, times = jnp.stack([h, 0.0 * h]), jnp.zeros_like(h), []
    for _ in range(n):
        ts = jnp.stack([t, t + 10.0])
        _, info = odeint(fall, y, ts, g, event=height, event_direction="falling",
                         full_output=True)
        t = info.event_time
        y = jnp.stack([0.0 * h, -e * info.event_state[1]])  # on the ground, bouncing up
        times.append(t)
    return jnp.stack(times)


@pytest.mark.slow
def test_bouncing_ball_first_three_bounces(x64):
    h, e, g = 2.0, 0.8, 9.81
    t1, v1 = np.sqrt(2 * h / g), np.sqrt(2 * g * h)
    expected = [t1, t1 + 2 * e * v1 / g, t1 + 2 * (e + e**2) * v1 / g]

    def last(h, e):
        times = bounce_times(h, e)
        return times[-1], times

    (_, times), (dh, de) = jax.jit(jax.value_and_grad(last, argnums=(0, 1), has_aux=True))(h, e)
    np.testing.assert_allclose(times, expected, rtol=1e-8)
    np.testing.assert_allclose(de, 2 * (1 + 2 * e) * v1 / g, rtol=1e-7)
    np.testing.assert_allclose(
        dh, 1 / np.sqrt(2 * h * g) + 2 * (e + e**2) / g * np.sqrt(g / (2 * h)), rtol=1e-7
    )


# --- transformations ----------------------------------------------------------------------


def test_vmap_and_jit_elements_stop_at_different_times(x64):
    g = 9.81
    hs = np.array([1.0, 5.0, 20.0, 500.0])  # the last one is still falling at t = 5

    def time_and_rows(h):
        t, _, ys = impact(h, g)
        return t, ys

    # One compilation: jit of vmap of value-and-grad (the rows ride along as aux).
    fn = jax.jit(jax.vmap(jax.value_and_grad(time_and_rows, has_aux=True)))
    (times, ys), grads = fn(hs)
    times, ys, grads = np.asarray(times), np.asarray(ys), np.asarray(grads)
    expected = np.sqrt(2 * np.asarray(hs) / g)
    expected[-1] = np.inf
    np.testing.assert_allclose(times, expected, rtol=1e-8)
    np.testing.assert_allclose(grads[:3], 1 / np.sqrt(2 * np.asarray(hs[:3]) * g), rtol=1e-7)
    assert grads[3] == 0.0
    np.testing.assert_allclose(ys[3, :, 0], 500.0 - g * np.asarray(TS) ** 2 / 2, rtol=1e-9)
    np.testing.assert_allclose(ys[0, 1:, 0], 0.0, atol=1e-9)  # all rows past t = 0.45


def test_event_that_never_fires_is_an_ordinary_result(x64):
    ts = np.linspace(0.0, 2.0, 5)

    @jax.jit  # one program: the solve with the event, without it, and the gradient
    def run(k):
        ys, info = odeint(decay, 1.0, ts, k, 0.0, event=below, full_output=True)
        plain = odeint(decay, 1.0, ts, k, 0.0)
        g = jax.grad(lambda k: odeint(decay, 1.0, ts, k, 0.0, event=below)[-1])(k)
        return ys, info, plain, g

    ys, info, plain, g = run(0.5)
    np.testing.assert_allclose(ys, plain, rtol=1e-12)
    assert np.isinf(info.event_time) and np.isnan(info.event_state)
    assert int(info.event_index) == -1 and info.status_name == "converged"
    assert float(info.t_final) == 2.0
    np.testing.assert_allclose(g, -2 * np.exp(-1.0), rtol=1e-7)


def test_without_event_the_event_fields_are_none(x64):
    _, info = jax.jit(lambda k: odeint(decay, 1.0, TS, k, 0.0, full_output=True))(0.5)
    assert info.event_time is None and info.event_state is None and info.event_index is None


# --- directions and pytree events -------------------------------------------------------


@pytest.mark.parametrize(
    "direction, expected", [("both", np.pi / 2), ("falling", np.pi / 2),
                            ("rising", 3 * np.pi / 2)]
)
def test_direction(x64, direction, expected):
    ts = jnp.array([0.0, 7.0])
    _, info = odeint(oscillator, jnp.array([1.0, 0.0]), ts, event=position,
                     event_direction=direction, full_output=True)
    np.testing.assert_allclose(info.event_time, expected, rtol=1e-8)


def test_a_start_on_the_surface_does_not_fire(x64):
    # y = sin t starts at 0: the first crossing is at pi.
    _, info = odeint(oscillator, jnp.array([0.0, 1.0]), jnp.array([0.0, 4.0]),
                     event=position, full_output=True)
    np.testing.assert_allclose(info.event_time, np.pi, rtol=1e-8)


def test_pytree_event_reports_which_leaf_fired(x64):
    def events(y, t, k, c):
        return {"a_low": y - 0.1, "b_high": y - 0.5}  # leaves in key order

    def event_time(k):
        _, info = odeint(decay, 1.0, TS, k, 0.0, event=events, full_output=True)
        return info.event_time, info

    (_, info), g = jax.jit(jax.value_and_grad(event_time, has_aux=True))(1.0)
    np.testing.assert_allclose(info.event_time, np.log(2.0), rtol=1e-8)
    assert int(info.event_index) == 1
    np.testing.assert_allclose(g, -np.log(2.0), rtol=1e-7)


# --- failures and bad input -------------------------------------------------------------


def nan_late(y, t, k, c):
    return jnp.where(t > 1.0, jnp.nan, y + 1.0)


def test_nan_event_raises_naming_the_event_function(x64):
    with pytest.raises(solvers.ConvergenceError, match="event function nan_late returned NaN"):
        jax.block_until_ready(odeint(decay, 1.0, TS, 0.5, 0.0, event=nan_late))
    # Under jit the check is compiled in (a host callback: JAX wraps the error).
    with pytest.raises(Exception, match="event function nan_late returned NaN"):
        jax.block_until_ready(
            jax.jit(lambda k: odeint(decay, 1.0, TS, k, 0.0, event=nan_late))(0.5)
        )


def test_nan_event_follows_on_failure(x64):
    @jax.jit  # one program: both on_failure settings and the gradient
    def run(k):
        nan = odeint(decay, 1.0, TS, k, 0.0, event=nan_late, on_failure="nan",
                     full_output=True)
        ignore = odeint(decay, 1.0, TS, k, 0.0, event=nan_late, on_failure="ignore",
                        full_output=True)
        grad = jax.grad(lambda k: odeint(decay, 1.0, TS, k, 0.0, event=nan_late,
                                         on_failure="nan", full_output=True)[0][0])(k)
        return nan, ignore, grad

    (ys, info), (ys_ignore, info_ignore), grad = run(0.5)
    assert info.status_name == "nonfinite" and np.all(np.isnan(ys))
    assert np.isnan(info.event_time)
    ys, info = np.asarray(ys_ignore), info_ignore
    assert info.status_name == "nonfinite" and np.isnan(info.event_time)
    np.testing.assert_allclose(ys[:2], np.exp(-0.5 * np.asarray(TS[:2])), rtol=1e-7)
    assert np.all(np.isnan(ys[2:]))
    assert np.isnan(grad)  # a failed forward pass gives NaN gradients, not numbers


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(event=1.0), TypeError, "`event` must be callable"),
        (dict(event=below, event_direction="up"), ValueError,
         "'both', 'rising', 'falling'"),
        (dict(event=lambda y, t, k, c: jnp.int32(1)), TypeError, "floating"),
        (dict(event=lambda y: y), TypeError, "event is called with"),
    ],
)
def test_bad_event_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        odeint(decay, 1.0, TS, 0.5, 0.0, **kwargs)
