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
