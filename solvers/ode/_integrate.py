"""The stepping loop, with dense output at the output times.

The steps never stop at an output time: a ``lax.scan`` over the output times runs, for
each, a ``lax.while_loop`` of steps until the time is passed, and interpolates the output
from the last step's continuous extension (several outputs inside one step cost no step).
Only the final step is shortened, to end on the last output time exactly; a method whose
continuous extension is of lower order than its steps (``Stepper.lands``: kvaerno5) has
its steps shortened to end on every output time instead. The step loop
carries no output logic; its scalars are a :class:`Controller` (carried packed), and it never runs
more than its step budget. With ``record=B`` the loop also keeps the continuous
extension of its last ``B`` accepted steps (a ring buffer), for the interpolating
adjoint; ``integrate_jumps`` lands on every time instead and applies a jump there (the
backward pass). Statuses are the codes of :mod:`solvers._status`.
"""

from __future__ import annotations

import functools

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from implicit import _sharding

from solvers import _status
from solvers.ode import _control, _small

__all__ = [
    "Stats",
    "Stepper",
    "Record",
    "EventLog",
    "Controller",
    "integrate",
    "integrate_jumps",
    "interpolate",
    "valid_times",
    "NOT_FAILED",
]

#: Status while the loop runs, and of a run that reached its end: ``_status.CONVERGED``.
NOT_FAILED = _status.CONVERGED
#: A backward pass only (never in ``info.status``): the state it reconstructed (the
#: backsolve adjoint's ``y(t0)``, the discrete adjoint's replay) disagrees with the forward.
DRIFT = _status.DRIFT


class Stats(NamedTuple):
    status: Any  # a solvers._status code: CONVERGED (0, reached the end), MAX_STEPS,
    # STEP_UNDERFLOW, NONFINITE or INVALID_INPUT (traced times not increasing)
    t: Any  # time reached (last accepted step)
    h: Any  # the controller's next step size
    ratio: Any  # weighted RMS error of the last step (<= 1 when accepted)
    num_steps: Any  # attempted steps (what max_steps caps)
    num_accepted: Any
    num_rejected: Any
    num_fevals: Any  # right-hand side evaluations
    num_jacobians: Any  # Jacobian evaluations (stiff methods)
    num_factorizations: Any  # LU factorisations (stiff methods)


class Stepper(NamedTuple):
    """A method, as the loop sees it.

    ``init(s0, z0) -> cache`` (the cache holds at least ``k0``, the derivative at the
    current point). ``step(s, z, cache, h) -> (z1, err, ks, accept_cache, reject_cache,
    ok, counts)``: the new state, the error estimate of the controlled components, the
    stage derivatives (for dense output), the cache after an accepted or a rejected step,
    whether the stage solves succeeded and ``(fevals, jacobians, factorizations)``.
    """

    init: Callable
    step: Callable
    dense: Any  # (stages, degree) continuous-extension weights
    beta1: float
    beta2: float
    order: int  # exponent of the local error estimate (for the initial step)
    init_counts: tuple = (1, 0, 0)  # (fevals, jacobians, factorizations) spent by init
    # ``diff_step(s, z, cache, h, ks, eps=None) -> (z1, accept_cache, ks, err)``: the step
    # (and its error estimate) as a function of ``z``, ``cache`` and the parameters ``rhs``
    # closes over, to differentiate with ``jax.vjp`` (the discrete adjoint); ``ks`` are
    # the stage derivatives the step took (an implicit method linearises its stage
    # equations there); ``eps`` (shaped like ``err``) is added where the local error is
    # made (``z1`` of a one-step method, the corrector of a multistep one, so that the
    # history sees it). None: ``step`` itself, ``eps`` added to ``z1``.
    diff_step: Any = None
    # Steps end on every output time (the output is the state there, not the continuous
    # extension's value): for a method whose continuous extension is of lower order than
    # the step (kvaerno5's cubic Hermite).
    lands: bool = False
    # The largest step size (``odeint``'s ``max_step``, jax odeint's ``hmax``).
    max_step: float = float("inf")
    # ``control(ratio, accept, ok, cache) -> factor``: the next step size over this one,
    # from the error ratio, whether the stage solves succeeded and the cache after the step
    # (a multistep method picks its order and step size together, and retries a failed
    # solve at the same size with a new Jacobian: bdf). None: the PI controller (beta1,
    # beta2), and half the step after a failed stage solve.
    control: Any = None
    # ``restep(s, z, ks, h) -> (z1, k1, ok, counts)``: a step of size ``h`` (no error
    # control) from the start ``(s, z)`` of an accepted step whose stage derivatives were
    # ``ks``: the new state, the derivative there, whether its stage solves succeeded and
    # ``(fevals, jacobians, factorizations)``. Given, an event crossing is refined on the
    # method's own steps (:func:`refine_crossing`): for a method whose continuous extension
    # is two orders below its steps (kvaerno5's cubic Hermite against a fifth-order
    # step), whose error it then removes. None: the crossing is the continuous extension's
    # root; for dopri5 and tsit5 (fourth-order extension) that error is of the order of the
    # global error at the step's start and re-stepping did not lower the event time's
    # error (measured), and bdf's interpolant is of its step's own order.
    restep: Any = None
    # The cache carries the past steps (bdf's differences): a replayed block must then
    # take the forward's steps, or the cache it ends with is not the checkpoint's.
    history: bool = False
    # An explicit pair's tableau (its cache is ``(k0,)``, its ``ks`` all its stage
    # derivatives): the discrete adjoint then differentiates a step from the ``ks`` it took
    # (:func:`solvers.ode._explicit.erk_vjp`) instead of taking it again.
    tableau: Any = None
    # ``slope(u, s) -> u'``: the derivative of the controlled components, for the first
    # step's heuristic, where it is not ``rhs`` (a DAE's consistent slope, ``M y' = f``).
    # None: ``rhs``.
    slope: Any = None


class Record(NamedTuple):
    """The continuous extension of consecutive accepted steps, oldest first.

    ``y(s[i] + θ h[i]) = z[i] + Σ_d θ^(d+1) coef[i, d]``; unused rows have ``s = +inf``.
    ``start`` is the first time covered (the integration's start when it kept every step).
    """

    s: Any  # (B,)
    h: Any  # (B,)
    z: Any  # (B, N)
    coef: Any  # (B, degree, N)
    start: Any


def interpolate(record, t):
    """Evaluate a :class:`Record` at time ``t`` (extrapolating outside its steps)."""
    B = record.s.shape[0]
    i = jnp.clip(jnp.sum(record.s <= t) - 1, 0, B - 1)
    return record.z[i] + _horner(record.coef[i], (t - record.s[i]) / record.h[i])


def _horner(coef, theta):
    """``Σ_d θ^(d+1) coef[d]`` (Horner's rule, unrolled over the few degrees)."""
    acc = coef[-1]
    for d in range(coef.shape[0] - 2, -1, -1):
        acc = acc * theta + coef[d]
    return acc * theta


class Controller(NamedTuple):
    """The step loop's scalars: where it is, the step-size controller and the counters."""

    s: Any  # time reached (start of the next step)
    h: Any  # the next step size
    ratio_prev: Any  # error ratio of the last accepted step (floored), for the PI term
    ratio: Any  # error ratio of the last attempted step
    num_steps: Any  # attempted steps (what the budget caps)
    num_accepted: Any
    num_fevals: Any
    num_jacobians: Any
    num_factorizations: Any
    status: Any  # a solvers._status code; NOT_FAILED while running


    def pack(self):
        """The carried form: two small vectors (floats; int32 counters and status).

        Carrying ten separate scalars costs more kernels per step: the Lotka–Volterra
        solve took 25-50% longer on CPU, its gradient 5-15%.
        """
        # On an Explicit mesh the scalars must share one sharding and batching.
        floats = jnp.stack(_sharding.stackable([self.s, self.h, self.ratio_prev, self.ratio]))
        ints = jnp.stack(_sharding.stackable([jnp.asarray(v, jnp.int32) for v in self[4:]]))
        return floats, ints

    @classmethod
    def unpack(cls, packed):
        """The :class:`Controller` of a :meth:`pack`-ed carry."""
        floats, ints = packed
        return cls(*(floats[i] for i in range(4)), *(ints[i] for i in range(6)))

    @classmethod
    def accepted(cls, packed):
        """``num_accepted`` of a :meth:`pack`-ed carry. (Unpacking it and packing it again
        to save a checkpoint cost twelve kernels per window in the forward loop: XLA does
        not fold the slices back into the vectors.)"""
        return packed[1][cls._fields.index("num_accepted") - 4]

    @classmethod
    def time(cls, packed):
        """``s`` of a :meth:`pack`-ed carry (the same: no unpacking)."""
        return packed[0][cls._fields.index("s")]


class LastStep(NamedTuple):
    """The last accepted step (start, size, state, stage derivatives): dense output."""

    s: Any
    h: Any
    z: Any
    ks: Any


class Carry(NamedTuple):
    ctrl: Any  # Controller.pack(): a few kernels per step fewer than separate scalars
    z: Any  # the state
    cache: Any  # the stepper's cache (at least the derivative at the current point)
    last_step: Any  # LastStep (dense mode) or None
    rec: Any  # Record ring buffer (``start`` unset) or None
    ck: Any = None  # checkpoints (packed controller, state, cache) every W accepted steps
    ev: Any = None  # EventCarry (events only)


class EventCarry(NamedTuple):
    """The event functions' values along the loop (``integrate(..., event=)``)."""

    g: Any  # (E,) the event values at the current point
    g_start: Any  # (E,) ... at the start of the last accepted step
    cross: Any  # (E,) bool: which components changed sign (in the chosen direction) there
    fired: Any  # bool: a crossing was found: the loop stops after that step
    bad: Any  # bool: an event value was not finite (status NONFINITE)
    log: Any = None  # EventLog (non-terminal events only)


class EventLog(NamedTuple):
    """The crossings of non-terminal events (``integrate(..., event=, log=M)``), in order.

    ``t``: (M,) crossing times (``inf`` past ``count``), ``z``: (M, N) the states there
    (NaN past ``count``), ``index``: (M,) the event component that crossed (-1 past
    ``count``), ``count``: the crossings found (it goes on counting past ``M``: then only
    the first ``M`` are kept).
    """

    t: Any
    z: Any
    index: Any
    count: Any


class EventResult(NamedTuple):
    """Where the integration stopped on an event (or not).

    ``t``: the crossing time (``inf`` if none; NaN if an event value was not finite),
    ``z``: the state there (NaN if none), ``index``: the component of the raveled event
    values that crossed first (-1 if none), ``bad``: an event value was not finite.
    """

    t: Any
    z: Any
    index: Any
    bad: Any


#: Bracket iterations locating a crossing on a step's continuous extension (Chandrupatla's
#: method converges in a handful; the cap is bisection's worst case from [0, 1] in float64).
EVENT_MAX_ITERS = 100


def crossings(g0, g1, direction):
    """Which components went from ``g0`` to ``g1`` across zero, in ``direction``.

    ``"rising"``: from negative to zero or positive; ``"falling"``: from positive to zero or
    negative; ``"both"``: either. A component that starts at exactly zero does not count
    (the integration starts on the surface); NaN never counts.
    """
    rising = (g0 < 0) & (g1 >= 0)
    falling = (g0 > 0) & (g1 <= 0)
    if direction == "rising":
        return rising
    if direction == "falling":
        return falling
    return rising | falling


def _crossing_thetas(event, last_step, dense, cross):
    """Each crossing component's root ``θ ∈ [0, 1]`` on an accepted step's continuous
    extension (``inf`` for the components that did not cross); see :func:`locate_event`.
    Returns ``(theta, state, finite)``: ``state(θ)`` is the interpolated state."""
    from solvers import bracket

    s, h, z0, ks = last_step
    dtype = z0.dtype
    E = cross.shape[0]
    coef = h * _small.matmul(dense, ks)
    idx = jnp.arange(E)

    def state(theta):
        return z0 + _horner(coef, theta)

    def fn(theta):  # (E,) thetas -> component j of the event at theta[j]
        return jax.vmap(lambda th, j: event(state(th), s + th * h)[j])(theta, idx)

    eps = jnp.finfo(dtype).eps
    atol = 2 * eps * (jnp.abs(s) + jnp.abs(h)) / jnp.abs(h)
    lower = jnp.zeros((E,), dtype)
    upper = jnp.ones((E,), dtype)
    init, f_start = bracket._chandrupatla_init(fn, lower, upper)
    # Components that did not cross take no part (a bracket "without a sign change").
    init = init._replace(flag=jnp.where(cross, init.flag, _status.NO_SIGN_CHANGE))
    step = bracket._chandrupatla_step(fn, jnp.zeros((), dtype), atol)

    def cond(c):
        st, i = c
        return jnp.any(st.flag == _status.RUNNING) & (i < EVENT_MAX_ITERS)

    st, _ = _sharding.while_loop(cond, lambda c: (step(c[0]), c[1] + 1),
                                 (init, jnp.zeros((), jnp.int32)))
    theta, _ = bracket._chandrupatla_finish(st)
    # A crossing the interpolant misses (its value at θ = 1 rounds to the other side):
    # the root is the step's end to round-off.
    theta = jnp.where(st.flag == _status.NO_SIGN_CHANGE, 1.0, theta)
    finite = ~jnp.any(cross & ((st.flag == _status.NONFINITE) | ~jnp.isfinite(theta)))
    theta = jnp.where(cross, jnp.clip(theta, 0, 1), jnp.inf)
    return theta, state, finite


def refine_crossing(event, restep, last_step, theta, j, state):
    """Event component ``j``'s crossing near ``s + θh`` (its root on the step's continuous
    extension), refined on an actual step of the method.

    With ``y(t)`` the method's own step from the step's start ``s`` to ``t`` (``restep``:
    the same method, no error control), one Newton step on ``φ(t) = g_j(y(t), t)`` from
    the continuous extension's root ``t_0``: ``t = t_0 - φ(t_0) / φ'(t_0)``, with the
    derivative along the solution ``φ' = g_y · f(y, t) + g_t`` (one ``jax.jvp`` of the
    event function; ``f`` is the step's last stage derivative, at its new state). The state
    is moved to ``t`` to first order, ``y(t_0) + f Δt``. ``t_0`` is already within the
    continuous extension's error of the root, so what the Newton step leaves (of order
    ``Δt²``) is far below the step's own error. A correction that would leave the step
    ``[s, s + h]`` or that is not finite (``φ' = 0``: a tangential crossing), or a re-step
    whose stage solves did not converge, keeps the continuous extension's root and state;
    a re-stepped state or event value that is not finite is a failure (``finite`` False).

    ``state(θ)``: the continuous extension. Returns ``(t, z, finite, counts)``, ``counts``
    the ``(fevals, jacobians, factorizations)`` the re-step spent.
    """
    s, h, z0, ks = last_step
    t0 = jnp.where(theta == 1, s + h, s + theta * h)
    y, k1, ok, counts = restep(s, z0, ks, t0 - s)
    g, dg = jax.jvp(lambda y, t: event(y, t)[j], (y, t0), (k1, jnp.ones_like(t0)))
    finite = jnp.all(jnp.isfinite(y)) & jnp.isfinite(g)
    dt = -g / dg
    t = t0 + dt
    use = ok & finite & jnp.isfinite(dt) & (t >= s) & (t <= s + h)
    t = jnp.where(use, t, t0)
    z = jnp.where(use, y + k1 * dt, state(theta))
    return t, z, finite, tuple(jnp.asarray(c, jnp.int32) for c in counts)


def locate_event(event, restep, last_step, dense, g_start, g_end, cross):
    """The first crossing inside an accepted step.

    ``event(z, s) -> (E,)``; ``restep``: the method's :attr:`Stepper.restep` (None: the
    interpolant's root stands); ``last_step``: the step (start, size, state, stages);
    ``g_start``/``g_end``: the event values at its ends; ``cross``: the components that
    changed sign. Each crossing component's root in ``θ ∈ [0, 1]`` (``t = s + θ h``) on
    the step's continuous extension is found by Chandrupatla's method
    (:mod:`solvers.bracket`'s steps) to a few ulps of the time; the earliest one wins, and
    is refined on the method's own steps (:func:`refine_crossing`). Returns ``(t, z,
    index, finite, counts)``.
    """
    s, h = last_step[0], last_step[1]
    theta, state, finite = _crossing_thetas(event, last_step, dense, cross)
    j = jnp.argmin(theta)
    th = theta[j]
    if restep is None:
        t = jnp.where(th == 1, s + h, s + th * h)
        return t, state(th), j.astype(jnp.int32), finite, (0, 0, 0)
    th = jnp.where(jnp.isfinite(th), th, 0)  # (no crossing: unused)
    t, z, ok, counts = refine_crossing(event, restep, last_step, th, j, state)
    return t, z, j.astype(jnp.int32), finite & ok, counts


def log_crossings(event, restep, last_step, dense, cross, log, t0):
    """Append every crossing inside an accepted step to an :class:`EventLog`, earliest
    first (non-terminal events), each refined as :func:`locate_event` does. Returns
    ``(log, finite, counts)``."""
    s, h = last_step[0], last_step[1]
    dtype = last_step[2].dtype
    M = log.t.shape[0]
    E = cross.shape[0]
    theta, state, finite = _crossing_thetas(event, last_step, dense, cross)
    ok = jnp.isfinite(theta)
    th0 = jnp.where(ok, theta, 0)
    counts = (jnp.zeros((), jnp.int32),) * 3
    if restep is None:
        t = jnp.where(th0 == 1, s + h, s + th0 * h)
        z = jax.vmap(state)(th0)
    else:
        t, z, good, counts = jax.vmap(
            lambda th, j: refine_crossing(event, restep, last_step, th, j, state)
        )(th0, jnp.arange(E))
        finite = finite & jnp.all(good | ~ok)
        counts = tuple(jnp.sum(jnp.where(ok, c, 0)).astype(jnp.int32) for c in counts)
    order = jnp.argsort(jnp.where(ok, t, jnp.inf))  # the components that did not cross last
    t, z, ok = t[order], z[order], ok[order]
    t = jnp.maximum(t, jnp.nextafter(t0, jnp.asarray(jnp.inf, dtype)))  # after the start
    pos = log.count + jnp.cumsum(ok.astype(jnp.int32)).astype(jnp.int32) - 1
    slot = jnp.where(ok & (pos < M), pos, M)  # M: dropped (full, or no crossing)
    log = EventLog(
        t=log.t.at[slot].set(t, mode="drop"),
        z=log.z.at[slot].set(z, mode="drop"),
        index=log.index.at[slot].set(order.astype(jnp.int32), mode="drop"),
        count=(log.count + jnp.sum(ok.astype(jnp.int32))).astype(jnp.int32),
    )
    return log, finite, counts


def _count(ctrl, counts, where=True):
    """``ctrl`` with ``(fevals, jacobians, factorizations)`` added (where ``where``)."""
    fevals, jacobians, factorizations = (
        jnp.where(where, jnp.asarray(c, jnp.int32), 0) for c in counts
    )
    return ctrl._replace(
        num_fevals=(ctrl.num_fevals + fevals).astype(jnp.int32),
        num_jacobians=(ctrl.num_jacobians + jacobians).astype(jnp.int32),
        num_factorizations=(ctrl.num_factorizations + factorizations).astype(jnp.int32),
    )


def valid_times(ts):
    """Run-time check of traced output times: finite and strictly increasing."""
    return jnp.all(jnp.isfinite(ts)) & jnp.all(jnp.diff(ts) > 0)


#: A step that would end at most this fraction of its size short of an output time (or
#: the discrete adjoint's checkpoint) is stretched onto it (:func:`_attempt`).
SNAP = 1e-6

#: Dense output's record is filled this many accepted steps at a time (see ``_run``).
RECORD_CHUNK = 64


def _attempt(stepper, ctrl, z, cache, clip_to, t_end, budget, rtol, atol, n_ctrl, hold=False):
    """One attempted step from a :class:`Controller` (the body of every stepping loop).

    Returns ``(ctrl, z, cache, (accept, s, h, z_old, ks))``: the updated controller,
    state and cache, and what the step was (whether it was accepted, its start, size,
    initial state and stage derivatives). The forward loop and the discrete adjoint's
    replay both run this, so a replay from a saved carry retakes the same steps.
    ``hold=True``: the step's start, size and end are constants to differentiation (the
    discrete adjoint, whose derivatives hold the steps fixed, is itself differentiated
    forwards by its second-order rules; nothing else changes).
    """
    dtype = z.dtype
    i32 = jnp.int32
    eps = jnp.finfo(dtype).eps
    floor = jnp.asarray(_control.RATIO_FLOOR, dtype)
    s, h = ctrl.s, ctrl.h
    remaining = clip_to - s
    # A step that would end within SNAP of its size short of the time lands on it (and
    # one whose `s + h` rounds onto it): the discrete adjoint's replay, another program,
    # may round a step's size differently (1e-10 measured), and a step of that length
    # after it would ruin bdf's history (solvers/ode/_adjoint.py, replay).
    last = (h * (1 + SNAP) >= remaining) | (s + h >= clip_to)
    h_proposed = h
    h = jnp.where(last, remaining, h)
    s1 = jnp.where(last, clip_to, s + h)
    if hold:
        s, h, s1 = (jax.lax.stop_gradient(v) for v in (s, h, s1))
    z1, err, ks, cache_acc, cache_rej, ok, counts = stepper.step(s, z, cache, h)
    ratio = _control.error_ratio(err, z, z1, rtol, atol, n_ctrl)
    finite = jnp.isfinite(ratio) & jnp.isfinite(jnp.sum(z1))
    accept = ok & finite & (ratio <= 1)
    if stepper.control is None:
        factor = _control.pi_factor(
            ratio, ctrl.ratio_prev, accept, beta1=stepper.beta1, beta2=stepper.beta2
        )
        factor = jnp.where(ok, factor, 0.5)  # a failed stage solve halves the step
    else:
        factor = stepper.control(
            ratio, accept, ok,
            jax.tree.map(lambda a, r: jnp.where(accept, a, r), cache_acc, cache_rej),
        )
    h_next = h * factor
    # A step shortened to end on a time says little about the next one.
    h_next = jnp.where(last & accept, jnp.maximum(h_next, h_proposed), h_next)
    h_next = jnp.minimum(h_next, stepper.max_step)
    s_new = jnp.where(accept, s1, s)
    z_new = jnp.where(accept, z1, z)
    cache = jax.tree.map(lambda a, r: jnp.where(accept, a, r), cache_acc, cache_rej)
    underflow = ~accept & ~(h_next > 10 * eps * jnp.abs(s_new))  # NaN-safe
    status = jnp.where(
        underflow,
        jnp.where(finite, _status.STEP_UNDERFLOW, _status.NONFINITE),
        NOT_FAILED,
    )
    num_steps = ctrl.num_steps + 1
    done = s_new >= t_end
    # Out of steps: max_steps, unless the last step was not finite (then more
    # steps would not have helped: f is NaN or inf there).
    out_of_steps = (status == NOT_FAILED) & (num_steps >= budget) & ~done
    status = jnp.where(
        out_of_steps, jnp.where(finite, _status.MAX_STEPS, _status.NONFINITE), status
    )
    ctrl = Controller(
        s=s_new,
        h=h_next,
        ratio_prev=jnp.where(accept, jnp.maximum(ratio, floor), ctrl.ratio_prev),
        ratio=ratio,
        num_steps=num_steps,
        num_accepted=ctrl.num_accepted + accept.astype(i32),
        num_fevals=ctrl.num_fevals + jnp.asarray(counts[0], i32),
        num_jacobians=ctrl.num_jacobians + jnp.asarray(counts[1], i32),
        num_factorizations=ctrl.num_factorizations + jnp.asarray(counts[2], i32),
        status=status.astype(i32),
    )
    return ctrl, z_new, cache, (accept, s, h, z, ks)


def div(a, b):
    """``a // b`` for nonnegative int32 ``a`` and positive ``b`` (step counts, spacings):
    ``lax.div`` truncates, which is the floor there; ``//`` corrects for signs, which XLA
    compiles as three to five more scalar kernels each time."""
    return jax.lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def write_row(bufs, slot, keep, row):
    """``bufs`` with ``row`` written at ``slot`` where ``keep``, else at their last row, a
    spare that is never read: in a loop body, an in-place write instead of a select of
    the old row and the new (one kernel per buffer fewer per trip). A dynamic update
    slice, not ``.at[].set`` (a scatter): XLA:CPU fuses fewer kernels around it (the
    replay's loop body of Lotka-Volterra's gradient 31 -> 26)."""
    return jax.tree.map(
        lambda b, v: jax.lax.dynamic_update_index_in_dim(
            b, v.astype(b.dtype), jnp.where(keep, slot, b.shape[0] - 1), 0), bufs, row)


def _save_checkpoint(ck, hit, accepted, row, C):
    """Keep the carry ``row = (Controller.pack(), z, cache)`` every ``spacing`` accepted
    steps in ``C`` slots (``spacing`` doubles, and every other checkpoint is dropped, when
    they are full: memory stays ``C`` states). ``hit``: the step loop has just reached a
    multiple of ``spacing`` accepted steps (``accepted`` of them)."""
    bufs, spacing = ck

    def thin(bufs):
        return jax.tree.map(
            lambda b: jnp.concatenate([b[0::2], jnp.zeros_like(b[: C - (C + 1) // 2])]), bufs
        )

    def save(bufs, spacing):
        full = div(accepted, spacing) >= C
        bufs = jax.lax.cond(full, thin, lambda b: b, bufs)
        spacing = jnp.where(full, 2 * spacing, spacing)
        slot = jnp.minimum(div(accepted, spacing), C - 1)
        bufs = jax.tree.map(
            lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, slot, 0), bufs, row)
        return bufs, spacing

    return _sharding.cond_once(hit, save, lambda *ck: ck, bufs, spacing, explicit=False)


def _run(stepper, rhs_u, z0, ts, rtol, atol, h0, budget, n_ctrl, *, mode, record=0, jump=None,
         checkpoint=None, event=None, direction="both", progress=None, log=0, hold=False):
    """The stepping loop behind :func:`integrate` and :func:`integrate_jumps`.

    A ``lax.scan`` over the output times, each running a ``lax.while_loop`` of steps until
    the time is passed (``mode="dense"``: the output is then interpolated from the last
    step's continuous extension; steps are only shortened to end on ``ts[-1]``) or reached
    exactly (``mode="jumps"``: steps are shortened to end on every ``ts[j]``, where
    ``jump(j, z)`` then runs). The step loop itself carries no output logic, and stops
    after ``budget`` attempted steps whatever the input. Output times that are not finite
    and strictly increasing (traced ``ts``) skip the integration: status ``INVALID_INPUT``.
    With ``event(z, s) -> (E,)`` (dense mode) the loop also stops after the first accepted
    step across which an event component changes sign (:func:`crossings`); the crossing is
    then located on that step's continuous extension (:func:`locate_event`; refined on a
    step of the method with :attr:`Stepper.restep`), once, after the loop, and the
    outputs past it hold the state there. With ``log=M > 0`` the events
    are non-terminal instead: every crossing is located on its step as it happens and kept
    in an :class:`EventLog` of ``M`` slots, and the integration goes on.
    ``progress(t, accepted, t0, t_end)``, if given, runs on the host after every attempted
    step (``jax.debug.callback``; nothing is traced without it).
    """
    dtype = z0.dtype
    T = ts.shape[0]
    i32 = jnp.int32
    t0, t_end = ts[0], ts[-1]
    jumps = mode == "jumps"
    budget = jnp.asarray(budget, i32)
    cache = stepper.init(t0, z0)
    k0 = cache[0]
    first_span = (ts[1] if jumps else t_end) - t0

    def auto_h(_):
        return _control.initial_step(
            rhs_u if stepper.slope is None else stepper.slope, t0, z0[:n_ctrl], k0[:n_ctrl],
            first_span, rtol, atol, stepper.order,
        )

    h = jax.lax.cond(
        h0 > 0,
        # shard_map: typed to vary as auto_h's result does (the branches must agree).
        lambda _: _sharding.vary_like(jnp.minimum(h0, first_span).astype(dtype), (z0, k0)),
        auto_h,
        None,
    )
    h = jnp.minimum(h, stepper.max_step).astype(dtype)
    dense = jnp.asarray(stepper.dense.T, dtype)  # (degree, stages)
    degree = dense.shape[0]
    stages = dense.shape[1]
    floor = jnp.asarray(_control.RATIO_FLOOR, dtype)
    valid = valid_times(ts)
    c0 = stepper.init_counts
    ctrl = Controller(
        s=jnp.asarray(t0, dtype),
        h=jnp.asarray(h, dtype),
        ratio_prev=floor,
        ratio=floor,
        num_steps=jnp.zeros((), i32),
        num_accepted=jnp.zeros((), i32),
        num_fevals=jnp.asarray(c0[0], i32) + (h0 <= 0).astype(i32),
        num_jacobians=jnp.asarray(c0[1], i32),
        num_factorizations=jnp.asarray(c0[2], i32),
        status=jnp.where(valid, NOT_FAILED, _status.INVALID_INPUT).astype(i32),
    )
    ev = None
    if event is not None:
        g0 = event(z0, ctrl.s)
        g_ok = jnp.all(jnp.isfinite(g0))
        no = jnp.zeros(g0.shape, bool)
        ev = EventCarry(g0, g0, no, jnp.zeros((), bool), ~g_ok)
        if log:
            ev = ev._replace(log=EventLog(
                t=jnp.full((log,), jnp.inf, dtype),
                z=_sharding.rows_like(z0, log) + jnp.asarray(jnp.nan, dtype),  # (sharded as z0)
                index=jnp.full((log,), -1, i32),
                count=jnp.zeros((), i32),
            ))
        ctrl = ctrl._replace(
            status=jnp.where(valid & ~g_ok, _status.NONFINITE, ctrl.status).astype(i32)
        )
    last_step = (
        None
        if jumps
        else LastStep(ctrl.s, jnp.ones((), dtype), z0, _sharding.rows_like(z0, stages))
    )
    B = max(int(record), 1)

    def record_rows(rows):
        # (rows + 1: a rejected step goes to the spare last row, never read: write_row)
        return Record(
            s=jnp.full((rows + 1,), jnp.inf, dtype),
            h=jnp.ones((rows + 1,), dtype),
            z=_sharding.rows_like(z0, rows + 1),
            coef=_sharding.rows_like(_sharding.rows_like(z0, degree), rows + 1),
            start=None,
        )

    rec = record_rows(B) if record else None
    # The step loop writes the accepted steps into a chunk of K rows of its own, copied
    # into the record every K accepted steps by an outer loop: under vmap, JAX's batched
    # while loop selects its whole carry on every trip, and B rows carried by the step
    # loop were selected on every step (64 Lotka-Volterra solves, 8 output times, dense=True,
    # B = 10,000: 476 ms, now 65 ms; 1.0 ms without dense output).
    K = min(RECORD_CHUNK, B)

    def attempt(ctrl, z, cache, clip_to):
        return _attempt(stepper, ctrl, z, cache, clip_to, ts[-1], budget, rtol, atol, n_ctrl,
                        hold)

    def step_loop(target, carry):
        clip_to = target if (jumps or stepper.lands) else t_end

        def going(ctrl):
            return (ctrl.s < target) & (ctrl.status == NOT_FAILED) & (ctrl.num_steps < budget)

        def cond(c, stop_at=None):
            ctrl = Controller.unpack(c.ctrl)
            go = going(ctrl) if event is None else going(ctrl) & ~c.ev.fired
            return go if stop_at is None else go & (ctrl.num_accepted < stop_at)

        def body(c, first=None):
            # (first: with a record, the window's first accepted step's number)
            ctrl, z, cache, last_step, rec, ck, ev = c
            ctrl = Controller.unpack(ctrl)
            # Under vmap the body also runs for the elements already done: not a step.
            active = going(ctrl) if progress is not None else None
            ctrl, z, cache, (accept, s, h, z_old, ks) = attempt(ctrl, z, cache, clip_to)
            if event is not None:
                g1 = event(z, ctrl.s)
                ok = jnp.all(jnp.isfinite(g1))
                cross = accept & ok & crossings(ev.g, g1, direction)
                fired = jnp.any(cross)
                bad = accept & ~ok
                lg = ev.log
                if log:  # non-terminal: keep every crossing and go on
                    zero = jnp.zeros((), i32)
                    # (rare; under shard_map a loop of at most one trip: cond_once)
                    lg, found, counts = _sharding.cond_once(
                        fired,
                        lambda lg: log_crossings(event, stepper.restep, (s, h, z_old, ks),
                                                 dense, cross, lg, t0),
                        lambda lg: (lg, jnp.ones((), bool), (zero, zero, zero)),
                        lg,
                        explicit=False,
                    )
                    bad = bad | ~found
                    fired = jnp.zeros((), bool)
                    ctrl = _count(ctrl, counts)
                ev = EventCarry(
                    g=jnp.where(accept & ok, g1, ev.g),
                    g_start=jnp.where(accept, ev.g, ev.g_start),
                    cross=jnp.where(accept, cross, ev.cross),
                    fired=fired,
                    bad=bad,
                    log=lg,
                )
                # A crossing ends the integration (even on the budget's last step); a
                # non-finite event value is a failure.
                status = jnp.where(fired & (ctrl.status == _status.MAX_STEPS), NOT_FAILED,
                                   ctrl.status)
                status = jnp.where(bad & (status == NOT_FAILED), _status.NONFINITE, status)
                ctrl = ctrl._replace(status=status.astype(i32))
            if progress is not None:
                jax.debug.callback(progress, ctrl.s, accept & active, t0, t_end)
            if not jumps:
                # Kept whether accepted or not: the loop only stops on a target passed
                # (after an accepted step), an event (ditto) or a failure (the outputs
                # past it are NaN), so the step it ends on is an accepted one. No select.
                last_step = LastStep(s, h, z_old, ks)
            if record:  # (rec: the window's chunk; row 0 its first accepted step)
                new = Record(s, h, z_old, h * _small.matmul(dense, ks), None)
                rec = write_row(rec, ctrl.num_accepted - 1 - first, accept, new)
            return Carry(ctrl.pack(), z, cache, last_step, rec, ck, ev)

        if not checkpoint and not record:
            return _sharding.while_loop(cond, body, carry)

        # An outer loop of windows, each the step loop up to the next multiple of
        # `spacing` accepted steps (checkpoints) or K more (record), then the checkpoint
        # and the chunk's rows copied into the record. The step loop carries neither the
        # checkpoints (updated in it, even once in W steps under a cond, they cost about
        # 1 us per step on CPU: bdf on Robertson, 0.57 ms of a 0.56 ms solve) nor the
        # record (its rows go to a chunk of K, row 0 the window's first accepted step).
        def window(c):
            start = Controller.accepted(c.ctrl)
            stop_at = start + K if record else None
            if checkpoint:
                at_ck = (div(start, c.ck[1]) + 1) * c.ck[1]
                stop_at = at_ck if stop_at is None else jnp.minimum(stop_at, at_ck)
            inner = _sharding.while_loop(
                functools.partial(cond, stop_at=stop_at), functools.partial(body, first=start),
                c._replace(ck=None, rec=record_rows(K) if record else None),
            )
            accepted = Controller.accepted(inner.ctrl)
            ck, rec = c.ck, c.rec
            if checkpoint:
                ck = _save_checkpoint(ck, accepted == at_ck, accepted,
                                      (inner.ctrl, inner.z, inner.cache), C)
            if record:  # row i of the chunk is accepted step start + i (ring slot mod B)
                i = jnp.arange(K, dtype=i32)
                slot = jnp.where(i < accepted - start, (start + i) % B, B)
                rec = jax.tree.map(lambda r, k: r.at[slot].set(k[:K]), rec, inner.rec)
            return inner._replace(ck=ck, rec=rec)

        return _sharding.while_loop(cond, window, carry)

    def per_time(carry, x):
        # (dense output needs only the time; the index is scanned over in jumps mode alone:
        # one fewer array to set up before the loop)
        j, target = x if jumps else (None, x)
        carry = step_loop(target, carry)
        ctrl, z, cache, last_step, rec, ck, ev = carry
        ctrl = Controller.unpack(ctrl)
        reached = (ctrl.s >= target) & valid
        if event is not None:  # past an event: filled in after the loop
            reached = reached | (ev.fired & valid)
        if jumps:
            interior = reached & (j < T - 1)
            zj = jump(j, z)
            cache_j = stepper.init(target, zj)
            z = jnp.where(interior, zj, z)
            cache = jax.tree.map(lambda a, b: jnp.where(interior, a, b), cache_j, cache)
            ctrl = ctrl._replace(
                num_fevals=ctrl.num_fevals + interior.astype(i32) * stepper.init_counts[0]
            )
            return Carry(ctrl.pack(), z, cache, last_step, rec, ck, ev), None
        y = last_step.z + _horner(
            last_step.h * _small.matmul(dense, last_step.ks), (target - last_step.s) / last_step.h
        )
        y = jnp.where(target == ctrl.s, z, y)
        return carry, jnp.where(reached, y, jnp.nan)

    ck = None
    if checkpoint:
        W, C = checkpoint
        bufs = jax.tree.map(
            lambda v: _sharding.rows_like(jnp.asarray(v), C).at[0].set(v),
            (ctrl.pack(), z0, cache),
        )
        ck = (bufs, jnp.asarray(W, i32))
    carry = Carry(ctrl.pack(), z0, cache, last_step, rec, ck, ev)
    carry, ys = _sharding.scan(per_time, carry,
                               (jnp.arange(1, T), ts[1:]) if jumps else ts[1:])
    ctrl, z, rec = Controller.unpack(carry.ctrl), carry.z, carry.rec
    # A zero budget leaves the loop before any step: report it as max_steps.
    reached_end = ctrl.s >= t_end
    if event is not None and log:
        ctrl = ctrl._replace(
            status=jnp.where(carry.ev.bad & (ctrl.status == NOT_FAILED), _status.NONFINITE,
                             ctrl.status).astype(i32)
        )
    elif event is not None:
        ev = carry.ev
        reached_end = reached_end | ev.fired
        t_e, z_e, index, finite, counts = locate_event(
            event, stepper.restep, carry.last_step, dense, ev.g_start, ev.g, ev.cross
        )
        ctrl = _count(ctrl, counts, ev.fired)
        fired = ev.fired & finite
        bad = ev.bad | (ev.fired & ~finite)
        # Strictly after the start and no later than the end (round-off at θ = 0 or 1).
        t_e = jnp.clip(t_e, jnp.nextafter(t0, jnp.asarray(jnp.inf, dtype)), t_end)
        t_e = jnp.where(fired, t_e, jnp.where(bad, jnp.nan, jnp.inf))
        z_e = jnp.where(fired, z_e, jnp.nan)
        index = jnp.where(fired, index, -1)
        ctrl = ctrl._replace(
            status=jnp.where(bad & (ctrl.status == NOT_FAILED), _status.NONFINITE,
                             ctrl.status).astype(i32)
        )
        ys = jnp.where((ts[1:] > t_e)[:, None] & fired, z_e, ys)
        event_result = EventResult(t_e, z_e, index, bad)
    status = jnp.where(
        (ctrl.status == NOT_FAILED) & ~reached_end, _status.MAX_STEPS, ctrl.status
    ).astype(i32)
    stats = Stats(
        status,
        ctrl.s,
        ctrl.h,
        ctrl.ratio,
        ctrl.num_steps,
        ctrl.num_accepted,
        ctrl.num_steps - ctrl.num_accepted,
        ctrl.num_fevals,
        ctrl.num_jacobians,
        ctrl.num_factorizations,
    )
    if jumps:
        return jnp.where(valid, z, jnp.nan), stats
    ys = jnp.concatenate([z0[None], ys])
    # (ys, stats), then whichever of these were asked for, in this order.
    out = [ys, stats]
    if event is not None and not log:
        out.append(event_result)
    if checkpoint:
        out.append(carry.ck)
    if record:
        n_acc = ctrl.num_accepted
        # Oldest step first; with fewer than B steps the unused rows (s = inf) stay last.
        shift = jnp.where(n_acc > B, n_acc % B, 0)
        rec = jax.tree.map(lambda buf: jnp.roll(buf[:B], -shift, axis=0), rec)
        start = jnp.where(n_acc > B, rec.s[0], t0)
        out.append(rec._replace(start=start))
    if log:
        out.append(carry.ev.log)
    return tuple(out)


def integrate(stepper, rhs_u, z0, ts, rtol, atol, h0, budget, n_ctrl, record=0,
              checkpoint=None, event=None, direction="both", progress=None, log=0,
              hold=False):
    """Integrate from ``ts[0]`` through ``ts[-1]``; return ``(zs, Stats)`` (and a Record).

    ``zs[0] = z0`` and ``zs[i]`` approximates ``z(ts[i])`` (NaN where not reached).
    ``h0 <= 0`` asks for the automatic initial step; ``budget`` caps the attempted steps.
    ``rhs_u(u, s)`` (the controlled components' derivative) is used by the initial-step
    heuristic only. With ``record=B > 0`` also return the :class:`Record` of the last
    ``B`` accepted steps. With ``checkpoint=(W, C)`` return instead ``(zs, Stats, ck)``,
    ``ck = (bufs, spacing)``: ``bufs[c]`` is the loop's carry ``(Controller.pack(), z,
    cache)`` after ``c·spacing`` accepted steps (``C`` slots, ``C`` even; ``bufs[0]`` the
    initial one; ``spacing`` starts at ``W`` and doubles whenever the slots are full),
    from which :func:`_attempt` replays the following steps exactly (the discrete
    adjoint). With ``event(z, s) -> (E,)`` return instead ``(zs, Stats, EventResult)``: the
    integration stops at the first crossing in ``direction`` (see :func:`_run`); with
    ``log=M`` too, the events are non-terminal and an :class:`EventLog` is returned
    instead of the ``EventResult``. Several of these: ``(zs, Stats, EventResult, ck,
    Record, EventLog)``, leaving out those not asked for. ``progress``: see :func:`_run`.
    ``hold``: see :func:`_attempt`.
    """
    return _run(stepper, rhs_u, z0, ts, rtol, atol, h0, budget, n_ctrl, mode="dense",
                record=record, checkpoint=checkpoint, event=event, direction=direction,
                progress=progress, log=log, hold=hold)


def integrate_jumps(stepper, rhs_u, z0, ts, rtol, atol, h0, budget, n_ctrl, jump):
    """Integrate through ``ts``, landing on every time and applying ``z <- jump(j, z)`` there.

    Steps are shortened to end on each ``ts[j]`` exactly; ``jump`` runs at the interior
    times ``j = 1 .. T-2`` (not at the last one). Returns ``(z(ts[-1]), Stats)``. Used by
    the backward pass, whose state jumps by the output cotangents at the output times.
    """
    return _run(stepper, rhs_u, z0, ts, rtol, atol, h0, budget, n_ctrl, mode="jumps",
                jump=jump)
