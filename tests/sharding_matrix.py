"""The sharding matrix: every solver under every SPMD mode, on 8 simulated CPU devices.

Run as a script (the XLA flag must be set before JAX starts, so tests/test_sharding.py
runs it in a subprocess)::

    python tests/sharding_matrix.py [--solvers a,b] [--modes m,n] [--checks c,d]
    python tests/sharding_matrix.py --plan 'a,b@m,n;c@m' [--then-replicated e,f]

It prints one line per case, ``CASE <solver> <mode> <check> <PASS|FAIL> <detail>``,
and a table at the end. Modes: ``auto`` (a sharded ``jit`` on an Auto mesh),
``explicit`` (an Explicit mesh, ``jax.set_mesh``), ``shard_map`` (``check_vma=True``),
``pmap``. Checks: ``value``, ``grad`` (against the closed form), ``raise`` (one failing
element of 64: a catchable error naming the global index 37, no abort), ``nan``
(exactly the failed element is NaN).

``--replicated`` runs the other cases instead (``--solvers`` then picks among their
problems): under ``shard_map`` (float64), the gradient of a vmapped (or whole-batch)
solve with respect to a parameter that does not vary over the mesh, passed with
``in_specs=P()`` (check ``grad_replicated``) or closed over by the ``shard_map`` body
(``grad_closed``), against the gradient of the same loss on the whole batch without
``shard_map``; that an ``f`` closing over such a traced parameter is refused with the way
out (``odeint_f_closure``, check ``refused``); and, for odeint's other modes (the
interpolating adjoint, forward sensitivities, terminal and non-terminal events, dense
output), the values (``value``), the gradients in that parameter and in the sharded
batch (``grad_batched``), and forward mode (``jacfwd`` in the parameter, ``jvp_batched``
in the batch), each against the same computation without ``shard_map`` (the values are
those the gradient's program computes on its way: one program fewer per side).
"""

import os
import sys

if __name__ == "__main__":  # not when collected by pytest: the flag is for this process
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import time  # noqa: E402
import functools  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import solvers  # noqa: E402

N, BAD = 64, 37


def cube(x, a):
    return x**3 - a


# Each problem: (batched solve fn(a, on_failure) over a (64,) batch, good a value,
# bad a value, expected solution for the good value, expected d sum(x)/da per element).
def _bisection(method):
    def fn(a, on_failure):
        return method(cube, 0.0, 10.0, a, on_failure=on_failure)

    return fn, 8.0, 2000.0, 2.0, 1.0 / 12.0


def _fixed_point(method):
    def f(x, a):
        return a * x + 1.0

    def fn(a, on_failure):
        def one(a):
            x0 = jnp.zeros(3) if method == "anderson" else 0.0
            x = solvers.fixed_point(f, x0, a, method=method, on_failure=on_failure,
                                    max_steps=200)
            return jnp.mean(x) if method == "anderson" else x

        return jax.vmap(one)(a)

    # Anderson solves a linear map exactly even where plain iteration diverges: NaN fails it.
    return fn, 0.5, (float("nan") if method == "anderson" else 2.0), 2.0, 4.0


def _whole(method):
    """One fixed point of the whole (sharded) batch, as a DEQ layer is: the adjoint
    is a GMRES solve over the sharded state (not vmapped)."""

    def f(x, a):
        return a * x + 1.0

    def fn(a, on_failure):
        return solvers.fixed_point(f, jnp.zeros_like(a), a, method=method,
                                   on_failure=on_failure, max_steps=200,
                                   linear_solver="gmres")

    return fn, 0.5, (float("nan") if method == "anderson" else 2.0), 2.0, 4.0


def _newton(method="newton"):
    def F(x, a):
        return x**2 - a

    def fn(a, on_failure):
        def one(a):
            x = solvers.root(F, jnp.ones(2), a, method=method, on_failure=on_failure,
                             max_steps=50)
            return x[0]  # two unknowns: an LU solve per element

        return jax.vmap(one)(a)

    return fn, 4.0, -4.0, 2.0, 0.25


def _whole_root(method):
    """One system of the whole (sharded) batch, ``x_i² = a_i``: its dense Jacobian (one
    matrix of the whole state, split over the mesh) is factored as one LU."""

    def F(x, a):
        return x**2 - a

    def fn(a, on_failure):
        return solvers.root(F, jnp.ones_like(a), a, method=method, on_failure=on_failure,
                            max_steps=50)

    return fn, 4.0, -4.0, 2.0, 0.25


def _whole_minimize(method="lbfgs"):
    """One minimisation over the whole (sharded) batch: ``x_i* = sqrt(a_i)``."""

    def fun(x, a):
        return jnp.sum(0.25 * x**4 - 0.5 * a * x**2) + 0.0 * jnp.sum(jnp.sqrt(a))

    def fn(a, on_failure):
        return solvers.minimize(fun, jnp.ones_like(a), a, method=method,
                                on_failure=on_failure, max_steps=100)

    return fn, 4.0, -4.0, 2.0, 0.25


def _whole_least_squares(method="levenberg-marquardt"):
    """One least-squares problem over the whole (sharded) batch, residuals
    ``(x² - a, 2x² - 2a)``: ``x_i* = sqrt(a_i)``."""

    def residual(x, a):
        return jnp.concatenate([x**2 - a, 2.0 * x**2 - 2.0 * a + 0.0 * jnp.sqrt(a)])

    def fn(a, on_failure):
        return solvers.least_squares(residual, jnp.ones_like(a), a, method=method,
                                     on_failure=on_failure, max_steps=100)

    return fn, 4.0, -4.0, 2.0, 0.25


def _dogleg():
    def F(x, a):
        return x**2 - a

    def fn(a, on_failure):
        def one(a):
            x = solvers.root(F, jnp.ones(2), a, method="dogleg", on_failure=on_failure,
                             max_steps=50)
            return x[0]

        return jax.vmap(one)(a)

    # x^2 = -4 has no root: the trust region shrinks onto the minimum of |F| at 0.
    return fn, 4.0, -4.0, 2.0, 0.25


def _minimize():
    def fun(x, a):  # x* = sqrt(a) per coordinate (a > 0); NaN objective for a < 0
        return jnp.sum(0.25 * x**4 - 0.5 * a * x**2) + 0.0 * jnp.sqrt(a)

    def fn(a, on_failure):
        def one(a):
            x = solvers.minimize(fun, jnp.ones(2), a, on_failure=on_failure, max_steps=100)
            return x[0]

        return jax.vmap(one)(a)

    return fn, 4.0, -4.0, 2.0, 0.25


def _least_squares():
    def residual(x, a):  # x^2 = a (and 2x^2 = 2a): x* = sqrt(a); NaN for a < 0
        return jnp.stack([x[0] ** 2 - a, 2.0 * x[0] ** 2 - 2.0 * a]) + 0.0 * jnp.sqrt(a)

    def fn(a, on_failure):
        def one(a):
            x = solvers.least_squares(residual, jnp.ones(1), a, on_failure=on_failure,
                                      max_steps=100)
            return x[0]

        return jax.vmap(one)(a)

    return fn, 4.0, -4.0, 2.0, 0.25


def _odeint():
    def rhs(y, t, k):
        return -k * y

    def fn(a, on_failure):
        def one(k):
            ys = solvers.odeint(rhs, jnp.float32(1.0), jnp.array([0.0, 1.0]), k,
                                on_failure=on_failure, max_steps=60)
            return ys[-1]

        return jax.vmap(one)(a)

    return fn, 1.0, 1e5, float(np.exp(-1.0)), float(-np.exp(-1.0))


def _whole_odeint(**kw):
    """One integration of the whole (sharded) state, one decay rate per component (not
    vmapped): the stage buffers, records and the adjoint's state are the state's size.
    ``kw``: the method or adjoint (a stiff method's Newton iteration factorises the
    whole sharded Jacobian)."""

    def rhs(y, t, k):
        return -k * y

    def fn(a, on_failure):
        ys = solvers.odeint(rhs, jnp.ones_like(a), jnp.array([0.0, 1.0]), a,
                            on_failure=on_failure, max_steps=60, **kw)
        return ys[-1]

    # A stiff method takes k = 1e5 in its stride; growth at k = -1e3 overflows float32.
    bad = -1e3 if kw.get("method") in ("kvaerno5", "bdf") else 1e5
    return fn, 1.0, bad, float(np.exp(-1.0)), float(-np.exp(-1.0))


def _whole_odeint_dense():
    """Dense output of one whole sharded state: ``y(0.5) = exp(-0.5 k)`` evaluated from
    the stored steps (its gradient integrates again, to 0.5)."""

    def rhs(y, t, k):
        return -k * y

    def fn(a, on_failure):
        _, info = solvers.odeint(rhs, jnp.ones_like(a), jnp.array([0.0, 1.0]), a,
                                 on_failure=on_failure, max_steps=60, dense=32,
                                 full_output=True)
        return info.solution.evaluate(0.5)

    return fn, 1.0, 1e5, float(np.exp(-0.5)), float(-0.5 * np.exp(-0.5))


def _whole_odeint_event():
    """A terminal event of one whole sharded state: the mean of ``exp(-k_i t)`` falls to
    0.5, at ``t_e = log 2`` for ``k = 1``; each element returns its state there plus
    ``t_e`` (``d t_e / d k_j = -t_e / N``, so the gradient of the sum is ``-log 2``)."""

    def rhs(y, t, k):
        return -k * y

    def fn(a, on_failure):
        ys, info = solvers.odeint(rhs, jnp.ones_like(a), jnp.array([0.0, 1.0]), a,
                                  on_failure=on_failure, max_steps=60, full_output=True,
                                  event=lambda y, t, k: jnp.mean(y) - 0.5)
        return ys[-1] + info.event_time

    return fn, 1.0, 1e5, float(0.5 + np.log(2.0)), float(-np.log(2.0))


def _whole_odeint_nonterminal():
    """Non-terminal events of one whole sharded state: the mean of ``exp(-k_i t)``
    crosses 0.5 at ``log 2`` (``k = 1``) and the integration goes on to 1; each element
    returns its state at 1 plus the first crossing time (not differentiated)."""

    def rhs(y, t, k):
        return -k * y

    def fn(a, on_failure):
        ys, info = solvers.odeint(rhs, jnp.ones_like(a), jnp.array([0.0, 1.0]), a,
                                  on_failure=on_failure, max_steps=60, full_output=True,
                                  event=lambda y, t, k: jnp.mean(y) - 0.5,
                                  event_terminal=False, max_events=4)
        return ys[-1] + info.event_time[0]

    return fn, 1.0, 1e5, float(np.exp(-1.0) + np.log(2.0)), float(-np.exp(-1.0))


PROBLEMS = {
    "bisection": lambda: _bisection(solvers.bisection),
    "chandrupatla": lambda: _bisection(solvers.chandrupatla),
    "fixed_point": lambda: _fixed_point("iterate"),
    "anderson": lambda: _fixed_point("anderson"),
    "whole_iterate": lambda: _whole("iterate"),
    "whole_anderson": lambda: _whole("anderson"),
    "newton": _newton,
    "broyden": lambda: _newton("broyden"),
    "dogleg": _dogleg,
    "whole_newton": lambda: _whole_root("newton"),
    "whole_broyden": lambda: _whole_root("broyden"),
    "whole_dogleg": lambda: _whole_root("dogleg"),
    "whole_minimize": _whole_minimize,
    "whole_bfgs": lambda: _whole_minimize("bfgs"),
    "whole_newton_cg": lambda: _whole_minimize("newton-cg"),
    "whole_least_squares": _whole_least_squares,
    "whole_gauss_newton": lambda: _whole_least_squares("gauss-newton"),
    "minimize": _minimize,
    "least_squares": _least_squares,
    "odeint": _odeint,
    "whole_odeint": _whole_odeint,
    "whole_odeint_backsolve": lambda: _whole_odeint(adjoint="backsolve"),
    "whole_odeint_kvaerno5": lambda: _whole_odeint(method="kvaerno5"),
    "whole_odeint_bdf": lambda: _whole_odeint(method="bdf"),
    "whole_odeint_dense": _whole_odeint_dense,
    "whole_odeint_event": _whole_odeint_event,
    "whole_odeint_nonterminal": _whole_odeint_nonterminal,
}
MODES = ("auto", "explicit", "shard_map", "pmap")
CHECKS = ("value", "grad", "raise", "nan")


@functools.cache
def _mesh(kind):
    """The 8 devices as one axis ``"b"`` of ``kind``."""
    return jax.make_mesh((8,), ("b",), axis_types=(kind,))


# Problems of a parameter c that does not vary over the mesh and a batch d that is sharded,
# for --replicated: each maps (c, d) to one value per element of d (the loss is the sum of
# their squares); c reaches the solver as one of its arguments (odeint: f(y, t, c)).
@functools.cache
def _replicated_problems():
    ts = jnp.array([0.0, 0.5, 1.0])

    def decay(y, t, c):
        return -c * y

    def ode(**kw):
        def elems(c, d):
            ys = jax.vmap(lambda y0: solvers.odeint(decay, y0, ts, c, **kw))(d)
            return ys[:, -1]

        return elems

    def event(terminal, **kw):
        # y0 exp(-c t) falls to 0.4 c (c = 1.3: at t in 0.6 .. 2.0 for y0 in 1 .. 4)
        def elems(c, d):
            def one(y0):
                ys, info = solvers.odeint(decay, y0, jnp.array([0.0, 1.0, 2.5]), c,
                                          event=lambda y, t, c: y - 0.4 * c,
                                          event_terminal=terminal, full_output=True, **kw)
                if terminal:  # the event time and state (and rows past it: the state)
                    return info.event_time + info.event_state + ys[1] + ys[-1]
                # non-terminal: ys (differentiated) and the crossings found (values)
                return ys[-1] + jax.lax.stop_gradient(info.event_time[0]
                                                      + info.num_events)

            return jax.vmap(one)(d)

        return elems

    def dense(**kw):
        def elems(c, d):
            def one(y0):
                _, info = solvers.odeint(decay, y0, ts, c, dense=32, full_output=True, **kw)
                return jnp.sum(info.solution.evaluate(jnp.array([0.3, 0.8])))

            return jax.vmap(one)(d)

        return elems

    def vmapped(solve):
        return lambda c, d: jax.vmap(lambda a: solve(a, c))(d)

    def broyden(a, c):
        return solvers.root(lambda x, a, c: x**2 - a * c, jnp.ones(2), a, c,
                            method="broyden")[0]

    def bisection(a, c):
        return solvers.bisection(lambda x, a, c: x**3 - a * c, 0.0, 10.0, a, c)

    def whole_anderson(c, d):  # one solve of the whole local batch (GMRES adjoint)
        return solvers.fixed_point(lambda x, d, c: 0.3 * c * jnp.tanh(x) + d,
                                   jnp.zeros_like(d), d, c, method="anderson",
                                   linear_solver="gmres")

    return {
        "odeint": ode(),  # the discrete adjoint
        "odeint_backsolve": ode(adjoint="backsolve"),
        "odeint_interpolate": ode(adjoint="interpolate"),
        "odeint_forward": ode(adjoint="forward"),
        "odeint_forward_adaptive": ode(adjoint="forward_adaptive"),
        "odeint_kvaerno5": ode(method="kvaerno5"),
        "odeint_kvaerno5_interpolate": ode(method="kvaerno5", adjoint="interpolate"),
        "odeint_bdf": ode(method="bdf"),
        "odeint_event": event(True),
        "odeint_event_interpolate": event(True, adjoint="interpolate"),
        "odeint_event_kvaerno5": event(True, method="kvaerno5"),
        "odeint_event_nonterminal": event(False),
        "odeint_dense": dense(),
        "bisection": vmapped(bisection),
        "broyden": vmapped(broyden),
        "whole_anderson": whole_anderson,
    }


#: --replicated: (problem, check) pairs. grad_replicated: the gradient in c, passed with
#: in_specs=P(); grad_closed: c closed over by the shard_map body; value: the values;
#: grad_batched: the gradient in the sharded d; jacfwd: forward mode, jax.jacfwd in c
#: (one tangent per element), jvp_batched: jax.jvp in d.
_ODE_MODES = ("odeint_interpolate", "odeint_forward", "odeint_kvaerno5_interpolate",
              "odeint_event", "odeint_event_interpolate", "odeint_event_kvaerno5",
              "odeint_event_nonterminal", "odeint_dense")
REPLICATED_CASES = (
    [(name, "grad_replicated") for name in (
        "odeint", "odeint_backsolve", "odeint_kvaerno5", "odeint_bdf", "bisection",
        "broyden", "whole_anderson")]
    + [("odeint", "grad_closed"), ("odeint_f_closure", "refused")]
    + [(name, check) for name in _ODE_MODES
       for check in ("value", "grad_replicated", "grad_batched")]
    + [("odeint_forward", "jacfwd"), ("odeint_forward", "jvp_batched")]
    + [("odeint_forward_adaptive", check) for check in (
        "value", "grad_replicated", "grad_batched", "jacfwd", "jvp_batched")]
)


#: Problems whose gradients in c and in d (checks ``grad_replicated`` and ``grad_batched``)
#: come from one program per side, ``jax.grad(loss, argnums=(0, 1))``: their rules are
#: reverse mode (``jax.custom_vjp``), whose backward pass computes both cotangents whichever
#: is asked for, so the joint program runs what the two programs of one gradient each ran,
#: traced and compiled once instead of twice. (Forward sensitivities,
#: ``adjoint="forward*"``, propagate only the tangents of the inputs differentiated: each
#: gradient keeps its own program there.)
_JOINT_GRADS = frozenset(
    name for name, check in REPLICATED_CASES if check == "grad_batched"
    and (name, "grad_replicated") in REPLICATED_CASES and not name.startswith("odeint_forward"))

#: (problem, program, side) -> its outputs, or the error it raised: each program of a
#: problem runs once per side however many checks compare its outputs.
_OUTPUTS = {}


def _outputs(key, compute):
    if key not in _OUTPUTS:
        try:
            _OUTPUTS[key] = compute()
        except Exception as err:  # noqa: BLE001 - raised again to each check that uses it
            _OUTPUTS[key] = err
    if isinstance(_OUTPUTS[key], Exception):
        raise _OUTPUTS[key]
    return _OUTPUTS[key]


def replicated_case(name, check):
    """``(ok, detail)``: problem ``name`` under ``shard_map`` (``check_vma=True``), c
    replicated and d sharded, against the same computation on the whole batch without
    ``shard_map`` (float64, relative 1e-10)."""
    c = jnp.float64(1.3)
    d = jnp.linspace(1.0, 4.0, N)
    mesh = _mesh(AxisType.Explicit)
    sharded = jax.device_put(d, NamedSharding(mesh, P("b")))
    if name == "odeint_f_closure":  # f closes over c: refused, saying what to do
        def loss(c, d):
            return jnp.sum(jax.vmap(lambda y0: solvers.odeint(lambda y, t: -c * y, y0,
                                                              jnp.array([0.0, 1.0])))(d))

        g = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P("b")), out_specs=P())
        try:
            jax.jit(g)(c, sharded)
        except ValueError as err:
            msg = str(err)
            ok = "closes over" in msg and "Pass it to odeint as an argument" in msg
            return ok, msg[:120]
        return False, "no error raised"
    elems = _replicated_problems()[name]

    def loss(c, d):  # (and the values, which the gradient's forward pass computes)
        values = elems(c, d)
        return jnp.sum(values**2), values

    def grad(argnums):  # (gradient, values)
        return lambda c, d: jax.grad(loss, argnums, has_aux=True)(c, d)

    programs = {  # program -> (function of (c, d), out_specs)
        "grad_c": (grad(0), (P(), P("b"))),
        "grad_cd": (grad((0, 1)), ((P(), P("b")), P("b"))),
        "grad_d": (grad(1), (P("b"), P("b"))),
        "jacfwd": (jax.jacfwd(elems), P("b")),
        "jvp_batched": (lambda c, d: jax.jvp(lambda d: elems(c, d), (d,),
                                             (jnp.ones_like(d),))[1], P("b")),
    }

    def without_shard_map(program):  # on the whole batch
        fn = programs[program][0]
        return _outputs((name, program, "expected"),
                        lambda: jax.tree.map(np.asarray, jax.jit(fn)(c, d)))

    def under_shard_map(program):  # c passed with in_specs=P()
        fn, out_spec = programs[program]
        g = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("b")), out_specs=out_spec)
        return _outputs((name, program, "shard_map"),
                        lambda: jax.tree.map(np.asarray, jax.jit(g)(c, sharded)))

    # The values come from a gradient's program (its forward pass): that of c, or of c
    # and d jointly (_JOINT_GRADS).
    joint = name in _JOINT_GRADS
    program, pick = {
        "value": ("grad_cd" if joint else "grad_c", lambda out: out[1]),
        "grad_replicated": ("grad_cd", lambda out: out[0][0]) if joint else
                           ("grad_c", lambda out: out[0]),
        "grad_closed": ("grad_c", lambda out: out[0]),
        "grad_batched": ("grad_cd", lambda out: out[0][1]) if joint else
                        ("grad_d", lambda out: out[0]),
    }.get(check, (check, lambda out: out))
    expected = pick(without_shard_map(program))
    if check == "grad_closed":  # the body closes over c (a constant of the program)
        fn, out_spec = programs[program]
        g = jax.shard_map(lambda d: fn(c, d), mesh=mesh, in_specs=P("b"),
                          out_specs=out_spec)
        out = pick(jax.tree.map(np.asarray, jax.jit(g)(sharded)))
    else:
        out = pick(under_shard_map(program))
    scale = np.max(np.abs(expected))
    rel = float(np.max(np.abs(out - expected)) / scale)
    finite = bool(np.all(np.isfinite(expected))) and scale > 0
    return finite and rel <= 1e-10, (
        f"{np.ravel(out)[:2].tolist()} vs {np.ravel(expected)[:2].tolist()} without "
        f"shard_map (max rel err {rel:.1e})")


def _main_replicated(only=None):
    jax.config.update("jax_enable_x64", True)
    ok_all = True
    for name, check in REPLICATED_CASES:
        if only and name not in only:
            continue
        try:
            ok, detail = replicated_case(name, check)
        except Exception as err:  # noqa: BLE001
            ok, detail = False, f"{type(err).__name__}: {str(err)[:300]}"
            if os.environ.get("SHARDING_TRACEBACK"):
                traceback.print_exc()
        ok_all &= ok
        detail = detail.replace("\n", " ")
        print(f"CASE {name} shard_map {check} {'PASS' if ok else 'FAIL'} {detail}", flush=True)
    print("ALL PASS" if ok_all else "SOME FAILED", flush=True)


@functools.cache
def _problem(name):
    """``PROBLEMS[name]()``, built once: its solve function is then one Python object, so
    the programs of its checks (below) are cached by JAX as well."""
    return PROBLEMS[name]()


@functools.cache
def _program(name, mode, on_failure):
    """The compiled function of problem ``name`` in ``mode``: its values and, with
    ``on_failure="raise"``, the gradient of ``sum(fn)`` too (one vjp: the values are the
    forward pass's), one program per (problem, mode, on_failure). The ``value``, ``grad``
    and ``raise`` checks run the same program, so it is traced and compiled once (a
    separate value-only program cost a third of the matrix's compilations)."""
    fn = _problem(name)[0]

    def body(a):
        if on_failure != "raise":
            return fn(a, on_failure)
        out, vjp = jax.vjp(lambda a: fn(a, on_failure), a)
        return out, vjp(jnp.ones_like(out))[0]

    out_specs = P("b") if on_failure != "raise" else (P("b"), P("b"))
    if mode == "pmap":
        return jax.pmap(body)
    if mode == "shard_map":
        return jax.jit(jax.shard_map(body, mesh=_mesh(AxisType.Explicit), in_specs=P("b"),
                                     out_specs=out_specs))
    return jax.jit(body)


def _run(mode, name, a, on_failure):
    """Problem ``name``'s solve over the batch ``a`` in ``mode`` (with ``"raise"``: its
    values and gradient), as NumPy arrays with their sharding specs (``None`` under
    ``pmap``)."""
    g = _program(name, mode, on_failure)
    if mode == "pmap":
        out = g(a.reshape(8, -1))
        return jax.tree.map(lambda v: np.asarray(v).reshape(-1), out), \
            jax.tree.map(lambda v: None, out)
    mesh = _mesh(AxisType.Explicit if mode in ("explicit", "shard_map") else AxisType.Auto)
    a = jax.device_put(a, NamedSharding(mesh, P("b")))
    if mode == "auto":
        out = jax.block_until_ready(g(a))
    else:
        with jax.set_mesh(mesh):
            out = jax.block_until_ready(g(a))
    return jax.tree.map(np.asarray, out), \
        jax.tree.map(lambda v: getattr(v.sharding, "spec", None), out)


def case(name, mode, check):
    _, good, bad, x_star, dx = _problem(name)
    a = jnp.full(N, good, jnp.float32)
    if check in ("raise", "nan"):
        a = a.at[BAD].set(bad)
    if check == "value":
        (out, _), (spec, _) = _run(mode, name, a, "raise")
        ok = np.allclose(out, x_star, rtol=1e-3, atol=1e-4)
        sharded = spec is None or tuple(spec)[:1] == ("b",)
        return ok and sharded, f"max err {np.max(np.abs(out - x_star)):.1e}, out spec {spec}"
    if check == "grad":
        (_, out), (_, spec) = _run(mode, name, a, "raise")
        ok = np.allclose(out, dx, rtol=1e-2, atol=1e-4)
        sharded = spec is None or tuple(spec)[:1] == ("b",)
        return ok and sharded, f"max err {np.max(np.abs(out - dx)):.1e}, grad spec {spec}"
    whole = name.startswith("whole")  # one solve: a failing element fails all of it
    if check == "nan":
        out, _ = _run(mode, name, a, "nan")
        nan = np.isnan(out)
        if whole:  # the shard (or batch) holding the failure is NaN, the others not
            return bool(nan[BAD]) and not nan.all() or (mode in ("auto", "explicit")
                                                        and nan.all()), \
                f"nan at {np.flatnonzero(nan).tolist()[:10]}..."
        return (bool(nan[BAD]) and nan.sum() == 1), f"nan at {np.flatnonzero(nan).tolist()}"
    try:
        _run(mode, name, a, "raise")
    except Exception as err:  # noqa: BLE001 - any catchable error, its message checked
        msg = str(err)
        ok = "did not converge" in msg and (whole or f"first at index ({BAD},)" in msg)
        tail = msg[msg.find("did not converge"):][:160].replace("\n", " ")
        return ok, f"{type(err).__name__}: {tail}"
    return False, "no error raised"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--solvers", default=",".join(PROBLEMS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--replicated", action="store_true")
    parser.add_argument("--plan", default=None, help="instead of --solvers and --modes: "
                        "groups 'solver,solver@mode,mode' separated by ';'")
    parser.add_argument("--then-replicated", default=None, help="after the matrix, these "
                        "--replicated problems (one process: its start paid once)")
    opts = parser.parse_args()
    assert jax.device_count() == 8, jax.devices()
    if opts.replicated:  # (--solvers picks among its problems)
        only = opts.solvers.split(",") if opts.solvers != ",".join(PROBLEMS) else None
        return _main_replicated(only)
    plan = ([tuple(group.split("@")) for group in opts.plan.split(";")] if opts.plan
            else [(opts.solvers, opts.modes)])
    checks = opts.checks.split(",")
    table = {}
    for names, modes in plan:
        for name in names.split(","):
            for mode in modes.split(","):
                for check in checks:
                    start = time.perf_counter()
                    try:
                        ok, detail = case(name, mode, check)
                    except Exception as err:  # noqa: BLE001
                        ok, detail = False, f"{type(err).__name__}: {str(err)[:300]}"
                        if os.environ.get("SHARDING_TRACEBACK"):
                            traceback.print_exc()
                    table[name, mode, check] = ok
                    detail = detail.replace("\n", " ") + f" ({time.perf_counter() - start:.1f} s)"
                    print(f"CASE {name} {mode} {check} {'PASS' if ok else 'FAIL'} {detail}",
                          flush=True)
    print()
    print(f"{'solver':14s} {'mode':10s} " + " ".join(f"{c:6s}" for c in checks))
    for name, mode in dict.fromkeys((name, mode) for name, mode, _ in table):
        cells = " ".join(f"{'pass' if table[name, mode, c] else 'FAIL':6s}" for c in checks)
        print(f"{name:14s} {mode:10s} {cells}")
    print("ALL PASS" if all(table.values()) else "SOME FAILED", flush=True)
    if opts.then_replicated:  # (last: it switches float64 on for the rest of the process)
        _main_replicated(opts.then_replicated.split(","))


if __name__ == "__main__":
    main()
