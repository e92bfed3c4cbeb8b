"""Hooks for every test the suite runs: tests/ and the doctests of implicit/ and solvers/.

Each program XLA:CPU compiles keeps its kernels in memory mappings of their own (code,
read-only data, data) for as long as JAX's caches hold the program: about 125 mappings
for one ``odeint`` program. A pytest worker that compiles a few hundred of them reaches
Linux's per-process limit (``vm.max_map_count``, 65,530 by default), and the next
compilation then dies inside XLA (segmentation fault or abort), whichever test it is.
So, between tests, the caches are cleared once a worker holds more than ``MAP_BUDGET``
mappings (docs/failures.md, "Many compiled programs in one process").
"""

import os

#: XLA:CPU's cheaper code generation, for the tests only (set before JAX starts its CPU
#: client, so every test, doctest, notebook kernel and subprocess of the suite inherits it;
#: the subprocesses that set flags of their own append them to these). The suite is bound
#: by compilation (XLA:CPU compiles each kernel of a program separately): fusions are
#: emitted by XLA's elemental IR emitter (its CPU default until its MLIR fusion emitters)
#: and LLVM skips its expensive optimisation passes. The HLO program, and every HLO pass
#: run on it, is the one a user's call compiles; only its translation to machine code
#: differs. Measured on a 2-core machine, tests/test_ode_events.py and tests/test_root.py
#: take 157 s with XLA's defaults, 83 s with these flags. (Also tried: LLVM at -O0
#: besides, ``--xla_backend_optimization_level=0``: the whole suite 1041 -> 625 s, but the
#: elemental emitter at -O0 computes kvaerno5's discrete adjoint wrongly, 5e-7 off
#: forward mode on Lotka-Volterra at rtol 1e-9 with adjoint_window=32 and 1e-2 off with
#: 512, where they agree to 1e-14 under XLA's defaults, under each flag alone and with
#: window 1 (the replay retakes the forward's steps exactly there, and its buffer written
#: as a select of the whole buffer instead of an in-place row update gives the right
#: gradient): not used. -O1: no faster than these flags.)
#: ``TEST_XLA_CODEGEN=default`` runs the suite with XLA's defaults
#: (``make test-default-codegen``); ``make demo``, ``make bench`` and ``make docs`` never
#: use these flags.
TEST_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true"
if os.environ.get("TEST_XLA_CODEGEN", "cheap") == "cheap":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

#: One compilation cache for the whole run: JAX's persistent cache in a fresh temporary
#: directory, made by the process that starts the run (set before JAX starts, through
#: JAX's environment variables, so pytest's workers, the notebook kernels and every
#: subprocess share it). A program whose HLO a test already compiled (the same solver on
#: the same problem, from another test or file: JAX's in-memory caches are per function
#: object) is loaded instead of compiled again, and every run starts cold, so nothing
#: carries over between runs. Programs that compile in under ``CACHE_MIN_COMPILE_S`` are
#: not written. Measured, clean-clone ``.ci/run`` on a 2-core machine, back to back
#: (without, with, without): tests 1146, 1008, 1059 s (8.6% less than the two runs
#: without), user CPU 36.6, 32.3, 34.0 min.
CACHE_MIN_COMPILE_S = "0.3"
_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-tests-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", CACHE_MIN_COMPILE_S)

import jax  # noqa: E402
import pytest  # noqa: E402

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


#: Test files whose tests each run for tens of seconds (subprocesses with 8 simulated
#: devices, notebooks on their own kernel, the demo): collected first, so that
#: ``pytest -n`` (which hands tests out in collection order) starts them first and the
#: short tests fill in after, instead of one worker finishing the last long test alone.
LONG_FIRST = ("tests/test_sharding.py", "tests/test_notebooks.py", "tests/test_demo.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONG_FIRST)  # (stable)


def pytest_unconfigure(config):
    if _CACHE_DIR is not None:  # (the process that made it: the run is over)
        import shutil

        shutil.rmtree(_CACHE_DIR)
