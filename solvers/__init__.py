"""solvers: fixed points, roots and ODEs in JAX, differentiated by the implicit function theorem.

Every solver takes the unknown first and the parameters after (``f(x, *args)``), works
under ``jit``, ``vmap``, ``grad`` and ``grad(grad)``, and takes the common options
``rtol``, ``atol``, ``max_steps``, ``rule``, ``linear_solver``, ``on_failure`` and
``full_output``.
"""

from solvers._loop import ConvergenceError, Info
from solvers.bracket import bisection, chandrupatla
from solvers.fixed_point import fixed_point
from solvers.ode import odeint
from solvers.root import newton, root

__all__ = [
    "ConvergenceError",
    "Info",
    "bisection",
    "chandrupatla",
    "fixed_point",
    "newton",
    "odeint",
    "root",
]
