"""Roots ``F(x, *args) = 0``: Newton (dense or matrix-free), chord and Broyden, with line search.

All three methods take steps ``x <- x + t d`` with ``d ≈ -J⁻¹ F(x)`` and ``t`` from a
backtracking (Armijo) line search on ``|F|``. They differ in ``J``:

- ``"newton"``: the Jacobian at every iterate, dense (``jax.jacfwd`` and an LU solve) for
  small systems, matrix-free (Newton–Krylov: GMRES on ``jax.jvp``, with an
  Eisenstat–Walker forcing term) for large ones, so no ``n × n`` matrix is ever formed;
- ``"chord"``: the Jacobian of an earlier iterate, factorised once and kept while each
  step at least halves ``|F|``;
- ``"broyden"``: good Broyden rank-one updates of the initial Jacobian (limited memory,
  in product form: no transposed solve needed).

Chord and Broyden recompute the Jacobian when the memory is full or their direction
fails the line search; a direction from a fresh Jacobian that fails is a reported
failure (singular Jacobian, no decrease), never a NaN handed back without notice.

Newton's line search (a fresh Jacobian at every step) accepts full steps
non-monotonically, with a watchdog that bounds the steps after a failure (see
:func:`root`).

``"dogleg"`` globalises with a trust region instead of a line search (Powell's dogleg
on ``|F|²`` with a fresh dense Jacobian, as MINPACK's ``hybrj``): it also converges
where the Jacobian is singular away from the root.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from implicit import _checks, _lu, _sharding, linear
from implicit._reduce import all_
from solvers import _runner, _status

__all__ = ["root", "newton"]

#: The fewest unknowns at which the gradient of a dense ``"newton"`` or ``"chord"`` solve
#: with the ``"dense"`` adjoint refines with the forward pass's last factorisation;
#: below, the adjoint forms its own Jacobian (one batch of VJPs) and solves once (other
#: linear solvers, iterative or given, start from the refinement at every size).
#: Measured on CPU, value and gradient of the root benchmark's problem: reuse costs 7.1,
#: 32.0, 43.4, 59.5, 259 us of backward time at n = 16, 64, 96, 128, 256; the fresh dense
#: solve 5.7, 19.2, 35.1, 60-65, 358 (reuse pays for the factorisation's row
#: permutation, an n-step loop on CPU, and one or two refinements, which a fresh LU of
#: the augmented system does without).
REUSE_MIN_SIZE = 128

METHODS = ("newton", "chord", "broyden", "dogleg")
JACOBIANS = ("auto", "dense", "matfree")
#: ``jacobian="auto"`` materialises the Jacobian up to this many unknowns (an LU solve of
#: this size costs about as much as a few dozen matrix-free GMRES iterations).
DENSE_MAX_SIZE = 500

_ARMIJO = 1e-4  # sufficient decrease: |F(x + t d)| <= (1 - _ARMIJO t) |F(x)|
_MAX_BACKTRACKS = 20
#: Non-monotone line search: a full step is accepted when it lowers |F| below its largest
#: value over this many accepted iterates (Grippo, Lampariello & Lucidi), so that Newton's
#: full steps may cross a ridge of |F|. Measured with the robustness benchmark's problems
#: (MGH from 1x, 3x, 10x, 30x and 100x their starts, 110 cases; random tanh systems, seeds
#: 0-3, 400): solved with 3 / 4 / 5 / 6 / 7 / 8 / 10 iterates: MGH 84 / 87 / 86 / 87 / 84
#: / 85 / 85, tanh 393 / 395 / 394 / 394 / 397 / 390 / 389. A longer window lets Newton
#: wander among far, huge values of |F| (Chebyquad from 100x: |F| ~ 1e11 for 500 steps).
_WINDOW = 5
#: Newton's backtracking factor (chord and Broyden: the quadratic model's minimiser within
#: [0.1, 0.5] of the previous trial). Long backtracked steps keep the non-monotone
#: iteration exploring rather than settling into a local minimum of |F|: on 100 random
#: tanh(A x + b) = x (n = 30, A ~ N(0, 9/n)), seeds 0-3, the quadratic model in
#: [0.1, 0.5] solved 72, in [0.5, 0.5] 96/93/96/99, 0.6 98/97/98/96 (with a _WINDOW of 10;
#: of 5: 100/97/98/99).
_BACKTRACK = 0.6
_ETA_MAX = 0.1  # largest GMRES forcing term (relative residual of the Newton system)
_GMRES_MAX_STEPS = 200  # matrix-vector products per Newton–Krylov direction


def root(
    F,
    x0,
    *args,
    method="newton",
    has_aux=False,
    jacobian="auto",
    line_search=True,
    history_size=10,
    lower=None,
    upper=None,
    rtol=None,
    atol=None,
    x_scale=None,
    max_steps=100,
    rule="vjp",
    linear_solver="auto",
    on_failure="raise",
    full_output=False,
    check_every=None,
    jac_sparsity=None,
):
    """Find ``x*`` with ``F(x*, *args) == 0``, differentiable by the implicit function theorem.

    Each step solves ``J d = -F(x)`` (``J`` the Jacobian or its chord/Broyden
    approximation) and moves to ``x + t d``, where ``t`` halves (with quadratic
    interpolation) until ``|F|`` decreases enough. The solve stops when the estimated
    error of ``x + d`` is small in every unknown's own scale:
    ``max_i |d_i| / (atol + rtol |x_i|) <= 1`` (an unknown of 1e-7 is not judged by the
    tolerance of one of 1), scaled down by ``ρ / (1 - ρ)`` once two full steps show a
    contraction rate ``ρ < 1/2``;
    a small step from chord's or Broyden's stale Jacobian counts only if ``|F|`` at least
    halved over it (else the Jacobian is refreshed to decide: a stale approximation can
    give a tiny step far from a root). ``atol`` there is at most ``rtol`` times the
    unknowns' size (``max(max|x|, max|x0|)``, as MINPACK's ``xtol |D x|``): unknowns of
    1e-7 from a guess of 1e-5 are not settled by ``atol = 1e-10``. With a formed Jacobian
    (dense: ``newton``, ``chord``, ``broyden``, ``dogleg``; ``jac_sparsity``'s blocks:
    ``newton``; not matrix-free), the residual must also hold, equation by equation:
    ``|F_i(x)| <= sum_j |J_ij| (atol + rtol |x_j|)`` (that ``atol``), what a change of the
    unknowns within their tolerances can move ``F_i`` by, so a tiny step
    from an ill-conditioned ``J`` far from a root is not a solution, however ``F`` is
    scaled. A guess with ``F(x0) == 0`` is returned after zero steps.
    Gradients with respect to ``args`` and to traced values ``F`` closes over are
    ``-(∂F/∂x)⁻¹ ∂F/∂θ`` (one adjoint linear solve with ``linear_solver``); the
    iterations are never differentiated.

    Args:
      F: ``F(x, *args)`` returning a pytree with the structure, shapes and dtypes of ``x``
        (with ``has_aux=True``, a pair of that and any auxiliary pytree).
      x0: initial guess (pytree of arrays; ints are promoted to float).
      *args: parameters (pytrees of arrays), differentiated; leaves that are not
        arrays (an Equinox module's activation, a string) are held fixed.
      method: ``"newton"``, ``"chord"``, ``"broyden"`` or ``"dogleg"`` (trust region;
        dense Jacobian; ``line_search`` and ``history_size`` do not apply).
      has_aux: ``F`` returns ``(residual, aux)``; ``aux`` at the root is returned too
        (differentiable, through ``x*`` by the implicit function theorem).
      jacobian: ``"dense"`` (``jax.jacfwd`` and LU), ``"matfree"`` (GMRES on ``jax.jvp``;
        no Jacobian is formed) or ``"auto"`` (dense up to ``DENSE_MAX_SIZE`` (500)
        unknowns).
      line_search: backtrack along the direction until ``|F|`` decreases (``False``: full
        steps, cheapest when ``x0`` is known to be close, e.g. inside an implicit ODE step).
        Newton's search is non-monotone: its full step is accepted when ``|F|`` falls
        below its largest value over the last 5 iterates (backtracked ones, by a factor
        0.6, must lower ``|F|`` itself); where it finds no decrease, that full step is
        taken anyway. Where a fresh Jacobian then fails (singular, or no finite trial),
        a watchdog goes back to the previous iterate and bounds the steps by a trust
        radius (half the way back, then MINPACK's rules: halved after a step that
        achieves under a tenth of the linear model's decrease of ``|F|²``, at least
        twice a step that achieves half of it). The solve is ``stagnated`` when no step
        over the stagnation window reaches a ``|F|`` below the last 5 iterates' (a
        cycle, a rounding floor), not while it keeps finding such points. Chord's and
        Broyden's are monotone and unbounded.
      history_size: Broyden's memory (rank-one updates before the Jacobian is recomputed).
      lower, upper: optional box bounds (pytrees like ``x0`` whose leaves are scalars or
        shaped like ``x0``'s, or scalars; ``lower <= upper``, checked when they are
        concrete; both a ``ValueError`` otherwise): the guess and
        every trial point are projected into the box (e.g. to keep ``F`` in its domain).
        A root outside the box ends the solve as ``no_decrease``.
      rtol, atol: tolerances (defaults follow the dtype: 1e-5/1e-6 in float32,
        1e-8/1e-10 in float64, 4 eps/0.4 eps in
        float16 and bfloat16); the adjoint linear solve uses ``rtol / 10`` (its test is
        on the 2-norm of the whole residual).
      x_scale: the unknowns' typical sizes (as MINPACK's ``diag`` and SciPy's
        ``x_scale``; positive; a scalar, or a pytree like ``x0`` whose leaves are scalars or
        shaped like ``x0``'s): unknown ``i`` is then settled to ``atol * x_scale_i + rtol
        |x_i|``, in the step test and in the residual test, instead of the automatic
        ``min(atol, rtol max(max|x|, max|x0|))`` for all. Set it where the unknowns differ
        in size by orders of magnitude and some of them tend to 0 (``rtol |x_i|`` then
        vanishes and the common absolute part is too coarse for the small ones).
      rule: ``"vjp"`` or ``"jvp"`` (see :func:`implicit.custom_root`).
      linear_solver: adjoint linear solver (see :mod:`implicit.linear`); ``"auto"``
        (default): ``"dense"`` when the Jacobian is dense, ``"gmres"`` otherwise. With a
        dense Jacobian and ``method="newton"`` or ``"chord"`` (and, with
        ``linear_solver="dense"``, at least ``REUSE_MIN_SIZE`` (128) unknowns: below, the
        dense solve alone is cheaper), the adjoint system is
        first solved by iterative refinement with the forward pass's last factored
        Jacobian (Newton's is the root's to within the last step; the kept chord
        Jacobian contracts the adjoint's error as fast as it did the forward's): no
        Jacobian is formed for the gradient, and ``linear_solver`` runs only where the
        refinement does not converge. A backward solve that misses its tolerance
        follows ``on_failure``.
      on_failure: ``"raise"``, ``"nan"`` or ``"ignore"``.
      full_output: also return an :class:`solvers.Info`: ``converged``, ``num_steps``,
        ``residual`` (``max|F(x*)|``), ``residual_history`` (each step's error estimate:
        the scaled step above times ``atol + rtol * max|x|``) and ``status`` (why it
        stopped: ``converged``, ``max_steps``, ``nonfinite``, ``stagnated``, ``singular``
        or ``no_decrease``; see :data:`solvers.STATUSES`).
      check_every: steps per convergence test (``None``: 1, also on GPU/TPU: a step costs a
        Jacobian, more than the test's sync with the host). A solve may take up to
        ``check_every - 1`` steps more than it needs (and than ``max_steps``); the guess is
        still tested first.

      jac_sparsity: ``method="newton"`` only: the structure of the Jacobian, like
        ``scipy.integrate.solve_ivp``'s ``jac_sparsity``: a boolean ``(n, n)`` NumPy array
        or SciPy sparse matrix (True where an entry may be nonzero; ``n`` the size of the
        raveled ``x``), an int ``w`` (the band ``|i - j| <= w``), or ``"auto"``: read from
        ``F``'s jaxpr at trace time (every entry ``F`` could make nonzero, for any ``x``
        and ``args``: both branches of a ``where``, the zeros of a constant matrix kept;
        loops and other primitives it does not follow count as dense, and a pattern left
        mostly dense by them is an error naming them). The Jacobian is then
        computed by one ``jvp`` per colour of a greedy column colouring of the pattern, stored
        block tridiagonal after a reverse Cuthill–McKee reordering and factored by block cyclic
        reduction or block LU (pivoting within blocks only: for block diagonally dominant or
        symmetric positive definite Jacobians; a singular block gives a non-finite direction,
        the ``singular`` status), for every Newton step and for the implicit gradient's adjoint
        solve (``linear_solver="auto"``). Work and memory grow with ``n`` times the reordered
        band's width squared (resp. width), not ``n²``. ``jacobian`` must then be ``"auto"``.

    Returns:
      ``x*`` with the structure of ``x0``, or ``(x*, info)`` with ``full_output=True``;
      with ``has_aux``, ``(x*, aux)`` or ``(x*, aux, info)``.

    Example:
      >>> import jax, jax.numpy as jnp, solvers
      >>> F = lambda x, a: x ** 3 - a
      >>> g = jax.grad(lambda a: solvers.root(F, 1.0, a))(8.0)  # 1 / (3 x²) = 1/12
      >>> print(solvers.root(F, 1.0, 8.0), round(float(g), 7))
      2.0 0.0833333

      A tridiagonal system, ``2x_i - x_{i-1} - x_{i+1} + x_i³ = b_i``, with ``jac_sparsity=1``:

      >>> def G(x, b):
      ...     pad = jnp.pad(x, 1)
      ...     return 2 * x - pad[:-2] - pad[2:] + x ** 3 - b
      >>> x = solvers.root(G, jnp.zeros(1000), jnp.ones(1000), jac_sparsity=1)
      >>> print(float(jnp.max(jnp.abs(G(x, jnp.ones(1000))))) < 1e-5)
      True
    """
    opts = _runner.options(
        F, "F", rtol=rtol, atol=atol, max_steps=max_steps, on_failure=on_failure,
        full_output=full_output, rule=rule, linear_solver=linear_solver,
        check_every=check_every, check_every_on_accelerator=1,
    )
    _checks.check_choice(method, "method", METHODS)
    _checks.check_choice(jacobian, "jacobian", JACOBIANS)
    _checks.check_bool(line_search, "line_search")
    _checks.check_max_steps(history_size, "history_size")
    _checks.check_bool(has_aux, "has_aux")
    (F,), args = _checks.split_args((F,), args)
    x0 = _checks.as_floating(x0, "x0")
    size = sum(leaf.size for leaf in jax.tree.leaves(x0))
    structure = None
    if jac_sparsity is not None:
        if method != "newton":
            raise ValueError(f"jac_sparsity= is for method='newton', got method={method!r}")
        if jacobian != "auto":
            raise ValueError("jac_sparsity= sets how the Jacobian is formed: leave "
                             f"`jacobian` at 'auto', got jacobian={jacobian!r}")
        from solvers._sparse import structure as _structure

        structure = _structure(jac_sparsity, size, "jac_sparsity", fun=F, x=x0, args=args,
                               has_aux=has_aux)
        jacobian = "sparse"
        if linear_solver == "auto":
            linear_solver = _StructuredSolve(structure)
            opts = opts._replace(linear_solver=linear_solver)
    if jacobian == "auto":
        jacobian = "dense" if size <= DENSE_MAX_SIZE or method == "dogleg" else "matfree"
    if method == "dogleg" and jacobian != "dense":
        raise ValueError("method='dogleg' forms the Jacobian: it needs jacobian='dense' "
                         f"(or 'auto'), got jacobian={jacobian!r}")
    if linear_solver == "auto":
        opts = opts._replace(linear_solver="dense" if jacobian == "dense" else "gmres")
    # The adjoint refined with the forward's last factored Jacobian (see linear_solver);
    # the dense adjoint solve is cheaper below REUSE_MIN_SIZE unknowns.
    reuse = (jacobian == "dense" and method in ("newton", "chord") and opts.rule == "vjp"
             and not (opts.linear_solver == "dense" and size < REUSE_MIN_SIZE))
    dtype = jnp.result_type(*jax.tree.leaves(x0))
    # Unbounded: no projection at all (two loop-invariant ±inf vectors and a clip per step
    # fewer).
    bounded = lower is not None or upper is not None
    bounds = _checks.box_bounds(lower, upper, x0) if bounded else None
    scales = None if x_scale is None else _checks.scales(x_scale, x0, "x_scale")
    out = _runner.dispatch(
        _solve,
        x0,
        args,
        bounds,
        scales,
        *_checks.tolerances(rtol, atol, dtype),
        options=opts,
        F=F,
        fn=F,
        method=method,
        has_aux=has_aux,
        jacobian=jacobian,
        line_search=line_search,
        history_size=int(history_size),
        structure=structure,
        reuse=reuse,
        solver=f"solvers.root(method={method!r})",
    )
    return _runner.unpack_aux(out, has_aux, full_output)


class _StructuredSolve:
    """The adjoint linear solve with a :class:`solvers._sparse.Structure`: the operator's
    blocks from one product per colour (it is linear), factored, solved. (The structure is
    symmetrised, so it covers ``Jᵀ`` too.) Hashable: a static option."""

    #: How the engine's failure message names it.
    description = ("jac_sparsity's structured solve; a pattern that misses nonzero entries "
                   "of the Jacobian makes it miss too")
    #: Its blocks come from the products it is given alone (implicit.ift: no closure
    #: conversion needed).
    closes_over_traced_values = False

    def __init__(self, structure):
        self.structure = structure

    def __hash__(self):
        return hash(("structured", self.structure))

    def __eq__(self, other):
        return isinstance(other, _StructuredSolve) and other.structure == self.structure

    def __call__(self, matvec, b):
        b_flat, unravel = ravel_pytree(b)

        def mv(v):
            return ravel_pytree(matvec(unravel(v)))[0]

        s = self.structure
        factors = s.factor(s.jacobian(mv, jnp.zeros_like(b_flat)))
        return unravel(s.solve(factors, b_flat))


def newton(F, x0, *args, **options):
    """Newton's method with line search: :func:`root` with ``method="newton"``.

    Args:
      F: the function ``F(x, *args)`` whose root is sought, a pytree shaped like ``x``.
      x0: initial guess (a pytree of arrays); receives a zero gradient.
      *args: parameters (pytrees of arrays), differentiated; leaves that are not
        arrays are held fixed.
      **options: every keyword option of :func:`root` but ``method`` (``rtol``,
        ``atol``, ``max_steps``, ``line_search``, ``jac_sparsity``, ``rule``,
        ``linear_solver``, ``on_failure``, ``full_output``, ``has_aux``, ...).

    Returns:
      The root ``x*`` (structure of ``x0``), as :func:`root` returns it.

    Example:
      >>> import jax.numpy as jnp, solvers
      >>> F = lambda x, A, b: A @ x + x ** 3 - b
      >>> x = solvers.newton(F, jnp.zeros(2), jnp.eye(2), jnp.array([2.0, 10.0]))
      >>> print(x)
      [1. 2.]
    """
    if "method" in options:
        raise TypeError("solvers.newton() got an unexpected keyword argument 'method'")
    return root(F, x0, *args, method="newton", **options)


@_runner.jit_solver
def _solve(
    x0,
    args,
    bounds,
    x_scale,
    rtol,
    atol,
    *,
    F,
    method,
    has_aux,
    jacobian,
    line_search,
    history_size,
    options,
    solver,
    check,
    structure=None,
    reuse=False,
):
    F_aux = F
    F, out = _runner.main_output(F, "F", x0, args, has_aux)
    _checks.check_like(out, x0, "F(x0, *args)", "x0")

    if bounds is None:
        def project(v):
            return v
    else:
        lower, upper = (jax.lax.stop_gradient(ravel_pytree(b)[0]) for b in bounds)

        def project(v):
            return jnp.clip(v, lower, upper)

    def body(x0, args):
        x0_flat, unravel = ravel_pytree(x0)
        x0_flat = project(x0_flat)

        def fn(v):
            return ravel_pytree(F(unravel(v), *args))[0]

        tol = (rtol, atol, _runner.max_norm(x0_flat), _checks.flat_scales(x_scale, x0_flat.dtype))
        ops = _Linear(fn, jacobian, jnp.maximum(rtol, 8 * jnp.finfo(rtol.dtype).eps),
                      structure, tol)
        if method == "dogleg":
            runner_method = _dogleg(fn, project, *tol)
        else:
            runner_method = _method(fn, ops, *_METHODS[method](ops, history_size),
                                    line_search, rtol, atol, project,
                                    bounded=method == "newton")
        state, info = _runner.iterate(
            runner_method,
            x0_flat,
            rtol=rtol,
            atol=atol,
            max_steps=options.max_steps,
            record_history=options.full_output,
            check_every=options.check_every,
        )
        # A guess that is an exact root comes back unchanged after its zero-length step:
        # no step was taken.
        untouched = info.converged & jnp.all(state.x == x0_flat)
        info = info._replace(
            residual=_runner.max_norm(state.fx),
            num_steps=jnp.where(untouched, 0, info.num_steps),
        )
        if not reuse:
            return unravel(state.x), info
        factors = ops.reusable(state.quasi) if method == "newton" else state.quasi.factors
        return unravel(state.x), info, _adjoint_preconditioner(factors)

    x, info = _runner.solve(F, body, x0, args, rtol=rtol, options=options, check=check,
                            solver=solver, preconditioner=reuse)
    return _runner.with_aux(F_aux, x, args, info, has_aux)


def _adjoint_preconditioner(factors):
    """``v -> J⁻ᵀ v`` for the LU ``factors`` of a Jacobian ``J`` the forward pass formed
    (its last one), as a ``jax.tree_util.Partial``: the adjoint solve's preconditioner
    (:func:`implicit.custom_root`'s ``preconditioner``). Where that factorisation is not
    usable (a zero pivot or a non-finite entry: ``J`` singular at that iterate), the
    identity."""
    lu, permutation = factors
    usable = jnp.all(jnp.isfinite(lu))
    if permutation is not None:  # (LU factors; else the inverse, not finite if J is singular)
        usable = usable & jnp.all(jnp.diagonal(lu) != 0)
    return jax.tree_util.Partial(_apply_preconditioner, factors, usable)


def _apply_preconditioner(factors, usable, v):
    return jnp.where(usable, _lu.solve_transpose(factors, v), v)


class _State(NamedTuple):
    x: Any  # the iterate (flat)
    fx: Any  # F(x)
    status: Any  # RUNNING, or a failure status
    error: Any  # estimated error of x (the last step's length, scaled)
    scale: Any  # max|x|
    confirmed: Any  # whether that step can end the solve (see _method's step)
    f_start: Any  # |F| at the guess (-1 before the first step evaluated it)
    full_step: Any  # max|d| of the previous step if it was a full one (t = 1), else 0
    eta: Any  # matrix-free Newton: (previous forcing term, previous |F|); else None
    quasi: Any  # chord/Broyden: their own state (see _chord, _broyden); Newton: None
    f_window: Any  # |F| at the last _WINDOW accepted iterates (the non-monotone reference)
    f_best: Any  # the smallest |F| so far (a new one is progress for the runner)
    radius: Any  # Newton's step bound (2-norm; inf until a retreat sets it)
    improved: Any  # whether the last step made progress (see _method's step)
    x_back: Any  # Newton: the previous iterate, where a retreat goes (else None)
    fx_back: Any  # Newton: F there (else None)
    f_tol: Any  # per equation, the residual test's tolerance (_Linear.residual_tolerance)


def _norm(v):
    # An overflow (|F| > 1e19 in float32) gives inf, which the line search treats as a
    # failed trial: it shrinks the step.
    return jnp.sqrt(jnp.sum(v * v))


def _gmres(matvec, b, tol):
    # The engine's GMRES (restarted, early exit inside a cycle); an inexact direction is
    # fine: the line search and the next Newton step absorb the error.
    return linear.solve("gmres", matvec, b, rtol=tol, atol=0.0, max_steps=_GMRES_MAX_STEPS)


class _Linear(NamedTuple):
    """The Jacobian of ``fn`` as the methods use it: dense (LU) or matrix-free (GMRES)."""

    fn: Any
    jacobian: str  # "dense", "matfree" or "sparse" (a Structure: block elimination)
    eta_min: Any  # tightest GMRES forcing term
    structure: Any = None  # the solvers._sparse.Structure of jacobian="sparse"
    tol: Any = None  # (rtol, atol, max|x0|, x_scale or None): the tests' tolerances

    def residual_tolerance(self, x, jac):
        """Per equation, ``sum_j |J_ij| (atol + rtol' |x_j|)`` (``rtol' = max(rtol,
        16 eps)``, room for rounding): what a change of the unknowns within their own
        tolerances can move ``F_i`` by. A residual above it is not a solution, however
        small the step (an ill-conditioned ``J`` gives tiny Newton steps far from a
        root). ``jac``: the dense Jacobian, or (sparse) its blocks; ``inf`` where it is
        not formed (matrix-free)."""
        if jac is None or self.tol is None:
            return jnp.full_like(x, jnp.inf)
        if self.jacobian == "sparse":
            return _residual_tolerance(
                lambda w: self.structure.matvec(jnp.abs(jac), w), x, *self.tol)
        return _residual_tolerance(_abs_product(jac), x, *self.tol)

    def newton_step(self, x):
        """``(F(x), J(x)⁻¹ F(x), factors)``: ``J(x)`` factored as :meth:`reusable` takes it
        (dense: :func:`implicit._lu.factor_solve`'s, from one forward-mode pass; sparse: the
        block elimination; matrix-free: the point)."""
        if self.jacobian == "dense":
            jac, fx = jax.jacfwd(lambda v: (lambda y: (y, y))(self.fn(v)), has_aux=True)(x)
            step, factors = _lu.factor_solve(jac, fx)
            return fx, step, factors, self.residual_tolerance(x, jac)
        if self.jacobian == "sparse":
            s = self.structure
            blocks = s.jacobian(self.fn, x)
            fx, factors = self.fn(x), s.factor(blocks)
            return fx, s.solve(factors, fx), factors, self.residual_tolerance(x, blocks)
        fx = self.fn(x)
        return fx, self.apply_inverse(x, fx), x, self.residual_tolerance(x, None)

    def reusable(self, factors):
        """:meth:`newton_step`'s factors in the form :meth:`apply_inverse` takes (dense:
        the LU's permutation formed, once, where more solves follow)."""
        return _lu.with_permutation(factors) if self.jacobian == "dense" else factors

    def apply_inverse(self, factors, v):
        """``J⁻¹ v`` for the Jacobian :meth:`reusable` returned."""
        if self.jacobian == "dense":
            return _lu.solve(factors, v)
        if self.jacobian == "sparse":
            return self.structure.solve(factors, v)
        return _gmres(jax.linearize(self.fn, factors)[1], v, self.eta_min)

    def placeholder(self, x):
        if self.jacobian == "dense":  # zeros shaped as _lu.factor's factors (and as
            # factor_solve's: pivots and permutation are both (n,) int32)
            n = x.size
            shapes = jax.eval_shape(_lu.factor, jax.ShapeDtypeStruct((n, n), x.dtype))
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return x


def _newton(ops, history_size):
    """Newton: a fresh Jacobian at every step (matrix-free: Eisenstat–Walker forcing)."""
    del history_size

    def direction(state):
        x = state.x
        if ops.jacobian in ("dense", "sparse"):  # a factored Jacobian
            fx, step, factors, f_tol = ops.newton_step(x)
            kept = factors if ops.jacobian == "dense" else None  # (as newton_step's)
            return fx, -step, jnp.bool_(True), state.eta, kept, f_tol
        fx, matvec = jax.linearize(ops.fn, x)
        # Eisenstat–Walker (choice 2) forcing term: loose far from the root, tight near it.
        eta_prev, fnorm_prev = state.eta
        fnorm = _norm(fx)
        new = 0.9 * (fnorm / jnp.where(fnorm_prev > 0, fnorm_prev, 1.0)) ** 2
        safeguard = 0.9 * eta_prev**2
        new = jnp.where(safeguard > 0.1, jnp.maximum(new, safeguard), new)
        new = jnp.where(fnorm_prev > 0, jnp.clip(new, ops.eta_min, _ETA_MAX), _ETA_MAX)
        return (fx, -_gmres(matvec, fx, new), jnp.bool_(True), (new, fnorm), None,
                ops.residual_tolerance(x, None))

    def update(state, quasi, x, fx, d, moved, halved, small):
        return quasi  # dense: the last factored Jacobian (the adjoint's preconditioner)

    def init(x0):
        return ops.placeholder(x0) if ops.jacobian == "dense" else None

    return direction, update, init


class _Quasi(NamedTuple):
    d: Any  # the direction -H F(x) for the current iterate
    factors: Any  # the Jacobian at an earlier iterate (see _Linear.factor)
    s: Any  # Broyden: steps (history_size, n); chord: (0, n)
    u: Any  # Broyden: update vectors, H_{k+1} = (I + u_k s_kᵀ) H_k
    k: Any  # Broyden: number of stored updates
    refresh: Any  # recompute the Jacobian at the next step


def _quasi_direction(ops):
    """Reuse the kept direction, or refresh the Jacobian and compute a Newton direction
    (the first step always refreshes: it evaluates ``F`` at the guess with ``J``)."""

    def direction(state):
        q = state.quasi

        def refreshed(_):
            fx, step, factors, f_tol = ops.newton_step(state.x)
            return (fx, -step, ops.reusable(factors), jnp.zeros_like(q.s),
                    jnp.zeros_like(q.u), jnp.int32(0), f_tol)

        def kept(_):  # (the residual tolerance of the Jacobian's point)
            return state.fx, q.d, q.factors, q.s, q.u, q.k, state.f_tol

        # Under shard_map, a parameter that does not vary over the mesh is mixed with the
        # varying iterate inside `refreshed`; a vmapped cond (a select) would cast it to
        # varying first, which JAX 0.10 refuses there (see _sharding.cond_once). On an
        # Explicit mesh the cond works (the loop form fails there).
        fx, d, factors, s, u, k, f_tol = _sharding.cond_once(q.refresh, refreshed, kept,
                                                             None, explicit=False)
        return (fx, d, q.refresh, state.eta, q._replace(d=d, factors=factors, s=s, u=u, k=k),
                f_tol)

    return direction


def _apply_h(ops, q, v):
    """``H_k v`` with ``H_k = (I + u_{k-1} s_{k-1}ᵀ) ... (I + u_0 s_0ᵀ) J⁻¹``."""
    w = ops.apply_inverse(q.factors, v)
    if q.s.shape[0] == 0:  # chord
        return w
    body = lambda i, w: jnp.where(i < q.k, w + q.u[i] * _sharding.dot(q.s[i], w), w)  # noqa: E731
    return _sharding.fori_loop(0, q.s.shape[0], body, w)


def _chord(ops, history_size):
    """Chord: the Jacobian of an earlier iterate, kept while |F| at least halves."""
    del history_size

    def update(state, q, x, fx, d, moved, halved, small):
        d_next = -_apply_h(ops, q, fx)
        # Kelley's rule: a chord step that reduces |F| less than twofold is too slow, so
        # the Jacobian is recomputed (still one factorisation per few steps).
        refresh = ~moved | ~halved | small
        refresh = refresh | ~jnp.isfinite(_runner.max_norm(d_next))
        return q._replace(d=d_next, refresh=refresh)

    return _quasi_direction(ops), update, _initial_quasi(ops, 0)


def _broyden(ops, history_size):
    """Good Broyden: rank-one updates of the initial Jacobian's inverse (product form)."""
    eps = jnp.finfo(ops.eta_min.dtype).eps

    def update(state, q, x, fx, d, moved, halved, small):
        del halved
        z = _apply_h(ops, q, fx)  # H_k F(x_next)
        step = x - state.x
        hy = z + d  # H_k (F(x_next) - F(x)), as H_k F(x) = -d
        denom = _sharding.dot(step, hy)
        good = jnp.abs(denom) > eps * _norm(step) * _norm(hy)
        u_k = (step - hy) / jnp.where(good, denom, 1.0)
        d_next = -(z + u_k * _sharding.dot(step, z))
        keep = moved & good
        slot = jnp.minimum(q.k, q.s.shape[0] - 1)
        s = jnp.where(keep, q.s.at[slot].set(step), q.s)
        u = jnp.where(keep, q.u.at[slot].set(u_k), q.u)
        k = jnp.where(keep, q.k + 1, q.k)
        refresh = ~moved | ~good | (k >= q.s.shape[0]) | small
        refresh = refresh | ~jnp.isfinite(_runner.max_norm(d_next))
        return q._replace(d=d_next, s=s, u=u, k=k, refresh=refresh)

    return _quasi_direction(ops), update, _initial_quasi(ops, history_size)


_METHODS = {"newton": _newton, "chord": _chord, "broyden": _broyden}


def _method(fn, ops, direction, update, init_quasi, line_search, rtol, atol, project,
            bounded=False):
    """The runner's :class:`~solvers._runner.Method` for a direction and its update.

    ``bounded`` (Newton: a fresh Jacobian at every step): the line search's full step is
    judged non-monotonically (against the largest ``|F|`` of the last ``_WINDOW``
    iterates, Grippo, Lampariello & Lucidi), backtracked trials monotonically (against
    ``|F(x)|``), by the factor ``_BACKTRACK``; where no trial decreases ``|F|`` the full
    step is taken anyway. Where a fresh Jacobian then fails (singular, or no finite
    trial), a watchdog goes back to the previous iterate and bounds the steps by a
    radius (half the way back, then MINPACK's rules, :func:`_new_radius`): unbounded
    until then, as long steps into saturation and back are how Newton leaves a basin
    of a local minimum of ``|F|``. Else (a stale Jacobian, whose long steps are not to
    be trusted) monotone and unbounded."""
    dtype = rtol.dtype
    big = jnp.finfo(dtype).max

    def init(x0):
        # F(x0) comes with the first Jacobian (one evaluation and one trace of F fewer):
        # until then the error is unknown.
        eta = (jnp.asarray(_ETA_MAX, dtype), jnp.zeros((), dtype))
        zero = jnp.zeros((), dtype)
        return _State(
            x0, jnp.zeros_like(x0), jnp.int32(_status.RUNNING), zero + big, zero,
            jnp.bool_(False), zero - 1, zero, eta if ops.jacobian == "matfree" else None,
            init_quasi(x0), jnp.zeros((_WINDOW,), dtype), zero, zero + jnp.inf,
            jnp.bool_(False), x0 if bounded else None,
            jnp.zeros_like(x0) if bounded else None, jnp.full_like(x0, jnp.inf),
        )

    def step(state):
        x = state.x
        fx, d, fresh, eta, quasi, f_tol = direction(state)
        # (NaN if any entry is, also across devices; one pass over fx, d and x)
        f_max, step_size, x_max, fnorm = _runner.norms((fx, d, x), (fx,))
        f_ok = jnp.isfinite(f_max)
        # At an exact root the step is zero, whatever the Jacobian there.
        d = jnp.where(f_max == 0, 0.0, d)
        step_size = jnp.where(f_max == 0, 0.0, step_size)
        d_ok = jnp.isfinite(step_size)
        # Error of x + d: about |d| ρ / (1 - ρ) with ρ = |d| / |d_prev| the contraction
        # rate over two full steps (Hairer & Wanner's estimate for simplified Newton), so
        # a fast-converging iteration stops a step earlier; never more than |d|. Each
        # unknown is judged in its own scale (see _scaled_step).
        atol_x = _effective_atol(x, rtol, atol, *ops.tol[2:], x_max=x_max)
        scaled, scale = _scaled_step(x, d, rtol, atol_x)
        rate = scaled / jnp.where(state.full_step > 0, state.full_step, 1.0)
        known = (state.full_step > 0) & (rate < 1)
        relative = scaled * jnp.where(known, jnp.minimum(1.0, rate / (1.0 - rate)), 1.0)
        small = d_ok & (scaled <= 1)  # the step itself is within the tolerance
        first = state.f_start < 0
        f_start = jnp.where(first, fnorm, state.f_start)
        window = jnp.where(first, fnorm, state.f_window)
        f_best = jnp.where(first, fnorm, state.f_best)
        radius = state.radius
        if line_search:
            d_norm = _norm(d)
            cap = (jnp.where(d_ok & (d_norm > radius), radius / jnp.where(d_ok, d_norm, 1.0),
                             1.0) if bounded else 1.0)
            f_ref = jnp.max(window) if bounded else fnorm
            x_new, f_new, f_new_norm, t, ok, full = _line_search(
                fn, x, fx, cap * d, project, f_ref, skip=small | ~d_ok | ~f_ok,
                shrink=(_BACKTRACK, _BACKTRACK) if bounded else (0.1, 0.5))
            if bounded:  # escape: take the (bounded) full step where the search failed
                escape = (~ok & fresh & d_ok & f_ok & jnp.isfinite(full[2])
                          & jnp.any(full[0] != x))  # (a step projected back is none)
                x_new, f_new, f_new_norm = (jnp.where(escape, a, b) for a, b in
                                            zip(full, (x_new, f_new, f_new_norm)))
                t = jnp.where(escape, 1.0, t)
                ok = ok | escape
        else:
            x_new = project(x + d)
            f_new = fn(x_new)
            f_new_norm = _norm(f_new)
            t, ok, cap, full = 1.0, jnp.isfinite(f_new_norm), 1.0, (x_new, f_new, f_new_norm)
        moved = f_ok & d_ok & (ok | small)
        x_next = jnp.where(moved, x_new, x)
        f_next = jnp.where(moved, f_new, fx)
        f_next_norm = jnp.where(moved, f_new_norm, fnorm)
        whole = moved & (t == 1) & (cap == 1)  # the full step was taken
        halved = f_next_norm <= 0.5 * fnorm
        # The contraction rate shortens the estimate only where the full step it judges
        # was taken and at least halved |F| (as Newton's steps do near a root): after a
        # long step (into a flat region and back) any later step looks like fast
        # contraction; Newton reported 'converged' at max|F| = 7.4 that way.
        estimate = jnp.where(whole & halved, relative, scaled)
        error = jnp.where(d_ok, estimate * (atol + rtol * scale), big).astype(dtype)
        full_step = jnp.where(whole, scaled, 0.0).astype(dtype)
        no_decrease = _status.NO_DECREASE if line_search else _status.NONFINITE
        status = jnp.where(
            ~f_ok,
            _status.NONFINITE,
            jnp.where(fresh & ~d_ok, _status.SINGULAR,
                      jnp.where(fresh & ~moved, no_decrease, _status.RUNNING)),
        )
        if line_search and bounded:
            radius = _new_radius(radius, t * cap, _norm(d), fnorm, f_new_norm, moved & d_ok)
            # Watchdog: where a fresh Jacobian fails (singular, or no finite trial along
            # its direction), the solve goes back to the previous iterate with its steps
            # bounded by half the way from there (then MINPACK's radius rules), and the
            # reference restarts monotone. (Not where the bounds hold the trials at x:
            # a root outside the box, no_decrease.)
            back = state.x_back
            retreat = (fresh & f_ok & ~moved & jnp.any(x != back)
                       & (~d_ok | jnp.any(full[0] != x)))
            x_next = jnp.where(retreat, back, x_next)
            f_next = jnp.where(retreat, state.fx_back, f_next)
            f_next_norm = jnp.where(retreat, _norm(state.fx_back), f_next_norm)
            radius = jnp.where(retreat, 0.5 * _norm(x - back), radius)
            window = jnp.where(retreat, f_next_norm, window)
            status = jnp.where(retreat, _status.RUNNING, status)
            # Nowhere to go back to (the guess): the steps are bounded by hybr's first
            # radius, 100 |x| (100 at x = 0), and the same direction is searched again
            # within it, once (an unbounded radius only). On Brown's almost-linear system
            # (n = 30, 40) from its standard start, the last equation's gradient is 2e-9
            # there, the Newton step 5e8 long, and |F| overflowed at every trial.
            bound = (fresh & f_ok & ~moved & ~retreat & d_ok & jnp.isinf(radius)
                     & jnp.any(full[0] != x))
            radius = jnp.where(bound, _TRUST_RADIUS0 * jnp.maximum(_norm(x), 1.0), radius)
            status = jnp.where(bound, _status.RUNNING, status)
            moved = moved | retreat
        status = status.astype(jnp.int32)
        # A small step ends the solve only if it can be trusted: from a fresh Jacobian,
        # or one over which |F| at least halved (a stale approximation can give a tiny
        # step far from a root; then the residual has not moved, and the Jacobian is
        # refreshed to decide, also at the rounding floor, where |F| no longer halves).
        # Not where |F| is merely down to rtol times its value at the guess: from a far
        # guess that is no bound at all (Broyden 'converged' on Brown's almost-linear
        # system, n = 30 from 10x its start, at |F| = 9.8e5 under rtol |F(x0)| = 2.8e8).
        # And never where a residual, equation by equation, is above what the unknowns'
        # tolerances can account for (_Linear.residual_tolerance; f_tol is F's size, so
        # the test does not depend on how F is scaled): a tiny step from an
        # ill-conditioned J far from a root (Morgan's combustion system, unknowns
        # 1e-7..1e-5: three 'converged' points whose equilibrium rows were off by far
        # more than their terms' size times the tolerance).
        f_tol = f_tol.astype(dtype)
        residual_ok = all_(jnp.abs(f_next) <= f_tol)
        confirmed = (fresh | halved | (f_max == 0)) & residual_ok
        if quasi is not None:
            quasi = update(state._replace(fx=fx), quasi, x_next, f_next, d, moved, halved,
                           d_ok & (estimate <= 1) & ~confirmed)
        # Progress for the runner's stagnation test: a step (not lost in rounding) to a
        # |F| below every one of the last _WINDOW iterates'. A non-monotone iteration may
        # wander far before it converges and is not stopped while it keeps finding such
        # points; a cycle (or a rounding floor) does not.
        eps = jnp.finfo(dtype).eps
        lowest = f_next_norm < jnp.min(window) * (1 - 32 * eps)
        moved_by, x_norm, x_next_norm = _runner.norms((), (x_next - x, x, x_next))
        went = moved_by > jnp.sqrt(eps) * jnp.maximum(x_norm, x_next_norm)
        improved = moved & lowest & went
        window = jnp.where(moved, jnp.roll(window, 1).at[0].set(f_next_norm), window)
        if bounded and line_search:  # (a retreat keeps the point it went back to)
            state = state._replace(x_back=jnp.where(retreat, back, x),
                                   fx_back=jnp.where(retreat, state.fx_back, fx))
        return state._replace(
            x=x_next, fx=f_next, status=status, error=error,
            scale=jnp.where(d_ok, scale, 0.0).astype(dtype), confirmed=confirmed,
            f_start=f_start.astype(dtype),
            full_step=full_step, eta=eta, quasi=quasi, f_window=window.astype(dtype),
            f_best=jnp.minimum(f_best, f_next_norm).astype(dtype),
            radius=jnp.asarray(radius, dtype), improved=improved, f_tol=f_tol,
        )

    def terminate(state):
        return _runner.Progress(state.error, state.scale, state.status,
                                confirmed=state.confirmed, improved=state.improved)

    return _runner.Method(init, step, terminate)


# --- dogleg trust region ---------------------------------------------------------------


class _Trust(NamedTuple):
    x: Any  # the iterate (flat)
    fx: Any  # F(x)
    jac: Any  # J(x)
    newton: Any  # the Newton step -J(x)⁻¹ F(x) (non-finite where J is singular)
    radius: Any  # the trust region's radius (2-norm)
    evaluated: Any  # whether x has been evaluated (the first step evaluates the guess)
    status: Any
    error: Any
    scale: Any
    residual_ok: Any  # |F_i| within each equation's tolerance (_Linear.residual_tolerance)


_TRUST_ACCEPT = 1e-4  # accept a step whose actual reduction is this share of the predicted
_TRUST_RADIUS0 = 100.0  # initial radius: this times |x0| (or this if x0 = 0), as hybr


def _dogleg(fn, project, rtol, atol, size0, x_scale=None):
    """Powell's dogleg trust region on ``|F|²`` with a fresh dense Jacobian at every
    accepted point (as MINPACK's ``hybrj``, without its Broyden updates).

    Each step proposes the Newton step if it fits the trust region, else the point
    where the path from the Cauchy point (the model's minimiser along the steepest
    descent of ``|F|²``) to the Newton step leaves the region, or the steepest-descent
    step to its edge (also where ``J`` is singular). A trial that reduces ``|F|²`` by
    at least ``_TRUST_ACCEPT`` times the model's prediction is taken; the radius starts
    no longer than the first Newton step, halves after a poor step and grows after a
    good one (MINPACK's rules: see ``step``). The error
    of an iterate is its Newton step's length (0 at an exact root): the test trusts
    only a fresh Jacobian's step. A region shrunk to rounding without a decrease is
    ``no_decrease`` (a local minimum of ``|F|``, or a tolerance below the precision).
    """

    def evaluate(y):
        jac, fy = jax.jacfwd(lambda v: (lambda r: (r, r))(fn(v)), has_aux=True)(y)
        jac = _sharding.gathered(jac)  # (whole, as its LU needs it, on an Explicit mesh)
        newton = -_lu.factor_solve(jac, fy)[0]
        return fy, jac, jnp.where(_runner.max_norm(fy) == 0, 0.0, newton)

    def init(x0):
        n = x0.size
        dtype = x0.dtype
        big = jnp.asarray(jnp.finfo(dtype).max, dtype)
        zero = jnp.zeros((), dtype)
        return _Trust(x0, jnp.zeros_like(x0), jnp.zeros((n, n), dtype), jnp.zeros_like(x0),
                      zero, jnp.bool_(False), jnp.int32(_status.RUNNING), big, zero,
                      jnp.bool_(False))

    def proposal(state):
        """The dogleg step for the state's trust region, and its 2-norm."""
        fx, jac, newton = state.fx, state.jac, state.newton
        g = _sharding.split_like(_sharding.dot(jac.T, fx), newton)  # gradient of |F|² / 2
        p = dogleg_step(g, newton, jac, state.radius)
        return p, _norm(p)

    def step(state):
        p, p_norm = proposal(state)
        y = jnp.where(state.evaluated, project(state.x + p), state.x)
        fy, jac_y, newton_y = evaluate(y)
        dot = _sharding.dot
        f2, fy2 = dot(state.fx, state.fx), dot(fy, fy)
        model = state.fx + dot(state.jac, p)
        predicted = f2 - dot(model, model)
        rho = (f2 - fy2) / jnp.where(predicted > 0, predicted, 1.0)
        good = jnp.isfinite(fy2) & (predicted > 0) & (rho > _TRUST_ACCEPT)
        accept = ~state.evaluated | good
        x, fx, jac, newton = (
            jnp.where(accept, new, old)
            for new, old in ((y, state.x), (fy, state.fx), (jac_y, state.jac),
                             (newton_y, state.newton))
        )
        # MINPACK's radius: _TRUST_RADIUS0 |x0|, but no longer than the first Newton
        # step; halved after a poor step (rho < 0.1), at least twice the step after a
        # good one (rho >= 0.5), twice the step when the model was right to 10%.
        first_radius = _TRUST_RADIUS0 * jnp.where(_norm(y) > 0, _norm(y), 1.0)
        first_newton = _norm(newton_y)
        first_radius = jnp.where(jnp.isfinite(first_newton) & (first_newton > 0),
                                 jnp.minimum(first_radius, first_newton), first_radius)
        radius = jnp.where(rho < 0.1, 0.5 * state.radius,
                           jnp.where(rho >= 0.5, jnp.maximum(state.radius, 2.0 * p_norm),
                                     state.radius))
        radius = jnp.where(good & (jnp.abs(rho - 1.0) <= 0.1), 2.0 * p_norm, radius)
        radius = jnp.where(good | (rho < 0.1), radius, 0.5 * state.radius)  # (predicted <= 0)
        radius = jnp.where(state.evaluated, radius, first_radius).astype(x.dtype)
        f_max = _runner.max_norm(fx)
        step_size = _runner.max_norm(newton)
        eps = jnp.finfo(x.dtype).eps
        stuck = state.evaluated & ~good & (radius <= eps * jnp.maximum(_norm(x), eps))
        status = jnp.where(~jnp.isfinite(f_max), _status.NONFINITE,
                           jnp.where(stuck, _status.NO_DECREASE, _status.RUNNING))
        big = jnp.finfo(x.dtype).max
        atol_x = _effective_atol(x, rtol, atol, size0, x_scale)
        scaled, scale = _scaled_step(x, jnp.where(jnp.isfinite(step_size), newton, 0.0),
                                     rtol, atol_x)
        error = jnp.where(jnp.isfinite(step_size), scaled * (atol + rtol * scale), big)
        error = error.astype(x.dtype)
        # The residual test of _method's (see _Linear.residual_tolerance).
        r_tol = _residual_tolerance(_abs_product(jac), x, rtol, atol, size0, x_scale)
        residual_ok = all_(jnp.abs(fx) <= r_tol)
        return _Trust(x, fx, jac, newton, radius, jnp.bool_(True), status.astype(jnp.int32),
                      error, scale.astype(x.dtype), residual_ok)

    def terminate(state):
        return _runner.Progress(state.error, state.scale, state.status,
                                confirmed=state.residual_ok)

    return _runner.Method(init, step, terminate, warmup=True)


def _initial_quasi(ops, history_size):
    """Chord/Broyden state before the first step (which refreshes the Jacobian)."""

    def init(x0):
        zeros = _sharding.rows_like(x0, history_size)  # (split like x0 on a mesh)
        return _Quasi(
            d=jnp.zeros_like(x0), factors=ops.placeholder(x0), s=zeros, u=zeros,
            k=jnp.int32(0), refresh=jnp.bool_(True),
        )

    return init


def dogleg_step(g, newton, jac, radius):
    """Powell's dogleg step within ``radius`` (2-norm) of the model ``|F + J p|² / 2``
    (also a Gauss–Newton model: ``least_squares``), ``g = Jᵀ F`` its gradient: the
    ``newton`` step where it fits, else the path from the Cauchy point (the model's
    minimiser along ``-g``) towards it cut at the radius, or the steepest-descent step to
    the edge (also where ``newton`` is not finite: a singular ``J``)."""
    dot = _sharding.dot  # (inner products of split vectors on an Explicit mesh)
    jg = dot(jac, g)
    g_norm = _norm(g)
    cauchy = -dot(g, g) / jnp.where(dot(jg, jg) > 0, dot(jg, jg), 1.0) * g
    c_norm = _norm(cauchy)
    n_norm = _norm(newton)
    newton_ok = jnp.isfinite(n_norm)
    edge = -radius / jnp.where(g_norm > 0, g_norm, 1.0) * g  # steepest descent, |.|=Δ
    d = jnp.where(newton_ok, newton, 0.0) - cauchy
    a, b, c = dot(d, d), 2.0 * dot(cauchy, d), c_norm**2 - radius**2
    tau = (-b + jnp.sqrt(jnp.maximum(b * b - 4 * a * c, 0.0))) / jnp.where(a > 0, 2 * a, 1)
    dog = cauchy + jnp.clip(tau, 0.0, 1.0) * d
    return jnp.where(newton_ok & (n_norm <= radius), newton,
                     jnp.where(~newton_ok | (c_norm >= radius), edge, dog))


def _effective_atol(x, rtol, atol, size0, x_scale=None, x_max=None):
    """``min(atol, rtol max(max|x|, max|x0|))`` (``atol`` where both are 0): the absolute
    tolerance of each unknown, no coarser than ``rtol`` times the unknowns' size (the
    automatic scale of the unknowns, as MINPACK's ``xtol |D x|``). Changes nothing where
    the unknowns are of the order ``atol / rtol`` or larger. With ``x_scale`` (the user's
    sizes, flat like ``x``): ``atol * x_scale``, unknown by unknown."""
    if x_scale is not None:
        return (atol * x_scale).astype(x.dtype)
    top = jnp.maximum(_runner.max_norm(x) if x_max is None else x_max, size0)
    return jnp.where(top > 0, jnp.minimum(atol, rtol * top), atol).astype(x.dtype)


def _abs_product(jac):
    """``w -> |J| w`` for a dense Jacobian."""
    return lambda w: _sharding.dot(jnp.abs(jac), w)


def _residual_tolerance(abs_product, x, rtol, atol, size0, x_scale=None):
    """``|J| (atol + rtol' |x|)``, row by row, ``rtol' = max(rtol, 16 eps)`` (see
    :meth:`_Linear.residual_tolerance`; ``abs_product(w) = |J| w``), split as ``x`` is
    (on an Explicit mesh the gathered Jacobian's product is not)."""
    rtol = jnp.maximum(rtol, 16 * jnp.finfo(x.dtype).eps)
    # The absolute part no larger than rtol times the unknowns' size (the largest of
    # the iterate and the guess, as MINPACK's xtol |D x|): unknowns of 1e-7 from a guess
    # of 1e-5 are not settled by atol = 1e-10 (their equations' terms are that small
    # too). Where both are 0, atol.
    w = _effective_atol(x, rtol, atol, size0, x_scale) + rtol * jnp.abs(x)
    return _sharding.split_like(abs_product(w).astype(x.dtype), x)


def _scaled_step(x, d, rtol, atol):
    """``(max_i |d_i| / (atol + rtol |x_i + d_i|), max|x + d|)``: the step in each
    unknown's own tolerance (the runner's test, ``error <= atol + rtol * scale``, is then
    passed with ``error`` this times ``atol + rtol * scale``). A max-norm test alone lets
    an unknown of 1e-7 be 10% off next to one of 1 (and the contraction rate of such an
    unknown's steps hide behind the large unknown's first step)."""
    y = x + d
    return _runner.norms((d / (atol + rtol * jnp.abs(y)), y))


def _new_radius(radius, t, d_norm, fnorm, f_new_norm, moved):
    """MINPACK's update of the step bound after a step ``t d`` (``t <= 1`` of the
    Newton direction ``d``) took ``|F|`` from ``fnorm`` to ``f_new_norm``: with ``ρ`` the
    actual reduction of ``|F|²`` over the linear model's, halved when ``ρ < 0.1``, at
    least twice the step when ``ρ >= 0.5``."""
    predicted = fnorm**2 * (1.0 - (1.0 - t) ** 2)
    ratio = (fnorm**2 - f_new_norm**2) / jnp.where(predicted > 0, predicted, 1.0)
    new = jnp.where(ratio < 0.1, 0.5 * radius,
                    jnp.where(ratio >= 0.5, jnp.maximum(radius, 2.0 * t * d_norm), radius))
    return jnp.where(moved & (predicted > 0), new, radius)


def _line_search(fn, x, fx, d, project, f_ref, skip, shrink=(0.1, 0.5)):
    """Backtrack from ``t = 1`` until ``|F(x + t d)| <= (1 - 1e-4 t) |F(x)|``, the full
    step ``t = 1`` judged against ``f_ref >= |F(x)|`` instead (non-monotone: the largest
    ``|F|`` over the last ``_WINDOW`` iterates).

    Each trial ``t`` comes from the quadratic model of ``|F(x + t d)|²`` (slope
    ``-2 |F(x)|²`` along a Newton direction), kept within ``[0.1, 0.5]`` of the previous
    one; a non-finite ``F`` shrinks ``t`` tenfold. Returns ``(x + t d, F(x + t d),
    |F(x + t d)|, t, ok)``;
    with ``skip`` the full step is returned as is. ``F`` appears once in the program (the
    loop's first pass tries ``t = 1``), which keeps compilation short.
    """
    f0 = _norm(fx)

    def accepted(t, fnorm):
        # False for NaN; a strict decrease (1 - 1e-4 t rounds to 1 for tiny t, and a
        # trial projected back onto x must not count as progress).
        ref = jnp.where(t == 1, f_ref, f0)
        return (fnorm <= (1.0 - _ARMIJO * t) * ref) & ((fnorm < ref) | (f0 == 0))

    def cond(carry):
        t, _, _, fnorm, i, _ = carry
        return (i == 0) | (~skip & ~accepted(t, fnorm) & (i <= _MAX_BACKTRACKS))

    def body(carry):
        t, _, _, fnorm, i, first = carry
        r2 = (fnorm / jnp.where(f0 > 0, f0, 1.0)) ** 2
        denom = r2 - 1.0 + 2.0 * t
        quadratic = t * t / jnp.where(denom > 0, denom, 1.0)
        t_new = jnp.where(jnp.isfinite(fnorm) & (denom > 0), quadratic, 0.1 * t)
        t_new = jnp.where(i == 0, 1.0, jnp.clip(t_new, shrink[0] * t, shrink[1] * t))
        x_t = project(x + t_new * d)
        f_t = fn(x_t)
        fnorm_t = _norm(f_t)
        first = jax.tree.map(lambda a, b: jnp.where(i == 0, a, b), (x_t, f_t, fnorm_t), first)
        return t_new, x_t, f_t, fnorm_t, i + 1, first

    one = jnp.ones((), f0.dtype)
    init = (one, x, fx, f0, 0, (x, fx, f0))
    t, x_t, f_t, fnorm, _, first = _sharding.while_loop(cond, body, init)
    return x_t, f_t, fnorm, t, skip | accepted(t, fnorm), first
