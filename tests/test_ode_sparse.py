"""odeint(jac_sparsity=...): structured Jacobians for bdf and kvaerno5 (issue 15).

The 1-D Brusselator by the method of lines (Hairer & Wanner II, IV.1), states
interleaved (u_1, v_1, u_2, ...) so that the Jacobian is banded with half-width 2.
Expected values: SciPy's Radau at tight tolerances and float64 central finite
differences of SciPy Radau solves; never odeint itself.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from scipy.integrate import solve_ivp

import solvers
from benchmarks._brusselator import brusselator, brusselator_np
from benchmarks._brusselator import brusselator_y0 as initial

N = 12
ALPHA = 0.02
TS = np.linspace(0.0, 10.0, 5)


def pattern(n):
    """The exact pattern (not the full band): u_i couples to u_{i±1}, v_i; v_i likewise."""
    m = 2 * n
    P = np.eye(m, dtype=bool)
    i = np.arange(m)
    P[i[:-2], i[:-2] + 2] = P[i[:-2] + 2, i[:-2]] = True
    P[np.arange(0, m, 2), np.arange(1, m, 2)] = True
    P[np.arange(1, m, 2), np.arange(0, m, 2)] = True
    return P


@functools.lru_cache(maxsize=None)  # (the four forward tests share radau(ALPHA))
def radau(alpha, n=N, ts=TS):
    sol = solve_ivp(brusselator_np, (ts[0], ts[-1]), initial(n), method="Radau", t_eval=ts,
                    rtol=1e-12, atol=1e-12, args=(alpha,),
                    jac_sparsity=sp.csr_matrix(pattern(n)))
    assert sol.success
    ys = sol.y.T
    ys.setflags(write=False)  # (cached: shared by the tests that ask for it)
    return ys


def loss_np(ys):
    return float(np.sum(ys[-1] ** 2) + np.sum(ys[2, 0::2]))


def loss(ys):
    return jnp.sum(ys[-1] ** 2) + jnp.sum(ys[2, 0::2])


@pytest.mark.parametrize("method", ["bdf", "kvaerno5"])
@pytest.mark.parametrize("sparsity", ["band", "pattern"])
def test_brusselator_forward_against_scipy(x64, method, sparsity):
    jac_sparsity = 2 if sparsity == "band" else pattern(N)
    ys, info = solvers.odeint(brusselator, jnp.asarray(initial(N)), jnp.asarray(TS), ALPHA,
                              method=method, rtol=1e-9, atol=1e-11,
                              jac_sparsity=jac_sparsity, full_output=True)
    ref = radau(ALPHA)
    err = np.max(np.abs(np.asarray(ys) - ref)) / np.max(np.abs(ref))
    assert err < 2e-6, err
    assert bool(info.converged)


def brusselator_fd_scipy(eps=1e-5):
    """d loss / d alpha at ALPHA: central differences of SciPy Radau solves (rtol 1e-12)."""
    return (loss_np(radau(ALPHA + eps)) - loss_np(radau(ALPHA - eps))) / (2 * eps)


#: brusselator_fd_scipy(), computed once (about 5 s on one core); ``make test-slow``
#: checks it against a fresh computation (test_brusselator_reference_is_scipys).
BRUSSELATOR_FD = -1425.8114969578626


@pytest.mark.slow
def test_brusselator_reference_is_scipys():
    np.testing.assert_allclose(brusselator_fd_scipy(), BRUSSELATOR_FD, rtol=1e-7)


@pytest.mark.parametrize("method,adjoint", [("bdf", "discrete"),
                                            pytest.param("kvaerno5", "discrete",
                                                         marks=pytest.mark.slow),
                                            ("kvaerno5", "forward")])
def test_brusselator_gradient_against_finite_differences(x64, method, adjoint):
    fd = BRUSSELATOR_FD
    diff = jax.jacfwd if adjoint == "forward" else jax.grad
    # (one program: eagerly, the derivative's pieces were compiled one by one)
    grad = jax.jit(diff(lambda a: loss(solvers.odeint(
        brusselator, jnp.asarray(initial(N)), jnp.asarray(TS), a, method=method, rtol=1e-9,
        atol=1e-11, jac_sparsity=2, adjoint=adjoint))))(ALPHA)
    assert abs(float(grad) - fd) / abs(fd) < 1e-5, (float(grad), fd)


def test_structured_matches_dense_and_pytree_state(x64):
    """A pytree state: the pattern is of the raveled state (ravel_pytree order)."""
    n = 6

    def f(y, t):  # two leaves, each a tridiagonal diffusion with decay, coupled pointwise
        a, b = y["a"], y["b"]
        lap = lambda w: jnp.concatenate([w[1:], w[-1:]]) - 2 * w + jnp.concatenate(  # noqa: E731
            [w[:1], w[:-1]])
        return {"a": 50.0 * lap(a) - a + 0.1 * b, "b": 50.0 * lap(b) - 2 * b}

    P = np.zeros((2 * n, 2 * n), bool)
    i = np.arange(n)
    for off in (0, n):
        P[off + i, off + i] = True
        P[off + i[:-1], off + i[1:]] = P[off + i[1:], off + i[:-1]] = True
    P[i, n + i] = True
    y0 = {"a": jnp.linspace(0.0, 1.0, n), "b": jnp.ones(n)}
    ts = jnp.array([0.0, 0.5, 1.0])
    for method in ("bdf", "kvaerno5"):
        ys = solvers.odeint(f, y0, ts, method=method, rtol=1e-10, atol=1e-12, jac_sparsity=P)
        yd = solvers.odeint(f, y0, ts, method=method, rtol=1e-10, atol=1e-12)
        for k in ("a", "b"):
            np.testing.assert_allclose(ys[k], yd[k], rtol=1e-9, atol=1e-12)


def test_jac_sparsity_errors():
    y0 = jnp.ones(4)
    ts = jnp.array([0.0, 1.0])
    f = lambda y, t: -y  # noqa: E731
    with pytest.raises(ValueError, match="jac_sparsity= is for the stiff methods"):
        solvers.odeint(f, y0, ts, method="dopri5", jac_sparsity=1)
    with pytest.raises(ValueError, match=r"`jac_sparsity` must have shape \(4, 4\)"):
        solvers.odeint(f, y0, ts, method="bdf", jac_sparsity=np.eye(3, dtype=bool))
    with pytest.raises(TypeError, match="`jac_sparsity` must be a boolean array"):
        solvers.odeint(f, y0, ts, method="bdf", jac_sparsity=np.eye(4))
    with pytest.raises(ValueError, match="half-width must be >= 0"):
        solvers.odeint(f, y0, ts, method="kvaerno5", jac_sparsity=-2)
