"""JAX's own ``tests/ode_test.py`` gradient checks, ported to ``solvers.odeint``.

Each calls ``jax.test_util.check_grads(..., modes=["rev"], order=2)``: reverse over reverse,
first and second derivatives in every input (``y0``, ``ts`` and the arguments) against
finite differences, tolerance 1e-3 in float64, as in JAX's file; nothing else changed.
Run with the default adjoint (the discrete adjoint, differentiated again by its
second-order rules) and with ``adjoint="backsolve"`` (whose backward pass is itself an
ODE solve, as ``jax.experimental.ode.odeint``'s is). Slow (about 75 s: ``check_grads``
runs each transformation eagerly); second derivatives through both adjoints are in the
default suite (tests/test_ode_forward.py, tests/test_ode.py).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import solvers

pytestmark = pytest.mark.slow
TOL = 1e-3


def _odeint(adjoint, f, y0, ts, *args):
    return solvers.odeint(f, y0, ts, *args, rtol=1.4e-8, atol=1.4e-8, adjoint=adjoint)


def pend(y, _, m, g):
    return jnp.stack([y[1], -m * y[1] - g * jnp.sin(y[0])])


def negate(y, _t):
    return jax.tree.map(jnp.negative, y)


def weird_time(y, t):
    return jnp.array([y[1] * -t, -1 * y[1] - 9.8 * jnp.sin(y[0])])


def decay(y, t, arg1, arg2):
    return -jnp.sqrt(t) - y + arg1 - jnp.mean((y + arg2) ** 2)


def swoop(y, t, arg1, arg2):
    return jnp.array(y - jnp.sin(t) - jnp.cos(t) * arg1 + arg2)


def _cases():
    rng = np.random.RandomState(0)
    args = (jnp.asarray(rng.randn(3)), jnp.asarray(rng.randn(3)))
    return {
        "pend_grads": (pend, (jnp.array([jnp.pi - 0.1, 0.0]), jnp.linspace(0.0, 1.0, 11),
                              0.25, 9.8)),
        "pytree_state": (negate, ((jnp.array(-0.1), jnp.array([[[0.1]]])),
                                  jnp.linspace(0.0, 1.0, 11))),
        "weird_time_pendulum_grads": (weird_time, (jnp.array([jnp.pi - 0.1, 0.0]),
                                                   jnp.linspace(0.0, 1.0, 11))),
        "decay": (decay, (jnp.asarray(rng.randn(3)), jnp.linspace(0.1, 0.2, 4), *args)),
        "swoop": (swoop, (jnp.linspace(0.1, 0.9, 10), jnp.array([0.1, 0.2]), 0.1, 0.2)),
        "swoop_big_y0": (swoop, (jnp.linspace(1.1, 10.9, 10), jnp.array([0.1, 0.2]), 0.1,
                                 0.3)),
    }


@pytest.mark.parametrize("adjoint", ["discrete", "backsolve"])
@pytest.mark.parametrize("name", list(_cases()))
def test_jax_ode_test_second_order_rev(x64, name, adjoint):
    f, args = _cases()[name]
    check_grads(partial(_odeint, adjoint, f), args, modes=["rev"], order=2, atol=TOL,
                rtol=TOL)
