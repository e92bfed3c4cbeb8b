"""Robustness of the root finders: how many problems from the literature each one solves.

Every ``solvers.root`` method against SciPy (``root``: ``hybr``, MINPACK's dogleg, and
``lm``) and optimistix (``Newton``, ``Dogleg``), as a new user would call them: float64,
``rtol = atol = 1e-10`` (SciPy: ``xtol`` and, for ``lm``, ``ftol``), at most 500 steps
(SciPy: ``maxfev = 500``), the Jacobian by ``jax.jacfwd`` (SciPy: passed as ``jac``).

A solve counts as **solved** when the method reports success (ours: ``info.converged``;
SciPy: ``sol.success``; optimistix: ``sol.result == RESULTS.successful``) and an
independent residual, the problem's function evaluated by NumPy (no JAX) in float64 at
the returned point, is below ``RESIDUAL = 1e-8`` in the max-norm. A reported success
whose residual is not below it is a **silent wrong answer**, counted on its own (the
column that must be zero for this project). An exception (a peer that fails to run)
counts as unsolved.

Problems (none from this repository's tests):

- **MGH**: the 22 square systems of MINPACK's ``hybrd`` test driver (``file21``: 14
  functions at their standard dimensions), Moré, Garbow & Hillstrom (1981), "Testing
  unconstrained optimization software", ACM TOMS 7(1), 17-41, functions and starting
  points as MINPACK's ``vecfcn`` and ``initpt`` define them: Rosenbrock, Powell singular,
  Powell badly scaled, Wood, helical valley, Watson (n = 6, 9; the gradient of its least
  squares function), Chebyquad (n = 5, 6, 7, 8, 9), Brown almost-linear (n = 10, 30, 40),
  discrete boundary value, discrete integral equation (n = 1, 10), trigonometric,
  variably dimensioned, Broyden tridiagonal and Broyden banded (n = 10). Each from 1x,
  10x and 100x its standard start (Watson's start is 0: there ``x0 = factor``, as in
  ``initpt``). MINPACK's driver runs some cases from fewer starts; here all have three.
- **Chandrasekhar's H-equation** (Kelley, "Iterative Methods for Linear and Nonlinear
  Equations", SIAM 1995, §5.6), midpoint rule with n = 100 nodes, ``c = 0.9`` and
  ``c = 0.9999`` (nearly singular at the root), from ``x0 = 1``.
- **Chemical equilibrium**, Meintjes & Morgan (1990), "Chemical equilibrium systems as
  numerical test problems", ACM TOMS 16(2), 143-151: the combustion of propane in air
  (5 unknowns, the reduced form, R = 10, p = 40) from ``x0 = 1, 10, 100`` (all entries),
  and Morgan's 10-species combustion system (Morgan, "Solving Polynomial Systems Using
  Continuation for Engineering and Scientific Problems", Prentice-Hall 1987; badly
  scaled: the unknowns are 6e-11 ... 1.5e-5) from ``x0 = 1e-5, 1e-6, 1e-7`` (all
  entries). Its residual test is relative, row by row (:func:`combustion10_scaled_residual`):
  the absolute one cannot judge it (near any point of size 1e-5 its six equilibrium rows
  are below 1e-9); a second table shows the relative residuals.
- **tanh-3**: optimistix's own test system ``(tanh(a + 0.1), tanh(b - 0.5), tanh(2c))``
  from ``(0.5, -0.3, 0.7)`` (root ``(-0.1, 0.5, 0)``; the full Newton step overshoots:
  ``tanh`` is flat far from its root).
- **random tanh**: 100 systems ``tanh(A x + b) = x``, n = 30, ``A = S / sqrt(n) * N(0, 1)``
  entries with ``S = TANH_SCALE = 3`` (spectral radius about 3: the plain fixed-point
  iteration ``x <- tanh(A x + b)`` fails on most of them; counted in the report),
  ``b ~ N(0, 1)``, seed 0, from ``x0 = 0``.

One jit compilation per problem and method serves all its starts (and the H-equation's two
``c``, the 100 random systems: their data are arguments). Run: ``python -m benchmarks
robustness`` (part of ``make bench``); ``python -m benchmarks.robustness`` alone.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

import solvers

RTOL = ATOL = 1e-10
MAX_STEPS = 500
RESIDUAL = 1e-8
FACTORS = (1.0, 10.0, 100.0)
TANH_N, TANH_COUNT, TANH_SCALE, TANH_SEED = 30, 100, 3.0, 0
OURS_METHODS = ("newton", "dogleg", "chord", "broyden")  # every method solvers.root offers


# --------------------------------------------------------------------------- problems
#
# Each function takes ``xp`` (``jax.numpy`` or ``numpy``): the solvers see the jnp version,
# the residual test runs the same formulas through NumPy, outside JAX.


def rosenbrock(x, xp):
    return xp.stack([1.0 - x[0], 10.0 * (x[1] - x[0] ** 2)])


def powell_singular(x, xp):
    return xp.stack([x[0] + 10.0 * x[1], math.sqrt(5.0) * (x[2] - x[3]),
                     (x[1] - 2.0 * x[2]) ** 2, math.sqrt(10.0) * (x[0] - x[3]) ** 2])


def powell_badly_scaled(x, xp):
    return xp.stack([1e4 * x[0] * x[1] - 1.0, xp.exp(-x[0]) + xp.exp(-x[1]) - 1.0001])


def wood(x, xp):
    t1, t2 = x[1] - x[0] ** 2, x[3] - x[2] ** 2
    return xp.stack([-200.0 * x[0] * t1 - (1.0 - x[0]),
                     200.0 * t1 + 20.2 * (x[1] - 1.0) + 19.8 * (x[3] - 1.0),
                     -180.0 * x[2] * t2 - (1.0 - x[2]),
                     180.0 * t2 + 20.2 * (x[3] - 1.0) + 19.8 * (x[1] - 1.0)])


def helical_valley(x, xp):
    tpi = 8.0 * math.atan(1.0)
    safe = xp.where(x[0] == 0, 1.0, x[0])
    angle = xp.arctan(x[1] / safe) / tpi
    t1 = xp.where(x[0] > 0, angle,
                  xp.where(x[0] < 0, angle + 0.5, xp.where(x[1] >= 0, 0.25, -0.25)))
    t2 = xp.sqrt(x[0] ** 2 + x[1] ** 2)
    return xp.stack([10.0 * (x[2] - 10.0 * t1), 10.0 * (t2 - 1.0), x[2]])


def watson(x, xp):
    n = x.shape[0]
    t = np.arange(1, 30) / 29.0  # (29,)
    j = np.arange(n)
    powers = t[:, None] ** j[None, :]  # t_i^(j-1), 1-based j
    dpow = np.zeros((29, n))
    dpow[:, 1:] = j[1:] * t[:, None] ** (j[1:] - 1)  # (j-1) t^(j-2)
    sum1 = dpow @ x
    sum2 = powers @ x
    t1 = sum1 - sum2**2 - 1.0
    t2 = 2.0 * t * sum2
    kpow = t[:, None] ** (j[None, :] - 1.0)  # t^(k-2), 1-based k
    f = xp.sum(kpow * (j[None, :] - t2[:, None]) * t1[:, None], axis=0)
    temp = x[1] - x[0] ** 2 - 1.0
    extra = xp.concatenate([xp.stack([x[0] * (1.0 - 2.0 * temp), temp]), xp.zeros(n - 2)])
    return f + extra


def chebyquad(x, xp):
    n = x.shape[0]
    y = 2.0 * x - 1.0
    t_prev, t_cur = xp.ones_like(y), y
    rows = []
    for _ in range(n):
        rows.append(xp.mean(t_cur))
        t_prev, t_cur = t_cur, 2.0 * y * t_cur - t_prev
    k = np.arange(1, n + 1)
    const = np.zeros(n)
    const[1::2] = 1.0 / (k[1::2] ** 2 - 1.0)
    return xp.stack(rows) + const


def brown_almost_linear(x, xp):
    n = x.shape[0]
    head = x[:-1] + xp.sum(x) - (n + 1)
    return xp.concatenate([head, xp.prod(x)[None] - 1.0])


def _grid(n):
    h = 1.0 / (n + 1)
    return h, h * np.arange(1, n + 1)


def discrete_boundary_value(x, xp):
    h, t = _grid(x.shape[0])
    padded = xp.pad(x, 1)
    return 2.0 * x - padded[:-2] - padded[2:] + h**2 * (x + t + 1.0) ** 3 / 2.0


def discrete_integral_equation(x, xp):
    h, t = _grid(x.shape[0])
    cube = (x + t + 1.0) ** 3
    left = xp.cumsum(t * cube)  # j <= k
    right = xp.sum((1.0 - t) * cube) - xp.cumsum((1.0 - t) * cube)  # j > k
    return x + h * ((1.0 - t) * left + t * right) / 2.0


def trigonometric(x, xp):
    n = x.shape[0]
    k = np.arange(1, n + 1)
    return (n + k) - xp.sin(x) - xp.sum(xp.cos(x)) - k * xp.cos(x)


def variably_dimensioned(x, xp):
    k = np.arange(1, x.shape[0] + 1)
    s = xp.sum(k * (x - 1.0))
    return x - 1.0 + k * (s * (1.0 + 2.0 * s**2))


def broyden_tridiagonal(x, xp):
    padded = xp.pad(x, 1)
    return (3.0 - 2.0 * x) * x - padded[:-2] - 2.0 * padded[2:] + 1.0


def broyden_banded(x, xp):
    n = x.shape[0]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    band = ((j != i) & (j >= i - 5) & (j <= i + 1)).astype(float)
    return x * (2.0 + 5.0 * x**2) + 1.0 - band @ (x * (1.0 + x))


def _start(name, n):
    """MINPACK's ``initpt`` at factor 1."""
    h = 1.0 / (n + 1)
    t = h * np.arange(1, n + 1)
    return {
        "rosenbrock": [-1.2, 1.0],
        "powell_singular": [3.0, -1.0, 0.0, 1.0],
        "powell_badly_scaled": [0.0, 1.0],
        "wood": [-3.0, -1.0, -3.0, -1.0],
        "helical_valley": [-1.0, 0.0, 0.0],
        "watson": np.zeros(n),
        "chebyquad": t,
        "brown_almost_linear": 0.5 * np.ones(n),
        "discrete_boundary_value": t * (t - 1.0),
        "discrete_integral_equation": t * (t - 1.0),
        "trigonometric": np.ones(n) / n,
        "variably_dimensioned": 1.0 - np.arange(1, n + 1) / n,
        "broyden_tridiagonal": -np.ones(n),
        "broyden_banded": -np.ones(n),
    }[name]


def _factor_start(name, n, factor):
    x = np.asarray(_start(name, n), np.float64)
    if factor == 1.0:
        return x
    if name == "watson":  # initpt: the standard start is 0, so x = factor
        return np.full(n, factor)
    return factor * x


#: MINPACK's hybrd test driver (file21): (function, dimension) for its 22 cases.
MGH_CASES = [
    (rosenbrock, 2), (powell_singular, 4), (powell_badly_scaled, 2), (wood, 4),
    (helical_valley, 3), (watson, 6), (watson, 9), (chebyquad, 5), (chebyquad, 6),
    (chebyquad, 7), (chebyquad, 8), (chebyquad, 9), (brown_almost_linear, 10),
    (brown_almost_linear, 30), (brown_almost_linear, 40), (discrete_boundary_value, 10),
    (discrete_integral_equation, 1), (discrete_integral_equation, 10), (trigonometric, 10),
    (variably_dimensioned, 10), (broyden_tridiagonal, 10), (broyden_banded, 10),
]


def chandrasekhar(x, xp, c):
    n = x.shape[0]
    mu = (np.arange(1, n + 1) - 0.5) / n
    kernel = mu[:, None] / (mu[:, None] + mu[None, :])
    return x - 1.0 / (1.0 - c / (2 * n) * (kernel @ x))


H_N = 100
H_CS = (0.9, 0.9999)

# Propane in air, Meintjes & Morgan (1990), the reduced 5-unknown form (R = 10, p = 40).
_R, _R5 = 10.0, 0.193
_R6, _R7 = 0.002597 / math.sqrt(40.0), 0.003448 / math.sqrt(40.0)
_R8, _R9, _R10 = 0.00001799 / 40.0, 0.0002155 / math.sqrt(40.0), 0.00003846 / 40.0


def propane(x, xp):
    x1, x2, x3, x4, x5 = (x[i] for i in range(5))
    return xp.stack([
        x1 * x2 + x1 - 3.0 * x5,
        2.0 * x1 * x2 + x1 + x2 * x3**2 + _R8 * x2 - _R * x5 + 2.0 * _R10 * x2**2
        + _R7 * x2 * x3 + _R9 * x2 * x4,
        2.0 * x2 * x3**2 + 2.0 * _R5 * x3**2 - 8.0 * x5 + _R6 * x3 + _R7 * x2 * x3,
        _R9 * x2 * x4 + 2.0 * x4**2 - 4.0 * _R * x5,
        x1 * (x2 + 1.0) + _R10 * x2**2 + x2 * x3**2 + _R8 * x2 + _R5 * x3**2 + x4**2 - 1.0
        + _R6 * x3 + _R7 * x2 * x3 + _R9 * x2 * x4,
    ])


# Morgan's 10-species combustion system (the four element balances, then six equilibrium
# relations ``k_i x_i = products``).
_K = (0.5140437e-7, 0.1006932e-6, 0.7816278e-15, 0.1496236e-6, 0.6194411e-7, 0.2089296e-14)


def combustion10(x, xp):
    x1, x2, x3, x4, x5, x6, x7, x8, x9, x10 = (x[i] for i in range(10))
    return xp.stack([
        x2 + 2.0 * x6 + x9 + 2.0 * x10 - 1e-5,
        x3 + x8 - 3e-5,
        x1 + x3 + 2.0 * x5 + 2.0 * x8 + x9 + x10 - 5e-5,
        x4 + 2.0 * x7 - 1e-5,
        _K[0] * x5 - x1**2,
        _K[1] * x6 - 2.0 * x2**2,
        _K[2] * x7 - x4**2,
        _K[3] * x8 - x1 * x3,
        _K[4] * x9 - x1 * x2,
        _K[5] * x10 - x1 * x2**2,
    ])


def combustion10_scaled_residual(x):
    """max over rows of ``|F_i(x)| / s_i`` (NumPy): ``s_i`` the size of the row's terms,
    the right-hand side of a balance, ``max(|k_i x_i|, |product|)`` for an equilibrium
    relation (0 / 0 counts as 0: both sides vanish)."""
    x = np.asarray(x, np.float64)
    f = combustion10(x, np)
    x1, x2, x3, x4 = x[:4]
    products = np.array([x1**2, 2.0 * x2**2, x4**2, x1 * x3, x1 * x2, x1 * x2**2])
    eq = np.maximum(np.abs(np.array(_K) * x[4:]), np.abs(products))
    scale = np.concatenate([[1e-5, 3e-5, 5e-5, 1e-5], eq])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(f == 0, 0.0, np.abs(f) / scale)
    return float(np.max(ratio))


def tanh3(x, xp):
    return xp.tanh(np.array([1.0, 1.0, 2.0]) * x + np.array([0.1, -0.5, 0.0]))


def tanh_fixed_point(x, xp, a, b):
    return xp.tanh(a @ x + b) - x


def tanh_systems():
    rng = np.random.default_rng(TANH_SEED)
    a = TANH_SCALE / math.sqrt(TANH_N) * rng.standard_normal((TANH_COUNT, TANH_N, TANH_N))
    b = rng.standard_normal((TANH_COUNT, TANH_N))
    return a, b


def fixed_point_iteration_solves(a, b, steps=MAX_STEPS):
    """How many of the random systems plain ``x <- tanh(A x + b)`` solves from 0."""
    solved = 0
    for ai, bi in zip(a, b):
        x = np.zeros(TANH_N)
        for _ in range(steps):
            x = np.tanh(ai @ x + bi)
        solved += np.max(np.abs(tanh_fixed_point(x, np, ai, bi))) < RESIDUAL
    return int(solved)


class Problem:
    """``fn(x, xp, *params)`` and its instances ``(label, x0, params)``; ``residual(x,
    params)`` is the independent NumPy test: max|F|, or the problem's ``relative`` test."""

    def __init__(self, name, column, fn, instances, relative=None):
        self.name, self.column, self.fn, self.instances = name, column, fn, instances
        self.relative = relative  # a scale-aware test that replaces max|F|

    def residual(self, x, params):
        if self.relative is not None:
            return self.relative(x)
        return float(np.max(np.abs(self.fn(np.asarray(x, np.float64), np, *params))))


def problems():
    out = []
    for fn, n in MGH_CASES:
        name = fn.__name__
        out.append(Problem(f"{name} n={n}", "MGH", fn, [
            (f"{factor:g}x", _factor_start(name, n, factor), ()) for factor in FACTORS
        ]))
    out.append(Problem(f"H-equation n={H_N}", "H-equation", chandrasekhar,
                       [(f"c={c:g}", np.ones(H_N), (np.float64(c),)) for c in H_CS]))
    out.append(Problem("propane (5)", "chemical eq.", propane,
                       [(f"x0={s:g}", np.full(5, s), ()) for s in (1.0, 10.0, 100.0)]))
    out.append(Problem("combustion (10, badly scaled)", "chemical eq.", combustion10,
                       [(f"x0={s:g}", np.full(10, s), ()) for s in (1e-5, 1e-6, 1e-7)],
                       relative=combustion10_scaled_residual))
    out.append(Problem("tanh-3", "tanh-3", tanh3, [("x0=(0.5,-0.3,0.7)",
                                                    np.array([0.5, -0.3, 0.7]), ())]))
    a, b = tanh_systems()
    out.append(Problem(f"random tanh n={TANH_N}", "random tanh", tanh_fixed_point,
                       [(f"#{i}", np.zeros(TANH_N), (a[i], b[i])) for i in range(TANH_COUNT)]))
    return out


# --------------------------------------------------------------------------- methods
#
# A method is ``make(fn) -> run(x0, params) -> (x, success, status)``; ``make`` is called
# once per problem, so one compilation serves every instance of it.


def _jnp_fn(fn):
    return lambda x, *params: fn(x, jnp, *params)


def ours(method):
    def make(fn):
        F = _jnp_fn(fn)

        @jax.jit
        def solve(x0, params):
            x, info = solvers.root(F, x0, *params, method=method, rtol=RTOL, atol=ATOL,
                                   max_steps=MAX_STEPS, on_failure="ignore", full_output=True)
            return x, info.converged, info.status

        def run(x0, params):
            x, ok, status = solve(jnp.asarray(x0), tuple(jnp.asarray(p) for p in params))
            return np.asarray(x), bool(ok), solvers.status_name(int(status))

        return run

    return make


def optimistix(solver_name):
    def make(fn):
        import optimistix as optx  # (here: the test extra, which imports this module, has none)

        solver = getattr(optx, solver_name)(rtol=RTOL, atol=ATOL)
        F = _jnp_fn(fn)

        @jax.jit
        def solve(x0, params):
            sol = optx.root_find(lambda x, p: F(x, *p), solver, x0, params,
                                 max_steps=MAX_STEPS, throw=False)
            return sol.value, sol.result == optx.RESULTS.successful, sol.stats["num_steps"]

        def run(x0, params):
            x, ok, steps = solve(jnp.asarray(x0), tuple(jnp.asarray(p) for p in params))
            ok = bool(ok)
            return np.asarray(x), ok, "successful" if ok else f"failed ({int(steps)} steps)"

        return run

    return make


def scipy_root(method):
    def make(fn):
        jac = jax.jit(jax.jacfwd(_jnp_fn(fn)))
        options = ({"xtol": RTOL, "maxfev": MAX_STEPS} if method == "hybr" else
                   {"xtol": RTOL, "ftol": RTOL, "maxiter": MAX_STEPS})

        def run(x0, params):
            jparams = tuple(jnp.asarray(p) for p in params)
            sol = scipy.optimize.root(
                lambda x: fn(x, np, *params), x0,
                jac=lambda x: np.asarray(jac(jnp.asarray(x), *jparams)),
                method=method, options=options)
            message = " ".join(sol.message.split())
            return sol.x, bool(sol.success), message if len(message) < 70 else message[:67] + "..."

        return run

    return make


METHODS = {
    **{f"ours {m}": ours(m) for m in OURS_METHODS},
    "SciPy hybr (MINPACK)": scipy_root("hybr"),
    "SciPy lm (MINPACK)": scipy_root("lm"),
    "optimistix Newton": optimistix("Newton"),
    "optimistix Dogleg": optimistix("Dogleg"),
}


# --------------------------------------------------------------------------- running


def run_method(name, make, probs):
    """Outcome per (problem, instance): "solved", "wrong" (success, residual too big) or
    "unsolved"; the silent wrong answers' details; the seconds of the first call of each
    problem (mostly compilation) and of all calls; and the relative tests' results."""
    outcomes, wrong, relative, statuses = {}, [], {}, {}
    first_s = total_s = 0.0
    for prob in probs:
        start = time.perf_counter()
        try:
            run = make(prob.fn)
        except Exception as e:  # noqa: BLE001 - a method that cannot run counts as unsolved
            run, error = None, e
        for k, (label, x0, params) in enumerate(prob.instances):
            t0 = time.perf_counter()
            try:
                if run is None:
                    raise error
                x, ok, status = run(x0, params)
                residual = prob.residual(x, params)
                if prob.relative is not None:
                    relative[prob.name, label] = (ok, prob.relative(x), status)
            except Exception as e:  # noqa: BLE001 - counted as unsolved, not hidden
                ok, residual, status = False, math.nan, f"error: {type(e).__name__}"
            if k == 0:
                first_s += time.perf_counter() - t0
            solved = ok and residual < RESIDUAL
            outcome = "solved" if solved else ("wrong" if ok else "unsolved")
            outcomes[prob.name, label] = outcome
            statuses[prob.name, label] = status
            if outcome == "wrong":
                wrong.append((prob.name, label, residual, status))
        total_s += time.perf_counter() - start
    return outcomes, wrong, first_s, total_s, relative, statuses


def main():
    with jax.enable_x64(True):  # float64 for this suite only (make bench runs all in one process)
        _main()


def _main():
    start = time.perf_counter()
    probs = problems()
    a, b = tanh_systems()
    fixed_point = fixed_point_iteration_solves(a, b)
    results = {}
    for name, make in METHODS.items():
        results[name] = run_method(name, make, probs)
        _, wrong, first_s, total_s, _, _ = results[name]
        print(f"  {name}: {total_s:.0f} s ({first_s:.0f} s first calls)", flush=True)

    groups = {}  # column -> [(problem, label)]
    for prob in probs:
        for label, _, _ in prob.instances:
            column = prob.column
            if column == "MGH":
                column = f"MGH {label}"
            groups.setdefault(column, []).append((prob.name, label))
    total = sum(len(v) for v in groups.values())

    print(f"\n# Robustness of root finding: problems from the literature, float64, "
          f"rtol = atol = {RTOL:g}, max {MAX_STEPS} steps, {jax.devices()[0].platform}")
    print(f"\n## Problems solved (success reported and NumPy max|F| < {RESIDUAL:g})\n")
    header = (["method"] + [f"{c} ({len(v)})" for c, v in groups.items()]
              + [f"solved ({total})", "silent wrong answers", "s (first calls)"])
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for name, (outcomes, wrong, first_s, total_s, _, _) in results.items():
        counts = [sum(outcomes[key] == "solved" for key in keys) for keys in groups.values()]
        cells = [name] + [str(c) for c in counts] + [
            str(sum(counts)), str(len(wrong)), f"{total_s:.0f} ({first_s:.0f})"]
        print("| " + " | ".join(cells) + " |")
    print(f"\n- solved: the method reports success and the residual, `F` evaluated by NumPy "
          f"at the returned point, is below {RESIDUAL:g} in the max-norm. A silent wrong "
          f"answer: success reported, residual not below it. The 10-species combustion "
          f"system: each row relative to the size of its terms (below).")
    print(f"- MGH: MINPACK's 22 hybrd test cases from 1x, 10x, 100x the standard start; "
          f"H-equation: c = 0.9, 0.9999, n = {H_N}; chemical eq.: propane (5 unknowns) from "
          f"1, 10, 100 and the 10-species combustion system from 1e-5, 1e-6, 1e-7; random "
          f"tanh: {TANH_COUNT} systems `tanh(A x + b) = x`, n = {TANH_N}, A with N(0, "
          f"{TANH_SCALE:g}²/n) entries (plain fixed-point iteration from 0 solves "
          f"{fixed_point} of them in {MAX_STEPS} steps).")
    jax_first = sum(r[2] for n, r in results.items() if not n.startswith("SciPy"))
    jax_total = sum(r[3] for n, r in results.items() if not n.startswith("SciPy"))
    print("- s: the method's wall time over all problems, and (in parentheses) that of the "
          "first call of each problem: its compilation (ours, optimistix; SciPy: the "
          f"Jacobian's) and one solve. Compilation dominates: {jax_first:.0f} of the "
          f"{jax_total:.0f} s of ours and optimistix together are first calls ({len(probs)} "
          "problems, one compilation each per method).")
    print("\n## Silent wrong answers (success reported, residual not below "
          f"{RESIDUAL:g})\n")
    any_wrong = False
    for name, result in results.items():
        by_problem = {}
        for prob_name, label, residual, status in result[1]:
            by_problem.setdefault(prob_name, []).append((label, residual, status))
        for prob_name, cases in by_problem.items():
            any_wrong = True
            if len(cases) <= 3:
                what = ", ".join(f"{label} ({residual:.1e})" for label, residual, _ in cases)
            else:
                res = [c[1] for c in cases]
                what = f"{len(cases)} instances (residuals {min(res):.1e} ... {max(res):.1e})"
            print(f"- {name}: {prob_name}: {what}; reported: {cases[0][2]}")
    if not any_wrong:
        print("- none")

    print("\n## Why ours did not solve (status of each unsolved instance)\n")
    for name, result in results.items():
        if not name.startswith("ours"):
            continue
        counts = {}
        for key, outcome in result[0].items():
            if outcome == "unsolved":
                counts[result[5][key]] = counts.get(result[5][key], 0) + 1
        tanh = {}
        for key, outcome in result[0].items():
            if outcome == "unsolved" and key[0].startswith("random tanh"):
                tanh[result[5][key]] = tanh.get(result[5][key], 0) + 1
        listed = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        listed_tanh = ", ".join(f"{k} {v}" for k, v in sorted(tanh.items(), key=lambda kv: -kv[1]))
        print(f"- {name}: {listed or '-'} (of which random tanh: {listed_tanh or '-'})")

    rel_probs = [p for p in probs if p.relative is not None]
    for prob in rel_probs:
        labels = [label for label, _, _ in prob.instances]
        print(f"\n## {prob.name}: each row relative to the size of its terms\n")
        print("| method | " + " | ".join(labels) + " |")
        print("|---|" + "|".join("---" for _ in labels) + "|")
        for name, result in results.items():
            cells = []
            for label in labels:
                ok, rel, _ = result[4].get((prob.name, label), (False, math.nan, ""))
                cells.append(f"{rel:.1e} ({'success' if ok else 'failure'} reported)")
            print(f"| {name} | " + " | ".join(cells) + " |")
        print("\n- max over rows of |F_i| / s_i at the returned point, s_i the right-hand "
              "side of a balance, max(|k_i x_i|, |product|) for an equilibrium relation "
              f"(the test of the first table: below {RESIDUAL:g}). The absolute max|F| "
              "cannot tell: near any point of size 1e-5 the equilibrium rows are below "
              "1e-9. atol = 1e-10 is above the smallest unknown (6e-11): a solver may "
              "stop with it wrong.")

    print("\n## Per problem: + solved, . not solved, ! silent wrong answer (one mark per "
          "start)\n")
    names = list(results)
    short = [n.replace(" (MINPACK)", "").replace("optimistix", "optx") for n in names]
    print("| problem | " + " | ".join(short) + " |")
    print("|---|" + "|".join("---" for _ in short) + "|")
    marks = {"solved": "+", "unsolved": ".", "wrong": "!"}
    for prob in probs:
        if prob.column == "random tanh":
            continue
        cells = ["".join(marks[results[n][0][prob.name, label]]
                         for label, _, _ in prob.instances) for n in names]
        print(f"| {prob.name} | " + " | ".join(cells) + " |")
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
