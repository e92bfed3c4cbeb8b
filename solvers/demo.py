"""The showcase behind ``make demo``: one problem of each kind, solved and differentiated.

Run ``python -m solvers.demo [--output DIR]``. For each problem (a fixed point, a root of
a nonlinear system by Newton's method, a bracketed scalar root, an ODE) it prints the
value of a scalar loss of the solution, its gradient by the implicit function theorem (or
the ODE adjoint), the relative error of that gradient against float64 central finite
differences, and the time of the compiled ``value_and_grad``. It writes the plots
(solver convergence, finite-difference checks, log1pexp's custom rule, gradient
clipping, an ODE trajectory) as PNG files into ``DIR`` (default ``demo_output/``, or the
environment variable ``SOLVERS_DEMO_OUTPUT``) and prints that folder's path.

Everything runs in float64, so that the finite-difference check is meaningful, and the
solves use tight tolerances (a finite difference of a solve is only as accurate as the
solve).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import implicit
import solvers
from implicit import plot

__all__ = ["main"]

DEFAULT_OUTPUT = "demo_output"
OUTPUT_ENV = "SOLVERS_DEMO_OUTPUT"
#: Finite-difference steps of the gradient check (float64 central differences).
FD_STEPS = np.logspace(-2, -9, 15)
#: Parameters beyond this many are checked along one random direction, not coordinatewise.
FD_MAX_COORDINATES = 8


class Check(NamedTuple):
    """One problem's loss, implicit gradient, finite-difference check and timings."""

    title: str
    value: float
    grad: Any
    fd_errors: np.ndarray  # relative error of central differences, one per FD_STEPS
    fd_what: str  # what was compared: the whole gradient or one directional derivative
    compile_s: float  # first call of the jitted value_and_grad (compilation included)
    run_s: float  # best of a few compiled calls

    @property
    def fd_error(self) -> float:
        return float(np.nanmin(self.fd_errors))

    @property
    def fd_step(self) -> float:
        return float(FD_STEPS[np.nanargmin(self.fd_errors)])


def _check(title: str, loss: Callable, theta: Any) -> Check:
    """Time ``value_and_grad(loss)`` at ``theta`` and check the gradient by finite differences."""
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    start = time.perf_counter()
    value, grad = jax.block_until_ready(value_and_grad(theta))
    compile_s = time.perf_counter() - start
    run_s = np.inf
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(value_and_grad(theta))
        run_s = min(run_s, time.perf_counter() - start)

    size = sum(np.size(leaf) for leaf in jax.tree.leaves(theta))
    direction = None
    if size > FD_MAX_COORDINATES:
        keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(theta)))
        leaves, treedef = jax.tree.flatten(theta)
        direction = treedef.unflatten(
            [jax.random.normal(k, jnp.shape(leaf), jnp.float64) for k, leaf in zip(keys, leaves)]
        )
    fd_errors = plot.finite_difference_errors(loss, theta, grad, FD_STEPS, direction=direction)
    what = "gradient" if direction is None else "directional derivative along a random direction"
    return Check(title, float(value), grad, fd_errors, what, compile_s, run_s)


def _report(check: Check, details: str) -> None:
    grad = np.concatenate([np.ravel(np.asarray(g)) for g in jax.tree.leaves(check.grad)])
    shown = np.array2string(grad[:4], precision=6, separator=", ")
    more = f" ... ({grad.size} entries)" if grad.size > 4 else ""
    print(f"\n[{check.title}] {details}")
    print(f"  value       loss = {check.value:.10g}")
    print(f"  gradient    {shown}{more}")
    print(
        f"  FD check    relative error {check.fd_error:.1e} ({check.fd_what}, float64 central "
        f"differences, best step h = {check.fd_step:.0e})"
    )
    print(
        f"  time        value_and_grad {1e3 * check.run_s:.2f} ms compiled "
        f"({check.compile_s:.1f} s first call, compilation included)"
    )


# --------------------------------------------------------------------------------------
# The problems
# --------------------------------------------------------------------------------------


def _deq_layer(z, theta):
    return jnp.tanh(theta["A"] @ z + theta["b"])


def fixed_point_problem():
    """A small equilibrium layer ``z = tanh(A z + b)``: gradient of ``|z*|²`` in ``(A, b)``."""
    rng = np.random.default_rng(0)
    n = 6
    theta = {
        "A": jnp.asarray(0.5 * rng.normal(size=(n, n)) / np.sqrt(n)),  # a contraction
        "b": jnp.asarray(rng.normal(size=n)),
    }
    z0 = jnp.zeros(n)

    def loss(theta):
        z = solvers.fixed_point(_deq_layer, z0, theta, method="anderson", rtol=1e-12)
        return jnp.sum(z**2)

    check = _check("fixed point", loss, theta)
    _report(
        check,
        f"z = tanh(A z + b), {n} unknowns, 42 parameters: solvers.fixed_point(method="
        "'anderson'), loss |z*|^2",
    )
    infos = {
        method: solvers.fixed_point(
            _deq_layer, z0, theta, method=method, rtol=1e-12, full_output=True
        )[1]
        for method in ("iterate", "anderson")
    }
    return check, infos


_BRATU_N = 32


def _bratu(u, lam):
    # The discretised Bratu problem u'' + lam e^u = 0, u(0) = u(1) = 0 (scaled by h²).
    h = 1.0 / (_BRATU_N + 1)
    padded = jnp.pad(u, 1)
    return padded[:-2] - 2 * u + padded[2:] + h**2 * lam * jnp.exp(u)


def root_problem():
    """Newton on the Bratu problem: gradient of the mean of ``u`` in ``lam``."""
    u0 = jnp.zeros(_BRATU_N)

    def loss(lam):
        return jnp.mean(solvers.newton(_bratu, u0, lam, rtol=1e-12))

    check = _check("root (Newton)", loss, jnp.float64(2.0))
    _report(
        check,
        f"Bratu problem u'' + lam e^u = 0, {_BRATU_N} unknowns, lam = 2: solvers.newton, "
        "loss mean(u*)",
    )
    infos = {
        method: solvers.root(_bratu, u0, 2.0, method=method, rtol=1e-12, full_output=True)[1]
        for method in ("newton", "chord", "broyden")
    }
    return check, infos


def _kepler(E, e, M):
    return E - e * jnp.sin(E) - M


def bracket_problem():
    """Kepler's equation ``E - e sin E = M`` for 16 mean anomalies: gradient in ``e``."""
    M = jnp.linspace(0.1, 6.2, 16)

    def loss(e):
        E = solvers.chandrupatla(_kepler, 0.0, 2 * jnp.pi, e, M, rtol=1e-14, atol=1e-14)
        return jnp.sum(jnp.sin(E))

    check = _check("bracketed root", loss, jnp.float64(0.6))
    _report(
        check,
        "Kepler's equation E - e sin E = M, 16 values of M in [0, 2 pi], e = 0.6: "
        "solvers.chandrupatla, loss sum(sin E*)",
    )
    infos = {
        method.__name__: method(
            _kepler, 0.0, 2 * jnp.pi, 0.6, M, rtol=1e-14, atol=1e-14, full_output=True
        )[1]
        for method in (solvers.bisection, solvers.chandrupatla)
    }
    return check, infos


def _lotka_volterra(y, t, theta):
    alpha, beta, gamma, delta = theta
    prey, predator = y
    return jnp.stack(
        [alpha * prey - beta * prey * predator, -gamma * predator + delta * prey * predator]
    )


#: float64 reference (tight SciPy Radau, DESIGN.md) for the Lotka–Volterra problem.
LV_REFERENCE_VALUE = 842.503898308
LV_REFERENCE_GRAD = np.array([32.87985, -541.66745, 504.66100, -1777.73152])


def ode_problem():
    """Lotka–Volterra, 50 outputs on [0, 10]: gradient of ``sum(ys²)`` in its 4 parameters."""
    ts = jnp.linspace(0.0, 10.0, 50)
    y0 = jnp.array([1.0, 1.0])
    theta = jnp.array([1.5, 1.0, 3.0, 1.0])

    def loss(theta):
        ys = solvers.odeint(_lotka_volterra, y0, ts, theta, rtol=1e-10, atol=1e-10)
        return jnp.sum(ys**2)

    check = _check("ODE", loss, theta)
    _report(
        check,
        "Lotka-Volterra (alpha, beta, gamma, delta) = (1.5, 1, 3, 1), y0 = (1, 1), 50 outputs "
        "on [0, 10]: solvers.odeint(method='dopri5'), adjoint gradient, loss sum(ys^2)",
    )
    print(
        f"  reference   SciPy Radau: loss {LV_REFERENCE_VALUE}, gradient relative error "
        f"{plot.gradient_error(check.grad, LV_REFERENCE_GRAD):.1e} (reference has 10 digits)"
    )
    t_fine = jnp.linspace(0.0, 10.0, 400)
    trajectory = solvers.odeint(_lotka_volterra, y0, t_fine, theta, rtol=1e-10, atol=1e-10)
    return check, (t_fine, trajectory)


# --------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------


def _save(fig, folder: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    path = folder / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_convergence(convergence, folder):
    import matplotlib.pyplot as plt

    width = 5.2 * len(convergence)
    fig, axes = plt.subplots(1, len(convergence), figsize=(width, 4.2), layout="constrained")
    for ax, (title, infos) in zip(np.atleast_1d(axes), convergence.items()):
        plot.plot_convergence(infos, ax=ax, title=title)
    return _save(fig, folder, "convergence.png")


def _plot_gradient_checks(checks, folder):
    import matplotlib.pyplot as plt

    width = 4.6 * len(checks)
    fig, axes = plt.subplots(
        1, len(checks), figsize=(width, 4.0), layout="constrained", sharey=True
    )
    for ax, check in zip(np.atleast_1d(axes), checks):
        plot.plot_gradient_check(FD_STEPS, check.fd_errors, ax=ax)
        ax.set_title(f"{check.title}: implicit gradient\nvs central differences (float64)")
        ax.set_ylabel("relative difference")
    return _save(fig, folder, "gradient_check.png")


def _plot_rules(folder):
    def naive_log1pexp(x):
        return jnp.log(1.0 + jnp.exp(x))

    fig, _ = plot.plot_custom_vs_naive(
        naive_log1pexp,
        implicit.log1pexp,
        jnp.linspace(-20.0, 120.0, 281, dtype=jnp.float32),
        labels=("autodiff of log(1 + exp(x))", "implicit.log1pexp"),
        title="d/dx log(1 + e^x) in float32: naive autodiff vs custom rule",
    )
    log1pexp_path = _save(fig, folder, "log1pexp.png")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.0, 4.2), layout="constrained")
    plot.plot_gradient_clipping(jnp.sin, jnp.linspace(0.0, 10.0, 500), -0.75, 0.75, ax=ax)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: the curves fill the axes
    return log1pexp_path, _save(fig, folder, "gradient_clipping.png")


def _plot_trajectory(trajectory, folder):
    import matplotlib.pyplot as plt

    ts, ys = (np.asarray(a) for a in trajectory)
    fig, (ax_t, ax_phase) = plt.subplots(1, 2, figsize=(10.5, 4.0), layout="constrained")
    ax_t.plot(ts, ys[:, 0], label="prey")
    ax_t.plot(ts, ys[:, 1], label="predator")
    ax_t.set(xlabel="t", ylabel="population", title="Lotka-Volterra, solvers.odeint (dopri5)")
    ax_t.grid(True, alpha=0.3)
    ax_t.legend()
    ax_phase.plot(ys[:, 0], ys[:, 1], color="C2")
    ax_phase.plot(ys[0, 0], ys[0, 1], "ko", label="y0 = (1, 1)")
    ax_phase.set(xlabel="prey", ylabel="predator", title="Phase plane")
    ax_phase.grid(True, alpha=0.3)
    ax_phase.legend()
    return _save(fig, folder, "ode_trajectory.png")


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m solvers.demo",
        description="Solve one problem of each kind, check implicit gradients against "
        "finite differences, and write plots.",
    )
    parser.add_argument(
        "--output",
        default=os.environ.get(OUTPUT_ENV, DEFAULT_OUTPUT),
        help=f"folder for the PNG plots (default: ${OUTPUT_ENV} or {DEFAULT_OUTPUT}/)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> list[Check]:
    """Run the showcase; return the checks (one per problem)."""
    options = _parse(argv)
    folder = Path(options.output).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"implicit / solvers demo: jax {jax.__version__} on {jax.devices()[0].platform}")
    with jax.enable_x64(True):
        fixed, fixed_infos = fixed_point_problem()
        root, root_infos = root_problem()
        bracket, bracket_infos = bracket_problem()
        ode, trajectory = ode_problem()
        checks = [fixed, root, bracket, ode]
        paths = [
            _plot_convergence(
                {
                    "Fixed point z = tanh(Az + b)": fixed_infos,
                    "Root: Bratu problem (max |step|)": root_infos,
                    "Kepler's equation (widest bracket)": bracket_infos,
                },
                folder,
            ),
            _plot_gradient_checks(checks, folder),
            *_plot_rules(folder),
            _plot_trajectory(trajectory, folder),
        ]
    print(f"\nPlots written to {folder}:")
    for path in paths:
        print(f"  {path.name}")
    worst = max(check.fd_error for check in checks)
    elapsed = time.perf_counter() - start
    print(f"\nWorst finite-difference relative error: {worst:.1e}. Total time {elapsed:.1f} s.")
    return checks


if __name__ == "__main__":
    main(sys.argv[1:])
