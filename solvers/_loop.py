"""The one iteration driver, the info record and the failure policy of every solver.

A solver supplies a ``step(state) -> (state, error, scale)``; :func:`iterate` runs it in
a ``lax.while_loop`` until ``error <= atol + rtol * scale`` (both max-norms the solver
chooses: a step length, a residual, a bracket width), ``max_steps`` is reached, or the
error becomes non-finite. :func:`dispatch` is the public entry: it compiles a solver
once per function object and shapes, and applies ``on_failure`` so that a failed solve
raises a clear :class:`ConvergenceError` (eagerly) or a runtime error with the same
message (under ``jit``/``vmap``/``grad``), unless the caller asked for NaN or the last
iterate.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as _jax_core

from implicit._host import host_check

__all__ = [
    "ConvergenceError",
    "Info",
    "apply_failure_policy",
    "dispatch",
    "iterate",
    "jit_solver",
    "max_norm",
]


class ConvergenceError(RuntimeError):
    """A solver did not converge (raised with ``on_failure="raise"``, the default)."""


class Info(NamedTuple):
    """What a solve did (``full_output=True``); batched solves give batched fields.

    Attributes:
      converged: bool array, whether the stopping test was met.
      num_steps: int array, iterations taken.
      residual: the final error measure (max-norm) the stopping test used.
      residual_history: ``(max_steps,)`` error after each step, NaN past ``num_steps``;
        ``None`` unless the solver was asked for ``full_output``.
      status: int array naming why a solve failed, for solvers that can tell (``0``: no
        particular reason, ``k > 0``: the solver's ``reasons[k - 1]``); ``None`` otherwise.
    """

    converged: Any
    num_steps: Any
    residual: Any
    residual_history: Any = None
    status: Any = None


def max_norm(tree):
    """Largest absolute entry of a pytree of arrays."""
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1:
        return jnp.max(jnp.abs(leaves[0]))
    return jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in leaves]))


def iterate(step, state, *, rtol, atol, max_steps, record_history=False, error_dtype=None):
    """Run ``step`` until convergence; return ``(state, Info)``.

    Args:
      step: ``step(state) -> (state, error, scale)``; converged when
        ``error <= atol + rtol * scale``.
      state: the initial state (any pytree).
      rtol, atol: tolerances (may be traced).
      max_steps: static iteration cap.
      record_history: keep the error after every step in ``Info.residual_history``.
      error_dtype: dtype of the error (defaults to ``rtol``'s).
    """
    dtype = error_dtype or jnp.result_type(rtol)
    history = jnp.full((max_steps if record_history else 0,), jnp.nan, dtype)

    def cond(carry):
        _, k, error, converged, _ = carry
        return (k < max_steps) & ~converged & jnp.isfinite(error)

    def body(carry):
        state, k, _, _, history = carry
        state, error, scale = step(state)
        error = jnp.asarray(error, dtype)
        converged = error <= atol + rtol * scale
        if record_history:
            history = history.at[k].set(error)
        return state, k + 1, error, converged, history

    # The initial error is the largest finite value, so the loop starts; a step whose
    # error is NaN or infinite stops it, reported as not converged.
    big = jnp.asarray(jnp.finfo(dtype).max, dtype)
    init = (state, jnp.int32(0), big, jnp.bool_(False), history)
    state, k, error, converged, history = jax.lax.while_loop(cond, body, init)
    info = Info(converged, k, error, history if record_history else None)
    return state, info


def _failure_message(solver, converged, num_steps, residual, max_steps, status=None, reasons=()):
    converged, num_steps, residual = map(np.asarray, (converged, num_steps, residual))
    failed = ~converged
    num_steps = np.broadcast_to(num_steps, failed.shape)
    residual = np.broadcast_to(residual, failed.shape)
    status = np.broadcast_to(np.asarray(0 if status is None else status), failed.shape)
    if failed.ndim == 0:
        steps, res, code = int(num_steps), float(residual), int(status)
        where = ""
    else:
        idx = np.argwhere(failed)
        first = tuple(int(i) for i in idx[0])
        steps, res, code = int(num_steps[first]), float(residual[first]), int(status[first])
        where = f" ({idx.shape[0]} of {failed.size} batch elements failed; first at index {first})"
    if 0 < code <= len(reasons):
        why = f"{reasons[code - 1]} ({steps} steps taken, final residual {res:.3e})"
    elif not np.isfinite(res):
        why = f"the residual became non-finite ({res}) at step {steps}"
    else:
        why = f"{steps} steps taken (max_steps={max_steps}), final residual {res:.3e}"
    return (
        f"{solver} did not converge{where}: {why}. Increase max_steps, loosen rtol/atol, "
        "start closer to a solution, or pass on_failure='nan' or 'ignore'."
    )


def _raise_described(info, *, describe):
    # `describe(info)` (NumPy leaves, batched under vmap) writes the whole message.
    info = jax.tree.map(np.asarray, info)
    if not np.all(info.converged):
        raise ConvergenceError(describe(info))


def _default_describe(solver, max_steps, reasons):
    def describe(info):
        return _failure_message(
            solver, info.converged, info.num_steps, info.residual, max_steps, info.status, reasons
        )

    return describe


def apply_failure_policy(
    x, info, *, solver, on_failure, check, max_steps, reasons=(), describe=None
):
    """Apply ``on_failure`` inside a trace.

    ``"nan"`` fills the solution of failed solves (only those batch elements) with NaN;
    ``"raise"`` with ``check="callback"`` raises from a host callback at run time (the
    eager path, ``check="host"``, raises in :func:`dispatch` instead); ``"ignore"``
    returns the last iterate. ``reasons`` are the texts of ``info.status`` codes 1, 2, ...;
    a solver whose message needs run-time values (an ODE's time reached) passes
    ``describe(info) -> str`` instead.
    """
    if on_failure == "nan":
        return jax.tree.map(lambda leaf: jnp.where(info.converged, leaf, jnp.nan), x)
    if on_failure == "raise" and check == "callback":
        describe = describe or _default_describe(solver, max_steps, reasons)
        checked = {k: v for k, v in info._asdict().items() if v is not None}
        checked.pop("residual_history", None)
        ok = host_check(
            info.converged, lambda i: _raise_described(info._replace(**i), describe=describe),
            checked,
        )
        # Folding the check's result into the output keeps it from being dropped; it is
        # always True when it returns (the host raises otherwise).
        return jax.tree.map(lambda leaf: jnp.where(ok, leaf, jnp.nan), x)
    return x


def jit_solver(impl):
    """``jax.jit`` a solver's implementation with its keyword-only parameters static.

    Convention of every solver here: arrays (the guess, parameters, tolerances) are
    positional and traced, so changing them never recompiles; the function, method
    names and other options are keyword-only and static (hashable).
    """
    params = inspect.signature(impl).parameters.values()
    static = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
    return jax.jit(impl, static_argnames=static)


def _under_transformation() -> bool:
    # True inside jit/vmap/grad tracing: there the failure check must be compiled in.
    return not _jax_core.trace_state_clean()


def dispatch(
    jitted, *args, solver, on_failure, full_output, max_steps, reasons=(), describe=None, **static
):
    """Call a solver's jitted implementation and apply the eager failure check.

    ``jitted(*args, check=..., solver=..., on_failure=..., max_steps=..., **static)``
    must return ``(x, info)``; ``reasons`` are the texts of ``info.status`` codes;
    ``describe(info) -> str``, if given, writes the whole failure message instead.
    """
    check = "callback" if _under_transformation() else "host"
    x, info = jitted(
        *args, check=check, solver=solver, on_failure=on_failure, max_steps=max_steps, **static
    )
    if check == "host" and on_failure == "raise":
        _raise_described(info, describe=describe or _default_describe(solver, max_steps, reasons))
    return (x, info) if full_output else x
