"""solvers: fixed points, roots, minima and ODEs in JAX, differentiated implicitly.

Every solver takes the unknown first and the parameters after (``f(x, *args)``), works
under ``jit``, ``vmap`` and ``grad`` (which other transformations each supports, and with
which option: the documentation's "JAX transformations" table), and takes the common options
``rtol``, ``atol``, ``max_steps``, ``on_failure`` and ``full_output``; the fixed-point,
root and bracketed solvers also take ``rule`` and ``linear_solver`` (``odeint``
differentiates by its own adjoint, ``adjoint=``). Why a solve stopped is one vocabulary
for every solver (:data:`STATUSES`, ``info.status`` and :func:`status_name`); a failed solve raises
:class:`ConvergenceError` (a failed adjoint solve :class:`AdjointSolveError`) unless
``on_failure`` says otherwise.
"""

from implicit.ift import AdjointSolveError
from solvers._runner import ConvergenceError, Info
from solvers._status import STATUSES, status_name
from solvers.bracket import bisection, chandrupatla
from solvers.fixed_point import fixed_point
from solvers.least_squares import least_squares
from solvers.minimize import minimize
from solvers.ode import odeint
from solvers.root import newton, root

__all__ = [
    "AdjointSolveError",
    "ConvergenceError",
    "Info",
    "STATUSES",
    "bisection",
    "chandrupatla",
    "fixed_point",
    "least_squares",
    "minimize",
    "newton",
    "odeint",
    "root",
    "status_name",
]
