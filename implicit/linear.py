"""Adjoint linear solvers: the linear systems of the implicit function theorem.

Every solver here solves ``matvec(x) = b`` for ``x``, where ``matvec`` is a linear
function on pytrees (``b`` and ``x`` share a structure). All but ``"dense"`` are
matrix-free: they only call ``matvec``. :func:`solve` wraps the chosen method in
:func:`jax.lax.custom_linear_solve`, so every solve (a user's callable included) is
differentiable to any order and transposable, which the ``rule="jvp"`` engine needs.

Methods (``linear_solver=``):

- ``"gmres"``: restarted GMRES (default; any nonsingular system).
- ``"bicgstab"``: BiCGSTAB (any nonsingular system, short recurrences).
- ``"cg"``: conjugate gradients (symmetric positive-definite systems only).
- ``"dense"``: materialises the matrix and uses an LU solve (small systems).
- ``"neumann"``: the JAX notebook's fixed-point iteration on the adjoint. For a root
  residual ``F(x) = f(x) - x`` of a contraction ``f`` the system is
  ``(J - I) x = b``, and the iteration ``x <- x + matvec(x) - b`` is the Neumann series
  ``x = -(b + J b + J^2 b + ...)``. Converges when the spectral radius of ``J`` is
  below one; it stops at its tolerance, at ``max_steps`` or at its rounding floor, and
  a result more than 10x off its tolerance is NaN (never a silent wrong value).
- ``"diagonal"``: the exact solve ``x = b / matvec(1)`` of a *diagonal* system (an
  elementwise residual, as in the bracketed solvers): one ``matvec``. Its convergence
  check is elementwise, so one failed element leaves the others' derivatives intact.
- ``"jfb"``: Jacobian-free backpropagation: approximates the system matrix by ``-I``
  (i.e. ``(I - J)^{-1} ~ I`` for fixed points), so ``x = -b``. Cheap and approximate.
- a callable ``(matvec, b) -> x``.

Tolerances: a solve stops when ``norm(matvec(x) - b) <= atol + rtol * norm(b)``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jax.scipy.sparse import linalg as jsp_linalg

from implicit import _lu, _sharding
from implicit._reduce import all_

__all__ = ["LINEAR_SOLVERS", "LINEAR_METHODS", "solve", "refined", "REFINE_STEPS"]

#: Names accepted by ``linear_solver=``. ``LINEAR_METHODS`` are the ones that are exact
#: linear maps of ``b`` (usable in the forward-mode ``rule="jvp"``).
LINEAR_SOLVERS = ("gmres", "bicgstab", "cg", "dense", "diagonal", "neumann", "jfb")
LINEAR_METHODS = ("gmres", "bicgstab", "cg", "dense", "diagonal")


def _vdot(a, b):
    # An elementwise product and a sum, not jnp.vdot: a reduction over a sharded axis
    # needs no output sharding on an Explicit mesh, a contraction does.
    return sum(jnp.sum(jnp.conj(x) * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _norm(a):
    return jnp.sqrt(jnp.maximum(_vdot(a, a).real, 0.0))


def _axpy(alpha, x, y):
    return jax.tree.map(lambda xi, yi: alpha * xi + yi, x, y)


def _gmres(matvec, b, rtol, atol, max_steps, restart=10):
    """Restarted GMRES on a flat vector: Arnoldi with classical Gram-Schmidt (a second
    pass when needed), Givens rotations for a running residual estimate, early exit
    inside a cycle as soon as the estimate meets the tolerance. A short restart keeps
    the orthogonalisation cheap: the adjoint systems here are well conditioned."""
    n = b.shape[0]
    m = min(restart, n)
    dtype = b.dtype
    bound = atol + rtol * jnp.linalg.norm(b)
    rows = jnp.arange(m + 1)

    def cycle(x):
        r = b - matvec(x)
        beta = jnp.linalg.norm(r)
        # Broadcast from b: on an Explicit mesh the basis keeps b's sharding.
        basis = jnp.broadcast_to(jnp.zeros_like(b), (m + 1, n))
        basis = basis.at[0].set(r / jnp.where(beta > 0, beta, 1))
        hess = jnp.zeros((m + 1, m), dtype)  # Hessenberg matrix, rotated to triangular
        g = jnp.zeros(m + 1, dtype).at[0].set(beta)

        def not_done(c):
            j, _, _, _, g = c
            return (j < m) & (jnp.abs(g[j]) > bound)

        def arnoldi_step(c):
            j, basis, hess, rot, g = c
            w = matvec(basis[j])
            mask = rows <= j
            w_norm = jnp.linalg.norm(w)
            rep = _sharding.replicated(basis, w)  # Explicit meshes: n may be sharded

            def gram_schmidt(w):  # (w's coefficients on the basis, w less its projection)
                h = jnp.where(mask, _sharding.matmul(basis, w, out_sharding=rep), 0.0)
                return h, w - _sharding.matmul(h, basis)

            h, w = gram_schmidt(w)
            # A second Gram-Schmidt pass where the first cancelled much of w (DGKS):
            # computed always and selected (a conditional syncs with the host on a GPU).
            h2, w2 = gram_schmidt(w)
            h2 = h + h2
            again = jnp.linalg.norm(w) < 0.7 * w_norm
            h, w = jnp.where(again, h2, h), jnp.where(again, w2, w)
            h_norm = jnp.linalg.norm(w)
            basis = basis.at[j + 1].set(w / jnp.where(h_norm > 0, h_norm, 1))
            h = h.at[j + 1].set(h_norm)

            # The earlier rotations at once: rot is their product (identity past row j),
            # so one small matrix-vector product, not a loop of j trips (host syncs on
            # a GPU).
            h = _sharding.matmul(rot, h)
            a, bb = h[j], h[j + 1]
            radius = jnp.sqrt(a * a + bb * bb)
            radius = jnp.where(radius > 0, radius, 1)
            c_j, s_j = a / radius, bb / radius
            h = h.at[j].set(c_j * a + s_j * bb).at[j + 1].set(0.0)
            g = g.at[j + 1].set(-s_j * g[j]).at[j].set(c_j * g[j])
            rot_j, rot_j1 = rot[j], rot[j + 1]
            rot = rot.at[j].set(c_j * rot_j + s_j * rot_j1)
            rot = rot.at[j + 1].set(-s_j * rot_j + c_j * rot_j1)
            return j + 1, basis, hess.at[:, j].set(h), rot, g

        j, basis, hess, _, g = _sharding.while_loop(
            not_done, arnoldi_step, (jnp.int32(0), basis, hess, jnp.eye(m + 1, dtype=dtype), g)
        )
        used = jnp.arange(m) < j
        tri = jnp.where(used[:, None] & used[None, :], hess[:m], jnp.eye(m, dtype=dtype))
        y = jax.scipy.linalg.solve_triangular(tri, jnp.where(used, g[:m], 0.0), lower=False)
        return x + _sharding.matmul(y, basis[:m]), jnp.abs(g[j]), j

    def outer_cond(c):
        _, residual, steps = c
        return (residual > bound) & (steps < max_steps)

    def outer_body(c):
        x, _, steps = c
        x, residual, j = cycle(x)
        return x, residual, steps + jnp.maximum(j, 1)

    init = (jnp.zeros_like(b), jnp.asarray(jnp.inf, dtype), jnp.int32(0))
    return _sharding.while_loop(outer_cond, outer_body, init)[0]


def _bicgstab(matvec, b, rtol, atol, max_steps):
    return jsp_linalg.bicgstab(matvec, b, tol=rtol, atol=atol, maxiter=max_steps)[0]


def _cg(matvec, b, rtol, atol, max_steps):
    return jsp_linalg.cg(matvec, b, tol=rtol, atol=atol, maxiter=max_steps)[0]


def _dense(matvec, b, rtol, atol, max_steps):
    del rtol, atol, max_steps
    b_flat, unravel = ravel_pytree(b)

    def matvec_flat(v):
        return ravel_pytree(matvec(unravel(v)))[0]

    eye = _sharding.vary_like(jnp.eye(b_flat.size, dtype=b_flat.dtype), b_flat)  # shard_map
    # (each column's input split like b on an Explicit mesh, as the matvec expects)
    columns = jax.vmap(lambda e: matvec_flat(_sharding.split_like(e, b_flat)))(eye)
    # One LU of the augmented [A | b]: no row permutation to form (on CPU a loop of n
    # small steps, 4.4 us at n = 64), as a one-off solve needs none.
    return unravel(_lu.factor_solve(columns.T, b_flat)[0])


def _diagonal(matvec, b, rtol, atol, max_steps):
    del rtol, atol, max_steps
    return b / matvec(jnp.ones_like(b))


#: Neumann steps per loop trip on GPU/TPU, where every trip syncs its predicate with the
#: host (about 20 us on an H100, more than a small step costs): the residual is tested
#: after the last of them, so a solve may take up to this many - 1 steps more than it
#: needed (each only contracts the error further). One on CPU.
NEUMANN_STEPS_PER_TRIP_ON_ACCELERATOR = 8


#: Neumann steps without a new smallest residual after which the iteration has reached
#: its rounding floor and stops (see :func:`_neumann`).
NEUMANN_STALL = 64
#: How far above its tolerance a solve's residual may be and pass (:func:`converged`,
#: :func:`_neumann`); ``DENSE_SLACK`` for ``"dense"`` (see :func:`converged`).
SLACK = 10
DENSE_SLACK = 1000


def _neumann(matvec, b, rtol, atol, max_steps):
    """The Neumann iteration until its residual meets the tolerance, ``max_steps``, or
    :data:`NEUMANN_STALL` steps without a new smallest residual (its rounding floor,
    about ``eps / (1 - ρ)`` relative for a spectral radius ``ρ``: above float32's
    tolerance as ``ρ`` nears 1). Its result passes within :data:`SLACK` times the
    tolerance, as :func:`converged` passes iterative solves, else it is NaN."""
    bound = atol + rtol * _norm(b)
    every = NEUMANN_STEPS_PER_TRIP_ON_ACCELERATOR if _sharding.on_accelerator() else 1

    # The scalars travel as one vector (residual norm, smallest so far, steps since it):
    # one kernel updates them per trip, not one per scalar (compile time, and launches).
    def cond(carry):
        _, k, (err, _, since) = carry
        return (err > bound) & (k < max_steps) & ~jnp.isnan(err) & (since < NEUMANN_STALL)

    def body(carry):
        x, k, (_, best, since) = carry
        for _ in range(every):
            r = jax.tree.map(jnp.subtract, matvec(x), b)  # r = A x - b
            x = jax.tree.map(jnp.add, x, r)
        err = _norm(r)
        lower = err < best
        scalars = jnp.stack([err, jnp.where(lower, err, best), jnp.where(lower, 0, since + every)])
        return x, k + every, scalars

    x0 = jax.tree.map(jnp.negative, b)
    inf = jnp.asarray(jnp.inf, bound.dtype)
    x, _, (err, _, _) = _sharding.while_loop(
        cond, body, (x0, 0, jnp.stack([inf, inf, jnp.zeros_like(inf)]))
    )
    ok = err <= SLACK * bound
    return jax.tree.map(lambda v: jnp.where(ok, v, jnp.nan), x)


def _jfb(matvec, b, rtol, atol, max_steps):
    del matvec, rtol, atol, max_steps
    return jax.tree.map(jnp.negative, b)


_METHODS: dict[str, Callable] = {
    "gmres": _gmres,
    "bicgstab": _bicgstab,
    "cg": _cg,
    "dense": _dense,
    "diagonal": _diagonal,
    "neumann": _neumann,
    "jfb": _jfb,
}


def solve(linear_solver, matvec, b, *, rtol, atol, max_steps=None, transpose_solver=None):
    """Solve ``matvec(x) = b`` with the named method, differentiably.

    Args:
      linear_solver: a name in :data:`LINEAR_SOLVERS` or a callable ``(matvec, b) -> x``.
      matvec: a linear function on pytrees shaped like ``b``.
      b: the right-hand side (a pytree of arrays).
      rtol, atol: relative and absolute tolerances on the residual norm.
      max_steps: cap on iterations of the iterative methods (default: ``10 * size``,
        at least 200).
      transpose_solver: a callable ``(matvec, b) -> x`` for the transposed system, used
        where the solve is transposed (reverse mode through it); by default
        ``linear_solver`` with the transposed product.

    Returns:
      ``x`` with the structure of ``b``.

    Example:
      >>> import jax.numpy as jnp
      >>> A = jnp.array([[3.0, 1.0], [1.0, 2.0]])
      >>> x = solve("gmres", lambda v: A @ v, jnp.array([1.0, 0.0]), rtol=1e-6, atol=0.0)
      >>> bool(jnp.allclose(A @ x, jnp.array([1.0, 0.0]), atol=1e-5))
      True
    """
    # Work on one flat vector: custom_linear_solve's transpose needs every leaf of the
    # right-hand side to depend on the tangents, which a pytree with a constant-zero part
    # (e.g. an unknown that the parameters do not enter) would break.
    b_flat, unravel = ravel_pytree(b)

    def matvec_flat(v):
        return ravel_pytree(matvec(unravel(v)))[0]

    raw = _flat_method(linear_solver, unravel, rtol, atol, max_steps, b_flat.size)
    raw_t = raw if transpose_solver is None else _flat_method(
        transpose_solver, unravel, rtol, atol, max_steps, b_flat.size)
    x_flat = jax.lax.custom_linear_solve(
        matvec_flat, b_flat, solve=raw, transpose_solve=raw_t, symmetric=linear_solver == "cg"
    )
    return unravel(x_flat)


def _flat_method(linear_solver, unravel, rtol, atol, max_steps, size):
    """``(matvec_flat, b_flat) -> x_flat`` for a name in :data:`LINEAR_SOLVERS` or a
    callable (which sees pytrees shaped by ``unravel``). ``max_steps`` None: 10 x
    ``size``, within [200, 2000]. A right-hand side with a NaN or inf gives NaN (every
    entry but for ``"diagonal"``, elementwise by nature): a Krylov loop stopped at once
    there (its residual test is False) and returned its zero start, and a callable may do
    the same; an upstream NaN cotangent must stay NaN, and the ``rule="jvp"`` failure
    scale (a NaN factor) must reach reverse mode through the transposed solve."""
    if callable(linear_solver):

        def raw(mv_flat, rhs_flat):
            def mv(v):  # the user's solver sees pytrees shaped like b
                return unravel(mv_flat(ravel_pytree(v)[0]))

            return ravel_pytree(linear_solver(mv, unravel(rhs_flat)))[0]

    else:
        steps = max_steps if max_steps is not None else max(200, min(10 * size, 2000))
        method = _METHODS[linear_solver]

        def raw(mv_flat, rhs_flat):
            return method(mv_flat, rhs_flat, rtol, atol, steps)

        if linear_solver == "diagonal":
            return raw

    def solve_(mv_flat, rhs_flat):
        x = raw(mv_flat, rhs_flat)
        return jnp.where(all_(jnp.isfinite(rhs_flat)), x, jnp.nan)

    return solve_


#: Refinement steps with a solver's approximate inverse before the configured solve takes
#: over (:func:`refined`). Newton's last Jacobian needs one or two; a chord iteration's
#: kept Jacobian contracts the adjoint error as fast as it contracted the forward one.
REFINE_STEPS = 8


def refined(p, fallback, *, rtol, atol, max_steps=None):
    """A ``linear_solver`` callable ``(matvec, b) -> x``: iterative refinement with an
    approximate inverse ``p`` (``p(v) ≈ A⁻¹ v`` on flat vectors), then ``fallback`` (a
    name in :data:`LINEAR_SOLVERS` or a callable) where that has not met the tolerance.

    ``x = p(b)``, then ``x <- x + p(b - A x)`` while ``norm(b - A x) > atol + rtol *
    norm(b)``, at most :data:`REFINE_STEPS` times: each step costs one ``matvec`` and
    one ``p``, and the error contracts by the spectral radius of ``I - p A``. Where it
    did not converge, ``fallback`` solves from scratch: a loop of at most one trip, so
    under ``vmap`` the elements that converged do not pay for it.
    """

    def solve_(matvec, b):
        b_flat, unravel = ravel_pytree(b)

        def mv(v):
            return ravel_pytree(matvec(unravel(v)))[0]

        bound = atol + rtol * jnp.linalg.norm(b_flat)

        def residual(x):
            r = b_flat - mv(x)
            return r, jnp.linalg.norm(r)

        def cond(c):
            _, _, r_norm, k = c
            return (r_norm > bound) & (k < REFINE_STEPS)

        def body(c):
            x, r, _, k = c
            x = x + p(r)
            return (x, *residual(x), k + 1)

        x = p(b_flat)
        x, _, r_norm, _ = _sharding.while_loop(cond, body, (x, *residual(x), jnp.int32(0)))

        def rescue(c):
            solve_flat = _flat_method(fallback, unravel, rtol, atol, max_steps, b_flat.size)
            return jnp.zeros((), bool), solve_flat(mv, b_flat)

        # (NaN fails the test: rescued too)
        _, x = _sharding.while_loop(lambda c: c[0], rescue, (~(r_norm <= bound), x))
        return unravel(x)

    return solve_


def _dtype(b):
    return jnp.result_type(*jax.tree.leaves(b))




def converged(linear_solver, matvec, b, x, *, rtol, atol):
    """Whether ``x`` solves ``matvec(x) = b`` to its tolerance (with :data:`SLACK`).

    ``"jfb"`` is an approximation by design and always passes; ``"neumann"`` passes when
    finite (its iteration computes its residual exactly and returns NaN when that missed
    the tolerance); ``"diagonal"`` is checked elementwise (``ok`` is then a pytree of bool
    arrays shaped like ``x``). These cost nothing; the others one ``matvec``. ``"dense"``
    gets :data:`DENSE_SLACK` instead: an LU solve's residual is at the rounding
    level of its matrix, above the tolerance where that is ill-conditioned (the gradient
    of a badly scaled fit, a condition number of 6e13: 14x), while a singular system's
    result, finite wherever rounding leaves its pivots non-zero, solves nothing (a
    residual near ``norm(b)``: an underdetermined least-squares fit). A right-hand side
    with a NaN or inf (an upstream NaN cotangent) passes: its NaN result is the caller's,
    not the solve's failure, and propagates as through JAX's own derivatives (which
    ``optax.apply_if_finite`` and the like rely on). Returns ``(ok, relative_residual)``,
    the residual ``inf`` where only finiteness is checked and it failed.
    """
    if linear_solver == "diagonal":
        ok = jax.tree.map(lambda v, bi: jnp.isfinite(v) | ~jnp.isfinite(bi), x, b)
        return ok, jax.tree.map(lambda v, o: jnp.where(o, 0.0, jnp.inf), x, ok)
    upstream = ~_all_finite(b)
    finite = _all_finite(x)
    if linear_solver == "neumann":
        return finite | upstream, jnp.where(finite, 0.0, jnp.inf).astype(_dtype(b))
    b_norm = jnp.sqrt(_vdot(b, b).real)
    r = jax.tree.map(jnp.subtract, matvec(x), b)
    r_norm = jnp.sqrt(_vdot(r, r).real)
    relative = r_norm / jnp.where(b_norm > 0, b_norm, 1)
    if linear_solver == "jfb":
        return jnp.bool_(True), relative
    slack = DENSE_SLACK if linear_solver == "dense" else SLACK
    return (finite & (r_norm <= slack * (atol + rtol * b_norm))) | upstream, relative


def _all_finite(tree):
    return all_(jnp.stack([all_(jnp.isfinite(v)) for v in jax.tree.leaves(tree)]))
