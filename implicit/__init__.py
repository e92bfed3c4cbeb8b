"""implicit: implicit differentiation for JAX.

The engine (:func:`custom_root`, :func:`custom_fixed_point`) gives any solver
derivatives from the implicit function theorem; :mod:`implicit.linear` holds the adjoint
linear solvers; ready custom-derivative rules and :mod:`implicit.plot` (plotting,
matplotlib imported lazily) complete it.
"""

from implicit import linear, plot
from implicit.ift import AdjointSolveError, custom_fixed_point, custom_root
from implicit.rules import (
    clip_gradient,
    debug_backward,
    log1pexp,
    with_derivative,
    x_over_1p_sqrt,
)

__all__ = [
    "AdjointSolveError",
    "clip_gradient",
    "custom_fixed_point",
    "custom_root",
    "debug_backward",
    "linear",
    "log1pexp",
    "plot",
    "with_derivative",
    "x_over_1p_sqrt",
]
