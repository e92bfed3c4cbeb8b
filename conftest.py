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
#: differs, and LLVM optimises nothing (``--xla_backend_optimization_level=0``). Measured on
#: a 2-core machine, the whole suite: 771 s with the first two flags, 536 s with all three
#: (tests/test_ode_events.py and tests/test_root.py alone: 157 s with XLA's defaults, 83 s
#: with the first two). At -O0 one test failed at first, and rightly: kvaerno5's discrete
#: adjoint on Lotka-Volterra was 5e-7 (window 32) to 0.15 (window 512) off forward mode,
#: because the replay (another program than the forward loop) rounded a step differently
#: and took other steps, counted to the forward's number and so ending short of it. The
#: replay now lands on the forward's times (solvers/ode/_adjoint.py, ``replay``), which a
#: user's program needs as much (XLA may round the replay differently on any backend).
#: (Per test, the seconds spent tracing, lowering and compiling: tools/compile_profile.py.)
#: ``TEST_XLA_CODEGEN=default`` runs the suite with XLA's defaults
#: (``make test-default-codegen``); ``make demo``, ``make bench`` and ``make docs`` never
#: use these flags.
#: (-O0 is not XLA:CPU's alone: it is left out where an accelerator's plugin is installed,
#: unless the run is on the CPU only.)
#: ``--xla_cpu_parallel_codegen_split_count=1``: one LLVM module per program instead of
#: XLA:CPU's split into parts compiled on its thread pool. Two pytest workers already keep
#: two cores busy, and the split (``SplitModule``, a thread-safe clone of the module per
#: part: ~140 of a Lotka-Volterra gradient's 740 ms of XLA compilation, in a profile of
#: its compile) only adds work. Measured, tests/test_ode*.py (four files) and
#: tests/test_ift.py with ``-n 2``: 113 -> 98 s and 117 -> 102 s (user CPU -12%).
TEST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true"
                  " --xla_cpu_parallel_codegen_split_count=1")


def _accelerator_plugin():
    import importlib.util

    def found(name):
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            return False

    return any(found(name) for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13",
                                        "jax_plugins.xla_rocm", "libtpu"))


if os.environ.get("TEST_XLA_CODEGEN", "cheap") == "cheap":
    flags = TEST_XLA_FLAGS
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _accelerator_plugin():
        flags += " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()

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
