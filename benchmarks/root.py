"""Root finding ``A x + θ x³ - b = 0``: implicit gradients, side by side with peers.

Problem 1 (dense, n = 64, float32): ``A = I + M Mᵀ / n`` with ``M`` drawn N(0, 1) (SPD,
eigenvalues in [1, ~5]), ``θ = 0.5``, ``b`` drawn N(0, 2²), ``x0 = 0``, ``rtol = 1e-5``,
``atol = 1e-6``. Loss ``sum(x*)``; gradient with respect to ``(θ, b)``.

Problem 2 (matrix-free, n = 10,000, float32): the same with ``A`` tridiagonal
(``2.5`` on the diagonal, ``-1`` off it), applied by shifts, never stored.

Reference: Newton in float64 (NumPy / SciPy sparse) to machine precision, then the
implicit function theorem: ``w = J⁻ᵀ 1``, ``J = A + 3θ diag(x²)``, ``∂/∂b = w``,
``∂/∂θ = -w·x³``. Gradient error: ``max over (θ, b) of max|g - g_ref| / max|g_ref|``.

Problem 3 (structured, n = 10,000, float64): the 2-D Bratu problem ``-Δu = λ exp(u)`` on
the unit square, 100 x 100 interior points (5-point stencil, zero boundary values),
``λ = 6``, ``u0 = 0``, rtol = atol = 1e-8. Loss ``sum(u*)``, gradient with respect to λ.
Ours with ``jac_sparsity`` (the stencil's pattern: colouring, block LU) against optimistix
Newton with lineax GMRES (forward and implicit adjoint); ours matrix-free (GMRES) for
comparison. Reference: float64 Newton with SciPy's sparse LU, then
``du/dλ = J⁻¹ exp(u)``.

Run: ``python -m benchmarks root`` (``python -m benchmarks.root bratu``: that table).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
import scipy.sparse
import scipy.sparse.linalg

import solvers
from benchmarks._common import time_rows as _common_time_rows
from benchmarks._common import OURS, Row, fresh_compile_time, print_table, temp_memory_bytes

N_DENSE = 64
N_LARGE = 10_000
THETA = 0.5
RTOL, ATOL = 1e-5, 1e-6
REPEAT_COMPILE = 3  # compile time: the smallest of a few compilations from scratch
TIMING_ROUNDS = 5  # run times: the best of interleaved rounds (see `time_rows`)
GRAD_ERROR_NOTE = "grad error = max over (θ, b) of max|g - g_ref| / max|g_ref|"


# --------------------------------------------------------------------------- problems


def dense_problem(seed=0):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((N_DENSE, N_DENSE))
    a = np.eye(N_DENSE) + m @ m.T / N_DENSE
    b = 2.0 * rng.standard_normal(N_DENSE)
    return a, b


def dense_F(a):
    def F(x, theta, b):
        return a @ x + theta * x**3 - b

    return F


def tridiagonal_apply(x):
    padded = jnp.pad(x, 1)
    return 2.5 * x - padded[:-2] - padded[2:]


def large_F(x, theta, b):
    return tridiagonal_apply(x) + theta * x**3 - b


def large_problem(seed=1):
    rng = np.random.default_rng(seed)
    return 2.0 * rng.standard_normal(N_LARGE)


def reference(apply_a, jac_a, theta, b):
    """Float64 Newton to machine precision and the IFT gradient of sum(x*)."""
    x = np.zeros_like(b)
    for _ in range(100):
        f = apply_a(x) + theta * x**3 - b
        jac = jac_a + scipy.sparse.diags(3 * theta * x**2)
        dx = scipy.sparse.linalg.spsolve(scipy.sparse.csc_matrix(jac), f)
        x = x - dx
        if np.max(np.abs(dx)) <= 1e-15 * max(1.0, np.max(np.abs(x))):
            break
    jac = scipy.sparse.csc_matrix(jac_a + scipy.sparse.diags(3 * theta * x**2))
    w = scipy.sparse.linalg.spsolve(jac.T, np.ones_like(b))
    return x, (-w @ x**3, w)


def grad_error(grads, ref):
    return max(
        float(np.max(np.abs(np.asarray(g, np.float64) - r)) / np.max(np.abs(r)))
        for g, r in zip(grads, ref)
    )


# --------------------------------------------------------------------------- methods
#
# Every method is ``solve(theta, b) -> x``, jittable.


def ours(F, n, **options):
    def solve(theta, b):
        return solvers.root(F, jnp.zeros(n, b.dtype), theta, b, rtol=RTOL, atol=ATOL, **options)

    return solve


def optimistix_newton(F, n, gmres=False):
    import lineax as lx
    import optimistix as optx

    if gmres:
        linear = lx.GMRES(rtol=RTOL, atol=ATOL)
        newton = optx.Newton(rtol=RTOL, atol=ATOL, linear_solver=linear)
        adjoint = optx.ImplicitAdjoint(linear_solver=linear)
    else:
        newton = optx.Newton(rtol=RTOL, atol=ATOL)
        adjoint = optx.ImplicitAdjoint()

    def solve(theta, b):
        fn = lambda x, args: F(x, *args)  # noqa: E731
        sol = optx.root_find(fn, newton, jnp.zeros(n, b.dtype), (theta, b), adjoint=adjoint)
        return sol.value

    return solve


def lax_custom_root(F, n, max_steps=50):
    """``jax.lax.custom_root`` around a hand-written dense Newton (the JAX docs' pattern)."""

    def solve(theta, b):
        fn = lambda x: F(x, theta, b)  # noqa: E731

        def newton(fun, x0):
            def cond(carry):
                _, k, err = carry
                return (k < max_steps) & (err > ATOL + RTOL * jnp.max(jnp.abs(carry[0])))

            def body(carry):
                x, k, _ = carry
                dx = jnp.linalg.solve(jax.jacfwd(fun)(x), fun(x))
                return x - dx, k + 1, jnp.max(jnp.abs(dx))

            return jax.lax.while_loop(cond, body, (x0, 0, jnp.asarray(jnp.inf, x0.dtype)))[0]

        def tangent_solve(g, y):
            return jnp.linalg.solve(jax.jacfwd(g)(y), y)

        return jax.lax.custom_root(fn, jnp.zeros(n, b.dtype), newton, tangent_solve)

    return solve


def jaxopt_broyden(F, n):
    import jaxopt

    broyden = jaxopt.Broyden(F, tol=ATOL, maxiter=500)

    def solve(theta, b):
        return broyden.run(jnp.zeros(n, b.dtype), theta, b).params

    return solve


# --------------------------------------------------------------------------- measuring



def measure(name, group, solve, theta, b, ref):
    """One row: compile s, grad temp MB and grad error now; run times by :func:`time_rows`."""

    def loss(theta, b):
        return jnp.sum(solve(theta, b))

    vg = jax.value_and_grad(loss, argnums=(0, 1))
    seconds, compiled = min(
        (fresh_compile_time(vg, theta, b) for _ in range(REPEAT_COMPILE)), key=lambda t: t[0]
    )
    _, grads = compiled(theta, b)
    row = Row(
        name,
        group,
        {
            "compile s": seconds,
            "grad temp MB": (temp_memory_bytes(compiled) or 0) / 2**20,
            "grad error": grad_error(grads, ref),
        },
    )
    TIMERS[id(row)] = {
        "solve ms": (jax.jit(solve), (theta, b)),
        "value-and-grad ms": (compiled, (theta, b)),
    }
    return row


TIMERS = {}  # id(row) -> {metric: (function, args)}


def time_rows(rows, rounds=TIMING_ROUNDS):
    return _common_time_rows(rows, TIMERS, rounds, repeat=10)


def scipy_row(name, F64, b64, theta, n):
    """SciPy ``root(method="hybr")`` in float64, forward only, analytic Jacobian."""

    def run():
        return scipy.optimize.root(
            lambda x: F64(x, theta, b64), np.zeros(n), jac=True, method="hybr"
        ).x

    start = time.perf_counter()
    count = 0
    while count < 5 or time.perf_counter() - start < 0.5:
        run()
        count += 1
    return Row(name, "peer", {"solve ms": 1e3 * (time.perf_counter() - start) / count})


def _warm_up():
    # The first compilation in a process pays one-time costs (LAPACK kernels, ...): pay
    # them before any row is timed.
    x = jnp.eye(3)
    jax.jit(
        lambda a: (
            jnp.linalg.solve(a, a[0])
            + jax.lax.while_loop(lambda v: v[0] < 1, lambda v: v + 1, a[1])
        )
    ).lower(x).compile()


def dense_table():
    a64, b64 = dense_problem()
    _, ref = reference(lambda x: a64 @ x, a64, THETA, b64)
    a = jnp.asarray(a64, jnp.float32)
    b = jnp.asarray(b64, jnp.float32)
    theta = jnp.float32(THETA)
    F = dense_F(a)
    n = N_DENSE
    rows = [
        measure("ours newton (dense)", OURS, ours(F, n), theta, b, ref),
        measure("ours chord (dense)", OURS, ours(F, n, method="chord"), theta, b, ref),
        measure("ours broyden (dense)", OURS, ours(F, n, method="broyden"), theta, b, ref),
        measure("optimistix Newton (LU)", "peer", optimistix_newton(F, n), theta, b, ref),
        measure(
            "lax.custom_root + hand-written Newton", "peer", lax_custom_root(F, n), theta, b, ref
        ),
        measure("jaxopt Broyden", "peer", jaxopt_broyden(F, n), theta, b, ref),
    ]

    def F64(x, theta, b):
        return a64 @ x + theta * x**3 - b, a64 + np.diag(3 * theta * x**2)

    rows.append(scipy_row("SciPy root hybr (float64, forward only)", F64, b64, THETA, n))
    return time_rows(rows)


def large_table():
    b64 = large_problem()
    n = N_LARGE
    main = 2.5 * np.ones(n)
    off = -np.ones(n - 1)
    jac_a = scipy.sparse.diags([off, main, off], [-1, 0, 1])
    _, ref = reference(lambda x: jac_a @ x, jac_a, THETA, b64)
    b = jnp.asarray(b64, jnp.float32)
    theta = jnp.float32(THETA)
    return time_rows(
        [
            measure("ours newton (matrix-free, GMRES)", OURS, ours(large_F, n), theta, b, ref),
            measure(
                "ours broyden (matrix-free)",
                OURS,
                ours(large_F, n, method="broyden"),
                theta,
                b,
                ref,
            ),
            measure(
                "optimistix Newton (lx.GMRES)",
                "peer",
                optimistix_newton(large_F, n, True),
                theta,
                b,
                ref,
            ),
        ]
    )


# --------------------------------------------------------------------------- Bratu 2-D

BRATU_M = 100
BRATU_LAM = 6.0
BRATU_TOL = 1e-8


def bratu_F(m):
    h = 1.0 / (m + 1)

    def F(u, lam):
        U = u.reshape(m, m)
        P = jnp.pad(U, 1)
        lap = (4 * U - P[:-2, 1:-1] - P[2:, 1:-1] - P[1:-1, :-2] - P[1:-1, 2:]) / h**2
        return (lap - lam * jnp.exp(U)).reshape(-1)

    return F


def bratu_laplacian(m):
    eye = scipy.sparse.identity(m)
    T = scipy.sparse.diags([-np.ones(m - 1), 2 * np.ones(m), -np.ones(m - 1)], [-1, 0, 1])
    return (scipy.sparse.kron(eye, T) + scipy.sparse.kron(T, eye)).tocsc() * (m + 1) ** 2


def bratu_reference(m, lam):
    A = bratu_laplacian(m)
    u = np.zeros(m * m)
    for _ in range(50):
        jac = scipy.sparse.csc_matrix(A - lam * scipy.sparse.diags(np.exp(u)))
        du = scipy.sparse.linalg.spsolve(jac, A @ u - lam * np.exp(u))
        u = u - du
        if np.max(np.abs(du)) <= 1e-15 * np.max(np.abs(u)):
            break
    jac = scipy.sparse.csc_matrix(A - lam * scipy.sparse.diags(np.exp(u)))
    return u, float(np.sum(scipy.sparse.linalg.spsolve(jac, np.exp(u))))


def bratu_table():
    import lineax as lx
    import optimistix as optx

    m, lam, tol = BRATU_M, BRATU_LAM, BRATU_TOL
    n = m * m
    F = bratu_F(m)
    pattern = bratu_laplacian(m) != 0
    _, g_ref = bratu_reference(m, lam)
    linear = lx.GMRES(rtol=tol, atol=tol)

    def optx_solve(lam):
        sol = optx.root_find(lambda u, a: F(u, a), optx.Newton(rtol=tol, atol=tol,
                                                                linear_solver=linear),
                             jnp.zeros(n), lam, adjoint=optx.ImplicitAdjoint(
                                 linear_solver=linear))
        return sol.value

    makers = [
        ("ours newton, jac_sparsity (colouring, block LU)", OURS, lambda lam: solvers.root(
            F, jnp.zeros(n), lam, jac_sparsity=pattern, rtol=tol, atol=tol)),
        ("ours newton, jac_sparsity='auto' (read from F)", OURS, lambda lam: solvers.root(
            F, jnp.zeros(n), lam, jac_sparsity="auto", rtol=tol, atol=tol)),
        ("ours newton (matrix-free, GMRES)", OURS, lambda lam: solvers.root(
            F, jnp.zeros(n), lam, rtol=tol, atol=tol, on_failure="nan")),
        ("optimistix Newton (lx.GMRES)", "peer", optx_solve),
    ]
    rows = []
    lam = jnp.float64(lam)
    for name, group, solve in makers:
        vg = jax.value_and_grad(lambda a, solve=solve: jnp.sum(solve(a)))
        seconds, compiled = fresh_compile_time(vg, lam)
        row = Row(name, group, {"compile s": seconds,
                                "grad temp MB": (temp_memory_bytes(compiled) or 0) / 2**20})
        try:
            _, g = compiled(lam)
            row.values["grad error"] = abs(float(g) - g_ref) / abs(g_ref)
            TIMERS[id(row)] = {"solve ms": (jax.jit(solve), (lam,)),
                               "value-and-grad ms": (compiled, (lam,))}
        except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
            row.values["grad error"] = f"failed: {type(e).__name__}"
            TIMERS[id(row)] = {"solve ms": (jax.jit(solve), (lam,))}
        print(f"  {name}: compile {seconds:.1f} s", flush=True)
        rows.append(row)
    return _common_time_rows(rows, TIMERS, rounds=3, repeat=2)


def bratu_main():
    with jax.enable_x64(True):
        rows = bratu_table()
    print_table(
        f"Root, 2-D Bratu {BRATU_M}x{BRATU_M} (n={BRATU_M ** 2}), λ = {BRATU_LAM}, float64, "
        f"rtol = atol = {BRATU_TOL}: value and gradient of sum(u*) w.r.t. λ",
        rows,
        ["compile s", "solve ms", "value-and-grad ms", "grad temp MB", "grad error"],
        ratio_columns=["solve ms", "value-and-grad ms"],
    )
    print("\ngrad error: relative to float64 Newton (SciPy sparse LU) + IFT; times: best of "
          "3 interleaved rounds (median of 2 calls each); a row whose gradient fails says so "
          "(ours matrix-free: unpreconditioned GMRES on the Laplacian misses the adjoint "
          "solve's tolerance, on_failure='nan').")


def main():
    start = time.perf_counter()
    _warm_up()
    platform = jax.devices()[0].platform
    print(
        f"# Root finding A x + θ x³ - b = 0, θ = {THETA}, rtol={RTOL}, atol={ATOL}, float32, "
        f"{platform}"
    )
    columns = ["compile s", "solve ms", "value-and-grad ms", "grad temp MB", "grad error"]
    ratios = ["compile s", "solve ms", "value-and-grad ms", "grad error"]
    rows = dense_table()
    print_table(
        f"Root, dense n={N_DENSE}: value and gradient of sum(x*) w.r.t. (θ, b)",
        rows,
        columns,
        ratio_columns=ratios,
    )
    rows = large_table()
    print_table(
        f"Root, matrix-free n={N_LARGE} (tridiagonal A): value and gradient of sum(x*)",
        rows,
        columns,
        ratio_columns=ratios,
    )
    print(
        f"\n{GRAD_ERROR_NOTE}; reference: float64 Newton + IFT. compile s: the smallest of "
        f"{REPEAT_COMPILE} compilations of value-and-grad."
    )
    bratu_main()
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["bratu"]:  # that table alone
        _warm_up()
        bratu_main()
    else:
        main()
