"""``adjoint="forward_adaptive"``: forward sensitivities with the step sizes differentiated.

The tangent of the whole integration, step-size controller and stage iterations included:
the exact derivative of the computed outputs as a function of the inputs. Checked against
closed forms (the linear-system oracle of test_ode_gradients), SciPy's Radau (an
independent integrator) by central differences on van der Pol μ = 1000 (issues 10 and
15: within 1% at rtol 1e-6, where the step sizes held fixed give a gradient 100x off),
and central differences of odeint itself (the derivative of the computed map).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.integrate import solve_ivp

from solvers import odeint
from test_ode_gradients import (
    CONTRACT,
    _check_contract,
    _linear,
    examples,
    linear_system,
    oracle,
    relerr,
    seeds,
)

ADAPTIVE = "forward_adaptive"
#: bdf's step sizes respond to the inputs (its error norms, its order selection), and
#: forward_adaptive differentiates that response, which no error estimate controls: over
#: 30 random stiff 2 x 2 systems (eigenvalues -1 and -1 .. -1e5, T in [0.5, 3], rtol 1e-8)
#: its error against the oracle was median 9.7e-8, at most 1.1e-5 (3 of 30 past the
#: contract's 100 x rtol), against at most 2.4e-7 for the discrete adjoint; kvaerno5's
#: forward_adaptive at most 7e-8 and dopri5's 6e-7 over the same kind of draw. The bound
#: for bdf is 10x the largest measured.
BDF_ADAPTIVE_BOUND = 1e-4


def van_der_pol(y, t, mu):
    return jnp.stack([y[1], mu * ((1 - y[0] ** 2) * y[1]) - y[0]])


def vdp_reference_scipy():
    """d y1(3000) / d mu at mu = 1000: central differences (step 1) of SciPy Radau solves
    at rtol = atol = 1e-9: -0.0035336, as at rtol 1e-11 (which took 4x as long: 13 s)."""

    def radau(mu):
        sol = solve_ivp(lambda t, y: [y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]],
                        (0.0, 3000.0), [2.0, 0.0], method="Radau", rtol=1e-9, atol=1e-9)
        assert sol.success
        return sol.y[0, -1]

    return (radau(1001.0) - radau(999.0)) / 2.0


#: vdp_reference_scipy(), computed once (4 s on one core); ``make test-slow`` checks it
#: against a fresh computation (test_vdp_reference_is_scipys).
VDP_REFERENCE = -0.00353359833433764


@pytest.mark.slow
def test_vdp_reference_is_scipys():
    np.testing.assert_allclose(vdp_reference_scipy(), VDP_REFERENCE, rtol=1e-7)


def _vdp_gradient(method, rtol, diff=jax.grad):
    def final(mu):
        ys = odeint(van_der_pol, jnp.array([2.0, 0.0]), jnp.array([0.0, 3000.0]), mu,
                    method=method, rtol=rtol, atol=rtol, max_steps=200_000, adjoint=ADAPTIVE)
        return ys[-1, 0]

    return float(jax.jit(diff(final))(1000.0))


def test_van_der_pol_kvaerno5_at_rtol_1e6(x64):
    # Measured: -0.00353344 (5e-5 relative); the default discrete adjoint: -0.388.
    g = _vdp_gradient("kvaerno5", 1e-6)
    assert abs(g - VDP_REFERENCE) <= 1e-2 * abs(VDP_REFERENCE), (g, VDP_REFERENCE)


@pytest.mark.slow
def test_van_der_pol_bdf_at_rtol_1e6(x64):
    # Measured: -0.00353603 (7e-4 relative); the default discrete adjoint: -0.0758.
    g = _vdp_gradient("bdf", 1e-6)
    assert abs(g - VDP_REFERENCE) <= 1e-2 * abs(VDP_REFERENCE), (g, VDP_REFERENCE)
    # Forward mode gives the same number (the rule is linear in the tangents).
    assert _vdp_gradient("bdf", 1e-6, jax.jacfwd) == pytest.approx(g, rel=1e-12)


@examples(2)
@given(seed=seeds, log_fast=st.floats(0.0, 5.0), T=st.floats(0.5, 3.0))
@pytest.mark.parametrize("method", ["kvaerno5", "bdf"])
def test_contract_stiff_2x2(method, seed, log_fast, T):
    # The error contract (within 100x rtol of the eigendecomposition oracle; bdf: see
    # BDF_ADAPTIVE_BOUND), never failing.
    _check_contract(method, ADAPTIVE, 64, seed, [-1.0, -(10.0**log_fast)], T,
                    must_succeed=True,
                    bound=BDF_ADAPTIVE_BOUND if method == "bdf" else CONTRACT)


def test_bdf_is_the_derivative_of_the_computed_map_where_it_misses_the_contract(x64):
    # A draw of the property above (HYPOTHESIS_EXPLORE=1) where bdf's forward_adaptive
    # gradient with respect to y0 is 8.8e-6 off the oracle (880 x rtol). That is the slope
    # of the computed map itself there: its central differences with a step of 1e-6 agree
    # with the rule to 1e-8 (with a step of 1e-4, which changes the step sequence, they are
    # 1.3e-4 off). The rule keeps its promise; the discrete adjoint, with the steps held
    # fixed, is within the contract (2.6e-8).
    lams, T = [-1.0, -100.0], 1.0
    A, V, y0, c = linear_system(55, lams)
    ref = oracle(V, lams, y0, c, T)[1]

    def loss(y0, adjoint):
        ys = odeint(_linear, y0, jnp.array([0.0, T]), A, method="bdf", rtol=1e-8,
                    atol=1e-10, adjoint=adjoint, max_steps=20_000)
        return jnp.dot(c, ys[-1])

    g = np.asarray(jax.jit(jax.grad(lambda y: loss(y, ADAPTIVE)))(y0))
    # (the discrete adjoint's value and gradient in one program, its values the map)
    value_and_discrete = jax.jit(jax.value_and_grad(lambda y: loss(y, None)))
    h = 1e-6
    central = np.array([(float(value_and_discrete(y0 + e)[0])
                         - float(value_and_discrete(y0 - e)[0])) / (2 * h)
                        for e in h * np.eye(2)])
    assert relerr(g, central) < 1e-6
    discrete = np.asarray(value_and_discrete(y0)[1])
    assert relerr(discrete, ref) < CONTRACT


@pytest.mark.slow
@examples(2)
@given(seed=seeds, log_fast=st.floats(0.0, 2.5), T=st.floats(0.5, 3.0))
def test_contract_explicit_2x2(seed, log_fast, T):
    _check_contract("dopri5", ADAPTIVE, 64, seed, [-1.0, -(10.0**log_fast)], T,
                    must_succeed=True)


def lotka_volterra(y, t, a, b, c, d):
    return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])


@pytest.mark.parametrize("method", ["tsit5", pytest.param("kvaerno5", marks=pytest.mark.slow),
                                    pytest.param("bdf", marks=pytest.mark.slow)])
def test_derivative_of_the_computed_map(x64, method):
    # Central differences of odeint itself at the same (loose) tolerance differentiate the
    # step-size choices too: that is the derivative this adjoint computes. The fixed-step
    # derivative ("discrete") is further from them.
    ts = jnp.linspace(0.0, 5.0, 6)
    y0 = jnp.array([1.0, 1.0])

    def loss(p, adjoint=ADAPTIVE):
        ys = odeint(lotka_volterra, y0, ts, *p, method=method, rtol=1e-5, atol=1e-5,
                    adjoint=adjoint)
        return jnp.sum(ys**2)

    p = np.array([1.5, 1.0, 3.0, 1.0])
    v = np.array([0.3, -0.2, 0.5, 0.1])
    # (the gradient and the jvp along v in one program)
    g, tangent = jax.jit(lambda p, v: (jax.grad(loss)(p), jax.jvp(loss, (p,), (v,))[1]))(
        jnp.asarray(p), jnp.asarray(v))
    g = np.asarray(g)
    value = jax.jit(loss)
    h = 1e-6
    fd = np.array([(float(value(p + h * e)) - float(value(p - h * e))) / (2 * h)
                   for e in np.eye(4)])
    # Measured at h = 1e-6: 8e-9 (tsit5), 6e-8 (kvaerno5), 1.5e-6 (bdf) relative; the
    # discrete adjoint's fixed-step derivative: 6e-5, 1.8e-4, 6.7e-4.
    np.testing.assert_allclose(g, fd, rtol=1e-5)
    # jvp along a direction = the gradient's projection (forward and reverse agree).
    assert float(tangent) == pytest.approx(float(g @ v), rel=1e-10)


def test_vmap_pytree_and_closure(x64):
    # vmap over parameters whose solves take different steps; a dict state and parameter;
    # a value f closes over, differentiated too. Closed form: y_a = e^{-kt},
    # y_b(1) = ∫0^1 w e^{-kt} dt = w (1 - e^{-k}) / k.
    ts = jnp.array([0.0, 1.0])

    def final(k, w):
        def f(y, t, p):
            return {"a": -p["k"] * y["a"], "b": w * y["a"]}

        return odeint(f, {"a": 1.0, "b": 0.0}, ts, {"k": k}, adjoint=ADAPTIVE)["b"][-1]

    ks = np.array([0.5, 2.0, 20.0])
    gk, gw = jax.jit(jax.vmap(jax.grad(final, argnums=(0, 1)), in_axes=(0, None)))(
        jnp.asarray(ks), 1.5)
    exact_k = 1.5 * (np.exp(-ks) / ks - (1 - np.exp(-ks)) / ks**2)
    np.testing.assert_allclose(gk, exact_k, rtol=1e-7)
    np.testing.assert_allclose(gw, (1 - np.exp(-ks)) / ks, rtol=1e-7)


@pytest.mark.slow
def test_hessian(x64):
    # Forward over the rule: d²/dk² e^{-k} = e^{-k}.
    h = jax.hessian(lambda k: odeint(lambda y, t, k: -k * y, 1.0, jnp.array([0.0, 1.0]), k,
                                     adjoint=ADAPTIVE)[-1])(0.5)
    assert float(h) == pytest.approx(np.exp(-0.5), rel=1e-6)


@pytest.mark.parametrize("method", ["dopri5", pytest.param("kvaerno5", marks=pytest.mark.slow),
                                    pytest.param("bdf", marks=pytest.mark.slow)])
def test_zero_solution_has_finite_derivatives(x64, method):
    # y0 = 0: every error estimate is exactly zero. Its derivative is the norm's (zero),
    # not sqrt's infinite one times zero: before, NaN sensitivities (a loud failure).
    g = jax.jit(jax.grad(lambda y0: odeint(lambda y, t: -0.5 * y, y0, jnp.array([0.0, 1.0]),
                                           method=method, adjoint=ADAPTIVE)[-1]))(0.0)
    assert np.isfinite(float(g))
    # (the steps grow tenfold on a zero solution and do not resolve the derivative:
    # 4e-6 relative for dopri5 and kvaerno5, 4% for bdf, as with the discrete adjoint)
    assert float(g) == pytest.approx(np.exp(-0.5), rel=0.1)


def test_non_finite_sensitivities_fail_loudly(x64):
    # d/dk of sqrt(k) at k = 0 is infinite: the value is fine, its derivative is not.
    def final(k, on_failure="raise"):
        return odeint(lambda y, t, k: -jnp.sqrt(k) * y, 1.0, jnp.array([0.0, 1.0]), k,
                      adjoint=ADAPTIVE, on_failure=on_failure)[-1]

    assert float(final(0.0)) == 1.0
    with pytest.raises(Exception, match="nonfinite") as err:
        jax.block_until_ready(jax.grad(final)(0.0))
    assert "forward_adaptive" in str(err.value)
    assert np.isnan(float(jax.grad(final)(0.0, "nan")))


def test_bad_input(x64):
    ts = jnp.array([0.0, 1.0])
    with pytest.raises(ValueError, match="adjoint='forward_adaptive'"):
        odeint(lambda y, t: -y, 1.0, ts, adjoint=ADAPTIVE, event=lambda y, t: y - 0.5)
    with pytest.raises(ValueError, match="adjoint='forward_adaptive'"):
        odeint(lambda y, t: -y, 1.0, ts, adjoint=ADAPTIVE, dense=4, full_output=True)
    with pytest.raises(ValueError, match="forward_adaptive"):  # listed among the valid ones
        odeint(lambda y, t: -y, 1.0, ts, adjoint="forward_adaptve")

