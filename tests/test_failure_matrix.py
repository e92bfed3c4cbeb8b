"""The failure matrix: every solver x mode x on_failure policy x failure kind.

Pins the documented outcomes of SPEC.md, "Termination and failure":

* ``on_failure="raise"``: :class:`solvers.ConvergenceError` eagerly, and under ``jit``,
  ``vmap``, ``grad`` and ``vmap`` of ``grad`` a run-time error carrying its message
  (docs/failures.md); the message names the solver and the status, and a NaN/divergence
  message does not tell the user to increase ``max_steps``.
* ``on_failure="nan"``: ``info.converged`` is False with the expected status for exactly the
  failed element, whose solution is all NaN; the good element keeps its value and gradient
  (batch from ``vmap``, or from an elementwise solver's array arguments).
* ``on_failure="ignore"``: the last iterate (finite for the max_steps and stagnation kinds),
  with the expected status, and its gradient is the implicit-function-theorem gradient at
  the returned point.
* Whatever the policy, a converged result is finite.

Each case is one parametrised problem ``solve(a)`` whose good parameter has a closed-form
solution and gradient; every expected number below comes from a closed form, never from
the code under test. Batches are ``[good, bad]`` (``vmap``) or ``[good, bad, good2]``
(array arguments of the elementwise bracket solvers).

Cost: the user functions are module-level (so the solvers' compile caches are shared
between tests). The default run covers every case and policy once, batched (``vmap`` of
``grad``, or the array batch of the elementwise solvers), and ``raise`` eagerly; the full
cross product is ``@pytest.mark.slow`` (``make test-slow``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers
from solvers import STATUSES, status_name

# --------------------------------------------------------------------------------------
# User functions (module level: one object each, so repeated calls hit the jit caches)
# --------------------------------------------------------------------------------------


def fp_affine(x, a):  # x = a x + 1: x* = 1/(1-a); |a| > 1 diverges, a -> 1 is slow
    return a * x + 1.0


def fp_nan(x, a):  # x* = 2a; NaN for a > 1
    return 0.5 * x + a + 0.0 * jnp.sqrt(1.0 - a)


def fp_cycle(x, a):  # x = a (1 - x): x* = a/(1+a); a = 1 cycles 0 -> 1 -> 0 (constant error)
    return a * (1.0 - x)


def fp_exp(x, a):  # x = a e^x: x* = 0.5 for a = 0.5 e^-0.5; a = 100 overflows at step 2
    return a * jnp.exp(x)


def fp_sqrt(x, a):  # x = sqrt(x + a): x* = (1 + sqrt(1 + 4a))/2
    return jnp.sqrt(x + a)


def fp_noroot(x, a):  # x = x - (x^2 + a)/10: x* = sqrt(-a); none for a > 0 (|error| >= a/10)
    return x - 0.1 * (x**2 + a)


def rt_exp(x, a):  # e^x = a: x* = log a; Newton from 0 jumps to a - 1 (e^199 = inf)
    return jnp.exp(x) - a


def rt_nan(x, a):  # x^3 = 8a: NaN for a > 1
    return x**3 - 8.0 * a + 0.0 * jnp.sqrt(1.0 - a)


def cube(x, a):  # x^3 = a
    return x**3 - a


def rt_cycle(x, a):  # Newton from 0 on x^3 - 2x + 2 cycles 0 -> 1 -> 0; a = 0.875: x* = 0.5
    return x**3 - 2.0 * x + a


def rt_square(x, a):  # x^2 = -a; a = 1: Broyden from 1 cycles 1 -> 0 -> -1 -> 1
    return x**2 + a


def br_nan(x, a):  # x^3 = a, NaN inside (5.5, 9.5) (finite at the ends 0 and 10)
    return x**3 - a + 0.0 * jnp.sqrt(jnp.abs(x - 7.5) - 2.0)


def br_pole(x, p):  # (x-2)(x-5) + p = 0 over x - 5; p = 0: root 2; p = -100: only the pole 5
    return x - 2.0 + p / (x - 5.0)


def ode_oscillator(y, t, k):  # y = (cos kt, sin kt)
    return k * jnp.stack([-y[1], y[0]])


def ode_nan(y, t, k):  # y = e^{-kt}; NaN for k > 2
    return -k * y + 0.0 * jnp.sqrt(2.0 - k)


TS = jnp.array([0.0, 1.0])
OSC_Y0 = jnp.array([1.0, 0.0])

# --------------------------------------------------------------------------------------
# Solves: solve(a, on_failure) -> (solution, info), with full_output=True
# --------------------------------------------------------------------------------------


def _fixed_point(f, x0, method, **kw):
    def solve(a, on_failure):
        return solvers.fixed_point(
            f, x0, a, method=method, on_failure=on_failure, full_output=True, **kw
        )

    return solve


def _root(F, x0, method, **kw):
    def solve(a, on_failure):
        return solvers.root(F, x0, a, method=method, on_failure=on_failure, full_output=True, **kw)

    return solve


def _bracket(name, F, lower, upper, **kw):
    def solve(a, on_failure):
        return getattr(solvers, name)(
            F, lower, upper, a, on_failure=on_failure, full_output=True, **kw
        )

    return solve


def _minimize(fun, x0, method, **kw):
    def solve(a, on_failure):
        return solvers.minimize(fun, x0, a, method=method, on_failure=on_failure,
                                full_output=True, **kw)

    return solve


def _least_squares(residual, x0, method, **kw):
    def solve(a, on_failure):
        return solvers.least_squares(residual, x0, a, method=method, on_failure=on_failure,
                                     full_output=True, **kw)

    return solve


def mn_nan(x, a):  # (x - a)^2: x* = a; NaN for a > 1.5
    return (x - a) ** 2 + 0.0 * jnp.sqrt(1.5 - a)


def mn_quartic(x, a):  # x* = a; dx/da = 1 at any point (the gradient depends on x - a)
    return (x - a) ** 4 + (x - a) ** 2


def ls_nan(x, a):  # residual x - a: x* = a; NaN for a > 1.5
    return jnp.stack([x - a + 0.0 * jnp.sqrt(1.5 - a), 0.5 * (x - a)])


def ls_exp(x, a):  # e^x = a and 2x = 2 log a: x* = log a; from 0 with few steps
    return jnp.stack([jnp.exp(x) - a, 2.0 * (x - jnp.log(a))])


def _ode(f, y0, method, **kw):
    def solve(k, on_failure):
        return solvers.odeint(f, y0, TS, k, method=method, on_failure=on_failure,
                              full_output=True, **kw)

    return solve


def _identity(x):
    return x


def _last_first(ys):  # y_0(t_end) of the oscillator
    return ys[-1, 0]


def _last(ys):
    return ys[-1]


class Case(NamedTuple):
    solver: str  # the name the message must contain
    label: str  # solver and method, for the test id
    kind: str
    status: str  # the expected status name of the failing element
    solve: Callable
    good: float
    bad: float
    value: float  # closed-form output at `good`
    grad: float  # closed-form d output / d a at `good`
    ift: Callable | None = None  # ift(x, a): IFT gradient at a returned point x (ignore)
    out: Callable = _identity  # the scalar output (and loss) of a solution
    good2: float | None = None  # a second good element (elementwise array batch)
    value2: float | None = None
    grad2: float | None = None
    elementwise: bool = False
    ode: bool = False

    @property
    def id(self):
        return f"{self.label}-{self.kind}"


A_EXP = 0.5 * math.exp(-0.5)  # x = a e^x has x* = 0.5


def _cases():
    cases = []
    for method in ("iterate", "anderson"):
        label = f"fixed_point[{method}]"
        if method == "iterate":
            # x = 2x + 1 doubles its error every step until it overflows.
            diverge = Case("solvers.fixed_point", label, "diverge", "nonfinite",
                           _fixed_point(fp_affine, 0.0, method), 0.5, 2.0, 2.0, 4.0)
            # x = 0.999x + 1 converges by 0.1% a step: 20 steps are not enough.
            max_steps = Case("solvers.fixed_point", label, "max_steps", "max_steps",
                             _fixed_point(fp_affine, 0.0, method, max_steps=20), 0.1, 0.999,
                             1 / 0.9, 1 / 0.81, ift=lambda x, a: x / (1 - a))
            # x = 1 - x from 0 cycles 0, 1, 0, ... with a constant error of 1.
            stagnate = Case("solvers.fixed_point", label, "stagnate", "stagnated",
                            _fixed_point(fp_cycle, 0.0, method, max_steps=1000), 0.5, 1.0,
                            1 / 3, 4 / 9, ift=lambda x, a: (1 - x) / (1 + a))
        else:
            # The first step is plain: x1 = f(0) = 100, and f(100) = 100 e^100 overflows.
            diverge = Case("solvers.fixed_point", label, "diverge", "nonfinite",
                           _fixed_point(fp_exp, 0.0, method), A_EXP, 100.0, 0.5,
                           math.exp(0.5) / 0.5)
            # x0 = 2 is the fixed point for a = 2 (zero steps); a = 12 needs several steps.
            max_steps = Case("solvers.fixed_point", label, "max_steps", "max_steps",
                             _fixed_point(fp_sqrt, 2.0, method, max_steps=1), 2.0, 12.0,
                             2.0, 1 / 3, ift=lambda x, a: 1 / (2 * math.sqrt(x + a) - 1))
            # No fixed point for a = 1: the error |x^2 + 1|/10 >= 0.1 cannot reach the tolerance
            # and the extrapolated iterates wander without a new smallest error.
            stagnate = Case("solvers.fixed_point", label, "stagnate", "stagnated",
                            _fixed_point(fp_noroot, 1.0, method, max_steps=1000), -4.0, 1.0,
                            2.0, -0.25, ift=lambda x, a: -1 / (2 * x))
        nan = Case("solvers.fixed_point", label, "nan", "nonfinite",
                   _fixed_point(fp_nan, 0.0, method), 0.5, 2.0, 1.0, 2.0)
        cases += [diverge, nan, max_steps, stagnate]

    for method in ("newton", "broyden"):
        label = f"root[{method}]"
        # Newton from 0 jumps to a - 1 = 199 where e^199 overflows (no line search).
        diverge = Case("solvers.root", label, "diverge", "nonfinite",
                       _root(rt_exp, 0.0, method, line_search=False), 2.0, 200.0,
                       math.log(2.0), 0.5)
        nan = Case("solvers.root", label, "nan", "nonfinite", _root(rt_nan, 1.5, method), 0.5,
                   2.0, 4 ** (1 / 3), 8 / (3 * 4 ** (2 / 3)))
        # x0 = 2 is the root for a = 8; the cube root of 1000 from 2 needs more than 2 steps.
        max_steps = Case("solvers.root", label, "max_steps", "max_steps",
                         _root(cube, 2.0, method, max_steps=2), 8.0, 1000.0, 2.0, 1 / 12,
                         ift=lambda x, a: 1 / (3 * x**2))
        if method == "newton":
            stagnate = Case("solvers.root", label, "stagnate", "stagnated",
                            _root(rt_cycle, 0.0, method, line_search=False, max_steps=1000),
                            0.875, 2.0, 0.5, 0.8, ift=lambda x, a: -1 / (3 * x**2 - 2))
        else:
            stagnate = Case("solvers.root", label, "stagnate", "stagnated",
                            _root(rt_square, 1.0, method, line_search=False, max_steps=1000),
                            -4.0, 1.0, 2.0, -0.25, ift=lambda x, a: -1 / (2 * x))
        cases += [diverge, nan, max_steps, stagnate]

    label = "root[dogleg]"
    cases += [
        Case("solvers.root", label, "nan", "nonfinite", _root(rt_nan, 1.5, "dogleg"), 0.5,
             2.0, 4 ** (1 / 3), 8 / (3 * 4 ** (2 / 3))),
        Case("solvers.root", label, "max_steps", "max_steps",
             _root(cube, 2.0, "dogleg", max_steps=2), 8.0, 1000.0, 2.0, 1 / 12,
             ift=lambda x, a: 1 / (3 * x**2)),
        # x^2 = -a has no root for a = 1: the trust region shrinks onto the minimum of
        # |F| at 0 (where J is singular) and reports no decrease.
        Case("solvers.root", label, "no_root", "no_decrease",
             _root(rt_square, 1.0, "dogleg", max_steps=1000), -4.0, 1.0, 2.0, -0.25,
             ift=lambda x, a: -1 / (2 * x)),
    ]

    for method in ("lbfgs", "gradient"):
        label = f"minimize[{method}]"
        cases += [
            Case("solvers.minimize", label, "nan", "nonfinite",
                 _minimize(mn_nan, 0.0, method), 0.5, 2.0, 0.5, 1.0),
            # x0 = 2 is the minimiser for a = 2 (zero steps); a = 100 is not reached in 2.
            Case("solvers.minimize", label, "max_steps", "max_steps",
                 _minimize(mn_quartic, 2.0, method, max_steps=2), 2.0, 100.0, 2.0, 1.0,
                 ift=lambda x, a: 1.0),
        ]
    for method in ("levenberg-marquardt", "gauss-newton"):
        label = f"least_squares[{method}]"
        cases += [
            Case("solvers.least_squares", label, "nan", "nonfinite",
                 _least_squares(ls_nan, 0.0, method), 0.5, 2.0, 0.5, 1.0),
            # x0 = 0 solves a = 1 (zero steps); log(1e6) from 0 needs more than 2 steps.
            Case("solvers.least_squares", label, "max_steps", "max_steps",
                 _least_squares(ls_exp, 0.0, method, max_steps=2), 1.0, 1e6, 0.0, 1.0,
                 ift=lambda x, a: (math.exp(x) / a + 4.0 / a) / (math.exp(2 * x) + 4.0)),
        ]

    for name, bisect_steps in (("bisection", 20), ("chandrupatla", 8)):
        label = name
        solver = f"solvers.{name}"
        cube_grad = lambda a: 1 / (3 * a ** (2 / 3))  # noqa: E731
        cases += [
            # NaN inside the bracket, on the failing element's path only.
            Case(solver, label, "nan", "nonfinite", _bracket(name, br_nan, 0.0, 10.0), 8.0,
                 343.0, 2.0, 1 / 12, good2=27.0, value2=3.0, grad2=1 / 27, elementwise=True),
            # Width 10/2^k must reach atol + rtol |x|: about 17 steps for x = 8 or 9,
            # 23 for x = 0.1 (bisection); Chandrupatla needs fewer, and more for x = 0.1.
            Case(solver, label, "max_steps", "max_steps",
                 _bracket(name, cube, 0.0, 10.0, max_steps=bisect_steps), 512.0, 1e-3, 8.0,
                 1 / 192, ift=lambda x, a: 1 / (3 * x**2), good2=729.0, value2=9.0,
                 grad2=cube_grad(729.0), elementwise=True),
            # 2000^(1/3) is not in [0, 10].
            Case(solver, label, "no_sign_change", "no_sign_change",
                 _bracket(name, cube, 0.0, 10.0), 8.0, 2000.0, 2.0, 1 / 12, good2=27.0,
                 value2=3.0, grad2=1 / 27, elementwise=True),
            # p = -100: F(0) > 0 > F(9) but the only sign change in [0, 9] is the pole 5
            # (the bracket [0, 9] never puts a midpoint exactly on the pole).
            Case(solver, label, "discontinuity", "discontinuity",
                 _bracket(name, br_pole, 0.0, 9.0), 0.0, -100.0, 2.0, 1 / 3,
                 elementwise=True),
        ]

    for method in ("dopri5", "kvaerno5"):
        label = f"odeint[{method}]"
        cases += [
            # 16 periods need far more than 60 steps; one period's sixth does not.
            Case("solvers.odeint", label, "max_steps", "max_steps",
                 _ode(ode_oscillator, OSC_Y0, method, max_steps=60), 1.0, 100.0,
                 math.cos(1.0), -math.sin(1.0), out=_last_first, ode=True),
            Case("solvers.odeint", label, "nan", "nonfinite", _ode(ode_nan, 1.0, method), 1.0,
                 3.0, math.exp(-1.0), -math.exp(-1.0), out=_last, ode=True),
        ]
    return cases


CASES = _cases()
POLICIES = ("raise", "nan", "ignore")
MODES = ("eager", "jit", "vmap", "grad", "vmap_grad")
ARRAY_MODES = ("array", "array_grad")  # elementwise solvers: the batch as an array argument

assert all(c.status in STATUSES for c in CASES)

# --------------------------------------------------------------------------------------
# Running a case in a mode
# --------------------------------------------------------------------------------------


class Result(NamedTuple):
    x: Any  # solution(s), NumPy
    info: Any  # NumPy leaves
    grad: Any  # d out / d a (grad modes), NumPy, else None


def _loss(case, on_failure, reduce=None):
    def loss(a):
        x, info = case.solve(a, on_failure)
        y = case.out(x)
        return (reduce(y) if reduce else y), (x, info)

    return loss


def _grad_transform(case, on_failure, mode):
    """`mode`'s gradient transform of `case`: ``a -> (d out / d a, (x, info))``."""
    if mode == "grad":
        return jax.grad(_loss(case, on_failure), has_aux=True)
    if mode == "vmap_grad":
        return jax.vmap(jax.grad(_loss(case, on_failure), has_aux=True))
    return jax.grad(_loss(case, on_failure, reduce=jnp.nansum), has_aux=True)  # array_grad


@functools.cache
def _jitted_grad(case, on_failure, mode):
    """:func:`_grad_transform` as one jitted program, built once per module.

    The eager transforms compile the forward and the backward solve as separate programs;
    under `jit` they are one. Used for the "nan"/"ignore" policies, whose outcomes are
    values; "raise" keeps the eager transforms (its run-time error stops before the
    backward program is compiled)."""
    return jax.jit(_grad_transform(case, on_failure, mode))


def _run(case, on_failure, mode, a):
    """Run `case` at parameter(s) `a` in `mode`; block until the results are ready."""
    g = None
    if mode in ("grad", "vmap_grad", "array_grad"):
        transform = (_grad_transform if on_failure == "raise" else _jitted_grad)(
            case, on_failure, mode)
        g, (x, info) = transform(jnp.asarray(a, jnp.float32))
    elif mode == "eager":
        x, info = case.solve(jnp.float32(a), on_failure)
    elif mode == "jit":
        x, info = jax.jit(case.solve, static_argnums=1)(jnp.float32(a), on_failure)
    elif mode == "vmap":
        x, info = jax.vmap(case.solve, in_axes=(0, None))(jnp.asarray(a, jnp.float32),
                                                          on_failure)
    elif mode == "array":
        x, info = case.solve(jnp.asarray(a, jnp.float32), on_failure)
    else:
        raise AssertionError(mode)
    x, info, g = jax.block_until_ready((x, info, g))
    to_np = lambda t: None if t is None else jax.tree.map(np.asarray, t)  # noqa: E731
    return Result(np.asarray(x), to_np(info), to_np(g))


def _batch(case, mode):
    """The parameters for `mode`: the bad one alone, or [good, bad(, good2)]."""
    if mode in ("vmap", "vmap_grad"):
        return [case.good, case.bad]
    if mode in ARRAY_MODES:
        return [case.good, case.bad, case.good if case.good2 is None else case.good2]
    return case.bad


def _expected_good(case, mode):
    """[(index, value, grad)] of the good elements of a batch."""
    good = [(0, case.value, case.grad)]
    if mode in ARRAY_MODES:
        if case.good2 is None:
            good.append((2, case.value, case.grad))
        else:
            good.append((2, case.value2, case.grad2))
    return good


def _element(tree, i, batched):
    return tree if not batched else jax.tree.map(lambda leaf: leaf[i], tree)


def _check_converged_is_finite(case, res):
    """`info.converged` implies a finite solution (every element)."""
    conv = np.asarray(res.info.converged)
    x = np.asarray(res.x)
    if case.ode or x.ndim > conv.ndim:  # a batch of ODE trajectories / vector solutions
        x = x.reshape(conv.shape + (-1,))
        finite = np.all(np.isfinite(x), axis=-1)
    else:
        finite = np.isfinite(x)
    assert np.all(finite | ~conv), (
        f"converged but non-finite: converged={conv}, solution={res.x}"
    )


def _close(actual, expected, what, rtol=1e-3, atol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol,
                               err_msg=what)


def _tolerances(case):
    # Float32 solves at the default rtol 1e-5; ODE values and adjoint gradients carry the
    # global error of a 1e-5 local tolerance.
    return dict(rtol=3e-3, atol=1e-4) if case.ode else dict(rtol=1e-3, atol=1e-5)


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------


def _fast(case, policy, mode):
    """The default run (the rest is `slow`): every case and policy once, batched."""
    if policy == "raise":
        # Eagerly for every case; through the compiled check (vmap of grad) once per solver.
        return mode == "eager" or (mode == "vmap_grad" and case.kind == "nan")
    if case.ode:
        # kvaerno5's adjoint compiles slowly: its gradient modes are `slow`.
        return mode == ("vmap_grad" if case.label == "odeint[dopri5]" else "vmap")
    return mode == ("array_grad" if case.elementwise else "vmap_grad")


def _params():
    params = []
    for case in CASES:
        modes = MODES + (ARRAY_MODES if case.elementwise else ())
        for policy in POLICIES:
            for mode in modes:
                marks = () if _fast(case, policy, mode) else (pytest.mark.slow,)
                params.append(
                    pytest.param(case, policy, mode, marks=marks,
                                 id=f"{case.id}-{policy}-{mode}")
                )
    return params


@pytest.mark.parametrize("case, policy, mode", _params())
def test_failure_matrix(case, policy, mode):
    batch = _batch(case, mode)
    if policy == "raise":
        _check_raise(case, mode, batch)
    elif policy == "nan":
        _check_nan(case, mode, batch)
    else:
        _check_ignore(case, mode, batch)


def _check_raise(case, mode, batch):
    # Block inside the raises block: on GPU the host check runs asynchronously.
    with pytest.raises(Exception) as err:
        jax.block_until_ready(_run(case, "raise", mode, batch))
    message = str(err.value)
    assert case.solver in message, message
    assert case.status in message, message
    if case.status == "nonfinite":
        assert "increase max_steps" not in message.lower(), message
    if mode in ("eager", "array"):
        assert isinstance(err.value, solvers.ConvergenceError), (
            f"{case.id}: raised {type(err.value).__name__}, not solvers.ConvergenceError"
        )
    else:
        # docs/failures.md: under jit/vmap/grad, "a runtime error carrying the same message"
        # (raised from a host check; JAX re-raises it as its own runtime error type).
        assert isinstance(err.value, solvers.ConvergenceError) or (
            "ConvergenceError" in message
        ), f"{case.id}: {type(err.value).__name__} without the ConvergenceError message"
    # A good problem does not raise, and gives the closed form.
    res = _run(case, "raise", "eager", case.good)
    _close(case.out(res.x), case.value, f"{case.id}: good value", **_tolerances(case))


def _check_batch_and_status(case, mode, res, batched):
    """converged/status of the failing element (index 1 of a batch) and of the good ones."""
    _check_converged_is_finite(case, res)
    conv = np.asarray(res.info.converged)
    names = status_name(np.atleast_1d(res.info.status))
    if batched:
        assert not conv[1], f"{case.id}: the failing element reports converged"
        assert names[1] == case.status, f"{case.id}: status {names[1]!r}, not {case.status!r}"
        for i, _, _ in _expected_good(case, mode):
            assert conv[i], f"{case.id}: good element {i} did not converge ({names[i]})"
            assert names[i] == "converged", names
    else:
        assert not bool(conv), f"{case.id}: the failing problem reports converged"
        assert names[0] == case.status, f"{case.id}: status {names[0]!r}, not {case.status!r}"


def _check_good(case, mode, res, batched):
    """The good elements keep their closed-form values and gradients (finite)."""
    tol = _tolerances(case)
    if not batched:
        return
    for i, value, grad in _expected_good(case, mode):
        _close(case.out(_element(res.x, i, True)), value, f"{case.id}: good value [{i}]", **tol)
        if res.grad is not None:
            g = np.asarray(res.grad)[i]
            assert np.isfinite(g), f"{case.id}: good gradient [{i}] is {g}"
            _close(g, grad, f"{case.id}: good gradient [{i}]", **tol)


def _check_scalar_good(case, policy, mode):
    """Eager/jit/grad modes run one problem: check the good one separately (same compile)."""
    if mode not in ("eager", "jit", "grad"):
        return
    res = _run(case, policy, mode, case.good)
    _check_converged_is_finite(case, res)
    assert bool(res.info.converged), f"{case.id}: good problem did not converge"
    tol = _tolerances(case)
    _close(case.out(res.x), case.value, f"{case.id}: good value", **tol)
    if res.grad is not None:
        _close(res.grad, case.grad, f"{case.id}: good gradient", **tol)


def _check_nan(case, mode, batch):
    res = _run(case, "nan", mode, batch)
    batched = np.ndim(batch) > 0
    _check_batch_and_status(case, mode, res, batched)
    bad = _element(res.x, 1, batched)
    assert np.all(np.isnan(bad)), f"{case.id}: failed solution not all NaN: {bad}"
    _check_good(case, mode, res, batched)
    _check_scalar_good(case, "nan", mode)


def _check_ignore(case, mode, batch):
    res = _run(case, "ignore", mode, batch)
    batched = np.ndim(batch) > 0
    _check_batch_and_status(case, mode, res, batched)
    _check_good(case, mode, res, batched)
    _check_scalar_good(case, "ignore", mode)
    bad = np.asarray(_element(res.x, 1, batched))
    if case.ode:
        # Outputs up to the time reached, NaN after: y(ts[0]) = y0 is returned.
        assert np.all(np.isfinite(bad[0])), f"{case.id}: y0 not returned: {bad}"
        return
    if case.kind not in ("max_steps", "stagnate"):
        return
    assert np.all(np.isfinite(bad)), f"{case.id}: last iterate not finite: {bad}"
    if res.grad is None:
        return
    g = np.asarray(res.grad)[1] if batched else np.asarray(res.grad)
    a = float(np.asarray(batch)[1] if batched else batch)
    with np.errstate(divide="ignore"):  # (a last iterate where the Jacobian is 0: inf)
        expected = case.ift(np.float64(bad), a)
    if not np.isfinite(expected):  # the adjoint system is singular at that point
        return
    assert np.isfinite(g), f"{case.id}: gradient at the last iterate x={bad} is {g}"
    _close(g, expected, f"{case.id}: IFT gradient at the last iterate x={bad}")


# --------------------------------------------------------------------------------------
# The documented examples, verbatim
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bisection", "chandrupatla"])
def test_elementwise_nan_keeps_the_other_elements_and_gradients(name):
    solve = getattr(solvers, name)
    a = jnp.array([8.0, 2000.0, 27.0])
    x, info = solve(cube, 0.0, 10.0, a, on_failure="nan", full_output=True)
    np.testing.assert_allclose(np.asarray(x)[[0, 2]], [2.0, 3.0], rtol=1e-4)
    assert np.isnan(x[1])
    np.testing.assert_array_equal(info.converged, [True, False, True])
    assert list(status_name(info.status)) == ["converged", "no_sign_change", "converged"]
    g = jax.grad(lambda a: jnp.nansum(solve(cube, 0.0, 10.0, a, on_failure="nan")))(a)
    g = np.asarray(g)
    assert np.all(np.isfinite(g[[0, 2]])), g
    np.testing.assert_allclose(g[[0, 2]], [1 / (3 * 8 ** (2 / 3)), 1 / (3 * 27 ** (2 / 3))],
                               rtol=1e-3)


def test_status_name_of_one_code_is_a_str():
    assert status_name(np.int32(0)) == "converged"
    assert list(status_name(np.array([0, 2]))) == ["converged", "nonfinite"]


def test_status_docstring_example_diverges_to_nonfinite():
    x, info = solvers.fixed_point(lambda x: 2 * x + 1, 0.0, on_failure="ignore",
                                  full_output=True)
    assert status_name(info.status) == "nonfinite"
    assert not bool(info.converged)


# An upstream NaN cotangent (a loss that became NaN) is the caller's, not a failed
# derivative: it comes back as NaN, as through JAX's own derivatives (what
# optax.apply_if_finite relies on), under the default on_failure="raise". Before, the
# implicit rules raised "the adjoint linear solve ... did not converge" and odeint "the
# adjoint (backward) integration failed ... nonfinite"; gmres/bicgstab/cg returned 0.
_UPSTREAM_NAN = {
    "fixed_point[neumann]": lambda a: solvers.fixed_point(
        lambda x, a: 0.5 * jnp.cos(a * x), jnp.zeros(3), a, linear_solver="neumann"),
    "fixed_point[gmres]": lambda a: solvers.fixed_point(
        lambda x, a: 0.5 * jnp.cos(a * x), jnp.zeros(3), a, linear_solver="gmres"),
    "fixed_point[dense]": lambda a: solvers.fixed_point(
        lambda x, a: 0.5 * jnp.cos(a * x), jnp.zeros(3), a, linear_solver="dense"),
    "root": lambda a: solvers.root(lambda x, a: x**3 - 8 * a, jnp.ones(2), a),
    "minimize": lambda a: solvers.minimize(lambda x, a: jnp.sum((x - a) ** 2), jnp.zeros(2), a),
    "least_squares": lambda a: solvers.least_squares(lambda x, a: x - a, jnp.zeros(2), a),
    "odeint[discrete]": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones(2), jnp.array([0.0, 1.0]), a),
    "odeint[backsolve]": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones(2), jnp.array([0.0, 1.0]), a, adjoint="backsolve"),
    "odeint[interpolate]": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones(2), jnp.array([0.0, 1.0]), a, adjoint="interpolate"),
}


@pytest.mark.parametrize("name", sorted(_UPSTREAM_NAN))
def test_upstream_nan_cotangent_propagates_without_a_raise(name):
    solve = _UPSTREAM_NAN[name]
    grad = jax.jit(jax.grad(lambda a, s: jnp.sum(solve(a)) * s))
    assert np.isnan(np.asarray(jax.block_until_ready(grad(0.5, jnp.nan))))
    assert np.isfinite(np.asarray(grad(0.5, 1.0)))


def test_upstream_nan_cotangent_of_one_element_leaves_the_others():
    # Elementwise solvers: only the element whose cotangent is NaN.
    g = jax.jit(jax.grad(lambda a, s: jnp.sum(solvers.bisection(cube, 0.0, 10.0, a) * s)))(
        jnp.array([8.0, 27.0]), jnp.array([jnp.nan, 1.0]))
    assert np.isnan(g[0])
    np.testing.assert_allclose(g[1], 1 / (3 * 27 ** (2 / 3)), rtol=1e-3)
