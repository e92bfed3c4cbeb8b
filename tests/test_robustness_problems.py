"""The robustness benchmark's problem definitions (``benchmarks/robustness.py``), without
solving anything: each function is written once for ``jax.numpy`` and NumPy (the solvers
see the first, the independent residual test runs the second), so the two must agree; and
the MGH ports must vanish at the solutions MINPACK's ``hybrd`` test driver reports."""

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import robustness as rb

PROBLEMS = rb.problems()


@pytest.mark.parametrize("prob", PROBLEMS, ids=[p.name for p in PROBLEMS])
def test_numpy_and_jnp_definitions_agree_at_every_start(prob, x64):
    for _, x0, params in prob.instances[:3]:
        f_np = prob.fn(np.asarray(x0, np.float64), np, *params)
        f_jnp = prob.fn(jnp.asarray(x0), jnp, *(jnp.asarray(p) for p in params))
        assert f_np.shape == np.shape(x0)
        np.testing.assert_allclose(np.asarray(f_jnp), f_np, rtol=1e-12, atol=1e-12)


def test_the_set_is_minpacks_hybrd_driver():
    assert len(rb.MGH_CASES) == 22
    assert sum(p.column == "MGH" for p in PROBLEMS) == 22


# Solutions printed by MINPACK's hybrd test driver (16 digits), and how small the port's
# residual is there (the rounding of the printed digits times the Jacobian's size).
MINPACK_SOLUTIONS = {
    (rb.watson, 6): [-0.1572508640134011e-01, 0.1012434869369118e+01, -0.2329916259567960,
                     0.1260430087800365e+01, -0.1513728922723441e+01, 0.9929964324318560],
    (rb.chebyquad, 5): [0.8375125649983552e-01, 0.3127292952224503, 0.5000000000008663,
                        0.6872707047760241, 0.9162487435008237],
    (rb.discrete_integral_equation, 1): [-0.1528138835625800],
    (rb.broyden_banded, 10): [-0.4283028636053099, -0.4765964242962535, -0.5196524638125549,
                              -0.5580993246169652, -0.5925061569509362, -0.6245036821428087,
                              -0.6232394714478015, -0.6213938418388717, -0.6204535966122983,
                              -0.5864692707477792],
    (rb.helical_valley, 3): [1.0, 0.0, 0.0],
    (rb.variably_dimensioned, 10): [1.0] * 10,
}


@pytest.mark.parametrize("case", MINPACK_SOLUTIONS, ids=lambda c: f"{c[0].__name__}-{c[1]}")
def test_minpack_solutions_are_roots_of_the_ports(case):
    fn, n = case
    x = np.asarray(MINPACK_SOLUTIONS[case], np.float64)
    assert x.shape == (n,)
    assert np.max(np.abs(fn(x, np))) < 1e-8


def test_the_chemical_systems_have_their_published_roots():
    # Propane (Meintjes & Morgan 1990): the positive root; the 10-species system's relative
    # test is 0 at a root and O(1) at the start.
    x = np.array([3.114102e-03, 3.459792e+01, 6.504178e-02, 8.593780e-01, 3.695186e-02])
    assert np.max(np.abs(rb.propane(x, np))) < 1e-5
    assert rb.combustion10_scaled_residual(np.full(10, 1e-5)) > 0.1
