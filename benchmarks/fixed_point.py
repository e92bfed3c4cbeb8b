"""DEQ fixed point ``z = tanh(W z + U x + b)``: implicit gradients, side by side with peers.

Problem (float32 for every timed run): state ``z`` of shape (batch=64, n=128), input
``x`` of shape (64, d_in=128) drawn N(0, 1), ``U`` (n, d_in) drawn N(0, 0.3²/d_in),
``b`` (n,) drawn N(0, 0.1²), ``W = 0.9 Q`` with ``Q`` a random orthogonal matrix (spectral
norm 0.9, so the map is a contraction), ``z0 = 0``, ``rtol = 1e-5``. Loss ``sum(z*²)``;
gradient with respect to ``(W, U, b)``.

The input scale 0.3 keeps tanh mostly unsaturated, so the map contracts slowly: plain
iteration needs ~53 steps, which the unrolled K=60 scan just covers (with U ~ N(0, 1/d_in)
tanh saturates and every method needs only ~29 steps). Because ``W`` is orthogonal, the
eigenvalues of the Jacobian ``J_i = diag(1 - z_i²) W`` at the solution fill an annulus
(moduli 0.4-0.82, all arguments): no Krylov polynomial beats ``J^k`` on such a spectrum, so
Anderson (forward) and GMRES (adjoint) need as many map/VJP evaluations as plain iteration
and the Neumann series; the cheapest step wins.

Reference: the fixed point solved to machine precision in float64 (NumPy), then the
dense implicit function theorem per batch element:
``w_i = (I - J_i)^{-T} 2 z_i``, ``J_i = diag(1 - z_i²) W``.

Gradient error: ``max over (W, U, b) of max|g - g_ref| / max|g_ref|``.

Run: ``python -m benchmarks fixed_point`` (or ``make bench``).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import solvers
from benchmarks._common import (
    OURS,
    Row,
    compile_time,
    print_table,
    run_times_interleaved,
    temp_memory_bytes,
)

N, BATCH, D_IN = 128, 64, 128
# The large DEQ (GPU rows; `python -m benchmarks fixed_point` runs it where the default device
# is not a CPU, or everywhere with BENCH_LARGE_DEQ=1; BENCH_LARGE_DEQ=0 leaves it out).
LARGE_N, LARGE_BATCH, LARGE_D_IN = 1024, 256, 1024
RTOL = 1e-5
ATOL = 1e-6  # our float32 default; the peers get the same where they take one
SCAN_STEPS = 60
INPUT_SCALE = 0.3
# "cg" needs a symmetric system, which (I - J)^T is not here: the engine reports its
# failed adjoint solve instead of returning a wrong gradient, so it has no row.
LINEAR_SOLVERS = ("gmres", "bicgstab", "dense", "neumann", "jfb")
# Per-sample solves compile slowly (5-10 s each here); the rest of the solvers tell nothing new.
VMAPPED_LINEAR_SOLVERS = ("gmres", "dense", "neumann")
ROUNDS = 20  # run times: fastest of 20 round-robin calls (robust on a shared machine)
GRAD_ERROR_NOTE = "grad error = max over (W, U, b) of max|g - g_ref| / max|g_ref|"


# --------------------------------------------------------------------------- problem


def make_problem(seed=0, n=N, batch=BATCH, d_in=D_IN):
    """NumPy float64 problem data: ``(W, U, b, x)``."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    q = q * np.sign(np.diag(r))  # Haar-distributed orthogonal matrix
    w = 0.9 * q
    u = INPUT_SCALE * rng.standard_normal((n, d_in)) / np.sqrt(d_in)
    b = 0.1 * rng.standard_normal(n)
    x = rng.standard_normal((batch, d_in))
    return w, u, b, x


def f_batch(z, w, u, b, x):
    """The DEQ map on the whole batch: ``z`` (batch, n), ``x`` (batch, d_in)."""
    return jnp.tanh(z @ w.T + x @ u.T + b)


def f_single(z, w, u, b, x):
    """The DEQ map for one sample: ``z`` (n,), ``x`` (d_in,)."""
    return jnp.tanh(w @ z + u @ x + b)


def reference_gradient(w, u, b, x):
    """Float64 dense-IFT gradient of ``sum(z*²)`` with respect to ``(W, U, b)``."""
    z = np.zeros((x.shape[0], w.shape[0]))
    for _ in range(10_000):
        z_new = np.tanh(z @ w.T + x @ u.T + b)
        if np.max(np.abs(z_new - z)) <= 4 * np.finfo(np.float64).eps:
            z = z_new
            break
        z = z_new
    eye = np.eye(w.shape[0])
    pre = np.empty_like(z)  # cotangent of the pre-activation, per sample
    for i in range(x.shape[0]):
        dtanh = 1.0 - z[i] ** 2
        jac = dtanh[:, None] * w  # J_i = diag(1 - z_i²) W
        wi = np.linalg.solve((eye - jac).T, 2.0 * z[i])
        pre[i] = dtanh * wi
    return pre.T @ z, pre.T @ x, pre.sum(0)


def grad_error(grads, ref):
    return max(
        float(np.max(np.abs(np.asarray(g, np.float64) - r)) / np.max(np.abs(r)))
        for g, r in zip(grads, ref)
    )


# --------------------------------------------------------------------------- methods
#
# Every method is ``solve(params, x) -> (z, iterations)``, jittable; ``iterations`` may be
# None (then a separate ``count(params, x)`` gives it).


def _z0(params, x):
    """The zero initial state: (batch, n), n from W (the first parameter)."""
    return jnp.zeros((x.shape[0], params[0].shape[0]), x.dtype)


def loss_of(solve):
    def loss(params, x):
        z = solve(params, x)[0]
        return jnp.sum(z**2)

    return loss


def ours_batched(method, linear_solver, max_steps=1000, on_failure="raise", rtol=RTOL):
    def solve(params, x, full_output=False):
        z0 = _z0(params, x)
        out = solvers.fixed_point(
            f_batch,
            z0,
            *params,
            x,
            method=method,
            rtol=rtol,
            linear_solver=linear_solver,
            max_steps=max_steps,
            on_failure=on_failure,
            full_output=full_output,
        )
        return (out[0], out[1].num_steps) if full_output else (out, None)

    return solve


def ours_vmapped(method, linear_solver):
    def solve(params, x, full_output=False):
        def one(xi):
            out = solvers.fixed_point(
                f_single,
                jnp.zeros(params[0].shape[:1], xi.dtype),
                *params,
                xi,
                method=method,
                rtol=RTOL,
                linear_solver=linear_solver,
                full_output=full_output,
            )
            return (out[0], out[1].num_steps) if full_output else (out, jnp.int32(0))

        z, steps = jax.vmap(one)(x)
        return z, (jnp.max(steps) if full_output else None)

    return solve


def jaxopt_solver(name, tol=RTOL):
    import jaxopt

    cls = {"fpi": jaxopt.FixedPointIteration, "anderson": jaxopt.AndersonAcceleration}[name]
    solver = cls(fixed_point_fun=f_batch, tol=tol, maxiter=1000, implicit_diff=True)

    def solve(params, x):
        z0 = _z0(params, x)
        z, state = solver.run(z0, *params, x)
        return z, state.iter_num

    return solve


def optimistix_vmapped():
    import optimistix as optx

    fp = optx.FixedPointIteration(rtol=RTOL, atol=ATOL)

    def solve(params, x):
        def one(xi):
            fn = lambda z, a: f_single(z, *a)  # noqa: E731
            z0 = jnp.zeros(params[0].shape[:1], xi.dtype)
            sol = optx.fixed_point(fn, fp, z0, (*params, xi), max_steps=1000)
            return sol.value, sol.stats["num_steps"]

        z, steps = jax.vmap(one)(x)
        return z, jnp.max(steps)

    return solve


def optimistix_gmres(rtol=RTOL, atol=ATOL):
    import lineax as lx
    import optimistix as optx

    fp = optx.FixedPointIteration(rtol=rtol, atol=atol)
    adjoint = optx.ImplicitAdjoint(linear_solver=lx.GMRES(rtol=rtol, atol=atol, max_steps=1000))

    def solve(params, x):
        fn = lambda z, a: f_batch(z, *a)  # noqa: E731
        z0 = _z0(params, x)
        sol = optx.fixed_point(fn, fp, z0, (*params, x), max_steps=1000, adjoint=adjoint)
        return sol.value, sol.stats["num_steps"]

    return solve


# The JAX "Custom derivative rules" notebook's fixed point, adapted to arrays: its
# stopping test `|x_prev - x| > 1e-6` becomes a relative max-norm test with `tol` (RTOL).


def _seed_loop(f, a, x_guess, tol=RTOL):
    def cond_fun(carry):
        x_prev, x, _ = carry
        return jnp.max(jnp.abs(x_prev - x)) > tol * jnp.max(jnp.abs(x))

    def body_fun(carry):
        _, x, k = carry
        return x, f(a, x), k + 1

    _, x_star, k = jax.lax.while_loop(cond_fun, body_fun, (x_guess, f(a, x_guess), 1))
    return x_star, k


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def seed_fixed_point(f, a, x_guess, tol=RTOL):
    return _seed_loop(f, a, x_guess, tol)[0]


def _seed_fwd(f, a, x_init, tol):
    x_star = seed_fixed_point(f, a, x_init, tol)
    return x_star, (a, x_star)


def _seed_rev_iter(f, packed, u):
    a, x_star, x_star_bar = packed
    _, vjp_x = jax.vjp(lambda x: f(a, x), x_star)
    return x_star_bar + vjp_x(u)[0]


def _seed_rev(f, tol, res, x_star_bar):
    a, x_star = res
    _, vjp_a = jax.vjp(lambda a: f(a, x_star), a)
    (a_bar,) = vjp_a(
        seed_fixed_point(
            functools.partial(_seed_rev_iter, f), (a, x_star, x_star_bar), x_star_bar, tol
        )
    )
    return a_bar, jnp.zeros_like(x_star)


seed_fixed_point.defvjp(_seed_fwd, _seed_rev)


def _seed_map(a, z):
    return f_batch(z, *a)


def seed_notebook(tol=RTOL):
    def solve(params, x):
        z0 = _z0(params, x)
        return seed_fixed_point(_seed_map, (*params, x), z0, tol), None

    def count(params, x):
        z0 = _z0(params, x)
        return _seed_loop(_seed_map, (*params, x), z0, tol)[1]

    return solve, count


def unrolled_scan(steps):
    def solve(params, x):
        z0 = _z0(params, x)
        z, _ = jax.lax.scan(lambda z, _: (f_batch(z, *params, x), None), z0, length=steps)
        return z, steps

    return solve


# --------------------------------------------------------------------------- measuring


def measure(name, group, solve, params, x, ref, count=None):
    """One row: compile s, temp memory, grad error, iterations; the run times are filled in
    later by :func:`time_rows` (round-robin over all rows, so machine load hits all alike)."""
    vg = jax.value_and_grad(loss_of(solve))
    # Compile the gradient first, so that no trace cache from other calls flatters it.
    seconds, compiled = compile_time(vg, params, x)
    (_, grads) = compiled(params, x)
    forward = jax.jit(lambda p, x: solve(p, x)[0])  # (timed through jit: _common.Compiled)
    jax.block_until_ready(forward(params, x))
    if count is None:
        count = lambda p, x: solve(p, x)[1]  # noqa: E731
        if jax.eval_shape(count, params, x) is None:
            count = lambda p, x: solve(p, x, full_output=True)[1]  # noqa: E731
    iters = jax.jit(count)(params, x)
    row = Row(name, group, {
        "compile s": seconds,
        "grad temp MB": temp_memory_bytes(compiled) / 2**20,
        "grad error": grad_error(grads, ref),
        "iterations": int(iters),
    })
    row.calls = {"solve": lambda: forward(params, x), "vg": lambda: compiled(params, x)}
    print(f"  {name}: " + ", ".join(f"{k}={v:.3g}" for k, v in row.values.items()), flush=True)
    return row


def time_rows(rows):
    """Fill in solve ms, value-and-grad ms and their ratio, timing all rows round-robin."""
    calls = {(i, k): fn for i, r in enumerate(rows) for k, fn in r.calls.items()}
    seconds = run_times_interleaved(calls, rounds=ROUNDS, statistic="min")
    for i, r in enumerate(rows):
        if not r.calls:  # a peer that failed on this problem (its name says how)
            continue
        solve, vg = seconds[(i, "solve")], seconds[(i, "vg")]
        r.values.update({"solve ms": 1e3 * solve, "value-and-grad ms": 1e3 * vg,
                         "vg / solve": vg / solve})
        del r.calls  # release the executables


def main_table(params, x, ref):
    rows = []
    for method in ("iterate", "anderson"):
        for ls in LINEAR_SOLVERS:
            if ls == "dense":
                continue  # (8192)² Jacobian per solve for the batched state; see vmapped rows
            rows.append(measure(f"ours {method} {ls} (batched)", OURS,
                                ours_batched(method, ls), params, x, ref))
    for method in ("iterate", "anderson"):
        for ls in VMAPPED_LINEAR_SOLVERS:
            rows.append(measure(f"ours {method} {ls} (vmapped)", OURS,
                                ours_vmapped(method, ls), params, x, ref))
    rows += peer_rows(params, x, ref, vmapped=True)
    time_rows(rows)
    return rows


def peer_rows(params, x, ref, vmapped):
    """Every peer's row (optimistix's per-sample LU only where ``vmapped``)."""
    rows = [measure_peer("jaxopt FixedPointIteration", jaxopt_solver("fpi"), params, x, ref),
            measure_peer("jaxopt AndersonAcceleration", jaxopt_solver("anderson"),
                         params, x, ref)]
    if vmapped:
        rows.append(measure_peer("optimistix fixed_point (vmapped, LU)", optimistix_vmapped(),
                                 params, x, ref))
    rows.append(measure_peer("optimistix fixed_point (batched, GMRES)", optimistix_gmres(),
                             params, x, ref))
    solve, count = seed_notebook()
    rows.append(measure_peer("seed notebook custom_vjp fixed_point", solve, params, x, ref,
                             count=count))
    rows.append(measure_peer(f"unrolled lax.scan K={SCAN_STEPS}", unrolled_scan(SCAN_STEPS),
                             params, x, ref))
    return rows


def measure_peer(name, solve, params, x, ref, count=None):
    """:func:`measure` for a peer that may raise on a problem: its row then says so."""
    try:
        return measure(name, "peer", solve, params, x, ref, count=count)
    except Exception as err:  # a peer's failed solve (reported in its row, not hidden)
        reason = str(err).strip().splitlines()
        reason = next((line for line in reason if "rror" in line), reason[0] if reason else "")
        print(f"  {name}: failed: {reason[:160]}", flush=True)
        row = Row(f"{name} (failed: {type(err).__name__})", "peer", {})
        row.calls = {}
        return row


def large_table(params, x, ref):
    """The large DEQ: batched rows only (per-sample Jacobians would be 256 x 1024²)."""
    rows = [measure(f"ours {method} {ls} (batched)", OURS, ours_batched(method, ls),
                    params, x, ref)
            for method in ("iterate", "anderson") for ls in ("gmres", "neumann")]
    rows += peer_rows(params, x, ref, vmapped=False)
    time_rows(rows)
    return rows


def max_steps_table(params, x, ref):
    rows = []
    for k in (10, 100, 1000):
        scan = measure(f"unrolled scan K={k}", "peer", unrolled_scan(k), params, x, ref)
        ours = measure(f"ours iterate gmres max_steps={k}", OURS,
                       ours_batched("iterate", "gmres", max_steps=k, on_failure="ignore"),
                       params, x, ref)
        time_rows([scan, ours])
        s, o = scan.values, ours.values
        rows.append(Row(f"K = {k}", OURS, {
            "scan temp MB": s["grad temp MB"],
            "ours temp MB": o["grad temp MB"],
            "temp ours/scan": f"{o['grad temp MB'] / s['grad temp MB']:.3f}x",
            "scan vg ms": s["value-and-grad ms"],
            "ours vg ms": o["value-and-grad ms"],
            "vg ours/scan": f"{o['value-and-grad ms'] / s['value-and-grad ms']:.2f}x",
            "scan grad error": s["grad error"],
            "ours grad error": o["grad error"],
            "ours iterations": o["iterations"],
        }))
    return rows


def main():
    start = time.perf_counter()
    w, u, b, x = make_problem()
    ref = reference_gradient(w, u, b, x)
    params = tuple(jnp.asarray(a, jnp.float32) for a in (w, u, b))
    x32 = jnp.asarray(x, jnp.float32)
    print(f"# DEQ fixed point z = tanh(W z + U x + b): n={N}, batch={BATCH}, d_in={D_IN}, "
          f"|W|_2 = 0.9, rtol={RTOL}, float32, {jax.devices()[0].platform}")
    rows = main_table(params, x32, ref)
    columns = ["compile s", "solve ms", "value-and-grad ms", "vg / solve", "grad temp MB",
               "grad error", "iterations"]
    print_table(
        "Fixed point: value and gradient of sum(z*²) w.r.t. (W, U, b)",
        rows,
        columns,
        ratio_columns=["compile s", "value-and-grad ms", "grad temp MB", "grad error"],
    )
    print()
    vmapped = ", ".join(VMAPPED_LINEAR_SOLVERS)
    for note in (
        f"{GRAD_ERROR_NOTE}; reference: float64 dense IFT.",
        "iterations: forward steps (vmapped rows: the largest over the batch).",
        "(batched): one solve over the (64, 128) state (our Anderson mixes the whole batch "
        "with one coefficient vector); (vmapped): one solve per sample "
        f"(linear solvers {vmapped} only).",
        "'dense' runs only vmapped (batched it would build an 8192 x 8192 Jacobian); 'cg' "
        "has no row: it needs a symmetric system, which I - J^T is not, and the engine "
        "raises on its failed adjoint solve rather than return a wrong gradient.",
        f"Times: fastest of {ROUNDS} calls, all rows timed round-robin; compile s: lower + "
        "compile of jit(value_and_grad), measured once per row.",
    ):
        print(f"- {note}")
    rows2 = max_steps_table(params, x32, ref)
    print_table(
        "Gradient memory and time against max_steps: unrolled scan vs ours (iterate, gmres, "
        "on_failure='ignore')",
        rows2,
        list(rows2[0].values),
    )
    on_cpu = jax.devices()[0].platform == "cpu"
    if os.environ.get("BENCH_LARGE_DEQ", "0" if on_cpu else "1") == "1":
        w, u, b, x = make_problem(n=LARGE_N, batch=LARGE_BATCH, d_in=LARGE_D_IN)
        ref = reference_gradient(w, u, b, x)
        params = tuple(jnp.asarray(a, jnp.float32) for a in (w, u, b))
        print(f"\n# Large DEQ: n={LARGE_N}, batch={LARGE_BATCH}, d_in={LARGE_D_IN}, otherwise "
              "as above")
        rows3 = large_table(params, jnp.asarray(x, jnp.float32), ref)
        print_table(
            "Large fixed point: value and gradient of sum(z*²) w.r.t. (W, U, b)",
            rows3,
            columns,
            ratio_columns=["compile s", "value-and-grad ms", "grad temp MB", "grad error"],
        )
        capped = [r.name for r in rows3 if r.name.startswith("jaxopt")
                  and r.values.get("iterations", 0) >= 1000]
        if capped:
            print(f"\n- {', '.join(capped)}: jaxopt's tol bounds the norm of the whole "
                  f"({LARGE_BATCH}, {LARGE_N}) state (ours and optimistix's the largest "
                  "element, relative); at 1e-5 in float32 it ran to maxiter=1000.")
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
