"""Bracketed scalar roots: cube roots of 100,000 values, side by side with peers.

Problem (float32): ``F(x, a) = x³ - a`` for ``a`` = 100,000 values evenly spaced in
[0.1, 100], bracket [0, 100] (the same for every element), rtol = 1e-5 and atol = 1e-6
where a method takes them. Loss ``sum(x*)``; gradient with respect to ``a``.

Reference: ``np.cbrt`` in float64; gradient ``1 / (3 a^(2/3))``. Errors are the largest
relative error over the 100,000 elements. SciPy's ``brentq`` (float64, a Python loop)
runs 1,000 of the values and its time is scaled by 100.

Run: ``python -m benchmarks bracket``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

import solvers
from benchmarks._common import time_rows as _common_time_rows
from benchmarks._common import OURS, Row, fresh_compile_time, print_table

N = 100_000
LOWER, UPPER = 0.0, 100.0
RTOL, ATOL = 1e-5, 1e-6
REPEAT_COMPILE = 3  # compile time: the smallest of a few compilations from scratch
TIMING_ROUNDS = 5  # run times: the best of interleaved rounds (see `time_rows`)


def cube(x, a):
    return x**3 - a


# --------------------------------------------------------------------------- methods
#
# Every method is ``solve(a) -> x`` (elementwise), jittable.


def ours(method, **options):
    fn = getattr(solvers, method)

    def solve(a):
        return fn(cube, LOWER, UPPER, a, rtol=RTOL, atol=ATOL, **options)

    return solve


def optimistix_bisection(rtol=RTOL, atol=ATOL, max_steps=256):
    import optimistix as optx

    solver = optx.Bisection(rtol=rtol, atol=atol)

    def one(ai):
        sol = optx.root_find(
            cube,
            solver,
            jnp.asarray(1.0, ai.dtype),
            ai,
            options=dict(lower=LOWER, upper=UPPER),
            max_steps=max_steps,
            throw=False,
        )
        return sol.value

    return jax.vmap(one)


def jaxopt_bisection(maxiter=30, tol=ATOL):
    import jaxopt

    solver = jaxopt.Bisection(
        cube, lower=LOWER, upper=UPPER, check_bracket=False, tol=tol, maxiter=maxiter
    )

    def one(ai):
        return solver.run(None, ai).params

    return jax.vmap(one)


# --------------------------------------------------------------------------- measuring


def rel_error(x, ref):
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref) / np.abs(ref)))



def measure(name, group, solve, a, x_ref, g_ref):
    """One row: compile s and errors now; run times by :func:`time_rows`."""
    vg = jax.value_and_grad(lambda a: jnp.sum(solve(a)))
    seconds, compiled = min(
        (fresh_compile_time(vg, a) for _ in range(REPEAT_COMPILE)), key=lambda t: t[0]
    )
    _, grad = compiled(a)
    forward = jax.jit(solve)
    row = Row(
        name,
        group,
        {
            "compile s": seconds,
            "root error": rel_error(forward(a), x_ref),
            "grad error": rel_error(grad, g_ref),
        },
    )
    TIMERS[id(row)] = {"solve ms": (forward, (a,)), "value-and-grad ms": (compiled, (a,))}
    return row


TIMERS = {}  # id(row) -> {metric: (function, args)}


def time_rows(rows, rounds=TIMING_ROUNDS):
    return _common_time_rows(rows, TIMERS, rounds, repeat=5)


def brentq_row(a64, x_ref):
    sample = a64[:: N // 1000]
    start = time.perf_counter()
    x = np.array(
        [
            scipy.optimize.brentq(cube, LOWER, UPPER, args=(ai,), xtol=ATOL, rtol=RTOL)
            for ai in sample
        ]
    )
    seconds = (time.perf_counter() - start) * (N / sample.size)
    return Row(
        "SciPy brentq loop (float64, 1,000 values x 100)",
        "peer",
        {
            "solve ms": 1e3 * seconds,
            "root error": rel_error(x, x_ref[:: N // 1000]),
        },
    )


def main():
    start = time.perf_counter()
    a64 = np.linspace(0.1, 100.0, N)
    x_ref = np.cbrt(a64)
    g_ref = 1.0 / (3.0 * x_ref**2)
    a = jnp.asarray(a64, jnp.float32)
    print(
        f"# Cube roots of {N:,} values in [0.1, 100] on [{LOWER}, {UPPER}], float32, "
        f"{jax.devices()[0].platform}"
    )
    rows = [
        measure("ours chandrupatla", OURS, ours("chandrupatla"), a, x_ref, g_ref),
        measure("ours bisection", OURS, ours("bisection"), a, x_ref, g_ref),
        measure(
            "optimistix Bisection (vmap, rtol=1e-5, atol=1e-6)",
            "peer",
            optimistix_bisection(),
            a,
            x_ref,
            g_ref,
        ),
        measure(
            "jaxopt Bisection (vmap, tol=1e-6, maxiter=30)",
            "peer",
            jaxopt_bisection(),
            a,
            x_ref,
            g_ref,
        ),
    ]
    rows = time_rows(rows) + [brentq_row(a64, x_ref)]
    columns = ["compile s", "solve ms", "value-and-grad ms", "root error", "grad error"]
    print_table(
        "Bracketed roots: solve and gradient of sum(x*) w.r.t. a",
        rows,
        columns,
        ratio_columns=["compile s", "solve ms", "value-and-grad ms", "root error"],
    )
    tight = measure(
        "optimistix Bisection (vmap, rtol = atol = 1e-6, max_steps=256)",
        "peer",
        optimistix_bisection(1e-6, 1e-6),
        a,
        x_ref,
        g_ref,
    )
    ours_tight = measure(
        "ours chandrupatla (rtol = atol = 1e-6)",
        OURS,
        lambda a: solvers.chandrupatla(cube, LOWER, UPPER, a, rtol=1e-6, atol=1e-6),
        a,
        x_ref,
        g_ref,
    )
    print_table(
        "Tolerances at float32's limit (optimistix runs to max_steps)",
        time_rows([ours_tight, tight], rounds=2),
        columns,
        ratio_columns=["solve ms", "root error"],
    )
    print(
        "\nroot error, grad error: max relative error over the elements against float64 "
        "np.cbrt and 1 / (3 a^(2/3)). compile s: the smallest of 3 compilations of "
        "value-and-grad from scratch."
    )
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
