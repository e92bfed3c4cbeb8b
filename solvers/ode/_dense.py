"""Dense output: ``odeint(..., dense=B, full_output=True)`` returns ``info.solution``.

The solution keeps the continuous extension of the last ``B`` accepted steps (the
interpolant the method fills its output times with: quartic for dopri5 and tsit5, cubic
Hermite for kvaerno5, the interpolating polynomial for bdf), as recorded by the step
loop (:class:`solvers.ode._integrate.Record`), and evaluates it at any time of the span it
covers. Outside that span (before the first kept step, after the time reached) the value
is NaN, never an extrapolation.

Derivatives of ``evaluate(t)`` (reverse mode, a ``jax.custom_vjp``) come from integrating
again, from ``t0`` to ``t``, with the differentiable solve of the same ``odeint`` call (its
method, tolerances and adjoint) and running its adjoint: the derivative of ``y(t)`` with
respect to ``y0``, the parameters, ``t0`` and ``t``, to the integration's tolerances. The
stored arrays themselves carry no derivative.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from implicit import _sharding
from solvers import _status
from solvers.ode import _integrate

__all__ = ["ODESolution"]


@jax.tree_util.register_pytree_node_class
class ODESolution:
    """The dense output of an ``odeint`` call: ``y(t)`` at any ``t`` of the span covered.

    Returned as ``info.solution`` by ``solvers.odeint(..., dense=B, full_output=True)``.
    A pytree (its arrays are leaves), so it passes through ``jit`` and ``vmap``: under
    ``vmap`` each batch element has its own solution (``jax.vmap(lambda s:
    s.evaluate(t))(info.solution)`` evaluates a batched one).

    Attributes:
      t0: the initial time ``ts[0]``.
      t_start: the first time covered: ``t0`` when every accepted step was kept
        (``complete``), else the start of the oldest step kept.
      t_end: the last time covered: the time reached (``ts[-1]``, or a terminal event's
        time); NaN when the integration failed under ``on_failure="nan"``.
      complete: bool, whether every accepted step was kept (the capacity ``B`` was
        enough), i.e. the whole span ``[t0, t_end]`` is covered.
      num_kept: how many steps are kept (at most ``B``).

    Example:
      >>> import jax.numpy as jnp, solvers
      >>> ys, info = solvers.odeint(lambda y, t: -y, 1.0, jnp.array([0.0, 2.0]),
      ...                           dense=64, full_output=True)
      >>> sol = info.solution
      >>> print([round(float(y), 4) for y in sol.evaluate(jnp.array([0.5, 1.0, 1.5]))])
      [0.6065, 0.3679, 0.2231]
      >>> print(bool(sol.complete), bool(jnp.isnan(sol.evaluate(3.0))))  # past the end
      True True
    """

    def __init__(self, record, t_end, t0, z0, theta, const, ctl, *, solve, unravel):
        self.record = record
        self.t_end = t_end
        self.t0 = t0
        self.z0 = z0
        self.theta = theta
        self.const = const
        self.ctl = ctl
        self._solve = solve
        self._unravel = unravel

    def tree_flatten(self):
        children = (self.record, self.t_end, self.t0, self.z0, self.theta, self.const,
                    self.ctl)
        return children, (self._solve, self._unravel)

    @classmethod
    def tree_unflatten(cls, aux, children):
        solve, unravel = aux
        return cls(*children, solve=solve, unravel=unravel)

    @property
    def t_start(self):
        return self.record.start

    @property
    def num_kept(self):
        return jnp.sum(jnp.isfinite(self.record.s))

    @property
    def complete(self):
        return self.record.start == self.t0

    def evaluate(self, t):
        """The state at time(s) ``t``, from the stored steps' continuous extension.

        Args:
          t: a time, or an array of times (any shape), anywhere in ``[t_start, t_end]``.

        Returns:
          The state, with the structure of ``y0`` and each leaf's shape prefixed by
          ``t``'s shape; NaN at the times outside ``[t_start, t_end]``. Differentiable in
          reverse mode with respect to ``y0``, the parameters, ``ts[0]`` and ``t`` (each
          time costs one more integration from ``t0`` to it, and its adjoint: see the
          module docs); the derivative at a time outside the span is NaN.

        Example:
          >>> import jax, jax.numpy as jnp, solvers
          >>> def y_at(k, t):
          ...     _, info = solvers.odeint(lambda y, t, k: -k * y, 1.0,
          ...                              jnp.array([0.0, 2.0]), k, dense=64,
          ...                              full_output=True)
          ...     return info.solution.evaluate(t)
          >>> print(round(float(jax.grad(y_at)(0.5, 1.0)), 5))  # d/dk exp(-k) = -exp(-k)
          -0.60653
        """
        dtype = self.z0.dtype
        t = jnp.asarray(t, dtype)
        # shard_map: the times vary with the solution (odeint's own inputs do) before
        # they enter the rule, so each device's cotangent of a time shared by the mesh is
        # its own, summed once where JAX transposes this cast.
        t = _sharding.vary_like(t, self.z0)
        shape = t.shape
        flat = _evaluate(self._solve, self.record, self.t_end, self.t0, self.z0, self.theta,
                         self.const, self.ctl, t.reshape(-1))
        ys = jax.vmap(self._unravel)(flat)
        return jax.tree.map(lambda leaf: leaf.reshape(shape + leaf.shape[1:]), ys)

    def __repr__(self):
        return f"ODESolution(steps kept: {self.record.s.shape[-1]} slots)"


def _inside(record, t_end, t):
    return (t >= record.start) & (t <= t_end)


# Jitted, as is the backward pass below: called eagerly (``evaluate`` outside any
# ``jit``, or ``jax.jacrev`` of it) each is then one compiled program, where JAX would
# otherwise dispatch (and compile) its operations one by one, the backward integration's
# among them (the ODE page's ``jax.jacrev`` example: 13.1 -> 8.3 s, idle 2-core CPU).
# Inside a ``jit`` they are inlined as before.
@jax.jit
def _values(record, t_end, t0, z0, t):
    y = jax.vmap(lambda tt: _integrate.interpolate(record, tt))(t)
    # No step taken (t_end == t0): the state is z0 there.
    y = jnp.where(((t == t0) & (record.start == t0))[:, None], z0, y)
    return jnp.where(_inside(record, t_end, t)[:, None], y, jnp.nan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _evaluate_rule(solve, record, t_end, t0, z0, theta, const, ctl, t):
    return _values(record, t_end, t0, z0, t)


def _evaluate(solve, record, t_end, t0, z0, theta, const, ctl, t):
    return _evaluate_rule(solve, record, t_end, t0, z0, theta, const, ctl, t)


def _fwd(solve, record, t_end, t0, z0, theta, const, ctl, t):
    y = _values(record, t_end, t0, z0, t)
    return y, (record, t_end, t0, z0, theta, const, ctl, t)


@functools.partial(jax.jit, static_argnums=0)
def _bwd(solve, res, g):
    record, t_end, t0, z0, theta, const, ctl, t = res
    dtype = z0.dtype
    inside = _inside(record, t_end, t)
    # At t0 itself, integrate over a span of a few ulps of the times (y and its
    # derivatives are y0's to round-off); outside the span, to its end (then dropped).
    eps = jnp.finfo(dtype).eps
    after_t0 = t0 + 16 * eps * jnp.maximum(jnp.abs(t0), jnp.abs(t_end - t0))
    t_end_ok = jnp.where(jnp.isfinite(t_end), t_end, after_t0)
    te = jnp.clip(jnp.where(inside, t, t_end_ok), after_t0, jnp.maximum(t_end_ok, after_t0))
    g_used = jnp.where(inside[:, None], g, 0)

    def one(te_k, g_k):
        def y_at(z0, t0, te, theta):
            zs, stats = solve(z0, jnp.stack([t0, te]), theta, const, ctl)[:2]
            return zs[1], stats.status

        _, vjp, status = jax.vjp(y_at, z0, t0, te_k, theta, has_aux=True)
        return vjp(g_k), status

    # (one integration per time: batched, or one after another for a whole state
    # sharded over an Explicit mesh, whose loops cannot be vmapped there)
    (z0_bar, t0_bar, t_bar, theta_bar), status = _sharding.map_like(
        one, (te, g_used), (z0, record, theta))
    ok = status == _status.CONVERGED
    # A cotangent on a value outside the span (NaN) has no derivative: NaN, not zero.
    wanted = jnp.any(g != 0, axis=1)
    bad = (~inside | ~ok) & wanted

    def nan_if(v):  # the unwanted times contribute nothing (even a NaN), the bad NaN
        shape = bad.shape + (1,) * (v.ndim - 1)
        v = jnp.where(wanted.reshape(shape), v, 0)
        return jnp.where(bad.reshape(shape), jnp.nan, v)
    z0_bar = jnp.sum(nan_if(z0_bar), axis=0)
    t0_bar = jnp.sum(nan_if(t0_bar), axis=0)
    t_bar = nan_if(t_bar)
    theta_bar = jax.tree.map(lambda v: jnp.sum(nan_if(v), axis=0), theta_bar)
    return None, None, t0_bar, z0_bar, theta_bar, None, None, t_bar


_evaluate_rule.defvjp(_fwd, _bwd)
