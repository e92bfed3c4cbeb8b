"""Hooks for every test the suite runs: tests/ and the doctests of implicit/ and solvers/.

Each program XLA:CPU compiles keeps its kernels in memory mappings of their own (code,
read-only data, data) for as long as JAX's caches hold the program: about 125 mappings
for one ``odeint`` program. A pytest worker that compiles a few hundred of them reaches
Linux's per-process limit (``vm.max_map_count``, 65,530 by default), and the next
compilation then dies inside XLA (segmentation fault or abort), whichever test it is.
So, between tests, the caches are cleared once a worker holds more than ``MAP_BUDGET``
mappings (docs/failures.md, "Many compiled programs in one process").
"""

import jax
import pytest

MAP_BUDGET = 20_000


def _map_count():
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:  # not Linux: no such limit to stay under
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    yield
    if _map_count() > MAP_BUDGET:
        jax.clear_caches()
