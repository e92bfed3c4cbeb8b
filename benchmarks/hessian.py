"""Second derivatives of an ODE loss: ``jax.hessian`` through the default (discrete)
adjoint against forward sensitivities (``adjoint="forward"``), issue 37's report.

``jax.hessian`` is ``jacfwd(jacrev(loss))``, forward over reverse. With the default
adjoint the outer ``jacfwd`` goes through the discrete adjoint's second-order rules (the
tangent-linear of the forward and backward passes); reverse over reverse
(``jacrev(jacrev(loss))``, the same rules transposed) is a row of its own; with
``adjoint="forward"`` the gradient itself comes from forward sensitivities, so the
Hessian is forward over forward (bdf: ``adjoint="forward_adaptive"``, its forward mode,
whose sensitivities also steer the step size). Problems and tolerances are the ODE
suite's (benchmarks/ode.py): Lotka–Volterra (dopri5, rtol = atol = 1e-6, 4 parameters)
and Robertson to t = 1e5 (kvaerno5 and bdf, rtol 1e-6, atol 1e-10, 3 log rate
constants). Peers: ``jax.experimental.ode.odeint`` on Lotka–Volterra, whose ``custom_vjp``
refuses forward mode, so its Hessian is ``jacrev(jacrev)`` (reverse over reverse).

- compile s: trace, lower and compile ``jit(hessian(loss))`` from cleared caches, the
  fastest of ``COMPILE_ROUNDS`` round-robin over the rows;
- run ms: the fastest of ``RUN_ROUNDS`` round-robin calls;
- Hessian error: ``max |H - H_ref| / max |H_ref|``, ``H_ref`` by central differences
  (step 1e-4 relative) of the forward-sensitivity gradient at rtol 1e-10, float64 (an
  independent route: no adjoint, no Hessian rule);
- ours / forward: the default adjoint's compile and run time over ``adjoint="forward"``'s.

Run: ``python -m benchmarks hessian`` (also part of ``make bench``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import ode
from benchmarks._common import OURS, Row, fresh_compile_time, print_table, run_times_interleaved

COMPILE_ROUNDS = 3
RUN_ROUNDS = 20
COLUMNS = ["compile s", "run ms", "Hessian error", "symmetry"]
RATIOS = ["compile s", "run ms"]
X64 = True  # (benchmarks/__main__.py runs each suite in the float64 mode it declares)
REF_RTOL = 1e-10  # the reference gradient's (atol scaled with it from the problem's ratio)


def _reference_hessian(grad_of, params, h=1e-4):
    """Central differences of ``grad_of`` (a float64 gradient at tight tolerance)."""
    params = np.asarray(params, np.float64)
    step = h * np.maximum(np.abs(params), 1.0)
    cols = []
    for i in range(params.size):
        e = np.zeros_like(params)
        e[i] = step[i]
        cols.append((np.asarray(grad_of(params + e)) - np.asarray(grad_of(params - e)))
                    / (2 * step[i]))
    H = np.stack(cols, axis=1)
    return (H + H.T) / 2


def _problems():
    lv = dict(f=ode.lotka_volterra, y0=ode.LV_Y0, ts=ode.LV_TS, loss=ode.lv_loss,
              params=ode.LV_PARAMS, tol=dict(rtol=ode.LV_RTOL, atol=ode.LV_ATOL),
              log_params=False)
    rob = dict(f=ode.robertson, y0=ode.ROB_Y0, ts=ode.ROB_TS, loss=ode.rob_loss,
               params=np.log(ode.ROB_K), tol=dict(rtol=ode.ROB_RTOL, atol=ode.ROB_ATOL),
               log_params=True)
    return {"Lotka–Volterra, dopri5": (lv, "dopri5"),
            "Robertson, kvaerno5": (rob, "kvaerno5"),
            "Robertson, bdf": (rob, "bdf")}


def _ours_loss(p, method, **kw):
    solve, _ = ode.ours(p["f"], p["y0"], p["ts"], method, log_params=p["log_params"],
                        **{**p["tol"], **kw})
    return lambda params: p["loss"](solve(params))


def _row(name, hessian_fn, params, H_ref):
    params = jnp.asarray(params)
    compile_s, compiled = fresh_compile_time(hessian_fn, params)
    H = np.asarray(compiled(params))
    row = Row(name, OURS if name.startswith("ours") else "peer", {
        "compile s": compile_s,
        "Hessian error": float(np.max(np.abs(H - H_ref)) / np.max(np.abs(H_ref))),
        "symmetry": float(np.max(np.abs(H - H.T)) / np.max(np.abs(H))),
    })
    row.call = lambda: compiled(params)
    row.recompile = lambda: fresh_compile_time(hessian_fn, params)[0]
    print(f"  {name}: compile {compile_s:.2f} s, error {row.values['Hessian error']:.1e}",
          flush=True)
    return row


def _forward(method):
    """The forward-sensitivity adjoint for ``method`` (bdf's multistep state is not
    differentiated step by step: its forward mode is ``"forward_adaptive"``)."""
    return "forward_adaptive" if method == "bdf" else "forward"


def rows_of(title, problem, method):
    forward = _forward(method)
    ref_grad = jax.jit(jax.grad(_ours_loss(problem, method, adjoint=forward, rtol=REF_RTOL,
                                           atol=REF_RTOL * problem["tol"]["atol"]
                                           / problem["tol"]["rtol"], max_steps=100_000)))
    H_ref = _reference_hessian(ref_grad, problem["params"])
    rows = [_row(f"ours {method}, default adjoint",
                 jax.hessian(_ours_loss(problem, method)), problem["params"], H_ref),
            _row(f"ours {method}, default adjoint, jacrev(jacrev)",
                 jax.jacrev(jax.jacrev(_ours_loss(problem, method))), problem["params"],
                 H_ref),
            _row(f"ours {method}, adjoint='{forward}'",
                 jax.hessian(_ours_loss(problem, method, adjoint=forward)),
                 problem["params"], H_ref)]
    if method == "dopri5":
        solve, _ = ode.jax_odeint(problem["f"], problem["y0"], problem["ts"], **problem["tol"])
        loss = lambda params: problem["loss"](solve(params))  # noqa: E731
        rows.append(_row("jax.experimental.ode.odeint, jacrev(jacrev)",
                         jax.jacrev(jax.jacrev(loss)), problem["params"], H_ref))
    return rows


def main():
    ode.warm_up()
    print(f"# Hessians of ODE losses through the default adjoint, float64, "
          f"{jax.devices()[0].platform}")
    tables = []
    for title, (problem, method) in _problems().items():
        print(f"\n{title} ...", flush=True)
        tables.append((title, rows_of(title, problem, method)))
    rows = [row for _, table in tables for row in table]
    for (i, _), seconds in run_times_interleaved(
            {(i, 0): row.call for i, row in enumerate(rows)}, rounds=RUN_ROUNDS).items():
        rows[i].values["run ms"] = 1e3 * seconds
    for _ in range(COMPILE_ROUNDS - 1):
        for row in rows:
            row.values["compile s"] = min(row.values["compile s"], row.recompile())
    for title, table in tables:
        forward = next(r for r in table if "forward" in r.name)
        for default in (r for r in table if "default" in r.name):
            for col in RATIOS:
                default.values[f"{col}, default / forward"] = (default.values[col]
                                                               / forward.values[col])
        has_peer = any(r.group != OURS for r in table)
        print_table(f"{title}: second derivatives of the suite's loss", table,
                    COLUMNS + [f"{c}, default / forward" for c in RATIOS],
                    ratio_columns=RATIOS if has_peer else ())
    for note in (
        f"compile s: trace + lower + compile from cleared caches, fastest of {COMPILE_ROUNDS}; "
        f"run ms: fastest of {RUN_ROUNDS} round-robin calls.",
        "Hessian error: against central differences of the forward-sensitivity gradient at "
        "rtol 1e-10 (float64); symmetry: max |H - Hᵀ| / max |H|.",
        "No target (issue 37 item 1 asks for the report).",
    ):
        print(f"- {note}")


if __name__ == "__main__":
    main()
