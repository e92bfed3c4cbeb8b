"""``solvers.odeint``: adaptive Runge–Kutta integration with an adjoint gradient."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from implicit import _checks, _sharding
from implicit._host import host_check
from solvers import _runner, _status
from solvers.ode import _adjoint, _dae, _events, _forward, _integrate, _tableaus
from solvers.ode._dense import ODESolution
from solvers.ode._explicit import explicit_stepper

__all__ = ["odeint", "ODEInfo", "ODESolution", "METHODS"]

METHODS = ("dopri5", "tsit5", "kvaerno5", "bdf")
STIFF_METHODS = ("kvaerno5", "bdf")
ADJOINTS = ("discrete", "backsolve", "interpolate", "forward", "forward_adaptive")
FORWARD_ADJOINTS = ("forward", "forward_adaptive")
#: ``init=``: how ``y0`` is taken (``None``: as given; ``"consistent"``: the algebraic
#: part of a DAE's ``y0`` solved for, from its differential part).
INITS = ("consistent",)
EVENT_DIRECTIONS = _events.DIRECTIONS
DEFAULT_MAX_STEPS = 10_000
#: The crossings a non-terminal event keeps by default (``max_events``).
DEFAULT_MAX_EVENTS = 64


class ODEInfo(NamedTuple):
    """What an ``odeint`` call did (``full_output=True``); batched under ``vmap``.

    Attributes:
      converged: bool, whether the integration reached ``ts[-1]``.
      num_steps: attempted steps, accepted and rejected (what ``max_steps`` caps).
      residual: weighted RMS local error estimate of the last step (``<= 1`` if accepted).
      num_accepted, num_rejected: accepted and rejected steps.
      num_fevals: right-hand side evaluations.
      num_jacobians, num_factorizations: Jacobians and LU factorisations (stiff methods).
      t_final: the time reached.
      status: why it stopped, a code of :mod:`solvers._status` (its name:
        ``info.status_name``, or ``solvers._status.status_name``): ``CONVERGED`` (0: reached
        ``ts[-1]``, or an event), ``MAX_STEPS``, ``STEP_UNDERFLOW``, ``NONFINITE`` (the
        state, ``f`` or the event function became NaN or inf) or ``INVALID_INPUT`` (traced
        ``ts`` not strictly increasing).
      event_time: with ``event=``: the time of the crossing that stopped the integration
        (differentiable), ``inf`` when no event fired before ``ts[-1]``, NaN when the event
        function returned NaN or inf (a failure). ``None`` without ``event``.
      event_state: with ``event=``: the state at ``event_time`` (structure of ``y0``;
        differentiable), NaN when no event fired. ``None`` without ``event``.
      event_index: with ``event=``: which event value crossed (its position among the
        leaves of the event function's output, raveled in order: the leaf index for a
        pytree of scalars), ``-1`` when none did. ``None`` without ``event``.
        With ``event_terminal=False`` these three hold every crossing kept, in time
        order, with a leading axis of ``max_events``: ``event_time`` is padded with
        ``inf``, ``event_state`` with NaN, ``event_index`` with -1 (not differentiated).
      num_events: with ``event_terminal=False``: the crossings found (it goes on
        counting past ``max_events``; then only the first ``max_events`` are kept).
        ``None`` otherwise.
      solution: with ``dense=``: an :class:`ODESolution`, whose ``evaluate(t)`` gives the
        state at any time of the span, from the method's continuous extension. ``None``
        without ``dense``.
    """

    converged: Any
    num_steps: Any
    residual: Any
    num_accepted: Any
    num_rejected: Any
    num_fevals: Any
    num_jacobians: Any
    num_factorizations: Any
    t_final: Any
    status: Any
    event_time: Any = None
    event_state: Any = None
    event_index: Any = None
    num_events: Any = None
    solution: Any = None

    @property
    def status_name(self):
        """The name(s) of ``status`` (concrete values only): a str, or an array of them."""
        return _status.status_name(self.status)


def odeint(
    f,
    y0,
    ts,
    *args,
    method="dopri5",
    rtol=None,
    atol=None,
    max_steps=DEFAULT_MAX_STEPS,
    adjoint=None,
    adjoint_rtol=None,
    adjoint_atol=None,
    adjoint_window=32,
    first_step=None,
    max_step=None,
    on_failure="raise",
    full_output=False,
    event=None,
    event_direction="both",
    progress=None,
    dense=None,
    event_terminal=True,
    max_events=DEFAULT_MAX_EVENTS,
    jac_sparsity=None,
    mass=None,
    init=None,
):
    """Integrate ``dy/dt = f(y, t, *args)`` from ``y(ts[0]) = y0``; return ``y`` at every ``ts``.

    ``method="dopri5"`` (Dormand–Prince 5(4)) and ``"tsit5"`` (Tsitouras 5(4)) are explicit
    pairs for non-stiff problems; ``"kvaerno5"`` (Kværnø's L-stable ESDIRK 5(4), stage
    equations solved by Newton's method) is for stiff ones. All adapt the step with a PI
    controller on the embedded error estimate (weighted RMS norm, accepted when
    ``|err_i| ≲ atol + rtol·|y_i|``) and pick the first step automatically. The explicit
    pairs hit every output time with their continuous extension, without shortening the
    steps there; ``"kvaerno5"``, whose continuous extension is a cubic Hermite (third
    order), ends a step on every output time instead. ``"bdf"`` is the variable-order
    (1–5), variable-step NDF/BDF of ``scipy.integrate.BDF`` and MATLAB's ``ode15s``
    (Shampine & Reichelt 1997) for stiff problems: cheap steps (one corrector solve by
    simplified Newton, the Jacobian and its LU kept across steps), order and step size
    picked together from the error estimates at orders k-1, k and k+1, the interpolating
    polynomial as the dense output (no steps cut at the output times); low order, so
    best at moderate tolerances.

    Gradients (reverse mode) with respect to ``y0``, ``ts``, every floating array in
    ``args`` and every traced value ``f`` closes over come from an adjoint rule. The
    default ``adjoint="discrete"`` gives the exact derivative of the computed outputs:
    the forward pass keeps a checkpoint every ``adjoint_window`` accepted steps, and the
    backward pass replays each segment's steps from its checkpoint and runs the cotangent
    back through them (one ``jax.vjp`` per step, step sizes held fixed). Nothing is
    integrated backwards, so it is stable for any stiffness, and its result does not
    depend on ``adjoint_window`` (memory: 128 checkpoints, whatever ``max_steps``, plus
    ``adjoint_window`` steps; past 128 x ``adjoint_window`` accepted steps the
    checkpoints thin out and blocks are replayed from further back). Second derivatives
    (the steps held fixed), with every method: ``jax.hessian`` (forward over reverse),
    ``grad(grad)`` and ``jacrev(jacrev)`` (reverse over reverse), through rules of their
    own (a second-order adjoint: one forward-mode pass through the forward and adjoint
    passes); third and higher derivatives raise ``NotImplementedError`` naming
    ``adjoint="forward"``. On linear test
    problems with eigenvalues from -1 to -1e5 its relative error is within 100x ``rtol``
    (docs/ode.md: the error contract). ``adjoint="backsolve"`` is the continuous adjoint
    with the state integrated backwards (``adjoint_rtol``/``adjoint_atol``, by default
    the forward tolerances); memory holds the outputs only and it is itself
    differentiable (``grad(grad)``), but integrating the state backwards is unstable for
    dissipative dynamics: when the reconstructed state leaves the stored outputs (or
    ``y0``) by more than 100x the adjoint tolerances it fails by ``on_failure`` (status
    ``drift``). ``adjoint="interpolate"`` recomputes the forward solution
    ``adjoint_window`` steps at a time and interpolates it while the continuous adjoint
    runs backwards (first derivatives only). ``adjoint="forward"`` computes forward
    sensitivities instead: the derivatives of the state with respect to the inputs that
    are differentiated are integrated alongside it with the same steps (step sizes held
    fixed: the same derivative of the computed outputs as ``"discrete"``), so ``jax.jvp``,
    ``jax.jacfwd``, ``jax.grad`` and ``jax.hessian`` all work, at any order; the cost
    grows with the number of scalars differentiated (``len(y0)`` plus the parameters'
    sizes, each order multiplying the state by that plus one): for small systems and few
    parameters. ``adjoint="forward_adaptive"`` is forward mode through the integration
    itself: the step sizes (the controller, rejections, the first step) and an implicit
    method's stage iterations are differentiated too, so the result is the derivative of
    the computed outputs as functions of the inputs, with the steps moving as they do.
    Where the step sizes track moving features (relaxation oscillations: van der Pol
    with mu = 1000 at rtol 1e-6, whose fast jumps shift along a grid held fixed) it is
    right where the fixed-step derivative is not (0.005% against 100x off, docs/ode.md);
    elsewhere it is usually no better (Robertson: 1.1e-6 against 7.7e-8), and the steps'
    response to the inputs is not error-controlled (``bdf`` on stiff linear systems at
    rtol 1e-8: up to 1.1e-5, past the 100x ``rtol`` contract; docs/ode.md). Every method,
    ``jax.jvp``/``jax.jacfwd`` at any order and ``jax.grad`` once (not ``grad(grad)``);
    cost as ``"forward"``. Its sensitivities becoming non-finite (f's derivative, or
    the steps', is not finite) fails by ``on_failure`` (status ``nonfinite``).

    Events: with ``event=g``, the integration stops where ``g(y, t, *args)`` crosses zero
    (a terminal event). After every accepted step the event values are compared with
    those at the step's start; at the first step across which one changed sign (in
    ``event_direction``), the crossing time is located on that step's continuous extension
    by Chandrupatla's bracketed method to a few ulps (so to the accuracy of the solution,
    ``rtol``/``atol``; kvaerno5, whose continuous extension is two orders below its
    steps, then takes one Newton step on a step of the method itself from the step's
    start to that time, one more step's right-hand side and Jacobian evaluations), and
    the rows of ``ys`` for output times past it hold the state there.
    ``info.event_time``, ``info.event_state`` and ``info.event_index`` say where
    (``inf``, NaN and -1 when no event fired: an ordinary result). The event time and
    state are differentiable (first order with any ``adjoint``; second order, as
    ``jax.hessian``, where the adjoint gives second derivatives: the default): by the
    implicit function theorem on ``g(y(t_e), t_e) = 0``, ``dt_e/dθ = -(g_y·∂y(t_e)/∂θ +
    g_θ) / (g_y·f + g_t)``, with ``∂y(t_e)/∂θ`` from one more integration, to the event
    time, and its adjoint (a crossing where ``g`` is tangent, ``g_y·f + g_t = 0``, has no
    derivative). A component that starts exactly at zero does not count as crossing until
    it leaves zero and comes back: restarting from an event state, pass
    ``event_direction`` so that the round-off side of zero does not fire at once. With
    ``event_terminal=False`` the events do not stop anything: every crossing is located
    the same way as it happens and the first ``max_events`` are kept (``info.event_time``
    etc. with a leading axis of ``max_events``, ``info.num_events`` the count); those
    times are not differentiated (``stop_gradient``: their gradient is zero; use a
    terminal event for a differentiable crossing time). Two crossings of one component
    inside one step (a sign change undone within it) are not seen, by either kind.

    Dense output: with ``dense=B`` (and ``full_output=True``), ``info.solution`` is an
    :class:`ODESolution` keeping the continuous extension of the last ``B`` accepted steps
    (``dense=True``: every step, ``B = max_steps``); ``info.solution.evaluate(t)`` is the
    state at any ``t`` of the span covered (NaN outside it: before the oldest step kept,
    when ``B`` was too small, ``info.solution.complete`` is False; after the time
    reached). Its reverse-mode derivative at a fixed ``t`` (with respect to ``y0``,
    ``args``, ``ts[0]`` and ``t``) integrates once more, from ``ts[0]`` to ``t``, and runs
    this call's adjoint: one integration and its adjoint per time evaluated.

    Complex states are not supported: integrate the real and imaginary parts as a real
    state (``jnp.stack([z.real, z.imag])``; docs/ode.md).

    Args:
      f: ``f(y, t, *args)``, returning a pytree with the structure, shapes and dtypes of
        ``y``.
      y0: initial state (pytree of real arrays: float32, float64 with x64; ints and bools
        are promoted to float; complex is refused, see above).
      ts: strictly increasing 1-D array of output times; ``ts[0]`` is the initial time.
      *args: parameters (pytrees of arrays), differentiated; leaves that are not
        arrays (an Equinox module's activation, a string) are held fixed.
      method: ``"dopri5"`` (default), ``"tsit5"``, ``"kvaerno5"`` or ``"bdf"`` (stiff).
      rtol, atol: local error tolerances (defaults follow the dtype: 1e-5/1e-6 in float32,
        1e-8/1e-10 in float64, 4 eps/0.4 eps in
        float16 and bfloat16). Traced values are fine: changing them does not recompile.
      max_steps: cap on the attempted steps over the whole of ``ts`` (not per interval);
        the backward pass gets the same cap.
      adjoint: ``"discrete"`` (default), ``"backsolve"``, ``"interpolate"`` (reverse mode)
        or ``"forward"`` (forward sensitivities: forward and reverse mode, any order) or
        ``"forward_adaptive"`` (the same with the step sizes differentiated); see above.
      adjoint_rtol, adjoint_atol: tolerances of the backward integration of the
        continuous adjoints (``"backsolve"``, ``"interpolate"``).
      adjoint_window: accepted steps between the discrete adjoint's checkpoints, and
        forward steps the interpolating adjoint keeps at a time (default 32): memory and
        speed only (the backward pass zeroes and fills a window's buffers per segment:
        smaller windows waste less on short integrations; past 128 x ``adjoint_window``
        accepted steps the checkpoints thin out and steps are replayed more).
      first_step: initial step size (default: chosen automatically).
      max_step: the largest step size (``jax.experimental.ode.odeint``'s ``hmax``; default:
        unbounded), e.g. so that a short forcing pulse is not stepped over.
      on_failure: what to do when ``max_steps`` is exhausted, the step size underflows,
        the state becomes non-finite (forward or backward) or traced ``ts`` are not
        increasing: ``"raise"`` (default: a :class:`solvers.ConvergenceError` naming the
        status and the time reached), ``"nan"`` (NaN outputs and gradients) or
        ``"ignore"`` (outputs up to the time reached; later ones are NaN).
      full_output: also return an :class:`ODEInfo` (``converged``, ``num_steps``,
        ``num_accepted``, ``num_rejected``, ``num_fevals``, ``event_time``, ...).
      event: ``event(y, t, *args)`` returning a scalar, or a pytree of floating arrays,
        whose first zero crossing (in any of its values) stops the integration; see
        above. A NaN or inf event value is a failure (status ``nonfinite``) that follows
        ``on_failure``.
      event_direction: which crossings count: ``"both"`` (default), ``"rising"`` (from
        negative to zero or positive) or ``"falling"`` (from positive to zero or
        negative); the same for every event value.
      progress: ``True`` prints the time reached after every accepted step (one line,
        rewritten); a callable ``progress(t)`` receives it instead (a Python float; under
        ``vmap``, once per batch element). Eager and under ``jit`` alike (a
        ``jax.debug.callback`` in the step loop of the forward integration; the backward
        passes report nothing). ``None`` (default): nothing is traced.
      dense: ``None`` (default), a capacity ``B`` (the accepted steps kept, the last
        ones) or ``True`` (every step); needs ``full_output=True``; see above. Memory:
        ``B x (degree + 1) x len(y0)`` floats (degree 4 for dopri5 and tsit5).
      event_terminal: ``True`` (default): the first crossing stops the integration;
        ``False``: every crossing is recorded and the integration goes on.
      max_events: the crossings kept with ``event_terminal=False`` (default 64).
      jac_sparsity: the structure of the Jacobian ``∂f/∂y`` of a stiff method
        (``"bdf"``, ``"kvaerno5"``), like ``scipy.integrate.solve_ivp``'s: a boolean
        ``(n, n)`` NumPy array or SciPy sparse matrix (True where an entry may be nonzero;
        ``n`` the size of the raveled state, in ``ravel_pytree`` order), an int ``w``
        (the band ``|i - j| <= w``), or ``"auto"``: read from ``f``'s jaxpr when the
        solver is traced (every entry ``f`` could make nonzero at any state, time and
        ``args``; what it does not follow, such as loops, counts as dense, and a pattern
        left mostly dense by it is an error naming it). The Jacobian is then computed by
        one ``jvp`` per colour of a greedy column colouring of the pattern, kept in
        block-tridiagonal form after a reverse Cuthill–McKee reordering, and ``I - cJ`` is
        factored by block
        cyclic reduction (blocks of up to 16) or block LU (wider bands): work and memory
        grow linearly with ``n`` for a fixed band (``n x B`` numbers, ``B`` the reordered
        band's half-width, at least 4). Both pivot within blocks only (stable for block
        diagonally dominant ``I - cJ``, as for diffusion);
        a singular block gives a failed step, retried smaller. A pattern that misses a
        nonzero of the Jacobian gives a wrong Jacobian (slower or failed Newton
        iterations), as in SciPy. ``None`` (default): dense Jacobians and LU.
      mass: ``method="bdf"`` only: a constant ``(n, n)`` mass matrix ``M`` over the raveled
        state (concrete: NumPy, or a JAX array outside ``jit``), possibly singular: the
        integration is then of ``M y' = f(y, t, *args)``, an index-1 DAE (the rows of
        ``M``'s left null space are the algebraic equations, its right null space the
        algebraic variables). ``y0`` must be consistent (or pass ``init``); a start where
        the algebraic equations' Jacobian with respect to the algebraic variables is
        singular (index 2 or more) fails by ``on_failure``, status ``singular``. Newton
        matrices ``M - cJ``; with ``jac_sparsity`` ``M`` must be diagonal. Differentiated
        by ``adjoint="discrete"`` or ``"forward_adaptive"``; ``event`` and ``dense`` as
        for ODEs. docs/ode.md, DAEs.
      init: ``None`` (default): ``y0`` as given; ``"consistent"`` (with ``mass``): the
        algebraic part of ``y0`` solved for from its differential part (Newton's method
        at ``ts[0]``; ``ys[0]`` is the corrected state, differentiated by the implicit
        function theorem; no convergence: status ``stagnated``).

    Returns:
      ``ys``, with the structure of ``y0`` and a leading axis of ``len(ts)`` (``ys[0]`` is
      ``y0``), or ``(ys, info)`` with ``full_output=True``.

    Example:
      >>> import jax, jax.numpy as jnp, solvers
      >>> decay = lambda y, t, k: -k * y
      >>> ts = jnp.array([0.0, 1.0, 2.0])
      >>> print(jnp.round(solvers.odeint(decay, 1.0, ts, 0.5), 5))  # exp(-0.5 t)
      [1.      0.60653 0.36788]
      >>> # (transformations under jax.jit: one compiled program each)
      >>> grad = jax.jit(jax.grad(lambda k: solvers.odeint(decay, 1.0, ts, k)[-1]))(0.5)
      >>> print(round(float(grad), 5))  # d/dk exp(-2k) = -2 exp(-1)
      -0.73576
      >>> final = lambda k: solvers.odeint(decay, 1.0, ts, k, adjoint="forward")[-1]
      >>> d1, d2 = jax.jit(lambda k: (jax.jacfwd(final)(k), jax.hessian(final)(k)))(0.5)
      >>> print(round(float(d1), 5), round(float(d2), 4))
      -0.73576 1.4715

      An event: ``y = exp(-k t)`` falls to 0.25 at ``t = log(4) / k``.

      >>> ts = jnp.array([0.0, 10.0])
      >>> ys, info = solvers.odeint(decay, 1.0, ts, 0.5, event=lambda y, t, k: y - 0.25,
      ...                           full_output=True)
      >>> print(round(float(info.event_time), 4), round(float(ys[-1]), 4))  # 2 log 4
      2.7726 0.25

      Dense output, and the zeros of ``sin t`` (non-terminal events):

      >>> osc = lambda y, t: jnp.stack([y[1], -y[0]])  # (sin t, cos t) from (0, 1)
      >>> ys, info = solvers.odeint(osc, jnp.array([0.0, 1.0]), jnp.array([0.0, 7.0]),
      ...                           dense=64, event=lambda y, t: y[0],
      ...                           event_terminal=False, max_events=4, full_output=True)
      >>> print([round(float(y), 4) for y in info.solution.evaluate(jnp.array([0.5, 6.5]))[:, 0]])
      [0.4794, 0.2151]
      >>> print(int(info.num_events), [round(float(t), 4) for t in info.event_time])  # π, 2π
      2 [3.1416, 6.2832, inf, inf]
    """
    opts = _runner.options(
        f, "f", rtol=rtol, atol=atol, max_steps=max_steps, on_failure=on_failure,
        full_output=full_output,
    )
    _checks.check_choice(method, "method", METHODS)
    for name, value in (
        ("adjoint_rtol", adjoint_rtol),
        ("adjoint_atol", adjoint_atol),
        ("first_step", first_step),
        ("max_step", max_step),
    ):
        _checks.check_positive(value, name)
    if adjoint is None:
        adjoint = "discrete"
    _checks.check_choice(adjoint, "adjoint", ADJOINTS)
    _checks.check_max_steps(adjoint_window, "adjoint_window")
    if event is not None:
        _checks.check_callable(event, "event")
    _checks.check_choice(event_direction, "event_direction", EVENT_DIRECTIONS)
    if progress is False:
        progress = None
    if progress is not None and progress is not True:
        _checks.check_callable(progress, "progress")
    if adjoint == "forward" and method == "bdf":
        raise ValueError(
            "adjoint='forward' supports method='dopri5', 'tsit5' and 'kvaerno5', not 'bdf' "
            "(its multistep state is not differentiated step by step yet): for forward "
            "mode with bdf pass adjoint='forward_adaptive', or use one of those methods"
        )
    if event is not None and adjoint in FORWARD_ADJOINTS:
        raise ValueError(
            "event= is differentiated in reverse mode (a custom_vjp); it does not combine "
            f"with adjoint={adjoint!r}: pass another adjoint"
        )
    if event_terminal not in (True, False):
        raise TypeError(f"`event_terminal` must be True or False, got {event_terminal!r}")
    _checks.check_max_steps(max_events, "max_events")
    if not event_terminal and event is None:
        raise ValueError("event_terminal=False needs an event function: pass event=")
    if dense is not None and dense is not False:
        if dense is not True:
            _checks.check_max_steps(dense, "dense")
        if not full_output:
            raise ValueError(
                "dense= returns the solution as info.solution: pass full_output=True too"
            )
        if adjoint in FORWARD_ADJOINTS:
            raise ValueError(
                "dense= output is differentiated in reverse mode (a custom_vjp); it does "
                f"not combine with adjoint={adjoint!r}: pass another adjoint"
            )
    # Every accepted step is kept with dense=True (they are at most max_steps).
    record = 0 if dense is None or dense is False else (
        int(max_steps) if dense is True else int(dense))
    (f, event), args = _checks.split_args((f, event), args, lead=2)
    _check_real(y0)
    y0 = _checks.as_floating(y0, "y0")
    structure = None
    if jac_sparsity is not None:
        if method not in STIFF_METHODS:
            raise ValueError(
                f"jac_sparsity= is for the stiff methods {STIFF_METHODS} (it structures "
                f"their Newton solves); method={method!r} is explicit and forms no Jacobian"
            )
        from solvers._sparse import structure as _structure

        size = sum(int(np.prod(jnp.shape(leaf))) for leaf in jax.tree.leaves(y0))
        t = jax.ShapeDtypeStruct((), jnp.result_type(*jax.tree.leaves(y0)))
        structure = _structure(jac_sparsity, size, "jac_sparsity", fun=f, x=y0,
                               args=(t, *args))
    size = sum(int(np.prod(jnp.shape(leaf))) for leaf in jax.tree.leaves(y0))
    mass = _dae.prepare_mass(mass, size, method)
    if init is not None:
        _checks.check_choice(init, "init", INITS)
        if mass is None:
            raise ValueError(
                "init='consistent' solves a DAE's algebraic equations for y0 (a singular "
                "mass matrix): it needs mass= (and method='bdf')"
            )
    if mass is not None:
        _check_mass_options(mass, structure, adjoint)
    dtype = jnp.result_type(*jax.tree.leaves(y0))
    ts = _checks.check_times(ts, "ts", dtype)
    rtol, atol = _checks.tolerances(rtol, atol, dtype)
    tols = (
        rtol,
        atol,
        rtol if adjoint_rtol is None else jnp.asarray(adjoint_rtol, dtype),
        atol if adjoint_atol is None else jnp.asarray(adjoint_atol, dtype),
        jnp.asarray(0.0 if first_step is None else first_step, dtype),
    )
    solver = f"solvers.odeint(method={method!r})"
    return _runner.dispatch(
        _solve,
        y0,
        ts,
        args,
        tols,
        f=f,
        method=method,
        adjoint=adjoint,
        window=int(adjoint_window),
        progress=progress,
        structure=structure,
        mass=mass,
        init=init,
        max_step=float("inf") if max_step is None else float(max_step),
        event=event,
        direction=event_direction,
        record=record,
        log=0 if event_terminal else int(max_events),
        options=opts,
        solver=solver,
        fn=f,
        message=_message(solver, opts.max_steps, event, dae=mass is not None),
        forward_hint=(
            f"adjoint={adjoint!r} is reverse mode only (jax.grad, jax.vjp, jax.jacrev); "
            f"pass {FORWARD_HINTS.get(method, FORWARD_HINT)} for forward mode"
        ),
    )


#: The forward-mode adjoint to advise (``FORWARD_HINTS``: the methods that differ).
FORWARD_HINT = "adjoint='forward' (forward sensitivities: jax.jvp, jax.jacfwd, jax.hessian)"
FORWARD_HINTS = {
    "bdf": "adjoint='forward_adaptive' (forward mode through the integration: jax.jvp, "
           "jax.jacfwd; adjoint='forward' does not support bdf)",
}


def _check_real(y0):
    """odeint integrates real states only: a complex leaf gets the way to integrate it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(y0)[0]:
        try:
            dtype = jnp.result_type(leaf)
        except TypeError:
            continue  # (as_floating names what is wrong with it)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            where = "`y0`" + jax.tree_util.keystr(path)
            raise TypeError(
                f"solvers.odeint does not support complex states: {where} has dtype "
                f"{dtype}. Supported: real floating states (float32, or float64 with "
                "jax_enable_x64; ints and bools are promoted). Integrate the real and "
                "imaginary parts as a real state instead, e.g. "
                "y0 = jnp.stack([z0.real, z0.imag]) and f returning "
                "jnp.stack([dz.real, dz.imag]) for dz = g(y[0] + 1j * y[1], t) "
                "(docs/ode.md: complex states)"
            )


def _ravels_like(out, y0):
    """Whether ``f``'s output, of another structure than ``y0``, ravels to ``y0``'s size
    with floating leaves (as ``jax.experimental.ode.odeint`` accepts: e.g. a list
    ``[dtheta, domega]`` for an array state). Anything else is checked strictly."""
    leaves = jax.tree.leaves(out)
    if jax.tree.structure(out) == jax.tree.structure(y0) or not leaves:
        return False
    size = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(y0))
    return (sum(int(np.prod(leaf.shape)) for leaf in leaves) == size
            and all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves))


def _check_mass_options(mass, structure, adjoint):
    """What ``mass=`` does not combine with (yet): ValueErrors naming it."""
    if structure is not None and not mass.diagonal:
        raise ValueError(
            "mass= with jac_sparsity= needs a diagonal mass matrix (the usual "
            "diag(1, ..., 1, 0, ..., 0) of a semi-explicit DAE); this one is not diagonal: "
            "pass jac_sparsity=None (dense Newton matrices M - cJ), or reorder the "
            "equations so that M is diagonal"
        )
    if adjoint in ("backsolve", "interpolate", "forward"):
        raise ValueError(
            f"mass= (DAEs) is differentiated by adjoint='discrete' (default) or "
            f"'forward_adaptive', not adjoint={adjoint!r}"
        )


def _make_stepper(method, max_step=float("inf"), structure=None, mass=None):
    extra = {} if structure is None else {"structure": structure}
    if mass is not None:
        extra["mass"] = mass
    if method == "bdf":
        from solvers.ode._bdf import bdf_stepper

        def bdf(*args, **kwargs):
            return bdf_stepper(*args, **kwargs, **extra)._replace(max_step=max_step)

        return bdf
    tab = _tableaus.TABLEAUS[method]
    if tab.implicit:
        from solvers.ode._stiff import implicit_stepper as make
    else:
        make = explicit_stepper

    def stepper(*args, **kwargs):
        return make(tab, *args, **kwargs, **extra)._replace(max_step=max_step)

    return stepper


@_runner.jit_solver
def _solve(y0, ts, args, tols, *, f, method, adjoint, window, max_step, event, direction,
           options, solver, check, progress=None, record=0, log=0, structure=None,
           mass=None, init=None):
    on_failure, max_steps = options.on_failure, options.max_steps
    # shard_map: the state, the times and the arguments all vary as the problem does,
    # cast here, before f is traced and before they enter the adjoint's custom_vjp. The
    # loops' carries then have one type, and so do the cotangents: the adjoint's
    # cotangent of a value that does not vary over the mesh (a replicated parameter, a
    # shared ts) is each device's own contribution, and JAX sums it over the devices
    # once, where it transposes this cast. Left uncast, such a value is mixed with the
    # varying state inside f, every vjp of a step transposes that mix into a sum over
    # the devices (a collective at every step of loops whose trip counts differ
    # between devices), and the summed cotangent comes back typed as varying.
    y0, ts, args = _sharding.vary_like((y0, ts, args), (y0, ts, args))
    out = _checks.call_shape(f, "f", y0, ts[0], *args)
    if not _ravels_like(out, y0):  # (an output that ravels to y0's shape is accepted)
        _checks.check_like(out, y0, "f(y0, t, *args)", "y0")
    fn, consts = jax.closure_convert(f, y0, ts[0], *args)
    y0_flat, unravel = ravel_pytree(y0)
    dtype = y0_flat.dtype
    leaves, treedef = jax.tree.flatten((args, consts))
    is_float = [jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in leaves]
    theta = tuple(leaf for leaf, fl in zip(leaves, is_float) if fl)
    const = tuple(leaf for leaf, fl in zip(leaves, is_float) if not fl)

    def G(u, s, theta, const):
        args, consts = jax.tree.unflatten(treedef, _merge(theta, const, is_float))
        dy = fn(unravel(u), s, *args, *consts)
        return ravel_pytree(dy)[0].astype(dtype)

    slope = dae_ok = None
    if mass is not None:
        # (a DAE: y' is the consistent slope, not f; the start checked for index 1, and
        # with init="consistent" its algebraic part solved for)
        def slope(u, s, theta, const):
            return _dae.slope(mass, lambda v, r: G(v, r, theta, const), u, s)

        y0_flat, dae_ok = _dae_start(mass, init, G, y0_flat, ts[0], theta, const, tols)
    report = functools.partial(_report_backward, solver=solver, max_steps=max_steps,
                               discrete=adjoint == "discrete")
    # (built here, not in odeint: the static `progress` is then the user's own object,
    # and repeated calls reuse the compiled solver)
    if progress is not None:
        progress = functools.partial(_notify, None if progress is True else progress)
    if adjoint in FORWARD_ADJOINTS:
        make = _make_stepper(method, max_step, structure, mass)
        n = y0_flat.size

        stiff = method == "kvaerno5"  # (its stage solves take a derivative order)

        def stepper_of(theta, const, rtol, atol, order):
            # An implicit method's stage values are differentiated exactly to the order
            # asked (one chord correction each); explicit steps are exact at any order.
            extra = {"derivative_order": max(order, 1)} if stiff else {}
            return make(lambda u, s: G(u, s, theta, const), n, rtol=rtol, atol=atol, **extra)

        solve = _forward.make_solve(stepper_of, G, G, n, on_failure=on_failure,
                                    progress=progress, adaptive=adjoint == "forward_adaptive",
                                    slope=slope)
    else:
        E = ev_theta = ev_const = None
        if event is not None:
            E, ev_theta, ev_const = _event_values(event, y0, ts, args, unravel, is_float,
                                                  treedef, dtype)
        terminal = event is not None and not log

        def make_solve(**kw):
            return _adjoint.make_solve(
                _make_stepper(method, max_step, structure, mass), G, y0_flat.size,
                on_failure=on_failure, report=report, adjoint=adjoint, window=window,
                max_steps=max_steps, slope=slope, **kw,
            )

        solve = make_solve(
            progress=progress, record=0 if terminal else record, event=E, log=log,
            direction=direction,
        )
    ctl = (*tols[:4], tols[4], jnp.asarray(max_steps, jnp.int32))
    if dae_ok is not None:  # (a start that is not index 1: no steps)
        ctl = ctl[:5] + (jnp.where(dae_ok[0] & dae_ok[1], ctl[5], 0),)
    # (shard_map: the tolerances, first step and budget vary as the state does too. A
    # branch taken by some elements only (a vmapped cond: the backward passes' step
    # size picks the first step afresh or not) casts every value it reads to vary
    # with its predicate, which fails where the branch had cast an invariant one
    # itself, mixing it with the state.)
    ctl = _sharding.vary_like(ctl, y0_flat)
    extra = {}
    rec = None
    if event is None or log:
        ev = ((), ()) if event is None else (ev_theta, ev_const)
        out = solve(y0_flat, ts, theta, const, ctl,
                    *(() if adjoint in FORWARD_ADJOINTS else (ev,)))
        zs, stats = out[:2]
        if record:
            rec = out[2]
        if log:
            # Not differentiated (documented): the cotangents of the crossings are dropped.
            lg = jax.lax.stop_gradient(out[-1])
            extra = dict(
                event_time=lg.t,
                event_state=jax.vmap(unravel)(lg.z),
                event_index=lg.index,
                num_events=lg.count,
            )
    else:
        event_solve = _events.make_event_solve(
            _make_stepper(method, max_step, structure, mass), G, E, y0_flat.size, solve,
            direction=direction, record=record, slope=slope,
        )
        out = event_solve(y0_flat, ts, theta, const, ev_theta, ev_const, ctl)
        zs, stats, result = out[:3]
        if record:
            rec = out[3]
        extra = dict(
            event_time=result.t,
            event_state=unravel(result.z),
            event_index=jax.lax.stop_gradient(result.index),
        )
    stats = jax.tree.map(jax.lax.stop_gradient, stats)
    if dae_ok is not None:
        status = jnp.where(dae_ok[0], jnp.where(dae_ok[1], stats.status, _status.STAGNATED),
                           _status.SINGULAR)
        stats = stats._replace(status=status.astype(stats.status.dtype))
    terminal = event is not None and not log
    info = ODEInfo(
        converged=stats.status == _status.CONVERGED,
        num_steps=stats.num_steps,
        residual=stats.ratio,
        num_accepted=stats.num_accepted,
        num_rejected=stats.num_rejected,
        num_fevals=stats.num_fevals,
        num_jacobians=stats.num_jacobians,
        num_factorizations=stats.num_factorizations,
        t_final=stats.t if not terminal else jnp.where(
            jnp.isfinite(extra["event_time"]), jax.lax.stop_gradient(extra["event_time"]),
            stats.t),
        status=stats.status,
        **extra,
    )
    if event is None and adjoint in FORWARD_ADJOINTS and on_failure == "nan":
        # NaN values and NaN tangents (the policy's `where` would give the failed
        # outputs the zero tangent of its NaN constant; the rule made the tangents of a
        # failure NaN).
        zs = zs + jnp.where(info.converged, 0.0, jnp.nan).astype(dtype)
        return jax.vmap(unravel)(zs), info
    # The event time and state and the dense output's span follow on_failure too (NaN
    # with "nan"; with "raise" they wait for the check, which a caller using only them
    # would otherwise drop as dead code under jit, and no error would be raised).
    more = {}
    if event is not None:
        more.update(event_time=info.event_time, event_state=info.event_state)
    if record:
        # The span covered ends at the time reached (or the event); a failure under
        # on_failure="nan" covers nothing (NaN everywhere), under "ignore" what was reached.
        more["t_end"] = info.t_final
    zs, more = _runner.apply_failure_policy(
        (zs, more),
        info,
        solver=solver,
        on_failure=on_failure,
        check=check,
        max_steps=max_steps,
        message=_message(solver, max_steps, event),
    )
    if record:
        solution = ODESolution(
            jax.lax.stop_gradient(rec), more.pop("t_end"), ts[0], y0_flat, theta, const,
            ctl, solve=make_solve(), unravel=unravel,
        )
        info = info._replace(solution=solution)
    return jax.vmap(unravel)(zs), info._replace(**more)


def _dae_start(mass, init, G, y0_flat, t0, theta, const, tols):
    """``(y0, (index1, converged))`` of a DAE: ``y0`` made consistent with
    ``init="consistent"``, whether its algebraic block is nonsingular there (index 1) and
    whether Newton converged (True without ``init``)."""
    sg = jax.lax.stop_gradient
    rhs = lambda u, s: G(u, s, theta, const)  # noqa: E731
    if init == "consistent":
        y0_flat, index1, converged = _dae.consistent(mass, rhs, y0_flat, t0, sg(tols[0]),
                                                     sg(tols[1]))
    else:
        converged = jnp.bool_(True)
        index1 = (_dae.index_one(_dae.algebraic_block(mass, rhs, sg(y0_flat), sg(t0)))
                  if mass.singular else jnp.bool_(True))
    return y0_flat, (jax.lax.stop_gradient(index1), jax.lax.stop_gradient(converged))


def _merge(floating, other, is_float):
    """The leaves split by ``is_float`` (differentiated, not), back in their order."""
    it_f, it_o = iter(floating), iter(other)
    return [next(it_f) if fl else next(it_o) for fl in is_float]


def _event_values(event, y0, ts, args, unravel, is_float, treedef, dtype):
    """``E(u, s, theta, const, ev_theta, ev_const) -> (E,)``, the raveled event values, and
    the floating and other values the event function closes over (its own parameters)."""
    out = _checks.call_shape(event, "event", y0, ts[0], *args)
    leaves = jax.tree.leaves(out)
    if not leaves or not all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves):
        name = getattr(event, "__qualname__", type(event).__name__)
        raise TypeError(
            f"event ({name}) must return a floating scalar or a pytree of floating arrays; "
            f"it returned {out}"
        )
    ev_fn, ev_consts = jax.closure_convert(event, y0, ts[0], *args)
    ev_float = [jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in ev_consts]
    ev_theta = tuple(c for c, fl in zip(ev_consts, ev_float) if fl)
    ev_const = tuple(c for c, fl in zip(ev_consts, ev_float) if not fl)

    def E(u, s, theta, const, ev_theta, ev_const):
        args, _ = jax.tree.unflatten(treedef, _merge(theta, const, is_float))
        consts = _merge(ev_theta, ev_const, ev_float)
        g = ev_fn(unravel(u), s, *args, *consts)
        return ravel_pytree(g)[0].astype(dtype)

    return E, ev_theta, ev_const


def _notify(progress, t, accepted, t0, t_end):
    """``odeint``'s ``progress`` on the host: the user's callable, or a one-line print."""
    if not accepted:
        return
    t = float(t)
    if progress is not None:
        progress(t)
        return
    t0, t_end = float(t0), float(t_end)
    done = 100.0 * (t - t0) / (t_end - t0) if t_end > t0 else 100.0
    print(f"\rsolvers.odeint: t = {t:.6g} of {t_end:.6g} ({done:5.1f}%)",
          end="\n" if t >= t_end else "", flush=True)


def _why(status, max_steps, solver, *, backward=False, event=False, discrete=False,
         dae=False):
    """``(why, advice)`` for a failed integration: solvers._status.explain, for an ODE."""
    if dae and status == _status.SINGULAR:
        return ("the DAE is not of index 1 at ts[0]: the Jacobian of its algebraic "
                "equations (the rows of the left null space of mass=) with respect to its "
                "algebraic variables (the right null space) is singular at y0 (an index-2 "
                "or higher problem, such as a pendulum with its position constraint, or a "
                "singular point); nothing was integrated",
                "reduce the problem to index 1 (differentiate the constraints that do not "
                "involve the algebraic variables, as in the pendulum's index-1 form), or "
                "start from another y0")
    if dae and status == _status.STAGNATED:
        return ("init='consistent': Newton's method on the DAE's algebraic equations at "
                f"ts[0] did not converge in {_dae.INIT_MAXITER} iterations (from y0's "
                "algebraic part); nothing was integrated",
                "start from a y0 whose algebraic part is closer to consistent values")
    if status == _integrate.DRIFT and discrete:
        return ("the discrete adjoint's replay of the forward's steps (another program, "
                "which XLA may round differently) took other steps, which do not join the "
                "forward's where the method's cache is its history (bdf), or needed more "
                "steps than its block holds: the gradient would be wrong",
                "pass another adjoint_window (other checkpoints), or "
                "adjoint='forward_adaptive' (forward mode: no replay)")
    if status == _integrate.DRIFT:
        why, _ = _status.explain(status)
        return (why + ", stiff or not: the gradient would be wrong",
                "use the default adjoint='discrete', or tighten adjoint_rtol/adjoint_atol")
    if status == _status.GRADIENT_ERROR:
        why, _ = _status.explain(status)
        why += (f": over {100 * _adjoint.GRADIENT_LIMIT:g}% (the default adjoint; fast "
                "transitions, as in relaxation oscillations, moving across the step grid)")
        return why, ("pass adjoint='forward_adaptive' (it differentiates the step sizes too; "
                     "its cost grows with the number of inputs), or tighten rtol/atol")
    tols = "adjoint_rtol/adjoint_atol" if backward else "rtol/atol"
    if status == _status.MAX_STEPS:
        why, _ = _status.explain(status, max_steps=max_steps)
        why += " (max_steps caps the attempted steps over the whole of ts)"
        if backward:
            return why, f"increase max_steps or loosen {tols}"
        if any(f"{m!r}" in solver for m in STIFF_METHODS):
            return why, f"increase max_steps or loosen {tols}"
        return (
            why,
            f"the problem may be stiff: try method='kvaerno5', or increase max_steps or "
            f"loosen {tols}",
        )
    if status == _status.NONFINITE and event:
        return (
            "the state, its derivative or the event function became non-finite (NaN or "
            "inf): the solution may blow up there, or f or the event function returns NaN "
            "or inf there",
            "check f, the event function and the solution near that time (more steps will "
            "not help)",
        )
    if status == _status.NONFINITE:
        return (
            "the state or its derivative became non-finite (NaN or inf): the solution may "
            "blow up there, or f returns NaN or inf there (with adjoint='forward_adaptive', "
            "differentiated: or the derivative of f, or of the steps taken, is not finite)",
            "check f and the solution near that time (more steps will not help)",
        )
    if status == _status.STEP_UNDERFLOW:
        why, _ = _status.explain(status)
        return why, f"loosen {tols}, or check f near that time"
    if status == _status.INVALID_INPUT:
        return (
            "`ts` must be strictly increasing and finite, and the traced output times are "
            "not (checked at run time; nothing was integrated)",
            "pass strictly increasing, finite ts",
        )
    return _status.explain(status, max_steps=max_steps)


def _first_failure(converged):
    failed = ~np.asarray(converged, bool)
    if failed.ndim == 0:
        return (), ""
    idx = np.argwhere(failed)
    first = tuple(int(i) for i in idx[0])
    where = f" ({idx.shape[0]} of {failed.size} batch elements failed; first at index {first})"
    return first, where


def _message(solver, max_steps, event=None, dae=False):
    """The runner's failure-message hooks for an ODE: its reasons, and the time reached
    (and, with an event function, whether it was the one that returned NaN or inf)."""

    def detail(info, first):
        t = float(np.asarray(info.t_final)[first])
        steps = int(np.asarray(info.num_steps)[first])
        rejected = int(np.asarray(info.num_rejected)[first])
        ratio = float(np.asarray(info.residual)[first])
        text = (
            f"failed at t={t:.6g} after {steps} steps, {rejected} rejected, last error ratio "
            f"{ratio:.3g}"
        )
        finfo = jnp.finfo(np.asarray(info.t_final).dtype)  # (jnp's knows bfloat16)
        if int(np.asarray(info.status)[first]) == _status.STEP_UNDERFLOW and finfo.bits < 64:
            shortest = 10 * float(finfo.eps) * abs(t)
            text += (f"; in {finfo.dtype} a step shorter than 10 eps |t| = {shortest:.2g} "
                     f"cannot be told from t there: float64 times (jax_enable_x64) resolve "
                     f"{float(finfo.eps) / float(np.finfo(np.float64).eps):.2g} times "
                     f"shorter steps")
        if event is not None and np.any(np.isnan(np.asarray(info.event_time)[first])):
            name = getattr(event, "__qualname__", type(event).__name__)
            text = (f"the event function {name} returned NaN or inf (a non-finite event "
                    f"value) at or before t={t:.6g}; {text}")
        return text

    return {"detail": detail,
            "explain": lambda code: _why(code, max_steps, solver, event=event is not None,
                                         dae=dae)}


def _report_backward(status, t_fail, *, solver, max_steps, discrete=False):
    """Raise (from the host, only when it failed) the failure of a backward pass.

    Returns a flag that is True when it returns: fold it into the gradient
    (``jnp.where(flag, g, nan)``) so that the check is not dropped as dead code.
    """

    def check(operands):
        status, t_fail = np.asarray(operands["status"]), np.asarray(operands["t"])
        first, where = _first_failure(status == _integrate.NOT_FAILED)
        code = int(status[first])
        if code == _integrate.NOT_FAILED:
            return
        why, advice = _why(code, max_steps, solver, backward=True, discrete=discrete)
        name = _status.status_name(code)
        raise _runner.ConvergenceError(
            f"{solver}: the adjoint (backward) integration failed{where} at "
            f"t={float(t_fail[first]):.6g}, status {name!r}: {why}. "
            f"To fix: {advice}; or pass on_failure='nan'."
        )

    return host_check(status == _integrate.NOT_FAILED, check, {"status": status, "t": t_fail})
