"""The price of safety: compile time against the simplest peer, and what the checks cost.

For each benchmark's default call (issue 35's rows), ``jax.jit(jax.value_and_grad(loss))``
of ours with the default ``on_failure="raise"``, of ours with ``on_failure="ignore"`` (no
check: no gradient-error estimate, no failure report) and of the simplest peer a user
would pick instead, on the same problem as the suite it comes from:

- compile s: trace, lower and compile from cleared caches (``jax.clear_caches()``), the
  fastest of ``COMPILE_ROUNDS``, round-robin over every call of the table (machine load
  hits them alike);
- run ms: the fastest call, ours timed round-robin with ``ignore`` and then with the peer
  (``RUN_SECONDS`` of rounds per pair, ``RUN_ROUNDS`` to ``MAX_RUN_ROUNDS`` of them; ours:
  the faster of the two), through ``jax.jit``
  (as every suite: the ahead-of-time object's call path costs more with a host callback);
- ours / peer: the default call's compile and run time over the peer's;
- checks' price: ``raise`` over ``ignore``, minus one (issue 35's targets: at most 10% of
  run time and 15% of compile time).

Run: ``python -m benchmarks price`` (also part of ``make bench``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bracket, fixed_point, minimize, neural_ode, ode, root
from benchmarks._common import OURS, Row, fresh_compile_time, print_table, run_times_interleaved

COMPILE_ROUNDS = 3
RUN_ROUNDS = 10  # the fewest; as many more as RUN_SECONDS allows, up to MAX_RUN_ROUNDS
MAX_RUN_ROUNDS = 300
RUN_SECONDS = 3.0
NODE_BATCH = 128  # issue 35's neural ODE row (the neural ODE suite's own rows use 512)
ENSEMBLE = 256  # the vmapped Lotka–Volterra row's parameter sets
COLUMNS = ["compile s", "compile s, ignore", "peer compile s", "compile ours / peer",
           "checks' compile price", "run ms", "run ms, ignore", "peer run ms",
           "run ours / peer", "checks' run price"]


def _ode_case(f, y0, ts, method, loss, params, peer, log_params=False, **tol):
    def ours_loss(on_failure):
        solve, _ = ode.ours(f, y0, ts, method, log_params=log_params, on_failure=on_failure,
                            **tol)
        return lambda p: loss(solve(p))

    peer_solve, _ = peer
    return ours_loss("raise"), ours_loss("ignore"), lambda p: loss(peer_solve(p)), (
        jnp.asarray(params),)


def lotka_volterra():
    tol = dict(rtol=ode.LV_RTOL, atol=ode.LV_ATOL)
    return _ode_case(ode.lotka_volterra, ode.LV_Y0, ode.LV_TS, "dopri5", ode.lv_loss,
                     ode.LV_PARAMS, ode.jax_odeint(ode.lotka_volterra, ode.LV_Y0, ode.LV_TS,
                                                   **tol), **tol)


def robertson(method):
    tol = dict(rtol=ode.ROB_RTOL, atol=ode.ROB_ATOL)
    peer = ode.diffrax_solver(ode.robertson, ode.ROB_Y0, ode.ROB_TS, "Kvaerno5",
                              "RecursiveCheckpointAdjoint", log_params=True, **tol)
    return _ode_case(ode.robertson, ode.ROB_Y0, ode.ROB_TS, method, ode.rob_loss,
                     np.log(ode.ROB_K), peer, log_params=True, **tol)


def neural():
    params64, y064 = neural_ode.make_problem()
    params = tuple(jnp.asarray(p, jnp.float32) for p in params64)
    y0 = jnp.asarray(y064[:NODE_BATCH], jnp.float32)

    def of(solve):
        return lambda params: neural_ode.loss(solve(params, y0))

    return (of(neural_ode.ours("dopri5")), of(neural_ode.ours("dopri5", on_failure="ignore")),
            of(neural_ode.jax_odeint()), (params,))


def deq():
    *params64, x64 = fixed_point.make_problem()
    params = tuple(jnp.asarray(p, jnp.float32) for p in params64)
    x = jnp.asarray(x64, jnp.float32)

    def of(solve):
        return fixed_point.loss_of(solve)

    # (Under "ignore", "auto" would pick GMRES, not the Neumann series it picks here: the
    # check's price is measured with the same linear solver.)
    return (of(fixed_point.ours_batched("iterate", "auto")),
            of(fixed_point.ours_batched("iterate", "neumann", on_failure="ignore")),
            of(fixed_point.seed_notebook()[0]), (params, x))


def newton():
    a, b = root.dense_problem()
    F = root.dense_F(jnp.asarray(a, jnp.float32))

    def of(solve):
        return lambda theta, b: jnp.sum(solve(theta, b))

    n = root.N_DENSE
    return (of(root.ours(F, n)), of(root.ours(F, n, on_failure="ignore")),
            of(root.lax_custom_root(F, n)),
            (jnp.asarray(root.THETA, jnp.float32), jnp.asarray(b, jnp.float32)))


def bisection():
    a = jnp.asarray(np.linspace(0.1, 100.0, bracket.N), jnp.float32)

    def of(solve):
        return lambda a: jnp.sum(solve(a))

    return (of(bracket.ours("bisection")), of(bracket.ours("bisection", on_failure="ignore")),
            of(bracket.jaxopt_bisection()), (a,))


def lbfgs():
    xt, yt, xv, yv = (jnp.asarray(v, jnp.float32) for v in minimize.logistic_data())
    log_lam = jnp.asarray(np.log(minimize.LAM), jnp.float32)

    def of(solve):
        return lambda log_lam: minimize.log_loss(solve(log_lam, xt, yt), xv, yv)

    return (of(minimize.ours("lbfgs")), of(minimize.ours("lbfgs", on_failure="ignore")),
            of(minimize.optimistix_bfgs()), (log_lam,))


def lotka_volterra_ensemble():
    """The Lotka–Volterra row's loss averaged over ``ENSEMBLE`` parameter sets (5% log-normal
    spread), each solved by its own vmapped ``odeint`` call: what fitting a population
    computes."""
    ours_raise, ours_ignore, peer, _ = lotka_volterra()

    def of(loss):
        return lambda P: jnp.mean(jax.vmap(loss)(P))

    spread = np.random.default_rng(0).normal(0.0, 0.05, (ENSEMBLE, len(ode.LV_PARAMS)))
    return of(ours_raise), of(ours_ignore), of(peer), (
        jnp.asarray(ode.LV_PARAMS * np.exp(spread)),)


#: (row, simplest peer, problem builder, float64) in issue 35's order; float32 rows as in
#: their own suites.
CASES = [
    ("Lotka–Volterra, dopri5", "jax.experimental.ode.odeint", lotka_volterra, True),
    (f"Lotka–Volterra ensemble, vmap over {ENSEMBLE} parameter sets, dopri5",
     "jax.experimental.ode.odeint", lotka_volterra_ensemble, True),
    (f"neural ODE, MLP, batch {NODE_BATCH}, dopri5", "jax.experimental.ode.odeint", neural,
     False),
    ("DEQ n=128, B=64 (defaults: iterate, linear_solver='auto')",
     "the JAX notebook's custom_vjp fixed point", deq, False),
    ("Newton, dense n=64", "lax.custom_root + hand-written Newton", newton, False),
    ("bisection, 100,000 values", "jaxopt Bisection (vmap)", bisection, False),
    ("L-BFGS hyperparameter gradient", "optimistix BFGS (ImplicitAdjoint)", lbfgs, False),
    ("Robertson, kvaerno5", "diffrax Kvaerno5", lambda: robertson("kvaerno5"), True),
    ("Robertson, bdf", "diffrax Kvaerno5", lambda: robertson("bdf"), True),
]


def _rounds(row):
    """Round-robin rounds for calls timed together: ``RUN_SECONDS`` of them in all, between
    ``RUN_ROUNDS`` and ``MAX_RUN_ROUNDS`` (a sub-millisecond call's fastest of 10 was up to
    twice its fastest of 200 on a shared 2-core machine)."""
    start = time.perf_counter()
    for fn in row.values():
        jax.block_until_ready(fn())
    per_round = time.perf_counter() - start
    return int(min(MAX_RUN_ROUNDS, max(RUN_ROUNDS, RUN_SECONDS / per_round)))


def _compile(loss, args, x64):
    with jax.enable_x64(x64):
        return fresh_compile_time(jax.value_and_grad(loss), *args)


def _call(compiled, args, x64):
    with jax.enable_x64(x64):  # (jit's dispatch cache is keyed by the x64 mode)
        return compiled(*args)


def main():
    print(f"# The price of safety: compile time against the simplest peer, and the checks' "
          f"cost, {jax.devices()[0].platform}")
    calls, compile_s = {}, {}
    for name, _, build, x64 in CASES:
        print(f"  {name} ...", flush=True)
        with jax.enable_x64(x64):
            *losses, args = build()
        for variant, loss in zip(("raise", "ignore", "peer"), losses):
            seconds, compiled = _compile(loss, args, x64)
            compile_s[name, variant] = [seconds]
            calls[name, variant] = (loss, args, x64, compiled)
    for _ in range(COMPILE_ROUNDS - 1):
        for key, (loss, args, x64, _) in calls.items():
            compile_s[key].append(_compile(loss, args, x64)[0])
    run_s = {}
    for name, *_ in CASES:
        fns = {key[1]: (lambda c=compiled, a=args, x=x64: _call(c, a, x))
               for key, (_, args, x64, compiled) in calls.items() if key[0] == name}
        # Ours against ignore, then against the peer, each pair round-robin for as many
        # rounds as fit (a slow peer leaves the checks' price as many rounds as a fast one)
        for pair in (("raise", "ignore"), ("raise", "peer")):
            pair = {v: fns[v] for v in pair}
            for v, seconds in run_times_interleaved(pair, rounds=_rounds(pair)).items():
                run_s[name, v] = min(run_s.get((name, v), float("inf")), seconds)
    rows = []
    for name, peer, *_ in CASES:
        c = {v: min(compile_s[name, v]) for v in ("raise", "ignore", "peer")}
        r = {v: 1e3 * run_s[name, v] for v in ("raise", "ignore", "peer")}
        rows.append(Row(f"{name} (peer: {peer})", OURS, {
            "compile s": c["raise"], "compile s, ignore": c["ignore"],
            "peer compile s": c["peer"], "compile ours / peer": f"{c['raise'] / c['peer']:.2f}x",
            "checks' compile price": f"{c['raise'] / c['ignore'] - 1:+.0%}",
            "run ms": r["raise"], "run ms, ignore": r["ignore"], "peer run ms": r["peer"],
            "run ours / peer": f"{r['raise'] / r['peer']:.2f}x",
            "checks' run price": f"{r['raise'] / r['ignore'] - 1:+.0%}",
        }))
    print_table("jit(value_and_grad) of each benchmark's default call", rows, COLUMNS)
    print(f"\n- compile s: trace + lower + compile from cleared caches, fastest of "
          f"{COMPILE_ROUNDS} (round-robin over every call); run ms: fastest call, ours "
          f"round-robin with ignore, then with the peer ({RUN_SECONDS:g} s of rounds per "
          f"pair, {RUN_ROUNDS} to {MAX_RUN_ROUNDS} rounds).")
    print("- ours: the default on_failure='raise'; ignore: on_failure='ignore' (no check); "
          "checks' price: raise / ignore - 1 (targets: run +10%, compile +15% at most).")
    print("- ours / peer: the default call against the simplest peer (target: compile 1.2x "
          "at most).")


if __name__ == "__main__":
    main()
