"""odeint's ``progress`` (issue 14): the time reached, reported from the step loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solvers.ode import odeint


def decay(y, t, k):
    return -k * y


TS = np.array([0.0, 1.0, 2.0, 5.0])


def test_progress_callable_receives_each_accepted_time_eagerly_and_under_jit():
    ts = jnp.asarray(TS)
    for call in (lambda fn, k: fn(k), lambda fn, k: jax.jit(fn)(k)):
        seen = []

        def solve(k, seen=seen):
            return odeint(decay, 1.0, ts, k, progress=seen.append, full_output=True)

        _, info = call(solve, 0.5)
        assert len(seen) == int(info.num_accepted)
        assert all(isinstance(t, float) for t in seen)
        assert np.all(np.diff(seen) > 0) and seen[0] > 0
        assert seen[-1] == pytest.approx(5.0)


def test_progress_under_vmap_reports_every_element_once_per_step():
    seen = []
    ks = jnp.array([0.5, 1.0, 3.0])
    _, info = jax.vmap(
        lambda k: odeint(decay, 1.0, jnp.asarray(TS), k, progress=seen.append,
                         full_output=True)
    )(ks)
    assert len(seen) == int(jnp.sum(info.num_accepted))
    assert seen.count(pytest.approx(5.0)) == 3


def test_progress_true_prints_and_off_traces_nothing(capsys):
    ts = jnp.asarray(TS)
    odeint(decay, 1.0, ts, 0.5, progress=True)
    out = capsys.readouterr().out
    assert "solvers.odeint: t = 5 of 5 (100.0%)" in out

    def jaxpr(progress):
        return str(jax.make_jaxpr(
            lambda k: odeint(decay, 1.0, ts, k, progress=progress, on_failure="ignore")
        )(0.5))

    assert "callback" not in jaxpr(None) and "callback" not in jaxpr(False)
    assert "callback" in jaxpr(True)


def test_progress_must_be_callable():
    with pytest.raises(TypeError, match="progress"):
        odeint(decay, 1.0, jnp.asarray(TS), 0.5, progress="yes")
