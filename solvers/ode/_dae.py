"""Index-1 DAEs ``M y' = f(y, t)`` with a constant, possibly singular mass matrix ``M``.

``M = U S Vᵀ`` (SVD, at trace time, in NumPy): with ``r`` its rank, the rows ``U0ᵀ`` of
the left null space pick the algebraic equations ``U0ᵀ f(y, t) = 0``, the columns ``V0``
of the right null space the algebraic variables, and ``U1, S1, V1`` the differential
part: ``S1 V1ᵀ y' = U1ᵀ f``. The DAE is of index 1 where the algebraic block
``A = U0ᵀ (∂f/∂y) V0`` is nonsingular; then the slope is determined by the state:
``y' = V1 S1⁻¹ U1ᵀ f - V0 A⁻¹ U0ᵀ (∂f/∂y · V1 S1⁻¹ U1ᵀ f + ∂f/∂t)`` (the algebraic
equations differentiated once). A diagonal ``M`` (the usual ``diag(1, …, 1, 0, …, 0)``)
is split exactly: its zero entries are the algebraic equations and variables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from implicit import _sharding

__all__ = ["Mass", "prepare_mass", "slope", "consistent"]

#: Newton iterations at most for ``init="consistent"``.
INIT_MAXITER = 20
#: ... converged when the weighted RMS norm of the last correction is below this.
INIT_TOL = 1e-6


class Mass:
    """A constant mass matrix over the raveled state, split at trace time (hashable: a
    static argument).

    Attributes: ``matrix`` (``(n, n)`` float64), ``rank``, ``diagonal`` (whether ``M`` is
    diagonal: then ``diag`` holds its diagonal), ``U1, S1, V1, U0, V0`` (the split above,
    NumPy float64; ``U0``/``V0`` have ``n - rank`` columns).
    """

    def __init__(self, matrix):
        M = np.asarray(matrix, np.float64)
        n = M.shape[0]
        self.matrix, self.n = M, n
        self.diagonal = not np.any(M - np.diag(np.diag(M)))
        if self.diagonal:
            d = np.diag(M)
            on = d != 0
            eye = np.eye(n)
            self.diag = d
            self.U1, self.S1, self.V1 = eye[:, on] * np.sign(d[on]), np.abs(d[on]), eye[:, on]
            self.U0 = self.V0 = eye[:, ~on]
        else:
            U, s, Vt = np.linalg.svd(M)
            cut = n * np.finfo(np.float64).eps * (s[0] if s.size else 0.0)
            r = int(np.sum(s > cut))
            self.U1, self.S1, self.V1 = U[:, :r], s[:r], Vt[:r].T
            self.U0, self.V0 = U[:, r:], Vt[r:].T
            self.diag = None
        self.rank = self.S1.size
        self._key = (n, M.tobytes())

    @property
    def singular(self):
        return self.rank < self.n

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, Mass) and self._key == other._key

    def __repr__(self):
        return f"Mass(n={self.n}, rank={self.rank}, diagonal={self.diagonal})"

    def times(self, v):
        """``M v`` (``v`` a vector of the state's dtype)."""
        if self.diagonal:
            return jnp.asarray(self.diag, v.dtype) * v
        return _sharding.matmul(jnp.asarray(self.matrix, v.dtype), v)

    def arrays(self, dtype):
        """``(U1, S1, V1, U0, V0)`` as arrays of ``dtype``."""
        return tuple(jnp.asarray(a, dtype) for a in (self.U1, self.S1, self.V1, self.U0,
                                                     self.V0))


def prepare_mass(mass, n, method):
    """``odeint``'s ``mass=`` checked and prepared: a :class:`Mass` (or ``None``)."""
    if mass is None:
        return None
    if method != "bdf":
        raise ValueError(
            f"mass= (a mass matrix: M y' = f(y, t, *args), DAEs) is supported by "
            f"method='bdf' only, not method={method!r}: pass method=\"bdf\""
        )
    if isinstance(mass, jax.core.Tracer):
        raise ValueError(
            "mass= must be a concrete (n, n) array (NumPy, or a JAX array outside jit): "
            "it is split into differential and algebraic parts when odeint is traced. Got "
            "a traced value; build it with NumPy, or pass it from outside the jitted "
            "function"
        )
    try:
        import scipy.sparse as sp

        if sp.issparse(mass):
            mass = mass.toarray()
    except ImportError:  # pragma: no cover
        pass
    try:
        M = np.asarray(mass)
    except Exception as err:  # (a pytree, an object)
        raise ValueError(f"mass= must be an (n, n) array, got {type(mass).__name__}") from err
    if M.dtype == object or not (np.issubdtype(M.dtype, np.floating)
                                 or np.issubdtype(M.dtype, np.integer)
                                 or M.dtype == bool):
        raise ValueError(f"mass= must be a real (n, n) array, got dtype {M.dtype}")
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(
            f"mass= must be a square (n, n) matrix over the raveled state, got shape "
            f"{M.shape}"
        )
    if M.shape[0] != n:
        raise ValueError(
            f"mass= has shape {M.shape}, but the raveled state (y0, in ravel_pytree "
            f"order) has {n} elements: expected ({n}, {n})"
        )
    if not np.all(np.isfinite(M.astype(np.float64))):
        raise ValueError("mass= must be finite (it contains NaN or inf)")
    return Mass(M)


def _directional(rhs, y, t, dirs, dts):
    """``∂f/∂y · dirs[i] + ∂f/∂t · dts[i]`` for every row ``i``."""
    return jax.vmap(lambda v, dt: jax.jvp(rhs, (y, t), (v, dt))[1])(dirs, dts)


def algebraic_block(mass, rhs, y, t):
    """``A = U0ᵀ (∂f/∂y) V0`` at ``(y, t)``, ``(m, m)``: ``m`` jvps."""
    dtype = y.dtype
    _, _, _, U0, V0 = mass.arrays(dtype)
    m = V0.shape[1]
    cols = _directional(rhs, y, t, V0.T, jnp.zeros((m,), dtype))  # (m, n): J V0, rows
    return _sharding.matmul(cols, U0).T


def slope(mass, rhs, y, t):
    """The consistent slope ``y'`` at ``(y, t)`` (module docstring): ``M y' = f`` on the
    differential equations, the algebraic ones differentiated once. ``m + 1`` jvps and an
    ``(m, m)`` solve (``m = n - rank``); ``M⁻¹ f`` for a nonsingular ``M``."""
    dtype = y.dtype
    U1, S1, V1, U0, V0 = mass.arrays(dtype)
    f = rhs(y, t)
    yd = _sharding.matmul(V1, _sharding.matmul(U1.T, f) / S1)
    if not mass.singular:
        return yd
    m = V0.shape[1]
    dirs = jnp.concatenate([yd[None], V0.T])
    dts = jnp.zeros((m + 1,), dtype).at[0].set(1.0)
    out = _directional(rhs, y, t, dirs, dts)
    r = _sharding.matmul(U0.T, out[0])
    A = _sharding.matmul(out[1:], U0).T
    return yd - _sharding.matmul(V0, jnp.linalg.solve(A, r))


def index_one(A):
    """Whether the algebraic block ``A`` is numerically nonsingular (an index-1 point)."""
    s = jnp.linalg.svd(A, compute_uv=False)
    m = A.shape[0]
    eps = jnp.finfo(A.dtype).eps
    return jnp.all(jnp.isfinite(s)) & (s[-1] > 100 * m * eps * s[0])


def consistent(mass, rhs, y0, t0, rtol, atol):
    """Consistent initial values: ``y0`` with its algebraic part (``V0``) moved so that
    the algebraic equations ``U0ᵀ f(y, t0) = 0`` hold, by Newton's method.

    Returns ``(y, index1, converged)``. The result's derivatives (with respect to ``y0``,
    ``t0`` and what ``rhs`` closes over) are the implicit function theorem's, exact at the
    solution found: ``y = y0 + V0 w*`` with ``w*`` held, minus ``x - stop_gradient(x)``,
    ``x = V0 A⁻¹ U0ᵀ f(y)`` (zero in value, its derivative that of ``w``).
    """
    if not mass.singular:
        return y0, jnp.bool_(True), jnp.bool_(True)
    dtype = y0.dtype
    _, _, _, U0, V0 = mass.arrays(dtype)
    sg = jax.lax.stop_gradient
    ys, ts = sg(y0), sg(t0)

    def g(y):
        return _sharding.matmul(U0.T, rhs(y, ts))

    def newton(y):
        A = algebraic_block(mass, rhs, y, ts)
        return y - _sharding.matmul(V0, jnp.linalg.solve(A, g(y)))

    A0 = algebraic_block(mass, rhs, ys, ts)
    index1 = index_one(A0)

    def cond(st):
        it, _, dn = st
        return (it < INIT_MAXITER) & ~(dn <= INIT_TOL) & ((it == 0) | jnp.isfinite(dn))

    def body(st):
        it, y, _ = st
        y_new = newton(y)
        scale = atol + rtol * jnp.abs(y_new)
        dn = jnp.sqrt(jnp.mean(((y_new - y) / scale) ** 2))
        return it + 1, y_new, dn

    st = (jnp.zeros((), jnp.int32), ys, jnp.asarray(jnp.inf, dtype))
    st = jax.lax.while_loop(cond, body, st)
    y_star = sg(st[1])
    converged = (st[2] <= INIT_TOL) & jnp.all(jnp.isfinite(y_star))
    # The derivative: w held at w*, the differential part following y0.
    w = _sharding.matmul(V0.T, y_star - ys)
    y = y0 + _sharding.matmul(V0, w)
    A = sg(algebraic_block(mass, rhs, y_star, ts))
    x = _sharding.matmul(V0, jnp.linalg.solve(A, _sharding.matmul(U0.T, rhs(y, t0))))
    y = y - (x - sg(x))
    return y, index1, converged
