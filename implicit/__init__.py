"""implicit: implicit differentiation for JAX.

The engine (:func:`custom_root`, :func:`custom_fixed_point`) gives any solver
derivatives from the implicit function theorem; :mod:`implicit.linear` holds the adjoint
linear solvers; ready custom-derivative rules and :mod:`implicit.plot` (plotting,
matplotlib imported lazily) complete it.
"""

from implicit import linear
from implicit.ift import custom_fixed_point, custom_root

__all__ = ["custom_root", "custom_fixed_point", "linear"]
