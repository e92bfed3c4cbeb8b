"""The implicit function theorem: the one place where solvers get their derivatives.

If ``x*(θ)`` solves ``F(x, θ) = 0`` and ``A = ∂F/∂x`` is nonsingular at the solution,
then ``dx*/dθ = -A⁻¹ ∂F/∂θ``. Reverse mode needs ``w = A⁻ᵀ ḡ`` (one adjoint linear
solve) and returns ``θ̄ = -(∂F/∂θ)ᵀ w``; forward mode solves ``A ẋ = -(∂F/∂θ) θ̇``.
Nothing here differentiates the solver's iterations: the solver may be any code.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from implicit import _checks, linear
from implicit import _sharding
from implicit._host import host_check
from implicit._reduce import all_

__all__ = ["custom_root", "custom_fixed_point"]


def custom_root(
    residual,
    *,
    linear_solver="gmres",
    has_aux=False,
    rule="vjp",
    rtol=None,
    atol=None,
    max_steps=None,
    on_failure="raise",
    preconditioner=False,
):
    """Decorate a root solver so that its derivatives come from the implicit function theorem.

    The decorated ``solver(x0, *args) -> x`` (or ``(x, aux)`` with ``has_aux``) must
    return ``x`` with ``residual(x, *args) == 0``. Its derivatives with respect to every
    floating array in ``args`` and every traced value that ``residual`` closes over are
    ``dx/dθ = -(∂residual/∂x)⁻¹ ∂residual/∂θ``; ``x0`` and ``aux`` get zero derivatives
    and the solver's own code is never differentiated (a ``lax.while_loop`` or a SciPy
    call through ``jax.pure_callback`` are both fine).

    Args:
      residual: ``residual(x, *args)``, returning a pytree shaped like ``x``.
      linear_solver: how the adjoint system is solved: ``"gmres"`` (default),
        ``"bicgstab"``, ``"cg"``, ``"dense"``, ``"neumann"``, ``"jfb"`` or a callable
        ``(matvec, b) -> x`` (see :mod:`implicit.linear`). The callable may close over
        values computed from the differentiated inputs (a factorisation of a matrix
        argument): they are closure-converted at the call, as ``jax.lax.custom_root``
        does, and its solve is then applied to the residual's Jacobian (transposed for
        the adjoint) rebuilt at the solution.
      has_aux: the solver returns ``(x, aux)``; ``aux`` is passed through undifferentiated.
      rule: ``"vjp"`` (a ``jax.custom_vjp`` rule: reverse mode, any order) or ``"jvp"``
        (a ``jax.custom_jvp`` rule with a transposable tangent solve: ``jax.jvp``,
        ``jax.jacfwd``, ``jax.hessian`` and reverse mode). The tangent solve must stay
        linear in the tangents, so ``on_failure`` checks it on a probe instead: the
        same solve of a fixed right-hand side with the same matrix, which fails where
        the matrix is singular (or the method does not converge on it); the tangents
        are then NaN (``"nan"``), or the solve raises (``"raise"``).
      rtol, atol: tolerances of the adjoint linear solve (``norm(A w - b) <= atol +
        rtol * norm(b)``); by default they follow the dtype (1e-5 float32, 1e-8 float64).
        Solvers in :mod:`solvers` pass their own forward tolerances here, so a gradient
        is as accurate as the solution.
      max_steps: iteration cap of the adjoint linear solve.
      on_failure: what an adjoint linear solve that misses its tolerance does (checked
        with one extra product): ``"raise"`` (default; a runtime error naming the
        linear solver and the residual, also under ``jit``/``vmap``), ``"nan"``
        (NaN derivatives) or ``"ignore"``.
      preconditioner: the solver also returns, last, ``P``: a ``jax.tree_util.Partial``
        with ``P(v) ≈ (∂residual/∂x)⁻ᵀ v`` on flat vectors (``x`` raveled), such as a
        solve with the transpose of the solver's last factored Jacobian. The adjoint
        solve is then iterative refinement with ``P`` (:func:`implicit.linear.refined`:
        a step or two where ``P`` is nearly exact), and ``linear_solver`` only where
        that does not converge. ``rule="jvp"``, ``"jfb"`` and ``"diagonal"`` do not use
        it. ``P`` is not part of the decorated function's output.

    Returns:
      A decorator turning ``solver`` into ``solver(x0, *args)`` with implicit derivatives.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from implicit import custom_root
      >>> def residual(x, a):
      ...     return x ** 2 - a
      >>> @custom_root(residual)
      ... def sqrt_newton(x0, a):
      ...     step = lambda _, x: x - residual(x, a) / (2 * x)
      ...     return jax.lax.fori_loop(0, 30, step, x0)
      >>> print(round(float(jax.grad(sqrt_newton, argnums=1)(1.0, 4.0)), 6))  # 1 / (2 sqrt 4)
      0.25
    """
    _checks.check_callable(residual, "residual")
    _checks.check_choice(rule, "rule", _checks.RULES)
    _checks.check_linear_solver(linear_solver, rule)
    _checks.check_positive(rtol, "rtol")
    _checks.check_positive(atol, "atol")
    _checks.check_choice(on_failure, "on_failure", _checks.ON_FAILURE)
    if max_steps is not None:
        _checks.check_max_steps(max_steps)
    _checks.check_bool(preconditioner, "preconditioner")

    def decorator(solver):
        _checks.check_callable(solver, "solver")

        @functools.wraps(solver)
        def wrapped(x0, *args):
            x0 = _checks.canonicalize(x0)
            try:
                return _implicit_solve(
                    residual, solver, x0, args, linear_solver, has_aux, rule, rtol, atol,
                    max_steps, on_failure, preconditioner,
                )
            except TypeError as err:  # JAX's words for it do not say what to do
                if rule != "vjp" or "forward-mode" not in str(err):
                    raise
                raise TypeError(
                    "implicit.custom_root(rule='vjp') is a custom_vjp rule: reverse mode only "
                    "(jax.grad, jax.vjp, jax.jacrev); forward-mode differentiation (jax.jvp, "
                    "jax.jacfwd, jax.hessian) needs rule='jvp' (with a linear linear_solver "
                    "such as 'gmres' or 'dense')"
                ) from err

        return wrapped

    return decorator


def custom_fixed_point(mapping, **options):
    """Decorate a fixed-point solver: like :func:`custom_root` with ``mapping(x) - x``.

    The decorated ``solver(x0, *args)`` must return ``x`` with ``mapping(x, *args) == x``.
    With ``linear_solver="neumann"`` the adjoint is the JAX notebook's iteration
    ``w <- ḡ + (∂mapping/∂x)ᵀ w``; with ``"jfb"`` it is Jacobian-free backpropagation.
    Takes the same keyword options as :func:`custom_root`.

    Args:
      mapping: ``mapping(x, *args)``, returning a pytree shaped like ``x``, whose fixed
        point the decorated solver returns.
      **options: the keyword options of :func:`custom_root` (``linear_solver``,
        ``has_aux``, ``rule``, ``rtol``, ``atol``, ``max_steps``, ``on_failure``,
        ``preconditioner``).

    Returns:
      A decorator turning ``solver`` into ``solver(x0, *args)`` with implicit derivatives.

    Example:
      >>> import jax
      >>> from implicit import custom_fixed_point
      >>> update = lambda x, a: 0.5 * (x + a / x)
      >>> @custom_fixed_point(update)
      ... def newton_sqrt(x0, a):
      ...     return jax.lax.fori_loop(0, 30, lambda _, x: update(x, a), x0)
      >>> print(float(jax.grad(newton_sqrt, argnums=1)(2.0, 2.0)))
      0.3535533845424652
    """
    _checks.check_callable(mapping, "mapping")

    def residual(x, *args):
        return jax.tree.map(jnp.subtract, mapping(x, *args), x)

    return custom_root(residual, **options)


def _all(tree):
    return all_(jnp.stack([all_(leaf) for leaf in jax.tree.leaves(tree)]))


def _implicit_solve(
    residual, solver, x0, args, linear_solver, has_aux, rule, rtol, atol, steps, on_failure,
    preconditioner=False,
):
    # Closure conversion: traced values that `residual` or `solver` close over become
    # explicit inputs, so derivatives reach the residual's ones and the solver's ones
    # receive zero (the solver's dependence is entirely captured by the residual).
    # Under shard_map (check_vma) the residual is traced with the solution's type: the
    # solution may vary over axes the guess does not (a constant guess, sharded args).
    def without_p(out):  # the solver's output without its trailing preconditioner
        if not preconditioner:
            return out
        return out[:-1] if has_aux else out[0]

    x_like = _sharding.like_output(lambda *a: without_p(solver(*a)), x0, args, has_aux)
    residual_fn, residual_consts = jax.closure_convert(residual, x_like, *args)
    solver_fn, solver_consts = jax.closure_convert(solver, x0, *args)
    linear_solver, lin_consts = _hoisted(linear_solver, residual_fn, x_like, args,
                                         residual_consts)
    _checks.check_like(jax.eval_shape(residual, x0, *args), x0, "residual(x0, *args)", "x0")

    dtype = jnp.result_type(*jax.tree.leaves(x0))
    default_rtol, default_atol = _checks.default_tolerances(dtype)
    # A solve cannot be more accurate than a few ulps; asking for more only burns steps.
    # Ulps of the least precise leaf: a float32 leaf of a float64 x rounds the residual
    # and its VJP there, and held to float64's tolerance every adjoint solve failed.
    eps = float(jnp.finfo(_checks.coarsest_dtype(x0)).eps)
    tol = (
        jnp.maximum(jnp.asarray(default_rtol if rtol is None else rtol, dtype), 8 * eps),
        jnp.asarray(0.0 if atol is None else atol, dtype),
    )

    def run_solver(x0, args, solver_consts):
        """The solver's output, and its preconditioner (None without one)."""
        out = solver_fn(x0, *args, *solver_consts)
        p = out[-1] if preconditioner else None
        out = without_p(out)
        x = out[0] if has_aux else out
        _checks.check_like(x, x0, "the solver's solution", "x0")
        return out, p

    def split(out):
        return (out[0], out[1]) if has_aux else (out, None)

    config = _RuleConfig(residual_fn, linear_solver, steps, on_failure, has_aux)

    if rule == "vjp":

        # The output is (out, P): fwd calls the rule's own primal (so a second derivative
        # does not differentiate the solver), and P is one of its results.
        @jax.custom_vjp
        def solve_p(x0, args, residual_consts, solver_consts, tol, lin_consts):
            out, p = run_solver(x0, args, solver_consts)
            # The preconditioner only speeds the solve up: a constant.
            return out, jax.tree.map(jax.lax.stop_gradient, p)

        def solve(*primals):
            return solve_p(*primals)[0]

        def solve_fwd(x0, args, residual_consts, solver_consts, tol, lin_consts):
            out, p = solve_p(x0, args, residual_consts, solver_consts, tol, lin_consts)
            return (out, p), (split(out)[0], args, residual_consts, tol, p, lin_consts)

        def solve_bwd(saved, g):
            x, args, consts, tol, p, lin_consts = saved
            args_bar, consts_bar = _vjp_bwd(config, x, args, consts, tol, p, split(g[0])[0],
                                            lin_consts)
            return None, args_bar, consts_bar, None, None, None

        solve_p.defvjp(solve_fwd, solve_bwd)

    else:

        @jax.custom_jvp
        def solve(x0, args, residual_consts, solver_consts, tol, lin_consts):
            return run_solver(x0, args, solver_consts)[0]

        @solve.defjvp
        def solve_jvp(primals, tangents):
            x0, args, consts, solver_consts, tol, lin_consts = primals
            _, args_dot, consts_dot, _, _, _ = tangents
            out = solve(*primals)
            x, aux = split(out)
            x_dot = _jvp_tangent(config, x, args, consts, args_dot, consts_dot, tol,
                                 lin_consts)
            if has_aux:
                # (zeros typed like their primals: under shard_map they vary alike)
                return out, (x_dot, jax.custom_derivatives.zero_from_primal(aux))
            return out, x_dot

    # shard_map: tolerances typed to vary with the problem (an implicit cast inserted at
    # the call would meet already varying values when the rule is lowered under vmap).
    tol = _sharding.vary_like(tol, (x_like, args))
    return solve(x0, args, residual_consts, solver_consts, tol, lin_consts)


class _Hoisted(NamedTuple):
    """A ``linear_solver`` callable that closes over traced values (a factor computed
    from the differentiated inputs), closure-converted at the forward call, as
    ``jax.lax.custom_root`` does: the adjoint solve ``Aᵀ w = b`` and the tangent solve
    ``A w = b`` (``A`` the residual's Jacobian at ``x``), each the callable applied to
    that operator, as functions of ``(b, x, args, consts, *hoisted)``; the hoisted values
    reach the rules as inputs (no cotangent), never as a tracer of a finished trace."""

    adjoint: Callable
    tangent: Callable
    num_adjoint: int  # the hoisted values: the adjoint's, then the tangent's

    def bound(self, x, args, consts, lin_consts, *, adjoint):
        """``(solve, transpose_solve)`` callables ``(matvec, b) -> w`` (the operator
        rebuilt at ``x``): the adjoint solve and its transpose (the tangent solve) for
        the vjp rule's adjoint (``adjoint=True``), the other way round for the jvp rule."""
        a, t = lin_consts[: self.num_adjoint], lin_consts[self.num_adjoint:]
        adjoint_solve = lambda _, b: self.adjoint(b, x, args, consts, *a)  # noqa: E731
        tangent_solve = lambda _, b: self.tangent(b, x, args, consts, *t)  # noqa: E731
        return ((adjoint_solve, tangent_solve) if adjoint
                else (tangent_solve, adjoint_solve))


def _hoisted(linear_solver, residual_fn, x_like, args, consts):
    """``(linear_solver, ())``, or, for a callable closing over traced values,
    ``(_Hoisted, hoisted values)``. (Finding them costs a trace of the adjoint solve: a
    callable that declares ``closes_over_traced_values = False``, such as root's
    ``jac_sparsity`` solve, skips it.)"""
    if not callable(linear_solver) or not getattr(linear_solver, "closes_over_traced_values",
                                                  True):
        return linear_solver, ()

    def adjoint(b, x, args, consts):
        _, vjp_x = jax.vjp(lambda y: residual_fn(y, *args, *consts), x)
        return linear_solver(lambda v: vjp_x(v)[0], b)

    def tangent(b, x, args, consts):
        _, matvec = jax.linearize(lambda y: residual_fn(y, *args, *consts), x)
        return linear_solver(matvec, b)

    adjoint_fn, adjoint_consts = jax.closure_convert(adjoint, x_like, x_like, args, consts)
    if not adjoint_consts:
        return linear_solver, ()
    tangent_fn, tangent_consts = jax.closure_convert(tangent, x_like, x_like, args, consts)
    return (_Hoisted(adjoint_fn, tangent_fn, len(adjoint_consts)),
            tuple(adjoint_consts) + tuple(tangent_consts))


class _RuleConfig(NamedTuple):
    """The static part of one decorated solver's derivative rule (hashable: the rules'
    bodies below are jitted with it static, so each is one compiled program, shared by
    every call with the same shapes: called eagerly, JAX would otherwise dispatch, and
    compile, their operations one by one, each adjoint solve's loop among them: one
    eager jvp, jacfwd, hessian and grad of a GMRES-differentiated fixed point compiled
    260 programs in 14.7 s that way, 36 in 5.9 s jitted)."""

    residual_fn: Callable  # (closure-converted: one object per residual and shapes)
    linear_solver: Any
    steps: Any
    on_failure: str
    has_aux: bool


def _linear_solve(config, matvec, b, tol, check=True, p=None, role="adjoint", operands=None):
    """Solve ``matvec(w) = b`` with the configured linear solver, checked. ``operands``:
    ``(x, args, consts, lin_consts)``, where ``matvec`` and the solve of its transpose
    come from there for a :class:`_Hoisted` callable (``role`` says which is which)."""
    linear_solver, steps, on_failure = config.linear_solver, config.steps, config.on_failure
    method, kind, transpose = linear_solver, linear_solver, None
    if isinstance(linear_solver, _Hoisted):
        method, transpose = linear_solver.bound(*operands, adjoint=role == "adjoint")
    # The solver's approximate inverse: refined, else linear_solver (not for "jfb",
    # an approximation by design, nor "diagonal", checked elementwise).
    if p is not None and linear_solver not in ("jfb", "diagonal"):
        method = linear.refined(p, method, rtol=tol[0], atol=tol[1], max_steps=steps)
        kind = "gmres"  # (checked by its residual, as an iterative solve is)
    x = linear.solve(method, matvec, b, rtol=tol[0], atol=tol[1], max_steps=steps,
                     transpose_solver=transpose)
    if on_failure == "ignore" or not check:
        return x
    # (a NaN or inf right-hand side, an upstream NaN cotangent, passes: see converged)
    ok, relative = linear.converged(kind, matvec, b, x, rtol=tol[0], atol=tol[1])
    if on_failure == "raise":
        everywhere = _all(ok)
        worst = jnp.max(jnp.stack([jnp.max(r, initial=0.0) for r in jax.tree.leaves(relative)]))
        flag = host_check(
            everywhere, _adjoint_failure(linear_solver, role), (everywhere, worst, tol[0])
        )
        return jax.tree.map(lambda v: jnp.where(flag, v, jnp.nan), x)
    # "nan": only what failed (elementwise for a diagonal solve, else the whole solve).
    if jax.tree.structure(ok) == jax.tree.structure(x):
        return jax.tree.map(lambda v, o: jnp.where(o, v, jnp.nan), x, ok)
    return jax.tree.map(lambda v: jnp.where(ok, v, jnp.nan), x)


@functools.partial(jax.jit, static_argnums=0)
def _vjp_bwd(config, x, args, consts, tol, p, g_x, lin_consts=()):
    """rule='vjp': the cotangents of ``args`` and of the residual's constants."""
    _, vjp_x = jax.vjp(lambda y: config.residual_fn(y, *args, *consts), x)
    w = _linear_solve(config, lambda v: vjp_x(v)[0], g_x, tol, p=p,
                      operands=(x, args, consts, lin_consts))
    _, vjp_params = jax.vjp(lambda a, c: config.residual_fn(x, *a, *c), args, consts)
    return vjp_params(jax.tree.map(jnp.negative, w))


@functools.partial(jax.jit, static_argnums=0)
def _jvp_tangent(config, x, args, consts, args_dot, consts_dot, tol, lin_consts=()):
    """rule='jvp': the solution's tangent."""
    _, rhs = jax.jvp(
        lambda a, c: config.residual_fn(x, *a, *c), (args, consts), (args_dot, consts_dot)
    )
    _, matvec = jax.linearize(lambda y: config.residual_fn(y, *args, *consts), x)
    # The tangent solve must stay linear in the tangents (it is transposed for reverse
    # mode), so its convergence is not checked on them: a probe, the same solve of a
    # fixed right-hand side (a function of the primals alone), is, and its outcome scales
    # the tangents by 1 or NaN (a product, linear in them: NaN also reaches reverse
    # mode's cotangents, which a select would zero). A singular system otherwise gave
    # finite garbage (1e16 from a dense LU, 1e50 from BiCGSTAB) for jax.jacfwd and
    # jax.grad alike.
    x_dot = _linear_solve(config, matvec, jax.tree.map(jnp.negative, rhs), tol, check=False,
                          role="tangent", operands=(x, args, consts, lin_consts))
    if config.on_failure != "ignore":
        flat, unravel = ravel_pytree(x)
        # (cosines at incommensurate angles: no structure a singular matrix's range
        # would contain)
        ramp = jnp.arange(flat.size, dtype=flat.dtype)
        probe = _sharding.vary_like(unravel(jnp.cos(1.7 * ramp + 0.3) + 0.5), x)
        # The probe's outcome is not differentiated (it scales by 1 or NaN), so its
        # operator is built from the primals with their derivatives stopped. (Built from
        # the differentiated ones, under a jitted forward-over-reverse (jax.hessian) of a
        # linear_solver callable closing over a factor of the inputs, JAX 0.10's
        # custom_linear_solve JVP met the constant right-hand side's symbolic-zero
        # tangent beside the operator's non-zero ones and failed.)
        x_s, args_s, consts_s, lin_s = jax.lax.stop_gradient((x, args, consts, lin_consts))
        _, matvec_s = jax.linearize(lambda y: config.residual_fn(y, *args_s, *consts_s), x_s)
        y = _linear_solve(config, matvec_s, probe, tol, role="tangent",
                          operands=(x_s, args_s, consts_s, lin_s))
        scale = jax.tree.map(lambda v: jnp.where(jnp.isfinite(v), 1.0, jnp.nan), y)
        x_dot = jax.tree.map(lambda v, m: v * m.astype(v.dtype), x_dot, scale)
    return x_dot


class AdjointSolveError(RuntimeError):
    """The linear solve of an implicit derivative missed its tolerance."""


def _adjoint_failure(linear_solver, role="adjoint"):
    # (a callable may describe itself, e.g. root's jac_sparsity solve)
    name = (f"linear_solver={linear_solver!r}" if isinstance(linear_solver, str) else
            getattr(linear_solver, "description", "linear_solver=<callable>"))

    def report(operands):
        # (under vmap, e.g. jax.jacrev, every operand may come batched, rtol too)
        ok, relative, rtol = np.broadcast_arrays(*(np.asarray(v) for v in operands))
        if np.all(ok):
            return
        rtol = rtol[~ok].flat[0]  # the first failed solve's
        worst = float(np.nanmax(np.where(ok, 0.0, np.nan_to_num(relative, nan=np.inf))))
        what = (f"relative residual {worst:.3e}" if np.isfinite(worst) else
                "non-finite solution (a singular system, or an iteration that missed its "
                "tolerance within max_steps)")
        raise AdjointSolveError(
            f"implicit differentiation: the {role} linear solve ({name}) "
            f"did not converge: {what}, tolerance rtol={float(rtol):.1e}"
            f" ({int((~ok).sum())} of {ok.size} solves failed). Try linear_solver='gmres' or "
            "'dense', a larger max_steps, or check that the Jacobian of the residual is "
            "nonsingular at the solution (it is singular where the solution is not unique)."
        )

    return report
