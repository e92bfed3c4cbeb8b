"""Shared test fixtures. Tests run in float32 unless they ask for the `x64` fixture."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Run the test with float64 enabled (restored afterwards)."""
    with jax.enable_x64(True):
        yield


@jax.jit
def _host_callback_noop(x):
    return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


@pytest.fixture(autouse=True)
def _fresh_runtime_token():
    """On a GPU a failed solve's error (raised by a host callback, asynchronously) stays in
    JAX's runtime token for the device after the test caught it, and a later
    ``jax.effects_barrier()`` raises it again, in whichever test comes next on that worker,
    until another computation with a host callback runs there. Run one after each test."""
    yield
    if jax.default_backend() != "cpu":
        jax.block_until_ready(_host_callback_noop(jax.numpy.zeros((), "float32")))
