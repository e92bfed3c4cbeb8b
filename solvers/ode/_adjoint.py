"""The adjoint rule: a ``jax.custom_vjp`` whose backward pass is another ODE solve.

For ``z' = G(u, s, θ)`` (``u`` = the first ``n_ctrl`` components of ``z``; the others are
quadratures, which ``G`` does not read) with outputs ``z(s_k)`` and output cotangents
``ḡ_k``, the backward pass integrates, from ``s_{T-1}`` down to ``s_0`` and in reversed
time ``r = -s``,

    u' = -G_u(u),    λ_u' = (∂G/∂u)ᵀ λ,    θ̄' = (∂G/∂θ)ᵀ λ,

with ``λ = (λ_u, λ_q)`` (``λ_q``, the quadratures' adjoint, is constant between outputs),
adding ``ḡ_k`` to ``λ`` and restarting ``u`` from the stored forward output at every
output time. ``θ̄`` is left out of the step-size control (a seminorm). Time cotangents are
``t̄_k = ḡ_k · G(z_k, s_k)`` for ``k ≥ 1`` and ``t̄_0 = -λ(s_0⁺) · G(z_0, s_0)``.

Each interval is solved by the same custom_vjp-wrapped integrator applied to the augmented
system, so the backward pass is itself differentiable (``grad(grad(...))``) and memory
holds only the outputs, whatever the number of steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from implicit import _sharding

from solvers import _status
from solvers.ode import _control, _explicit, _integrate, _small

__all__ = ["make_solve", "DRIFT_LIMIT"]

#: The backsolve adjoint fails (status drift) when the state it integrates backwards
#: comes back further than this from a stored output, in units of the adjoint tolerances
#: (the weighted RMS norm of the step control).
DRIFT_LIMIT = 100.0

#: The discrete adjoint's checkpoint slots (memory: this many states, whatever max_steps).
NUM_CHECKPOINTS = 128

#: The discrete adjoint fails (status gradient_error) when its estimate of the gradient's
#: error (:func:`_discrete_bwd`) exceeds this fraction of the gradient.
GRADIENT_LIMIT = 0.05

#: Substeps of an explicit step whose adjoint local error estimate exceeds the tolerance.
REFINE = 16
#: The discrete adjoint's backward trips (:func:`_discrete_bwd`): a step, a substep
#: forwards, a substep backwards, a refined step's outputs inside it.
STEP, SUB_FWD, SUB_BWD, DENSE = 0, 1, 2, 3
#: ... when the estimate exceeds this many times the forward tolerances (the steps were
#: chosen to make y's own estimate about 1; measured, the adjoint's: median 1 to 6, at
#: most 40 at rtol 1e-6 and 410 at 1e-12 on Lotka–Volterra and a Kepler orbit with
#: e = 0.9, whatever the tolerance; 627 at rtol 1e-6 and 6e5 at 1e-9 on the first step
#: of a zero solution, whose derivative is 5.2e-4 off unrefined).
REFINE_LIMIT = 100.0


def _flat(tree, dtype):
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((0,), dtype)
    return jnp.concatenate([jnp.ravel(leaf).astype(dtype) for leaf in leaves])


def _stack(*trees):
    """The trees (of one structure) stacked leaf by leaf: rows of cotangents for one
    ``jax.vmap`` of a vjp."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _row(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


def _cat(parts):
    """``jnp.concatenate(parts)`` for the backsolve adjoint's augmented state: on an
    Explicit mesh its pieces (a state split over the mesh, parameters' cotangents split
    their own ways, scalars) are gathered first, and the augmented system is integrated
    replicated (docs/scaling.md)."""
    return jnp.concatenate([_sharding.gathered(p) for p in parts])


def _unflat(flat, like):
    """The parameters' cotangent ``flat`` as a pytree like ``theta`` (``like``).

    Under ``shard_map``, ``odeint`` casts its arguments to vary with the state, so a
    cotangent varies where its parameter does. A value that ``f`` closes over cannot be
    cast before ``f`` is traced: one that does not vary while the state does gets a
    cotangent summed over the devices inside every step's derivative (a collective in
    loops whose trip counts differ between devices), typed as varying. That is refused
    here, with the way out, rather than by JAX's type check of the rule.
    """
    leaves, treedef = jax.tree.flatten(like)
    out, start = [], 0
    for leaf in leaves:
        size = jnp.size(leaf)
        out.append(flat[start : start + size].reshape(jnp.shape(leaf)).astype(leaf.dtype))
        start += size
        extra = _sharding.varying(out[-1]) - _sharding.varying(leaf)
        if extra:
            raise ValueError(
                "odeint under shard_map: f (or event) closes over a traced floating value "
                f"that does not vary over the mesh axes {sorted(extra)} while the solve "
                "does (a replicated parameter), and the solve is differentiated. Pass it "
                "to odeint as an argument instead (odeint(f, y0, ts, k) with f(y, t, k)), "
                "or close over jax.lax.pcast(k, axes, to='varying'): arguments are cast "
                "to vary with the state, and JAX sums their gradients over the devices "
                "once, where it transposes the cast."
            )
    return jax.tree.unflatten(treedef, out)


#: What to do for a second derivative the rule does not give.
_HIGHER = ("use the default adjoint='discrete' (second derivatives: jax.hessian, grad of "
           "grad), adjoint='forward' (forward sensitivities: jax.hessian, jax.jacfwd, "
           "jax.jvp and grad of grad, any order) or adjoint='backsolve' (grad of grad)")
#: The interpolating adjoint's backward pass has no derivative of its own.
FIRST_ORDER = ("solvers.odeint: the interpolating adjoint gives first derivatives only; "
               f"for higher derivatives {_HIGHER}")


def _refusing(message):
    """The identity ``(out, *dependencies) -> out`` whose derivative raises
    ``NotImplementedError(message)``: a value that must not be differentiated further,
    refused where JAX would otherwise differentiate it wrongly or drop the derivative."""

    @jax.custom_jvp
    def refuse(out, *dependencies):
        return out

    @refuse.defjvp
    def refuse_jvp(primals, tangents):
        raise NotImplementedError(message)

    return refuse


#: The interpolating adjoint's backward pass: any derivative of it reaches this (reverse,
#: grad of grad, linearises through it too; forward over reverse calls it directly).
_first_order_only = _refusing(FIRST_ORDER)

#: The discrete adjoint's second-order rules (make_solve) are not differentiated again.
SECOND_ORDER = ("solvers.odeint: the discrete adjoint gives first and second derivatives "
                "(jax.hessian, grad of grad, jacrev of jacrev); for third and higher "
                "derivatives pass adjoint='forward' (forward sensitivities, any order)")
#: The values the second-order rules' linear maps close over: a tangent there is a third
#: derivative, which lax.custom_linear_solve would drop (its solve's closure is not
#: differentiated).
_second_order_only = _refusing(SECOND_ORDER)


def is_zero(t):
    """Whether ``t`` is a symbolic zero tangent (a ``custom_jvp`` rule's, with
    ``symbolic_zeros=True``)."""
    return isinstance(t, SymbolicZero)


def zero_tangent(x):
    """A zero tangent for the primal ``x`` (float0 for integer and boolean arrays), varying
    over the ``shard_map`` axes ``x`` varies over (a tangent has its primal's type)."""
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return _sharding.vary_like(jnp.zeros_like(x), x)
    return _sharding.vary_like(np.zeros(np.shape(x), jax.dtypes.float0), x)


def _linear(fun, fun_t, t, like):
    """``fun(t)``, linear in ``t``, shaped like ``like``, whose transpose is ``fun_t``.

    A ``jax.lax.custom_linear_solve`` of the identity whose "solve" is ``fun``: JAX
    evaluates ``fun`` forwards (``jvp``, ``vmap``) and ``fun_t`` where it transposes
    (reverse mode), and neither needs to be transposable itself (each may be a
    forward-mode pass through the solver's loops). ``t`` may hold symbolic zeros (a
    ``custom_jvp`` rule's, ``symbolic_zeros=True``): only its other leaves are unknowns,
    with a zero of ``like``'s shape (times them: every unknown must be linear) to make
    the system square.
    """
    leaves, tree = jax.tree.flatten(t, is_leaf=is_zero)
    live = [not is_zero(v) for v in leaves]
    if not any(live):
        return jax.tree.map(jnp.zeros_like, like)

    def whole(lin):
        lin = iter(lin)
        return tree.unflatten([next(lin) if k else jnp.zeros(v.shape, v.dtype)
                               for v, k in zip(leaves, live)])

    lin = [v for v, k in zip(leaves, live) if k]
    scale = 0 * sum(jnp.sum(v) for v in lin)
    pad = jax.tree.map(lambda o: scale.astype(o.dtype) * jnp.zeros_like(o), like)
    # (Each in a jax.jit: under vmap, custom_linear_solve batches both functions once per
    # round of its fixed point on what is batched, and an inner jaxpr batched the same way
    # again is JAX's cached one; inlined by XLA.)
    fun_j = jax.jit(lambda lin: fun(whole(lin)))
    fun_t_j = jax.jit(lambda c: [v for v, k in zip(tree.flatten_up_to(fun_t(c)), live) if k])
    return jax.lax.custom_linear_solve(
        lambda v: v, (lin, pad),
        solve=lambda _, b: ([jnp.zeros_like(v) for v in b[0]], fun_j(b[0])),
        transpose_solve=lambda _, c: (fun_t_j(c[1]), jax.tree.map(jnp.zeros_like, c[1])),
    )[1]


def make_solve(make_stepper, G, n_ctrl, *, on_failure, report, adjoint="backsolve", window=32,
               max_steps=None, progress=None, record=0, event=None, log=0, direction="both",
               slope=None):
    """A differentiable ``solve(z0, ts, theta, const, ctl, ev=((), ())) -> (zs, Stats)``.

    ``G(u, s, theta, const)`` returns the derivative of the whole state; ``theta`` is a
    pytree of floating arrays (differentiated), ``const`` anything else (not).
    ``ctl = (rtol, atol, adjoint_rtol, adjoint_atol, h0, max_steps)``.
    ``make_stepper(rhs, n_ctrl, rtol=, atol=)`` builds the method for ``rhs(u, s)``;
    ``report(status, t) -> flag`` raises the failure of a backward pass from the host
    (fold the flag into the gradient so that the check stays).
    ``adjoint``: ``"backsolve"`` or ``"interpolate"`` (see :func:`_interpolating_bwd`),
    ``window``: the interpolating adjoint's step buffer; ``progress``: the forward
    loop's host callback (:func:`_integrate.integrate`), never the backward passes'.
    Outputs that are not differentiated (their cotangents are dropped: apply
    ``stop_gradient`` to them) follow ``(zs, Stats)`` when asked for: with ``record=B``
    the :class:`~solvers.ode._integrate.Record` of the last ``B`` accepted steps (dense
    output), with ``log=M`` the :class:`~solvers.ode._integrate.EventLog` of the
    non-terminal crossings of ``event(u, s, theta, const, ev_theta, ev_const) -> (E,)``
    in ``direction`` (``ev = (ev_theta, ev_const)``: the event function's own values).
    ``slope(u, s, theta, const)``: the state's time derivative where it is not ``G`` (a
    DAE's consistent slope), for the output times' cotangents (discrete adjoint only).
    """

    def run(z0, ts, theta, const, ctl, ev, checkpoint=None):
        rtol, atol, _, _, h0, budget = ctl

        def rhs(u, s):
            return G(u, s, theta, const)

        kw = {}
        if log:
            kw = dict(event=lambda u, s: event(u, s, theta, const, *ev), log=log,
                      direction=direction)
        stepper = make_stepper(rhs, n_ctrl, rtol=rtol, atol=atol)
        out = _integrate.integrate(
            stepper, lambda u, s: rhs(u, s)[:n_ctrl], z0, ts, rtol, atol, h0, budget, n_ctrl,
            checkpoint=checkpoint, progress=progress, record=record,
            hold=adjoint == "discrete", **kw,
        )
        rest = out[2:]
        ck = None
        if checkpoint:
            ck, rest = rest[0], rest[1:]
        return out[0], out[1], tuple(rest), ck

    @jax.custom_vjp
    def solve(z0, ts, theta, const, ctl, ev):
        zs, stats, rest, _ = run(z0, ts, theta, const, ctl, ev)
        return (zs, stats, *rest)

    def solve_fwd(z0, ts, theta, const, ctl, ev):
        if adjoint == "discrete":
            out, inner = forward(z0, ts, theta, const, ctl, ev)
            return out, ((z0, ts, theta), (const, ctl, ev), inner)
        # Through `solve`, not `run`: differentiating the residuals (grad of grad) then
        # uses this rule again instead of the stepping loop.
        out = solve(z0, ts, theta, const, ctl, ev)
        return out, (out[0], ts, theta, const, ctl)

    def G_adjoint(u2, r, theta2, const):
        # The augmented system in reversed time r = -s: (u, λ_u)' = (-G_u, (∂G/∂u)ᵀ λ) and
        # θ̄' = (∂G/∂θ)ᵀ λ, with λ = (λ_u, λ_q) and λ_q (quadratures' adjoint) a parameter.
        theta, lam_q = theta2
        u, lam_u = u2[:n_ctrl], u2[n_ctrl:]
        dz, vjp = jax.vjp(lambda u, th: G(u, -r, th, const), u, theta)
        u_bar, theta_bar = vjp(_sharding.split_like(_cat([lam_u, lam_q]), dz))
        return _cat([-dz[:n_ctrl], u_bar, _flat(theta_bar, dz.dtype)])

    def backsolve_intervals(zs, ts, theta, const, ctl, gz):
        # Output interval by output interval, each a differentiable `solve` of the
        # augmented system: the form that is differentiated again (grad of grad).
        _, _, adj_rtol, adj_atol, _, budget = ctl
        dtype = zs.dtype
        T, N = zs.shape
        n_u = n_ctrl
        adjoint_solve = make_solve(
            make_stepper, G_adjoint, 2 * n_u, on_failure=on_failure, report=report
        )

        def interval(carry, k):
            lam, theta_bar, h, left, status, t_fail = carry
            lam = lam + gz[k]
            z2 = _cat([zs[k, :n_u], lam[:n_u], theta_bar])
            ts2 = jnp.stack([-ts[k], -ts[k - 1]])
            ctl2 = (adj_rtol, adj_atol, adj_rtol, adj_atol, h, left)
            zs2, st = adjoint_solve(z2, ts2, (theta, lam[n_u:]), const, ctl2)
            end = zs2[1]
            lam = _cat([end[n_u : 2 * n_u], lam[n_u:]])
            first_failure = (status == _integrate.NOT_FAILED) & (st.status != _integrate.NOT_FAILED)
            t_fail = jnp.where(first_failure, -st.t, t_fail)
            status = jnp.where(status == _integrate.NOT_FAILED, st.status, status)
            left = jnp.where(status == _integrate.NOT_FAILED, left - st.num_steps, 0)
            return (lam, end[2 * n_u :], st.h, left, status, t_fail), None

        init = (
            jnp.zeros((N,), dtype),
            _flat(theta, dtype) * 0,
            jnp.zeros((), dtype),  # automatic initial step on the first interval
            jnp.asarray(budget, jnp.int32),
            jnp.asarray(_integrate.NOT_FAILED, jnp.int32),
            ts[-1],
        )
        (lam, theta_bar, _, _, status, t_fail), _ = _sharding.scan(
            interval, init, jnp.arange(T - 1, 0, -1)
        )
        return lam, theta_bar, status, t_fail

    def backsolve_loop(zs, ts, theta, const, ctl, gz):
        # The same integration as one loop that lands on every output time and jumps
        # there (u restarts from the stored output, λ gains the cotangent). The state is
        # (u, λ_u, λ_q | θ̄): λ_q, constant between outputs, rides along with zero slope.
        _, _, adj_rtol, adj_atol, _, budget = ctl
        dtype = zs.dtype
        T, N = zs.shape
        n_u = n_ctrl
        n_c = n_u + N

        # The last component (not controlled, zero slope) keeps the largest drift of the
        # backward-integrated state from the stored outputs, in units of the tolerance.
        def rhs(v, r):
            u, lam = v[:n_u], v[n_u:n_c]
            dz, vjp = jax.vjp(lambda u, th: G(u, -r, th, const), u, theta)
            u_bar, theta_bar = vjp(_sharding.split_like(lam, dz))  # (dz: as f splits it)
            zeros = jnp.zeros((N - n_u,), dtype)
            return _cat(
                [-dz[:n_u], u_bar, zeros, _flat(theta_bar, dtype), jnp.zeros((1,), dtype)]
            )

        def drift(u, k):
            return _control.error_ratio(u - zs[k, :n_u], u, zs[k, :n_u], adj_rtol, adj_atol,
                                        n_u)

        def jump(j, z):
            k = T - 1 - j
            worst = jnp.maximum(z[-1], drift(z[:n_u], k))
            return _cat([zs[k, :n_u], z[n_u:n_c] + gz[k], z[n_c:-1], worst[None]])

        stepper = make_stepper(rhs, n_c, rtol=adj_rtol, atol=adj_atol)
        z0 = _cat(
            [zs[T - 1, :n_u], gz[T - 1], _flat(theta, dtype) * 0, jnp.zeros((1,), dtype)]
        )
        end, st = _integrate.integrate_jumps(
            stepper, lambda v, r: rhs(v, r)[:n_c], z0, -ts[::-1], adj_rtol, adj_atol,
            jnp.zeros((), dtype), budget, n_c, jump,
        )
        worst = jnp.maximum(end[-1], drift(end[:n_u], 0))
        # Integrating the state backwards is unstable for dissipative dynamics: a state
        # that comes back far from the forward one means a wrong gradient. Fail instead.
        drifted = (st.status == _integrate.NOT_FAILED) & ~(worst <= DRIFT_LIMIT)
        status = jnp.where(drifted, _integrate.DRIFT, st.status)
        t_fail = jnp.where(drifted, ts[0], -st.t)
        return end[n_u:n_c], end[n_c:-1], status, t_fail

    @jax.custom_vjp
    def backsolve(zs, ts, theta, const, ctl, gz):
        return backsolve_loop(zs, ts, theta, const, ctl, gz)

    def backsolve_fwd(zs, ts, theta, const, ctl, gz):
        return backsolve(zs, ts, theta, const, ctl, gz), (zs, ts, theta, const, ctl, gz)

    def backsolve_bwd(res, cotangents):
        zs, ts, theta, const, ctl, gz = res

        def differentiable(zs, ts, theta, gz):
            return backsolve_intervals(zs, ts, theta, const, ctl, gz)[:2]

        _, vjp = jax.vjp(differentiable, zs, ts, theta, gz)
        zs_bar, ts_bar, theta_bar, gz_bar = vjp(cotangents[:2])
        return zs_bar, ts_bar, theta_bar, None, None, gz_bar

    backsolve.defvjp(backsolve_fwd, backsolve_bwd)

    def solve_bwd(res, cotangents):
        if adjoint == "discrete":
            x, nondiff, inner = res
            return *backward(x, cotangents[0], nondiff, inner), None, None, None
        if adjoint == "interpolate":
            return (*_interpolating_bwd(
                make_stepper, G, res, cotangents[0], window, on_failure=on_failure,
                report=report,
            ), None)
        zs, ts, theta, const, ctl = res
        gz = cotangents[0]
        T = zs.shape[0]
        n_u = n_ctrl
        if T == 1:
            lam, theta_bar = jnp.zeros_like(gz[0]), _flat(theta, zs.dtype) * 0
            status, t_fail = jnp.asarray(_integrate.NOT_FAILED, jnp.int32), ts[0]
        else:
            lam, theta_bar, status, t_fail = backsolve(zs, ts, theta, const, ctl, gz)
            lam = _sharding.split_like(lam, gz[0])  # (gathered on an Explicit mesh)
        z0_bar, ts_bar, theta_bar = _finish(
            lambda u, t: G(u, t, theta, const), zs[:, :n_u], ts, gz, lam, theta_bar,
            status, t_fail, on_failure=on_failure, report=report,
        )
        theta_bar = jax.tree.map(_sharding.split_like, _unflat(theta_bar, theta), theta)
        return z0_bar, ts_bar, theta_bar, None, None, None

    solve.defvjp(solve_fwd, solve_bwd)

    # --- the discrete adjoint, differentiable twice ---------------------------------
    #
    # The forward pass and the backward pass are each a jax.custom_jvp whose tangent is a
    # linear map with its transpose given (_linear), so that JAX differentiates them
    # forwards (jax.hessian) and in reverse (grad of grad) without differentiating a loop
    # in reverse. With x = (z0, ts, θ), the outputs zs(x), J = ∂zs/∂x (the steps held
    # fixed) and the gradient g(x, ḡ) = Jᵀ ḡ:
    #   forward:   ẋ ↦ J ẋ, transposed: z̄s ↦ Jᵀ z̄s (the adjoint pass);
    #   backward:  (ẋ, ḡ̇) ↦ H_ḡ ẋ + Jᵀ ḡ̇, transposed: u ↦ (H_ḡ u, J u), with
    #              H_ḡ = ∂²(ḡ·zs)/∂x², symmetric;
    # each a forward-mode pass (the tangent-linear) through the passes recomputed from x
    # (`tangents`): the residuals' tangents are not used, as a forward pass recomputed in
    # another program may take other steps (XLA rounds each program its own way), and a
    # tangent must come from the steps its primal took. The output times' derivatives
    # come from the flow outside the integration (`flow`).

    checkpoint = (window, NUM_CHECKPOINTS)

    @jax.custom_jvp
    def forward(z0, ts, theta, const, ctl, ev):
        zs, stats, rest, ck = run(z0, ts, theta, const, ctl, ev, checkpoint=checkpoint)
        return (zs, stats, *rest), (zs, ck, stats.num_accepted, stats.status, stats.t)

    def flow(x, const):
        # The output times' derivatives, to second order, from the flow outside the
        # integration (whose steps and output times are held): starting from z0 at
        # t0 + δ0 is starting at t0 from w = z0 - f δ0 + ½(f_y f - f_t) δ0², and the
        # output at t_k + δ_k is z_k + f δ_k + ½(f_y f + f_t) δ_k² (f: the state's time
        # derivative, a DAE's slope). The same values; the derivatives the first-order
        # rule gives for the times (_finish), differentiable again.
        z0, ts, theta = x
        held = jax.lax.stop_gradient(ts)
        d = ts - held
        f = G if slope is None else slope

        def taylor(z, s, theta, dk, sign):
            fz = f(z, s, theta, const)
            df = jax.jvp(lambda z, s: f(z, s, theta, const), (z, s),
                         (fz, sign * jnp.ones_like(s)))[1]
            return z + sign * fz * dk + 0.5 * df * dk**2

        def start(z0, d0, theta):
            return taylor(z0, held[0], theta, d0, -1)

        def shift(zs, d, theta):
            return jax.vmap(lambda z, s, dk: taylor(z, s, theta, dk, 1))(zs, held, d)

        return held, d, start, shift

    def adjoint_pass(zs, ts, theta, nondiff, rest, gz):
        # The discrete adjoint's gradient (z̄0, t̄s, θ̄) from the forward pass's residuals.
        const, ctl, _ = nondiff
        return _discrete_bwd(make_stepper, G, (zs, ts, theta, const, ctl, *rest), gz, window,
                             on_failure=on_failure, report=report, slope=slope)[:3]

    def outputs_and_gradient(x, gz, nondiff, gradient=True):
        # `forward` and `backward` from x, their derivatives with the output times moved
        # out of the integration (flow).
        const, ctl, ev = nondiff
        held, d, start, shift = flow(x, const)
        z0, _, theta = x
        w, start_vjp = jax.vjp(start, z0, d[0], theta)
        zs, stats, _, ck = run(w, held, theta, const, ctl, ev,
                               checkpoint=checkpoint if gradient else None)
        out, shift_vjp = jax.vjp(shift, zs, d, theta)
        if not gradient:
            return out
        gzs, d_bar, theta_bar = shift_vjp(gz)
        w_bar, _, theta_run = adjoint_pass(
            zs, held, theta, nondiff, (ck, stats.num_accepted, stats.status, stats.t), gzs)
        z0_bar, d0_bar, theta_start = start_vjp(w_bar)
        theta_bar = jax.tree.map(lambda *v: sum(v), theta_bar, theta_run, theta_start)
        return out, (z0_bar, d_bar.at[0].add(d0_bar), theta_bar)

    # Each a jax.jit of a stable function: the backward rule's map and its transpose are
    # the same one, so JAX traces and batches it once (a jaxpr batched the same way again
    # is JAX's cached one; the copies compile as before, inlined by XLA).

    @jax.jit
    def tangent_of_outputs(x, nondiff, t):  # J ẋ
        return jax.jvp(lambda *x: outputs_and_gradient(x, None, nondiff, False), x, t)[1]

    @jax.jit
    def tangents(x, gz, nondiff, t):  # (J ẋ, H_ḡ ẋ + Jᵀ ḡ̇)
        return jax.jvp(lambda x, gz: outputs_and_gradient(x, gz, nondiff), (x, gz), t)[1]

    @functools.partial(forward.defjvp, symbolic_zeros=True)
    def forward_jvp(primals, tangents_in):
        out, inner = forward(*primals)
        x, nondiff = _second_order_only(primals[:3]), primals[3:]
        zs_dot = _linear(lambda t: tangent_of_outputs(x, nondiff, t),
                         lambda c: backward(x, c, nondiff, inner),
                         tuple(tangents_in[:3]), out[0])
        zero = jax.tree.map(zero_tangent, (out[1:], inner))
        return (out, inner), ((zs_dot, *zero[0]), zero[1])

    @jax.custom_jvp
    def backward(x, gz, nondiff, inner):
        zs, *rest = inner
        return adjoint_pass(zs, *x[1:], nondiff, rest, gz)

    @functools.partial(backward.defjvp, symbolic_zeros=True)
    def backward_jvp(primals, tangents_in):
        x, gz, nondiff, inner = primals
        g = backward(*primals)
        x, gz = _second_order_only((x, gz))

        def H_t(u):  # (H_ḡ u, J u)
            zs_dot, g_dot = tangents(x, gz, nondiff, (u, jnp.zeros_like(gz)))
            return g_dot, zs_dot

        return g, _linear(lambda t: tangents(x, gz, nondiff, t)[1], H_t,
                          tuple(tangents_in[:2]), g)

    def solve_with_events(z0, ts, theta, const, ctl, ev=((), ())):
        return solve(z0, ts, theta, const, ctl, ev)

    # (a terminal event's rule goes through these: _events.make_event_solve)
    solve_with_events.rule = (solve_fwd, solve_bwd)
    return solve_with_events


def _interpolating_bwd(make_stepper, G, res, gz, window, *, on_failure, report):
    """The adjoint with the state interpolated from a forward re-integration.

    Output interval by output interval (last first), the forward solution is recomputed
    from the stored output, keeping the continuous extension of its last ``window`` steps;
    ``λ' = (∂G/∂u)ᵀ λ``, ``θ̄' = (∂G/∂θ)ᵀ λ`` is integrated backwards over those steps with
    ``u`` from the interpolant; if the interval took more steps, the forward is recomputed
    again up to where the covered part began, and so on. The state is never integrated
    backwards, so stiff problems (whose backward state equation is unstable) are fine;
    memory is ``window`` steps, whatever the number of steps.
    """
    zs, ts, theta, const, ctl = jax.tree.map(jax.lax.stop_gradient, res)
    gz_in = gz
    gz = jax.lax.stop_gradient(gz)
    rtol, atol, adj_rtol, adj_atol, _, budget = ctl
    dtype = zs.dtype
    T, n = zs.shape
    budget = jnp.asarray(budget, jnp.int32)

    def rhs(u, s):
        return G(u, s, theta, const)

    def adjoint_rhs(record):
        def G_lam(lam, r):
            t = -r
            y = _integrate.interpolate(record, t)
            _, vjp = jax.vjp(lambda u, th: G(u, t, th, const), y, theta)
            u_bar, theta_bar = vjp(lam[:n])
            return jnp.concatenate([u_bar, _flat(theta_bar, dtype)])

        return G_lam

    def window_step(carry):
        k, end, lam, theta_bar, h, left, status, t_fail = carry
        a = ts[k - 1]
        forward = make_stepper(rhs, n, rtol=rtol, atol=atol)
        _, st_f, record = _integrate.integrate(
            forward, rhs, zs[k - 1], jnp.stack([a, end]), rtol, atol, jnp.zeros((), dtype),
            budget, n, record=window,
        )
        G_lam = adjoint_rhs(record)
        # The parameter cotangents are step-controlled too (not a seminorm): their
        # integrand λ·∂f/∂θ(y) follows y's fast transients, which nothing else here
        # resolves (y is interpolated, not integrated). Leaving them out let the backward
        # steps stride over those transients: gradient errors of 1e-4 at rtol 1e-8 (one
        # eigenvalue -100), growing with stiffness and with the window (issue 10).
        nc = n + theta_bar.shape[0]
        backward = make_stepper(G_lam, nc, rtol=adj_rtol, atol=adj_atol)
        z2 = jnp.concatenate([lam, theta_bar])
        out, st_b = _integrate.integrate(
            backward, lambda v, r: G_lam(v, r)[:nc], z2, jnp.stack([-end, -record.start]),
            adj_rtol, adj_atol, h, left, nc,
        )
        fail_f = st_f.status != _integrate.NOT_FAILED
        new_status = jnp.where(fail_f, st_f.status, st_b.status)
        new_t = jnp.where(fail_f, st_f.t, -st_b.t)
        first = (status == _integrate.NOT_FAILED) & (new_status != _integrate.NOT_FAILED)
        status = jnp.where(status == _integrate.NOT_FAILED, new_status, status)
        t_fail = jnp.where(first, new_t, t_fail)
        end = out[1]
        return (k, record.start, end[:n], end[n:], st_b.h, left - st_b.num_steps, status,
                t_fail)

    def interval(carry, k):
        lam, theta_bar, h, left, status, t_fail = carry
        lam = lam + gz[k]

        def more(c):
            # Bounded by the step budget: every window takes at least one backward step.
            return (c[1] > ts[k - 1]) & (c[6] == _integrate.NOT_FAILED) & (c[5] > 0)

        # The jump in λ starts a fresh transient: pick the first step afresh (h = 0).
        c = (k, ts[k], lam, theta_bar, h * 0, left, status, t_fail)
        _, end, lam, theta_bar, h, left, status, t_fail = _sharding.while_loop(
            more, window_step, c
        )
        # Out of budget before the interval's start: max_steps.
        short = (status == _integrate.NOT_FAILED) & (end > ts[k - 1])
        t_fail = jnp.where(short, end, t_fail)
        status = jnp.where(short, _status.MAX_STEPS, status)
        return (lam, theta_bar, h, left, status, t_fail), None

    init = (
        _sharding.zeros_like(zs[0]),  # (sharded like the state on an Explicit mesh)
        _flat(theta, dtype) * 0,
        jnp.zeros((), dtype),  # automatic initial step on the first window
        budget,
        jnp.asarray(_integrate.NOT_FAILED, jnp.int32),
        ts[-1],
    )
    (lam, theta_bar, _, _, status, t_fail), _ = _sharding.scan(
        interval, init, jnp.arange(T - 1, 0, -1)
    )
    z0_bar, ts_bar, theta_bar = _finish(
        rhs, zs, ts, gz, lam, theta_bar, status, t_fail, on_failure=on_failure, report=report
    )
    z0_bar, ts_bar, theta_bar = _first_order_only(
        (z0_bar, ts_bar, theta_bar), res[0], res[1], res[2], gz_in
    )
    return z0_bar, ts_bar, _unflat(theta_bar, theta), None, None


def _finish(rhs, us, ts, gz, lam, theta_bar, status, t_fail, *, on_failure, report):
    """Cotangents of ``y0`` and ``ts`` from the adjoint at ``ts[0]``, then ``on_failure``.

    ``rhs(u, t)`` is the right-hand side at the stored outputs ``us``; ``dL/dt_i`` is
    ``gz_i · f(y_i, t_i)`` for the later times and ``-λ · f(y_0, t_0)`` for the first.
    """
    f0 = rhs(us[0], ts[0])
    t_bar0 = -_sharding.matmul(lam, f0, out_sharding=_sharding.replicated(lam, f0))
    z0_bar = lam + gz[0]
    dzs = jax.vmap(rhs)(us[1:], ts[1:])
    ts_bar = jnp.concatenate([t_bar0[None], jnp.sum(gz[1:] * dzs, axis=1)])
    cotangents = (z0_bar, ts_bar, theta_bar)
    # Traced times that are not increasing: the forward outputs were NaN after ts[0]
    # whatever on_failure, and so are the cotangents.
    valid = _integrate.valid_times(ts)
    cotangents = tuple(jnp.where(valid, v, jnp.nan) for v in cotangents)
    # A NaN or inf cotangent of the outputs (a loss that became NaN) is the caller's, not
    # the adjoint's failure: NaN cotangents, as through JAX's own derivatives (which
    # optax.apply_if_finite and the like rely on), and nothing reported.
    upstream = ~jnp.all(jnp.isfinite(gz))
    status = jnp.where(upstream, _integrate.NOT_FAILED, status)
    cotangents = tuple(jnp.where(upstream, jnp.nan, v) for v in cotangents)
    if on_failure == "nan":
        failed = status != _integrate.NOT_FAILED
        cotangents = tuple(jnp.where(failed, jnp.nan, v) for v in cotangents)
    elif on_failure == "raise":
        ok = report(status, t_fail)
        cotangents = tuple(jnp.where(ok, v, jnp.nan) for v in cotangents)
    return cotangents


def _diff_step(stepper):
    """``(s, z, cache, h, ks, eps=None) -> (z1, accept_cache, ks, err)``, differentiable
    (see Stepper)."""
    if stepper.diff_step is not None:
        return stepper.diff_step

    def diff_step(s, z, cache, h, ks_star, eps=None):
        z1, err, ks, cache_acc, _, _, _ = stepper.step(s, z, cache, h)
        return z1 if eps is None else z1 + eps, cache_acc, ks, err

    return diff_step


def _discrete_bwd(make_stepper, G, res, gz, window, *, on_failure, report, slope=None):
    """The discrete adjoint: the exact derivative of the computed outputs.

    The forward pass saved its loop carry (controller, state, cache) every ``window``
    accepted steps. Segment by segment (last first), the steps are replayed from the
    checkpoint with the forward's own step function (:func:`_integrate._attempt`), so the
    same steps are taken, and the accepted ones are kept (``window`` of them); then the
    cotangent runs back through them, one ``jax.vjp`` of each step (the step sizes and
    times are held fixed; an implicit method's stage equations are differentiated by the
    implicit function theorem at the stage values it found).
    Output ``y(t_j)`` is the continuous extension of the step containing ``t_j`` (or the
    state at its end), as in the forward loop, so its cotangent enters through that step.
    Nothing is integrated backwards: stable for any stiffness, and the result does not
    depend on ``window`` (memory only: ``NUM_CHECKPOINTS`` = 128 checkpoints, whatever
    ``max_steps``, plus ``window`` steps; past 128 x ``window`` steps the checkpoints thin
    out to every 2, 4, ... x ``window`` steps and each block of ``window`` steps is replayed
    from the nearest one: up to that spacing in extra replayed steps per block).
    """
    # (no stop_gradient: make_solve's second-order rules differentiate this pass
    # forwards, with the forward's steps held fixed: its run)
    zs, ts, theta, const, ctl, ck, n_acc, forward_status, t_last = res
    rtol, atol, _, _, _, budget = ctl
    budget = jnp.asarray(budget, jnp.int32)
    dtype = zs.dtype
    T, n = zs.shape
    W = window
    i32 = jnp.int32
    t_end = ts[-1]

    def stepper_of(theta):
        return make_stepper(lambda u, s: G(u, s, theta, const), n, rtol=rtol, atol=atol)

    stepper = stepper_of(theta)
    dense = jnp.asarray(stepper.dense.T, dtype)  # (degree, stages)
    degree = dense.shape[0]

    def clip_of(s):
        # Where the forward loop's step from s would be cut: the end, or (a method that
        # lands on the output times) the next output time.
        if not stepper.lands:
            return t_end
        return ts[jnp.minimum(jnp.searchsorted(ts, s, side="right"), T - 1)]

    bufs, spacing = ck
    num_slots = bufs[1].shape[0]
    Controller = _integrate.Controller
    cache_like = jax.tree.map(lambda b: b[0], bufs[2])
    stages = dense.shape[1]

    # Rows a block may keep: W, and a few more where the replay takes more steps to land
    # than the forward did (see replay).
    R = W + 2 + W // 16

    def replay(blk, active):
        """The accepted steps ``blk·W ..``: ``(ok, count, buf)``, replayed from the last
        checkpoint at or before them. Rows ``0 .. R-1`` of ``buf = (s, h, s1, z, cache,
        ks)`` hold them; the steps not kept (rejected, or before the block) go to the
        spare row ``R`` (:func:`_integrate.write_row`).

        A block whose end the forward's time is known at (a checkpoint, or the forward's
        last step) is replayed up to that time, its last step stretched onto it where it
        would end within ``_integrate.SNAP`` of its size short of it. The replay is
        another program than the forward loop, and XLA may round a step differently in it:
        measured with LLVM at -O0 on CPU, kvaerno5's and bdf's replayed steps ended 1e-10
        off the forward's, and kvaerno5 flipped a step's acceptance on Lotka-Volterra.
        Counted to the forward's number of steps alone, that replay stopped short of the
        outputs (a gradient 15% off at window 512, where nothing failed); a step added to
        close a 1e-10 gap ruined bdf's history (6% off). Landing, the blocks join, and the
        gradient is the exact derivative of the replayed steps. ``ok``: the block was
        replayed to its end (its time within R steps, or its count; for a method whose
        cache is its history, the forward's number of steps). ``active``: False for an
        element whose blocks are done (under vmap), which replays nothing (count 0)."""
        first = blk * W
        slot = _integrate.div(first, spacing)
        packed, z, cache = jax.tree.map(lambda b: b[slot], bufs)
        target = jnp.minimum(first + W, n_acc)
        last_block = target == n_acc
        at_checkpoint = (target == (slot + 1) * spacing) & (slot + 1 < num_slots)
        t_checkpoint = Controller.time(
            jax.tree.map(lambda b: b[jnp.minimum(slot + 1, num_slots - 1)], bufs[0]))
        land = last_block | at_checkpoint
        t_land = jnp.where(last_block, t_last, jnp.where(at_checkpoint, t_checkpoint, jnp.inf))
        buf = (
            jnp.zeros((R + 1,), dtype),
            jnp.ones((R + 1,), dtype),
            jnp.zeros((R + 1,), dtype),
            _sharding.rows_like(z, R + 1),  # (sharded like the state on an Explicit mesh)
            jax.tree.map(lambda v: _sharding.rows_like(v, R + 1), cache_like),
            _sharding.rows_like(_sharding.rows_like(z, stages), R + 1),
        )

        def cond(carry):
            packed, _, _, _, tries = carry
            ctrl = Controller.unpack(packed)
            more = jnp.where(land, ctrl.s < t_land, ctrl.num_accepted < target)
            return active & more & (ctrl.status == _integrate.NOT_FAILED) & (tries < budget)

        def body(carry):
            packed, z, cache, buf, tries = carry
            ctrl = Controller.unpack(packed)
            new, z1, cache1, (accept, s, h, z_old, ks) = _integrate._attempt(
                stepper, ctrl, z, cache, jnp.minimum(clip_of(ctrl.s), t_land), t_end,
                budget, rtol, atol, n, hold=True,
            )
            row = ctrl.num_accepted - first
            keep = accept & (row >= 0) & (row < R)
            buf = _integrate.write_row(buf, row, keep, (s, h, new.s, z_old, cache, ks))
            return new.pack(), z1, cache1, buf, tries + 1

        packed, _, _, buf, _ = _sharding.while_loop(
            cond, body, (packed, z, cache, buf, jnp.zeros((), i32))
        )
        ctrl = Controller.unpack(packed)
        count = ctrl.num_accepted - first
        same = count == target - first
        ok = jnp.where(land, (ctrl.s == t_land) & (count <= R) & (same | (not stepper.history)),
                       same)
        return ok, jnp.where(active, jnp.minimum(count, R), 0), buf

    explicit = stepper.diff_step is None
    if explicit:
        tab = stepper.tableau
        b = jnp.asarray(tab.b, dtype)
        rhs = lambda u, t, th: G(u, t, th, const)  # noqa: E731
    estimate = on_failure != "ignore"

    with_err = estimate or explicit  # (otherwise the step's error estimate is not used)

    def step_fn(z, cache, theta, eps, s, h, ks_star):
        z1, cache1, ks, err = _diff_step(stepper_of(theta))(s, z, cache, h, ks_star, eps)
        out = z1, cache1, h * _small.matmul(dense, ks), err if with_err else None
        # shard_map: every output varies as the cotangents do (a cache entry computed
        # from constants alone, as BDF's are, is otherwise invariant, and its varying
        # cotangent is refused; it reaches no input: the cast's transpose is dropped).
        return _sharding.vary_like(out, (z, cache, theta))

    def where(pred, a, b):
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), a, b)

    def adjoint_error_ratio(out, dz, lam_z1, s, z):
        """An explicit step's adjoint local error estimate over the tolerances: the
        cotangent through the embedded pair's error estimate alone (``out``'s last row).

        The steps were chosen for y alone; where they do not resolve the linearised
        dynamics (an exactly-zero solution: zero error estimates, steps growing tenfold),
        this is large, and the step is differentiated as its substeps (the derivative of
        a more accurate step, no longer of the computed one). The estimate is a function
        of z alone: the cached k0 = f(z) (FSAL) is z's too. (Without that path, Σ(b - b̂)
        = 0 no longer cancels the first-order term: an O(h) estimate instead of O(h⁵),
        1e4 x the tolerance at rtol 1e-8 on Lotka–Volterra, whose gradient then refined
        177 of 207 steps: 6.5x the time, and half as accurate.)
        """
        _, vjp_k0 = jax.vjp(lambda z: _sharding.vary_like(stepper.init(s, z), z), z)
        ez = out[0][-1] + vjp_k0(_row(out[1], -1))[0]
        scale = atol + rtol * jnp.maximum(jnp.abs(dz), jnp.abs(lam_z1))
        return jnp.sqrt(jnp.mean(jnp.square(ez / scale)))

    def next_trip(mode, j, refine):
        """The backward loop's next ``(mode, j)``: STEP (refined) -> SUB_FWD (j = 0 ..
        REFINE-2) -> SUB_BWD (j = REFINE-1 .. 0) -> DENSE -> STEP (the step before)."""
        fwd, bwd = mode == SUB_FWD, mode == SUB_BWD
        mode = jnp.where(refine | fwd & (j + 2 < REFINE), SUB_FWD, jnp.where(
            fwd | bwd & (j > 0), SUB_BWD, jnp.where(bwd, DENSE, STEP)))
        j = jnp.where(fwd, j + 1, jnp.where(bwd, j - 1, 0))
        return mode.astype(i32), j.astype(i32)

    def back_step(carry, buf):
        """One trip of the backward loop: one ``jax.vjp`` of ``step_fn`` (an explicit
        method's: :func:`_explicit.erk_vjp`, from the stage derivatives the replay kept).

        ``carry = (k, mode, j, sub, adj)``: steps ``0 .. k-1`` of the segment remain
        (``buf``'s rows, from the replay), the cotangents
        are ``adj``; ``sub`` holds a refined step's substep states. In mode ``STEP`` the
        trip differentiates step ``k - 1``. Where its adjoint's own error estimate is too
        large (explicit methods), the step is differentiated as ``REFINE`` equal substeps
        instead, by the same vjp on the trips that follow (one program: a loop of the
        substeps' own vjp cost more to compile than the rest of the backward pass, and ran
        for every element under vmap): ``SUB_FWD`` trips take the substeps forwards (substep
        ``j + 1``'s start to ``sub``'s row ``j``), ``SUB_BWD`` trips take the cotangent back
        through them, and a ``DENSE`` trip adds the cotangents of the outputs inside the
        step, which still come from the step's own continuous extension, and finishes the
        step.
        """
        k, mode, j, sub, adj = carry
        lam_z, lam_cache, theta_bar, mu_z, mu_cache, err_bar, size = adj
        s, h, s1, _, _, ks = _row(buf, k - 1)
        exact = (ts == s1).astype(dtype)
        inside = ((ts > s) & (ts < s1)).astype(dtype)
        frac = jnp.where(inside > 0, (ts - s) / h, 0.0)
        # The outputs' cotangents at the step's end, inside it, and weighted by θ, θ², ...
        # (products: a power of a float exponent is a call of pow each), in one product.
        powers = [inside * frac]
        for _ in range(degree - 1):
            powers.append(powers[-1] * frac)
        g = _small.matmul(jnp.stack([exact, inside, *powers]), gz)
        g_end, g_inside, weights = g[0], g[1], g[2:]
        step, fwd, bwd, dense_only = (mode == m for m in (STEP, SUB_FWD, SUB_BWD, DENSE))
        # An output at the step's end enters once, at the start of the step's trips.
        lam_z1 = lam_z + step * g_end
        z, cache = _row(buf[3:5], k - 1)
        if explicit:  # (the substeps' start, size and state on SUB_* trips)
            on_sub = fwd | bwd
            hs = h / REFINE
            s, h = jnp.where(on_sub, s + j * hs, s), jnp.where(on_sub, hs, h)
            z, cache = where(on_sub & (j > 0), _row(sub, jnp.maximum(j - 1, 0)), (z, cache))
        zero_z, zero_c = _sharding.zeros_like(z), _sharding.zeros_like(lam_cache)
        zero_w = _sharding.zeros_like(weights)
        zero_e = zero_z if with_err else None
        if explicit:
            # The stage derivatives: the replay's, or a substep's, taken here.
            ks = _sharding.cond_once(
                on_sub, lambda: _explicit.erk_step(tab, lambda u, t: rhs(u, t, theta), s, z,
                                                   cache[0], h, n)[3], lambda: ks)
            z1, cache1 = z + h * _small.matmul(b, ks), (ks[-1],)

            def vjp(rows):
                # (the last row, the adjoint's own error estimate, needs no parameters'
                # cotangent)
                dz, dcache, dtheta = _explicit.erk_vjp(
                    tab, rhs, s, z, h, ks, theta, rows, n, theta_rows=len(rows[0]) - 1)
                return dz, dcache, dtheta, None
        else:
            (z1, cache1, _, _), vjp_one = jax.vjp(
                lambda z, c, th, e: step_fn(z, c, th, e, s, h, ks), z, cache, theta,
                zero_z if estimate else None,
            )
            vjp = jax.vmap(vjp_one)
        # Row 0: the cotangent (the continuous extension's weights alone on a DENSE
        # trip). Row 1 (unless on_failure='ignore': nothing would report it): the
        # gradient's error estimate, the derivative of Σ λ_ε·e_n (the local error
        # estimates e_n weighted by λ_ε, the derivative of L with respect to an error
        # made at step n: to first order, the solution's error in L) with λ_ε held fixed;
        # a second cotangent μ carries its state dependence back (μ_n = (∂Φ_n/∂z)ᵀ μ_{n+1}
        # + (∂e_n/∂z)ᵀ λ_ε). λ_ε is the cotangent of a perturbation where the step makes
        # its error (eps: z1 of a one-step method, the corrector of BDF, so that its
        # history sees it too); a substep's error is left out (μ is carried through). Row
        # 2 (explicit methods): the adjoint's own local error estimate, the cotangent
        # through the embedded pair's error estimate alone.
        row0 = where(dense_only, (zero_z, zero_c), (lam_z1, lam_cache))
        row0 = (*row0, jnp.where(step | dense_only, weights, zero_w), zero_e)
        rows = [row0]
        if estimate:
            if explicit:  # (eps is added to z1 alone: its cotangent is z1's)
                lam_eps = row0[0]
            else:  # (row 0's cotangent of eps, from the step's one linearisation)
                lam_eps = vjp_one(row0)[3]
            rows.append((mu_z, mu_cache, zero_w, jnp.where(step, lam_eps, zero_z)))
        if explicit:
            rows.append((zero_z, zero_c, zero_w, lam_z1))
        out = vjp(_stack(*rows))
        dz, dcache, dtheta, _ = _row(out, 0)
        mu_new, derr = (mu_z, mu_cache), jnp.zeros_like(err_bar)
        if estimate:
            mu_new, derr = _row(out, 1)[:2], _flat(_row(out, 1)[2], dtype)
        refine = jnp.zeros((), bool)
        if explicit:
            refine = step & (adjoint_error_ratio(out, dz, lam_z1, s, z) > REFINE_LIMIT)
            # A SUB_FWD trip keeps its end (the next substep's start); the others write
            # the spare last row.
            sub = _integrate.write_row(sub, j, fwd, (z1, cache1))
            mode, j = next_trip(mode, j, refine)
        # The cotangents: replaced by the vjp's (a step, or a substep backwards), added
        # to (a DENSE trip), or kept (a refined step's first trip keeps its end's output
        # cotangent; SUB_FWD trips).
        plain = step & ~refine  # (a step differentiated as taken)
        take, done = plain | bwd, plain | dense_only
        lam_z = jnp.where(take, dz, jnp.where(dense_only, lam_z + dz, lam_z1))
        lam_z = lam_z + done * g_inside
        lam_cache = where(take, dcache, where(dense_only, jax.tree.map(jnp.add, lam_cache,
                                                                        dcache), lam_cache))
        mu_z, mu_cache = where(take, mu_new, (mu_z, mu_cache))
        dtheta = _flat(dtheta, dtype) * (take | dense_only)
        adj = (lam_z, lam_cache, theta_bar + dtheta, mu_z, mu_cache,
               err_bar + derr * plain, size + jnp.linalg.norm(dtheta))
        return k - done, mode, j, sub, adj

    def back_steps(count, buf, adj):
        """The cotangents ``adj`` back through the segment's ``count`` steps."""
        # (a refined step's substep states: REFINE - 1 rows and a spare; the steps' rows
        # are read only, and written to in no loop: a loop that wrote to them copied them
        # whole on every trip)
        sub = None
        if explicit:
            sub = jax.tree.map(lambda b: _sharding.rows_like(b[0], REFINE), buf[3:5])
        init = (count, jnp.asarray(STEP, i32), jnp.zeros((), i32), sub, adj)
        return _sharding.while_loop(lambda c: c[0] > 0, lambda c: back_step(c, buf), init)[4]

    def segment(carry):
        c, adj, status, t_fail = carry
        # Under vmap the body runs for the elements already done too (c < 0): no steps
        # for them. (Replayed from a slot of no block, their garbage steps went back
        # through refined substeps: 1,152 backward trips for 64 vmapped Lotka–Volterra
        # gradients whose own steps are 71 to 99.)
        ok, count, buf = replay(c, c >= 0)
        adj = back_steps(count, buf, adj)
        lam_z, theta_bar = adj[0], adj[2]
        # The replay did not reach the block's end (never expected), or the cotangent
        # became NaN or inf (f's derivative is not finite there): fail, never a number.
        finite = jnp.isfinite(jnp.sum(lam_z) + jnp.sum(theta_bar))
        new = jnp.where(~ok, _integrate.DRIFT,
                        jnp.where(finite, _integrate.NOT_FAILED, _status.NONFINITE))
        first = (status == _integrate.NOT_FAILED) & (new != _integrate.NOT_FAILED)
        status = jnp.where(first, new, status)
        t_fail = jnp.where(first, buf[0][0], t_fail)
        return c - 1, adj, status, t_fail

    n_blocks = _integrate.div(n_acc + W - 1, W)
    zero_adj = (
        _sharding.zeros_like(zs[0]),
        _sharding.zeros_like(cache_like),
        _flat(theta, dtype) * 0,
    )
    init = (
        n_blocks - 1,
        zero_adj + zero_adj + (jnp.zeros((), dtype),),
        jnp.asarray(_integrate.NOT_FAILED, i32),
        ts[0],
    )
    _, adj, status, t_fail = _sharding.while_loop(lambda c: c[0] >= 0, segment, init)
    lam_z, lam_cache, theta_bar, mu_z, mu_cache, err_bar, size = adj
    # The first cache (the derivative at y0) is a function of y0 and the parameters.
    _, vjp = jax.vjp(
        lambda z, th: _sharding.vary_like(stepper_of(th).init(ts[0], z), (z, th)), zs[0], theta
    )
    dz, dtheta = jax.vmap(vjp)(_stack(lam_cache, mu_cache))
    dtheta = [_flat(_row(dtheta, i), dtype) for i in (0, 1)]
    lam = lam_z + dz[0]
    theta_bar = theta_bar + dtheta[0]
    if estimate:
        # The gradient's error estimate against the gradient's size (y0's cotangent,
        # plus the parameters' per-step contributions summed in norm, a retaken step's
        # per substep, so that a gradient that cancels to nearly zero is not taken for a
        # wrong one): past
        # GRADIENT_LIMIT, fail. (Measured, van der Pol, mu = 1000 on [0, 3000],
        # kvaerno5: 1.37 at rtol 1e-6, the gradient 110x off; 0.15 at 1e-8, 5% off;
        # 0.017 at 1e-9, 0.4% off; below 4e-5 throughout the test suite.)
        norm = jnp.linalg.norm
        err = jnp.hypot(norm(mu_z + dz[1]), norm(err_bar + dtheta[1]))
        size = size + norm(lam + gz[0]) + norm(dtheta[0])
        inaccurate = (status == _integrate.NOT_FAILED) & ~(err <= GRADIENT_LIMIT * size)
        status = jnp.where(inaccurate, _status.GRADIENT_ERROR, status)
        t_fail = jnp.where(inaccurate, ts[0], t_fail)
    rhs = lambda u, s: (G if slope is None else slope)(u, s, theta, const)  # noqa: E731
    if on_failure == "nan":  # a failed forward pass: NaN gradients too
        status = jnp.where(forward_status != _integrate.NOT_FAILED, forward_status, status)
    z0_bar, ts_bar, theta_bar = _finish(
        rhs, zs, ts, gz, lam, theta_bar, status, t_fail, on_failure=on_failure, report=report
    )
    # The pass is differentiated forwards (make_solve's second-order rules, forwards and,
    # transposed, in reverse): the steps' derivatives are exact to second order (explicit
    # steps; kvaerno5's stages and bdf's corrector by two chord corrections).
    return z0_bar, ts_bar, _unflat(theta_bar, theta), None, None
