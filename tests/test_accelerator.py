"""What a GPU needs of the solvers, checked where the tests run (on CPU too).

- The solvers' own products (tableau weights times stages, Gram matrices, Krylov bases,
  quasi-Newton updates) are full float32 whatever the default matmul precision: a GPU's
  default is TF32 (about 1e-3 relative), too coarse for an error estimate or an
  orthogonal basis. The user's function keeps the precision it asks for.
- Loops that would make a host round trip per small step do not: GMRES applies its
  rotations without an inner loop or conditional; the Neumann adjoint takes several
  steps per loop trip on an accelerator.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import implicit._sharding
import implicit.linear
import solvers


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for sub in p if isinstance(p, (list, tuple)) else [p]:
            if isinstance(sub, jcore.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jcore.Jaxpr):
                yield sub


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from _eqns(sub)


def _dots(jaxpr):
    """The precision of every dot_general in ``jaxpr`` and its sub-jaxprs."""
    return [e.params["precision"] for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]


def _layer(x, a):  # no products of its own: every dot below is a solver's
    return jnp.tanh(a * x) + 0.5


CASES = {
    "fixed_point anderson": lambda a: solvers.fixed_point(
        _layer, jnp.zeros(5), a, method="anderson", linear_solver="gmres"),
    "root newton, gmres adjoint": lambda a: solvers.root(
        lambda x, a: x**3 - a, jnp.ones(5), a, linear_solver="gmres"),
    "odeint kvaerno5": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones(5), jnp.array([0.0, 1.0]), a, method="kvaerno5"),
    "odeint bdf": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones(5), jnp.array([0.0, 1.0]), a, method="bdf"),
    # 500 states: bdf's difference-array products become dots (past _small.FUSED_MAX).
    # In TF32 they stalled a GPU run of docs/ode.md's heat equation at max_steps (the
    # error estimate's noise kept the steps ~1e-6): reproduced on CPU by rounding their
    # operands to TF32, fixed by computing them in full precision.
    "odeint bdf, 500 states": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones(500), jnp.array([0.0, 1.0]), a, method="bdf"),
    "odeint dopri5, large state": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones((5, 200)), jnp.array([0.0, 1.0]), a),
    "odeint bdf, banded Jacobian": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones(500), jnp.array([0.0, 1.0]), a, method="bdf",
        jac_sparsity=1),
    "odeint dopri5, interpolating adjoint": lambda a: solvers.odeint(
        lambda y, t, a: -a * y, jnp.ones((5, 200)), jnp.array([0.0, 1.0]), a,
        adjoint="interpolate"),
    "least_squares": lambda a: solvers.least_squares(lambda x, a: x**2 - a, jnp.ones(5), a),
    "least_squares gauss-newton": lambda a: solvers.least_squares(
        lambda x, a: x**2 - a, jnp.ones(5), a, method="gauss-newton"),
    "root dogleg": lambda a: solvers.root(lambda x, a: x**3 - a, jnp.ones(5), a,
                                          method="dogleg"),
    "root broyden": lambda a: solvers.root(lambda x, a: x**3 - a, jnp.ones(5), a,
                                           method="broyden"),
    "minimize lbfgs": lambda a: solvers.minimize(
        lambda x, a: jnp.sum((x - a) ** 4), jnp.zeros(5), a, method="lbfgs"),
    "minimize bfgs": lambda a: solvers.minimize(
        lambda x, a: jnp.sum((x - a) ** 2), jnp.zeros(5), a, method="bfgs"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("grad", [False, True])
def test_solver_products_are_full_precision(name, grad):
    fn = CASES[name]
    if grad:
        fn = jax.grad(lambda a, fn=fn: jnp.sum(fn(a)))
    precisions = _dots(jax.make_jaxpr(fn)(jnp.float32(1.0)).jaxpr)
    assert precisions or name.startswith("root") and not grad  # (a scalar Newton: none)
    loose = [p for p in precisions if "HIGHEST" not in str(p)]
    assert not loose, f"{len(loose)} of {len(precisions)} products at {set(map(str, loose))}"


def test_user_function_keeps_its_precision():
    W = jnp.eye(3) * 0.5
    fn = lambda a: solvers.fixed_point(lambda x, W: jnp.tanh(W @ x) + a, jnp.zeros(3), W)  # noqa: E731
    precisions = {str(p) for p in _dots(jax.make_jaxpr(fn)(jnp.float32(1.0)).jaxpr)}
    assert "None" in precisions  # the user's W @ x, at the default precision


def _while_bodies(jaxpr, depth=0):
    """``(depth, body jaxpr)`` of every while loop, depth counting enclosing loops."""
    out = []
    for eqn in jaxpr.eqns:
        inner = depth + 1 if eqn.primitive.name == "while" else depth
        if eqn.primitive.name == "while":
            out.append((depth, eqn.params["body_jaxpr"].jaxpr))
        for sub in _subjaxprs(eqn):
            out += _while_bodies(sub, inner)
    return out


def test_gmres_runs_two_loops_and_no_conditional():
    """The restart loop and the Arnoldi loop; rotations and re-orthogonalisation inside a
    step add no loop trip or conditional (each a host round trip on a GPU)."""
    rng = np.random.default_rng(0)
    A = jnp.asarray(np.eye(30) + 0.3 * rng.standard_normal((30, 30)) / np.sqrt(30))
    b = jnp.asarray(rng.standard_normal(30))

    def solve(b):  # (the method itself: solve() adds its transpose's loops)
        return implicit.linear._gmres(lambda v: A @ v, b, 1e-7, 0.0, 200)

    jaxpr = jax.make_jaxpr(solve)(b).jaxpr
    loops = _while_bodies(jaxpr)
    assert sorted(d for d, _ in loops) == [0, 1]
    assert "cond" not in {e.primitive.name for e in _eqns(jaxpr)}
    x = np.asarray(jax.jit(solve)(b), np.float64)  # (one program, not one per loop/op)
    np.testing.assert_allclose(np.asarray(A, np.float64) @ x, b, atol=1e-4)


def test_gmres_solution_with_many_restarts_matches_dense():
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        n = 40  # four restart cycles at least
        A = np.eye(n) * 2 + rng.standard_normal((n, n)) / np.sqrt(n)
        b = rng.standard_normal(n)
        x = jax.jit(lambda A, b: implicit.linear.solve(  # (one program)
            "gmres", lambda v: A @ v, b, rtol=1e-11, atol=0.0))(jnp.asarray(A), jnp.asarray(b))
        np.testing.assert_allclose(np.asarray(x), np.linalg.solve(A, b), rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("accelerator", [False, True])
def test_neumann_takes_several_steps_per_trip_on_an_accelerator(monkeypatch, accelerator):
    monkeypatch.setattr(implicit._sharding, "on_accelerator", lambda: accelerator)
    rng = np.random.default_rng(2)
    M = 0.5 * np.linalg.qr(rng.standard_normal((8, 8)))[0]  # spectral radius 0.5
    b = rng.standard_normal(8)
    Mj = jnp.asarray(M, jnp.float32)

    def solve(b):  # (M - I) x = b, the engine's form of the adjoint (the method itself)
        return implicit.linear._neumann(lambda v: Mj @ v - v, b, 1e-6, 0.0, 200)

    jaxpr = jax.make_jaxpr(solve)(jnp.asarray(b, jnp.float32)).jaxpr
    (_, body), = _while_bodies(jaxpr)
    steps = implicit.linear.NEUMANN_STEPS_PER_TRIP_ON_ACCELERATOR if accelerator else 1
    assert len(_dots(body)) == steps  # one product with M per step
    x = jax.jit(solve)(jnp.asarray(b, jnp.float32))  # (one program)
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(M - np.eye(8), b), rtol=1e-4,
                               atol=1e-5)
