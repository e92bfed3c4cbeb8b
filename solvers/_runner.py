"""The solver runner: the one place that iterates, decides termination and fails.

A method is a small value (:class:`Method`): ``init(x0) -> state``, ``step(state) ->
state`` and ``terminate(state) -> Progress`` (its error, the scale the error is relative
to, and a status if the method itself knows it failed), closed over the user function
and parameters. The runner owns everything else, identically for every solver:

- :func:`iterate`: the ``lax.while_loop`` and the termination test. The guess is tested
  before any step; a solve is converged only when ``error <= atol + rtol * scale`` holds
  with a finite error and scale (and the method confirms it); a non-finite error or
  scale stops it as ``nonfinite``; no new smallest error (nor a ``Progress.improved``
  step) over ``STAGNATION_WINDOW`` steps, and as many as led to the smallest error,
  stops it as ``stagnated``; running out of steps is ``max_steps``.
- :func:`solve`: attaches the implicit rule (one adjoint policy for every solver: the
  backward solve runs at ``ADJOINT_RTOL_FACTOR * rtol`` with the forward ``max_steps``
  and is checked like the forward) and applies ``on_failure``.
- :func:`dispatch`: compiles a solver once per function object and static options,
  raises eagerly (:class:`ConvergenceError`), or compiles a host check in under
  transformations whose result the outputs depend on (so that it also surfaces on GPU,
  where host callbacks are asynchronous); explains forward-mode errors; warns when the
  same code keeps being recompiled because the function object is new at every call.
- :func:`failure_message`: the one message builder (statuses from
  :mod:`solvers._status`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from implicit import _checks, custom_root
from implicit import _sharding
from implicit._host import host_check
from implicit._reduce import any_
from solvers import _status

__all__ = [
    "ADJOINT_RTOL_FACTOR",
    "ConvergenceError",
    "Info",
    "Method",
    "Options",
    "Progress",
    "STAGNATION_WINDOW",
    "apply_failure_policy",
    "dispatch",
    "failure_message",
    "iterate",
    "jit_solver",
    "max_norm",
    "max_norms",
    "options",
    "solve",
]

#: Steps without a new smallest error after which a solve is reported ``stagnated``
#: (while the error stays within ``STAGNATION_BAND`` times its smallest value: an error
#: that keeps growing is a divergence, left to end as ``nonfinite`` or ``max_steps``),
#: and at least as many as were taken before that smallest error: a damped iteration
#: can sit on a plateau for 74 steps after 124 and then converge (tanh map, spectral
#: radius 1.6, damping 0.3), which a fixed window called a floor.
STAGNATION_WINDOW = 50
STAGNATION_BAND = 1e3
#: The adjoint (backward) solve's tolerance relative to the forward ``rtol``: its error
#: adds to the forward one, and a tenth keeps the gradient about as accurate as the
#: solution (and absorbs the adjoint test's 2-norm being weaker per entry than the
#: forward max-norm).
ADJOINT_RTOL_FACTOR = 0.1


class ConvergenceError(RuntimeError):
    """A solver did not converge (raised with ``on_failure="raise"``, the default)."""


class Info(NamedTuple):
    """What a solve did (``full_output=True``); batched solves give batched fields.

    Attributes:
      converged: bool array, whether the stopping test was met (``status == 0``).
      num_steps: int array, iterations taken (0 when the guess already passed the test).
      residual: the final error measure the stopping test used (max-norm), or ``|F|``
        for root finding.
      residual_history: ``(max_steps,)`` error after each step, NaN past ``num_steps``;
        ``None`` unless the solver was asked for ``full_output``.
      status: int array, why the solve stopped: a code of the shared vocabulary
        (:data:`solvers.STATUSES`); ``info.status_name`` gives the names.
    """

    converged: Any
    num_steps: Any
    residual: Any
    residual_history: Any = None
    status: Any = None

    @property
    def status_name(self):
        """The status as a name (``"converged"``, ``"max_steps"``, ...), or an array of them."""
        return _status.status_name(self.status)


class Progress(NamedTuple):
    """What a method says of its state, for the runner's termination test.

    ``error <= atol + rtol * scale`` is the test (both non-negative scalars; the error
    must be non-finite when the iterate is; stagnation is judged on it too). ``status``
    is ``RUNNING`` unless the method knows the solve failed (e.g. ``SINGULAR``);
    ``confirmed`` is False when the test must not end the solve yet (an error estimated
    from a stale Jacobian); ``improved`` is True when the step made progress that the
    error does not show (a minimiser's objective fell measurably), which also resets the
    stagnation count.
    """

    error: Any
    scale: Any
    status: Any = _status.RUNNING
    confirmed: Any = True
    improved: Any = False


class Method(NamedTuple):
    """An iterative method, as the runner sees it (see the module docstring).

    ``warmup=True``: ``init`` does not evaluate the function (so that it is traced and
    run once per step, inside the loop) and the first ``step`` only evaluates the guess;
    the runner does not call ``terminate`` before it, allows ``max_steps`` steps after
    it and does not count it.

    ``branches=True``: a step branches on a value the previous step stored (a bracket
    keeps the end of F's sign). With ``check_every > 1`` the runner then runs a trip's
    steps as an inner loop of known trip count, each step's state held once in its
    carry, instead of unrolled into one computation: there XLA may recompute such a
    value in several fusions whose roundings differ (FMA contraction), and a bracket
    updated from two signs of one F(x) loses the root.
    """

    init: Callable  # x0 -> state
    step: Callable  # state -> state
    terminate: Callable  # state -> Progress
    warmup: bool = False
    branches: bool = False


def _leaf_max_norm(leaf):
    norm = jnp.max(jnp.abs(leaf), initial=0.0)  # (0: an empty leaf)
    if _sharding.on_several_devices(leaf):
        # NaN is tested for apart: a max over devices (a sharded array's all-reduce)
        # may drop a NaN that a max on one device keeps; a NaN must never pass the test.
        norm = jnp.where(any_(jnp.isnan(leaf)), jnp.nan, norm)
    return norm


def max_norm(tree):
    """Largest absolute entry of a pytree of arrays (NaN if any entry is NaN)."""
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1:
        return _leaf_max_norm(leaves[0])
    return jnp.max(jnp.stack([_leaf_max_norm(leaf) for leaf in leaves]))


def max_norms(*trees):
    """:func:`max_norm` of each of several trees of the same shapes, as a tuple.

    One-array trees are reduced together where :func:`norms` can (one pass over the
    arrays, no stacked copy of them: a DEQ step's two norms read 2 x 32 kB instead of
    writing and reading a 64 kB stack).
    """
    leaves = [jax.tree.leaves(tree) for tree in trees]
    if all(len(ls) == 1 for ls in leaves):
        return norms([ls[0] for ls in leaves])
    return tuple(max_norm(tree) for tree in trees)


def norms(max_of=(), two_of=()):
    """``max|a|`` of each array of ``max_of``, then ``sqrt(sum(b * b))`` of each of
    ``two_of``, as a tuple.

    Arrays of one shape and dtype on one device are reduced together, by one variadic
    reduction: on CPU a reduction of more than 32 entries is two kernels plus its
    operand's, in every step of a loop and compiled apart (Newton's step, n = 64, had 16
    of them). Otherwise one reduction each (NaN propagates either way).
    """
    arrays = list(max_of) + list(two_of)
    k = len(max_of)
    if (arrays and len({jnp.shape(a) for a in arrays}) == 1
            and len({jnp.result_type(a) for a in arrays}) == 1
            and not any(_sharding.on_several_devices(a) for a in arrays)):
        zero = jnp.zeros((), jnp.result_type(arrays[0]))

        def combine(x, y):
            return (tuple(jnp.maximum(a, b) for a, b in zip(x[:k], y[:k]))
                    + tuple(a + b for a, b in zip(x[k:], y[k:])))

        out = jax.lax.reduce(tuple(jnp.abs(a) for a in max_of) + tuple(b * b for b in two_of),
                             (zero,) * len(arrays), combine, tuple(range(jnp.ndim(arrays[0]))))
        return tuple(out[:k]) + tuple(jnp.sqrt(v) for v in out[k:])
    return (tuple(max_norm(a) for a in max_of)
            + tuple(jnp.sqrt(jnp.sum(b * b)) for b in two_of))


def _judge(progress, rtol, atol, dtype):
    """``(status, error, improved)`` of a :class:`Progress`."""
    error = jnp.asarray(progress.error, dtype)
    scale = jnp.asarray(progress.scale, dtype)
    finite = jnp.isfinite(error) & jnp.isfinite(scale)
    passed = finite & (error <= atol + rtol * scale) & progress.confirmed
    status = jnp.where(
        progress.status != _status.RUNNING,
        progress.status,
        jnp.where(~finite, _status.NONFINITE, jnp.where(passed, _status.CONVERGED,
                                                        _status.RUNNING)),
    ).astype(jnp.int32)
    return status, error, progress.improved


def iterate(
    method,
    x0,
    *,
    rtol,
    atol,
    max_steps,
    record_history=False,
    stagnation_window=STAGNATION_WINDOW,
    check_every=1,
):
    """Run ``method`` from ``x0`` until it stops; return ``(state, Info)``.

    Args:
      method: a :class:`Method`.
      x0: the guess, passed to ``method.init``.
      rtol, atol: tolerances (may be traced scalars).
      max_steps: static iteration cap.
      record_history: keep the error after every step in ``Info.residual_history``.
      stagnation_window: steps without a new smallest error that count as
        stagnation (``None``: never).
      check_every: steps per loop trip; the test is taken after the last of them (the
        others' errors are not computed). The guess is still tested first; a solve may
        take up to ``check_every - 1`` steps more than it needed and than ``max_steps``.
    """
    dtype = jnp.result_type(rtol)
    every = int(check_every)
    state = method.init(x0)
    if method.warmup and every > 1:
        # The guess is tested after one step, not after a trip's worth.
        state = method.step(state)
    if method.warmup and every == 1:  # nothing evaluated yet: the first trip tests the guess
        status = jnp.int32(_status.RUNNING)
        error = jnp.asarray(jnp.finfo(dtype).max, dtype)
    else:
        status, error, _ = _judge(method.terminate(state), rtol, atol, dtype)
    history = jnp.full((max_steps if record_history else 0,), jnp.nan, dtype)
    # Steps taken, the warm-up's included (it is not counted in num_steps).
    start = jnp.int32(1 if method.warmup and every > 1 else 0)
    limit = max_steps + int(method.warmup)
    window = None if stagnation_window is None else -(-stagnation_window // every)

    # With stagnation, the loop's scalars (status, error, smallest error, trips since it
    # fell) travel as one array, updated at once: on CPU each separate update costs a
    # kernel launch per step (without, the two are carried apart: cheaper to fuse).
    acc = jnp.promote_types(dtype, jnp.float32)

    def record(status, error, best, since):
        if window is None:
            return status, error
        values = [jnp.asarray(v).astype(acc) for v in (status, error, best, since)]
        return jnp.stack(_sharding.stackable(values))  # (batched alike: Explicit mesh)

    def cond(carry):
        _, k, rec, _ = carry
        return (rec[0] == _status.RUNNING) & (k < limit)

    def body(carry):
        state, k, rec, history = carry
        if method.branches and every > 1:  # (see Method)
            state = jax.lax.fori_loop(0, every, lambda _, s: method.step(s), state)
        else:
            for _ in range(every):
                state = method.step(state)
        k = k + every
        status, error, improved = _judge(method.terminate(state), rtol, atol, dtype)
        best = since = None
        if window is not None:
            best, since = rec[2], rec[3]
            fell = (error < best) | improved
            best = jnp.minimum(best, error)
            since = jnp.where(fell, 0, since + 1)
            # A window, and at least as many trips as led to the smallest error (2x the
            # steps at worst): a long transient plateau is not a floor.
            trips = (k - start) // every
            stuck = ((since >= window) & (2 * since >= trips)
                     & (error <= STAGNATION_BAND * best))
            status = jnp.where((status == _status.RUNNING) & stuck, _status.STAGNATED, status)
        if record_history:  # (the warm-up step tests the guess: no step to record)
            i = k - 1 - int(method.warmup)
            i_ok = (i >= 0) & (i < max_steps)
            i = jnp.clip(i, 0, max_steps - 1)
            history = history.at[i].set(jnp.where(i_ok, error, history[i]))
        return state, k, record(status, error, best, since), history

    init = (state, start, record(status, error, error, 0), history)
    state, k, rec, history = _sharding.while_loop(cond, body, init)
    status, error = jnp.asarray(rec[0]).astype(jnp.int32), jnp.asarray(rec[1]).astype(dtype)
    status = jnp.where(status == _status.RUNNING, _status.MAX_STEPS, status)
    info = Info(
        converged=status == _status.CONVERGED,
        num_steps=jnp.maximum(k - int(method.warmup), 0),
        residual=error,
        residual_history=history if record_history else None,
        status=status,
    )
    return state, info


# --- failure messages and the failure policy -------------------------------------------


def failure_message(info, *, solver, max_steps, detail=None, explain=None):
    """The message of a failed solve (``info`` with NumPy leaves, batched or not).

    ``detail(info, index) -> str``, if given, replaces the default context (steps and
    residual) of the first failed element with a solver's own (an ODE's time reached);
    ``explain(code) -> (why, advice)`` replaces :func:`solvers._status.explain`.
    """
    converged = np.asarray(info.converged)
    failed = ~converged
    status = np.broadcast_to(np.asarray(info.status), failed.shape)
    steps = np.broadcast_to(np.asarray(info.num_steps), failed.shape)
    residual = np.broadcast_to(np.asarray(info.residual), failed.shape)
    if failed.ndim == 0:
        first, where = (), ""
    else:
        idx = np.argwhere(failed)
        first = tuple(int(i) for i in idx[0])
        where = f" ({idx.shape[0]} of {failed.size} batch elements failed; first at index {first})"
    code = int(status[first])
    why, advice = (explain or functools.partial(_status.explain, max_steps=max_steps))(code)
    context = f"{int(steps[first])} steps, final residual {float(residual[first]):.3e}"
    if detail is not None:
        context = detail(info, first)
    return (
        f"{solver} did not converge{where}: status '{_status.status_name(code)}': {why} "
        f"({context}). To fix: {advice}; or pass on_failure='nan' or 'ignore' to get the "
        "result anyway."
    )


def _raise_described(info, *, describe):
    info = jax.tree.map(np.asarray, info)
    if not np.all(info.converged):
        raise ConvergenceError(describe(info))


def _describer(solver, max_steps, message):
    def describe(info):
        return failure_message(info, solver=solver, max_steps=max_steps, **message)

    return describe


def apply_failure_policy(x, info, *, solver, on_failure, check, max_steps, message=None):
    """Apply ``on_failure`` inside a trace.

    ``"nan"`` fills the solution of failed solves (only those elements: ``converged``
    may be elementwise) with NaN; ``"raise"`` with ``check="callback"`` raises from a
    host check at run time, and the returned solution depends on that check (the eager
    path, ``check="host"``, raises in :func:`dispatch` instead); ``"ignore"`` returns the
    last iterate. ``message``: the ``detail``/``explain`` hooks of :func:`failure_message`.
    """
    if on_failure == "nan":
        return jax.tree.map(lambda leaf: jnp.where(info.converged, leaf, jnp.nan), x)
    if on_failure == "raise" and check == "callback":
        describe = _describer(solver, max_steps, message or {})
        # The history is left out: the host needs only the final values (and a traced
        # array closed over by the callback would fail to convert).
        checked = {k: v for k, v in info._asdict().items()
                   if v is not None and k != "residual_history"}
        drop = {"residual_history": None} if "residual_history" in info._fields else {}
        ok = host_check(
            info.converged,
            lambda i: _raise_described(info._replace(**i, **drop), describe=describe),
            checked,
        )
        # Folding the check's result into the output keeps it from being dropped and
        # makes the output wait for it (asynchronous callbacks on GPU).
        return jax.tree.map(lambda leaf: jnp.where(ok, leaf, jnp.nan), x)
    return x


# --- has_aux: a user function that also returns auxiliary data -------------------------


def check_pair(out, fn_name):
    """``fn(x0, *args)`` (shapes) of a function with ``has_aux=True``: a pair."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"`{fn_name}` with has_aux=True must return a pair (value, aux), got "
                         f"{jax.tree.structure(out)}")


def main_output(fn, fn_name, x0, args, has_aux):
    """``(fn, shapes of fn(x0, *args))``, or (``has_aux``, after checking that ``fn``
    returns a pair) the function of its first output only and that output's shapes: what
    the solver iterates on and differentiates (made inside the jitted solve, so the
    compiled solver is still cached per user function)."""
    out = _checks.call_shape(fn, fn_name, x0, *args)
    if not has_aux:
        return fn, out
    check_pair(out, fn_name)
    return (lambda *a: fn(*a)[0]), out[0]


def with_aux(fn, x, args, info, has_aux):
    """A solve's ``(x, info)``, or (``has_aux``) ``((x, aux), info)`` with ``aux`` the
    function's second output at the solution: differentiable, through ``x`` by the
    implicit function theorem and through ``args`` directly."""
    if not has_aux:
        return x, info
    return (x, fn(x, *args)[1]), info


def unpack_aux(out, has_aux, full_output):
    """What a solver returns: ``x``, ``(x, info)``, ``(x, aux)`` or ``(x, aux, info)``,
    from :func:`dispatch`'s output of a solve that returned :func:`with_aux`'s."""
    if has_aux and full_output:
        (x, aux), info = out
        return x, aux, info
    return out


# --- the implicit rule and the policy, attached once ------------------------------------


def solve(residual, body, x0, args, *, rtol, options, check, solver, preconditioner=False):
    """Run ``body(x0, args) -> (x, Info)`` with implicit derivatives and ``on_failure``.

    ``residual(x, *args) == 0`` at the solution gives the derivatives (the iterations in
    ``body`` are never differentiated); the adjoint linear solve uses
    ``options.linear_solver`` at ``ADJOINT_RTOL_FACTOR * rtol`` with ``options.max_steps``
    and follows ``options.on_failure`` too. With ``preconditioner=True`` ``body`` returns
    ``(x, Info, P)``, ``P`` the adjoint's preconditioner from the forward pass (see
    :func:`implicit.custom_root`).
    """

    @custom_root(
        residual,
        linear_solver=options.linear_solver,
        has_aux=True,
        rule=options.rule,
        rtol=ADJOINT_RTOL_FACTOR * rtol,
        max_steps=options.max_steps,
        on_failure=options.on_failure,
        preconditioner=preconditioner,
    )
    def implicit_solve(x0, *args):
        x, info, *p = body(x0, args)
        x = apply_failure_policy(
            x, info, solver=solver, on_failure=options.on_failure, check=check,
            max_steps=options.max_steps,
        )
        return (x, info, *p)

    return implicit_solve(x0, *args)


# --- options and dispatch: validate, compile once, raise eagerly, explain --------------


class Options(NamedTuple):
    """The options every solver shares (SPEC 'Options'), validated by :func:`options`.

    ``rule`` and ``linear_solver`` are ``None`` for a solver without an implicit rule
    (``odeint`` differentiates by its adjoint).
    """

    rtol: Any
    atol: Any
    max_steps: int
    on_failure: str
    full_output: bool
    rule: Any = None
    linear_solver: Any = None
    check_every: int = 1


def _default_check_every(on_accelerator):
    """``check_every=None``: 1 on CPU; on GPU/TPU, where every loop trip syncs its
    predicate with the host, ``on_accelerator`` (a solver's choice: several for cheap
    steps, 1 where a step costs a factorisation)."""
    return on_accelerator if _sharding.on_accelerator() else 1


def options(
    fn,
    fn_name,
    *,
    rtol,
    atol,
    max_steps,
    on_failure,
    full_output,
    rule=None,
    linear_solver=None,
    extra_linear_solvers=("auto",),
    check_every=1,
    check_every_on_accelerator=1,
):
    """Check the user's function and the common options; return them as :class:`Options`.

    ``check_every=None`` resolves to :func:`_default_check_every` with
    ``check_every_on_accelerator``.
    """
    _checks.check_callable(fn, fn_name)
    _checks.check_positive(rtol, "rtol")
    _checks.check_positive(atol, "atol")
    max_steps = _checks.check_max_steps(max_steps)
    _checks.check_choice(on_failure, "on_failure", _checks.ON_FAILURE)
    if rule is not None:
        _checks.check_choice(rule, "rule", _checks.RULES)
        _checks.check_linear_solver(linear_solver, rule, extra_linear_solvers)
    if check_every is None:
        check_every = _default_check_every(check_every_on_accelerator)
    check_every = _checks.check_max_steps(check_every, "check_every")
    return Options(rtol, atol, max_steps, on_failure, bool(full_output), rule, linear_solver,
                   check_every)



def jit_solver(impl):
    """``jax.jit`` a solver's implementation with its keyword-only parameters static.

    Convention of every solver here: arrays (the guess, parameters, tolerances) are
    positional and traced, so changing them never recompiles; the function, method
    names and other options are keyword-only and static (hashable).
    """
    params = inspect.signature(impl).parameters.values()
    static = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
    return jax.jit(impl, static_argnames=static)


def _is_traced(tree) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def _under_transformation(args) -> bool:
    """Whether the solve's outputs will be traced values (then the check is compiled in).

    True when an input is a tracer (vmap, grad, jit of the parameters), or inside a
    ``jit``/``eval_shape`` trace, where even a constant operation gives a tracer. A
    function that closes over a traced value is caught after the call (see dispatch).
    """
    if _is_traced(args):
        return True
    return isinstance(jax.lax.add(np.float32(0), np.float32(0)), jax.core.Tracer)


#: Function objects seen per code object, to spot a fresh lambda per call.
_SEEN: dict = {}
_WARNED: set = set()
_RECOMPILE_WARN_AFTER = 3


def _watch_recompiles(fn, solver):
    """Warn once when the same code arrives as a new function object again and again.

    ``jax.jit`` caches on the function object, so a lambda (or a nested function) made
    afresh at every call is compiled afresh at every call.
    """
    code = getattr(fn, "__code__", None)
    if code is None or code in _WARNED:
        return
    seen = _SEEN.setdefault(code, [])
    if any(ref() is fn for ref in seen):
        return
    try:
        import weakref

        seen.append(weakref.ref(fn))
    except TypeError:
        return
    if len(seen) >= _RECOMPILE_WARN_AFTER:
        _WARNED.add(code)
        _SEEN.pop(code, None)
        warnings.warn(
            f"{solver} is being compiled again because its function is a new object at "
            f"every call (the same code, {code.co_filename}:{code.co_firstlineno}); "
            "compiled solvers are cached per function object. Define the function once "
            "(outside the loop or the calling function) and pass changing values as "
            "*args, so that the compiled solver is reused.",
            RuntimeWarning,
            stacklevel=4,
        )


def dispatch(jitted, *args, solver, options, fn=None, message=None, forward_hint=None,
             **static):
    """Call a solver's jitted implementation and apply the eager failure check.

    ``jitted(*args, check=, solver=, options=, **static)`` must return ``(x, info)``; it
    receives ``options`` (an :class:`Options`) with the tolerances blanked (they are
    among ``args``, traced); ``fn`` is the user's function (watched for recompiles);
    ``message``: the ``detail``/``explain`` hooks of :func:`failure_message`;
    ``forward_hint``: what to tell a forward-mode caller that a custom_vjp refused (by
    default the ``rule='jvp'`` advice of the implicit solvers).
    """
    on_failure, max_steps, full_output = (
        options.on_failure, options.max_steps, options.full_output
    )
    # Static (hashable): the tolerances are traced arguments of their own.
    static["options"] = options._replace(rtol=None, atol=None)
    check = "callback" if _under_transformation(args) else "host"
    if fn is not None and check == "host":
        _watch_recompiles(fn, solver)

    def call(check):
        return jitted(*args, check=check, solver=solver, **static)

    try:
        x, info = call(check)
        if check == "host" and _is_traced(info):
            # The function closes over a traced value (e.g. under grad): the outputs
            # are traced after all, so the check must be compiled in.
            check = "callback"
            x, info = call(check)
    except TypeError as err:
        if "forward-mode" not in str(err) or "custom_vjp" not in str(err):
            raise
        hint = forward_hint or (
            "pass rule='jvp' (with a linear linear_solver such as 'gmres' or 'dense') "
            "for forward mode (jax.jvp, jax.jacfwd, jax.hessian)"
            if options.rule is not None
            else "it is differentiated in reverse mode only (jax.grad, jax.vjp, jax.jacrev)"
        )
        raise TypeError(f"{solver}: forward-mode differentiation needs a forward rule: "
                        f"{hint}.") from err
    if check == "host" and on_failure == "raise":
        _raise_described(info, describe=_describer(solver, max_steps, message or {}))
    return (x, info) if full_output else x
