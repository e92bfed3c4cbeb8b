"""Work–precision: gradient error against value-and-grad time, tolerances swept, ours and
every peer on the same axes (issue 35: the non-stiff ODEs' default adjoint and the DEQ).

A fixed tolerance compares methods at different accuracies (at rtol 1e-5 our neural
ODE gradient is 100x more accurate than jax odeint's); sweeping it gives each method a
curve of (time, error) points, and the question becomes: for the accuracy a peer
reaches, how long do we take?

- **Lotka–Volterra** (the ode suite's problem, float64): ``jit(value_and_grad)`` of
  ``sum(ys²)`` over 50 outputs, ``rtol = atol`` swept 1e-3 … 1e-9; reference: jax
  odeint at ``rtol = atol = 1e-13`` (an independent implementation).
- **Neural ODE** (the neural_ode suite's problem at batch 128, float32): ``rtol = atol``
  swept 1e-2 … 1e-7 (1e-2: the neural_ode suite's loose row; below 1e-7 float32's rounding is
  the error: every method stalls).
- **DEQ** (the fixed_point suite's problem, float32): ``rtol`` swept 3e-2 … 1e-6 (half
  decades down to 1e-4: the curves are a few milliseconds apart at loose tolerances); the
  unrolled ``lax.scan``'s knob is its number of iterations ``K`` instead.

Each point: the value-and-grad time (fastest of ``ROUNDS`` calls, every point of a
problem timed round-robin) and the gradient error against the suite's own reference
(``max over parameters of max|g - g_ref| / max|g_ref|``); the compile time (lower and
compile) beside it.

**Left of a peer** (the summary lines): a peer's point ``(t, e)`` has ours to its left
when one of our points is at least as accurate (error ``<= e``) and faster (time ``<=
t``); the ratio printed is our fastest such time over ``t`` (no interpolation between our
points: that would flatter us). "Not reached": the peer is more accurate than any point
of ours. The target (issue 35): ours left of every peer point, with the default adjoint.

Run: ``python -m benchmarks work_precision`` (part of ``make bench``); the plot is saved
to ``benchmarks/results/work_precision.png``.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import fixed_point as deq
from benchmarks import neural_ode as node
from benchmarks import ode
from benchmarks._common import compile_time, plot_work_precision, run_times_interleaved

X64 = True  # the ODE problems' float64 references (python -m benchmarks runs it so)

ROUNDS = 5
LV_TOLS = [1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9]
NODE_TOLS = [1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7]
NODE_BATCH = 128  # issue 35's row (the neural_ode suite's own rows use 512)
DEQ_TOLS = [3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6]  # (every method the same)
SCAN_STEPS = [10, 20, 40, 60, 80]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _rel_error(grads, ref):
    return max(float(np.max(np.abs(np.asarray(g, np.float64) - r)) / np.max(np.abs(r)))
               for g, r in zip(jax.tree.leaves(grads), ref))


def _point(loss, args, ref):
    """``(compile s, executable, gradient error)`` of ``jit(value_and_grad(loss))``."""
    seconds, compiled = compile_time(jax.value_and_grad(loss), *args)
    _, grads = compiled(*args)
    return seconds, compiled, max(_rel_error(grads, ref), 1e-16)


def sweep(curves, args, ref):
    """``curves``: name -> [(knob, loss)]. Returns name -> [(knob, ms, error, compile s)],
    every point timed round-robin with the others (machine load hits all alike)."""
    points, calls = {}, {}
    for name, knobs in curves.items():
        for knob, loss in knobs:
            try:
                seconds, compiled, err = _point(loss, args, ref)
            except Exception as exc:  # a peer that fails at this tolerance: said, not hidden
                print(f"  {name} at {knob:g}: failed ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[0][:120]})", flush=True)
                continue
            points[(name, knob)] = (seconds, err)
            calls[(name, knob)] = lambda c=compiled: c(*args)
            print(f"  {name} at {knob:g}: error {err:.2e}, compile {seconds:.2f} s", flush=True)
    times = run_times_interleaved(calls, rounds=ROUNDS)
    out = {name: [] for name in curves}
    for (name, knob), (seconds, err) in points.items():
        out[name].append((knob, 1e3 * times[(name, knob)], err, seconds))
    return out


def left_of(ours, peer):
    """For each peer point: our fastest time at an error at most the peer's, over the
    peer's time (None: no point of ours is that accurate)."""
    ratios = []
    for _, t, e, _ in peer:
        faster = [tt for _, tt, ee, _ in ours if ee <= e]
        ratios.append(min(faster) / t if faster else None)
    return ratios


def print_curves(title, curves, knob_name, ours_name):
    print(f"\n#### {title}\n")
    print(f"| method | {knob_name} | value-and-grad ms | grad error | compile s |")
    print("|---|---|---|---|---|")
    for name, pts in curves.items():
        for knob, ms, err, seconds in pts:
            print(f"| {name} | {knob:g} | {ms:.3g} | {err:.2e} | {seconds:.2f} |")
    print()
    for name, pts in curves.items():
        if name.startswith("ours") or not pts:
            continue
        ratios = left_of(curves[ours_name], pts)
        left = sum(r is not None and r <= 1 for r in ratios)
        reached = [r for r in ratios if r is not None]
        worst = f"{max(reached):.2f}x" if reached else "-"
        missing = len(ratios) - len(reached)
        print(f"- {ours_name} left of {name}: {left} of {len(ratios)} points; ours / peer "
              f"time at equal or better error: at most {worst}"
              + (f"; {missing} point(s) more accurate than any of ours" if missing else ""))


def lotka_volterra():
    def curve(make):
        return [(r, lambda p, s=make(r): ode.lv_loss(s(p))) for r in LV_TOLS]

    lv = (ode.lotka_volterra, ode.LV_Y0, ode.LV_TS)
    curves = {
        "ours dopri5 (default)": curve(lambda r: ode.ours(*lv, "dopri5", r, r)[0]),
        "ours dopri5, backsolve adjoint": curve(
            lambda r: ode.ours(*lv, "dopri5", r, r, adjoint="backsolve")[0]),
        "jax odeint": curve(lambda r: ode.jax_odeint(*lv, r, r)[0]),
        "diffrax Dopri5 (RecursiveCheckpointAdjoint)": curve(
            lambda r: ode.diffrax_solver(*lv, "Dopri5", "RecursiveCheckpointAdjoint", r, r)[0]),
        "diffrax Dopri5 (BacksolveAdjoint)": curve(
            lambda r: ode.diffrax_solver(*lv, "Dopri5", "BacksolveAdjoint", r, r)[0]),
    }
    params = jnp.asarray(ode.LV_PARAMS)
    reference = ode.jax_odeint(*lv, 1e-13, 1e-13)[0]
    ref = jax.jit(jax.grad(lambda p: ode.lv_loss(reference(p))))(params)
    return sweep(curves, (params,), [np.asarray(ref)])


def neural():
    params64, y064 = node.make_problem()
    y064 = y064[:NODE_BATCH]
    params = tuple(jnp.asarray(p, jnp.float32) for p in params64)
    y0 = jnp.asarray(y064, jnp.float32)
    ref = node.reference(params64, y064)

    def curve(make):
        return [(r, lambda p, s=make(r): node.loss(s(p, y0))) for r in NODE_TOLS]

    curves = {
        "ours dopri5 (default)": curve(lambda r: node.ours("dopri5", rtol=r, atol=r)),
        "ours dopri5, backsolve adjoint": curve(
            lambda r: node.ours("dopri5", rtol=r, atol=r, adjoint="backsolve")),
        "jax odeint": curve(lambda r: node.jax_odeint(rtol=r, atol=r)),
        "diffrax Dopri5 (RecursiveCheckpointAdjoint)": curve(
            lambda r: node.diffrax_solver("Dopri5", "RecursiveCheckpointAdjoint", r, r)),
        "diffrax Dopri5 (BacksolveAdjoint)": curve(
            lambda r: node.diffrax_solver("Dopri5", "BacksolveAdjoint", r, r)),
    }
    return sweep(curves, (params,), ref)


def fixed_point():
    w, u, b, x = deq.make_problem()
    ref = deq.reference_gradient(w, u, b, x)
    params = tuple(jnp.asarray(v, jnp.float32) for v in (w, u, b))
    x32 = jnp.asarray(x, jnp.float32)

    def curve(make, knobs=DEQ_TOLS):
        return [(k, lambda p, s=make(k): deq.loss_of(s)(p, x32)) for k in knobs]

    curves = {
        "ours fixed_point (default)": curve(
            lambda r: deq.ours_batched("iterate", "auto", rtol=r)),
        "seed notebook custom_vjp fixed_point": curve(lambda r: deq.seed_notebook(r)[0]),
        "jaxopt FixedPointIteration": curve(lambda r: deq.jaxopt_solver("fpi", r)),
        "jaxopt AndersonAcceleration": curve(lambda r: deq.jaxopt_solver("anderson", r)),
        "optimistix fixed_point (batched, GMRES)": curve(
            lambda r: deq.optimistix_gmres(r, r)),
        "unrolled lax.scan": curve(deq.unrolled_scan, SCAN_STEPS),
    }
    return sweep(curves, (params,), ref)


def main():
    start = time.perf_counter()
    platform = jax.devices()[0].platform
    print(f"# Work–precision: gradient error against value-and-grad time, {platform}")
    print("\nLotka–Volterra ...", flush=True)
    lv = lotka_volterra()
    print_curves("Lotka–Volterra, dopri5, float64: rtol = atol swept", lv, "rtol",
                 "ours dopri5 (default)")
    print("\nneural ODE ...", flush=True)
    nn = neural()
    print_curves(f"Neural ODE, MLP field, batch {NODE_BATCH}, float32: rtol = atol swept", nn,
                 "rtol", "ours dopri5 (default)")
    print("\nDEQ ...", flush=True)
    with jax.enable_x64(False):  # (as the fixed_point suite runs: the peers' own dtypes)
        fp = fixed_point()
    print_curves(f"DEQ n={deq.N}, batch {deq.BATCH}, float32: rtol swept (the scan: K "
                 "iterations)", fp, "rtol or K", "ours fixed_point (default)")
    path = os.path.join(RESULTS, "work_precision.png")
    panels = [("Lotka–Volterra (float64)", lv), (f"Neural ODE, batch {NODE_BATCH} (float32)", nn),
              ("DEQ (float32)", fp)]
    plot_work_precision([(title, {name: [(ms, err) for _, ms, err, _ in sorted(
        pts, key=lambda p: p[2])] for name, pts in curves.items()}) for title, curves in panels],
        path, xlabel="value-and-grad time (ms)", ylabel="gradient error (relative)")
    print(f"\n- times: fastest of {ROUNDS} calls, every point of a problem timed "
          "round-robin; compile s: lower and compile of jit(value_and_grad(loss)).")
    print(f"\nwork-precision plot: {path}")
    print(f"Total benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
