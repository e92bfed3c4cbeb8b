"""Why a solve stopped: the one status vocabulary of every solver, and its messages.

``info.status`` is an int array of the codes below (elementwise for elementwise solvers,
batched under ``vmap``); :func:`status_name` (or ``info.status_name``) turns it into the
names. ``0`` is success; every other code is a failure that follows ``on_failure``.

========================  ======================================================
``converged``             the stopping test held, with a finite solution, error and scale
``max_steps``             ``max_steps`` iterations (ODE: attempted steps) were not enough
``nonfinite``             the function, the iterate or the error became NaN or infinite
``stagnated``             the error stopped decreasing for a whole window of steps
                          (round-off floor above the tolerance, or a cycle)
``singular``              a Newton step was not finite: the Jacobian is singular
``no_decrease``           the line search found no decrease of ``|F|`` along the direction
``no_sign_change``        a bracket whose ends have the same sign (or are not finite)
``discontinuity``         a bracket that closed on a pole or a jump, not on a root:
                          ``|F|`` did not shrink with the bracket
``step_underflow``        an ODE step size fell below what floating point can resolve
``invalid_input``         an input checked at run time (traced ``ts`` not increasing)
``drift``                 an ODE ``backsolve`` adjoint's backward-integrated state left
                          the stored forward solution (or a replay missed its steps)
``gradient_error``        an ODE gradient's error estimate (the discrete adjoint's, whose
                          step sizes are held fixed) is a large fraction of the gradient
========================  ======================================================
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = [
    "CONVERGED",
    "MAX_STEPS",
    "NONFINITE",
    "STAGNATED",
    "SINGULAR",
    "NO_DECREASE",
    "NO_SIGN_CHANGE",
    "DISCONTINUITY",
    "STEP_UNDERFLOW",
    "INVALID_INPUT",
    "DRIFT",
    "GRADIENT_ERROR",
    "RUNNING",
    "STATUSES",
    "status_name",
    "explain",
]

STATUSES = (
    "converged",
    "max_steps",
    "nonfinite",
    "stagnated",
    "singular",
    "no_decrease",
    "no_sign_change",
    "discontinuity",
    "step_underflow",
    "invalid_input",
    "drift",
    "gradient_error",
)
(
    CONVERGED,
    MAX_STEPS,
    NONFINITE,
    STAGNATED,
    SINGULAR,
    NO_DECREASE,
    NO_SIGN_CHANGE,
    DISCONTINUITY,
    STEP_UNDERFLOW,
    INVALID_INPUT,
    DRIFT,
    GRADIENT_ERROR,
) = range(len(STATUSES))
#: Inside a loop only: not stopped yet. Never returned in ``info.status``.
RUNNING = -1


def status_name(status):
    """The name(s) of ``info.status`` codes: a ``str``, or a NumPy array of them.

    Example:
      >>> import solvers
      >>> x, info = solvers.fixed_point(lambda x: 2 * x + 1, 0.0, on_failure="ignore",
      ...                               full_output=True)
      >>> print(solvers.status_name(info.status))
      nonfinite
    """
    codes = np.asarray(status)
    names = np.asarray(STATUSES + ("running",), dtype=object)
    index = np.where((codes >= 0) & (codes < len(STATUSES)), codes, len(STATUSES))
    if index.ndim == 0:
        return str(names[int(index)])
    return names[index]


def _precision_hint():
    # GPUs (and TPUs) multiply float32 matrices in reduced precision by default (TF32),
    # which puts a floor of about 1e-3 relative under any matmul-based solve.
    if jax.default_backend() == "cpu":
        return ""
    precision = jax.config.jax_default_matmul_precision
    if precision in ("highest", "float32", "F32_F32_F32"):
        return ""
    return (
        f" On {jax.default_backend().upper()} the default matmul precision "
        f"({precision or 'default'}) is reduced (TF32/bf16 passes), which limits float32 "
        "solves to about 1e-3 relative: set JAX_DEFAULT_MATMUL_PRECISION=highest (or "
        "jax.config.update('jax_default_matmul_precision', 'highest')) or loosen rtol."
    )


def explain(code, *, max_steps=None):
    """Why a solve with status ``code`` failed, and what to do: one sentence each."""
    code = int(code)
    if code == MAX_STEPS:
        return (
            f"max_steps={max_steps} steps were not enough",
            "increase max_steps, loosen rtol/atol, or start closer to a solution",
        )
    if code == NONFINITE:
        return (
            "the function, the iterate or the error became non-finite (NaN or inf): the "
            "iteration diverged, or the function returns NaN/inf there",
            "check the function at the guess, start closer to a solution, or use damping "
            "or another method (more steps will not help)",
        )
    if code == STAGNATED:
        return (
            "the error stopped decreasing (no new smallest error over a window of steps): "
            "it sits at a round-off floor above the tolerance, or the iteration cycles or "
            "creeps without reaching a solution (a root solve: toward a local minimum of "
            "|F| that is not a root)",
            "at a round-off floor (a final residual near the tolerance) loosen rtol/atol or "
            "switch to float64; away from a solution start elsewhere or try another method "
            "(more steps will not help)" + _precision_hint(),
        )
    if code == SINGULAR:
        return (
            "the Jacobian is singular (the Newton step is not finite)",
            "start elsewhere, or use method='dogleg' (a trust region copes with a singular "
            "Jacobian away from the root)",
        )
    if code == NO_DECREASE:
        return (
            "the line search found no decrease of |F| (of the objective, for minimize and "
            "least_squares) along the search direction, or the trust region shrank to "
            "rounding without one (a singular or ill-conditioned Jacobian, a local minimum "
            "of |F|, a root outside the bounds, or rtol/atol below what the "
            "floating-point precision allows)",
            "start elsewhere (or widen the bounds), or loosen rtol/atol",
        )
    if code == NO_SIGN_CHANGE:
        return (
            "the bracket has no sign change: F(lower) and F(upper) have the same sign (or "
            "one of them, or lower or upper, is not finite)",
            "pass a bracket on whose ends F has opposite signs",
        )
    if code == DISCONTINUITY:
        return (
            "the bracket closed on a pole or a jump of F, not on a root: |F| at the ends "
            "did not shrink with the bracket",
            "pass a bracket that excludes the discontinuity",
        )
    if code == STEP_UNDERFLOW:
        return (
            "the step size underflowed (the solution may blow up or be non-smooth there, "
            "or the tolerances are too tight for the floating-point precision)",
            "loosen rtol/atol, or check the right-hand side there",
        )
    if code == INVALID_INPUT:
        return ("an input checked at run time is invalid", "fix the input")
    if code == DRIFT:
        return (
            "the state reconstructed by the backward pass drifted away from the forward "
            "solution (integrating a dissipative system backwards is unstable)",
            "use the default adjoint instead of adjoint='backsolve'",
        )
    if code == GRADIENT_ERROR:
        return (
            "the gradient's error estimate is a large fraction of the gradient (it is the "
            "derivative of the computed solution with its step sizes held fixed, and the "
            "solution's local errors move with the inputs)",
            "tighten rtol/atol, or differentiate the step sizes too",
        )
    return (f"unknown status {code}", "report this as a bug")
