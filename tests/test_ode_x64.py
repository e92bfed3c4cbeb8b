"""odeint with x64 switched on in a scoped context after import, and off again after it.

The checks run in a fresh interpreter (x64 off at import, as a user's session starts), so
that no global x64 state leaks into the other tests and no compiled solver is shared
with them. Expected values are closed forms: y = exp(-k t), dy(1)/dk = -exp(-k).
"""

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import math
    import jax
    import jax.numpy as jnp
    import numpy as np
    import solvers

    assert not jax.config.jax_enable_x64

    def decay(y, t, k):
        return -k * y

    ts = jnp.array([0.0, 1.0])

    def run(method, k=0.5):  # the values and the gradient: one program
        def loss(k):
            ys = solvers.odeint(decay, jnp.array([1.0]), ts, k, method=method)
            return ys[-1, 0], ys

        (_, ys), g = jax.value_and_grad(loss, has_aux=True)(k)
        return ys, g

    def check(method, dtype, rtol):
        ys, g = run(method)
        assert ys.dtype == dtype, (method, ys.dtype, dtype)
        assert g.dtype == dtype, (method, g.dtype, dtype)
        np.testing.assert_allclose(ys[-1, 0], math.exp(-0.5), rtol=rtol)
        np.testing.assert_allclose(g, -math.exp(-0.5), rtol=rtol)

    # The failing call of the report, verbatim.
    with jax.enable_x64(True):
        out = solvers.odeint(lambda y, t: -y, jnp.array([1.0]), jnp.array([0.0, 1.0]),
                             method="kvaerno5")
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out[-1, 0], math.exp(-1.0), rtol=1e-7)

    for method in ("dopri5", "kvaerno5"):  # (tsit5: dopri5's code, another tableau)
        check(method, jnp.float32, 1e-4)  # before the scope
        with jax.enable_x64(True):
            check(method, jnp.float64, 1e-6)
        check(method, jnp.float32, 1e-4)  # after it
        assert not jax.config.jax_enable_x64
    print("ok")
    """
)


def test_scoped_x64_after_import_every_method():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_ENABLE_X64="0")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
