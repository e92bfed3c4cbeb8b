#!/usr/bin/env bash
# One call on a lent GPU machine (JAX with CUDA preinstalled, no package registry):
#   bash benchmarks/gpu.sh [SECONDS_FOR_THE_TESTS] [SECONDS_FOR_THE_BENCHMARKS] [SUITE ...]
# 1. installs this checkout (and the peers' wheels, if a session carried them in .whl/:
#    `pip download -d .whl jaxopt` on a machine with a registry; .whl/ is ignored by git
#    and named in the device tool's `carry`),
# 2. runs the test suite on the GPU (XLA's default code generation: conftest.py's cheaper
#    CPU flags are for CPU CI), PYTEST_WORKERS workers (default 4) sharing the GPU (no
#    preallocation: each process takes the memory it uses); the notebook tests are left
#    out where nbclient is not installed, and the output says so (PYTEST_ARGS: more pytest
#    arguments, e.g. `@file` naming the tests to run, one per line),
# 3. runs the benchmark suites named (default: the GPU rows, neural_ode and fixed_point)
#    with full float32 matmuls, writing benchmarks/results/report_gpu.md.
# Where the device tool provides $OUT, the test log, the benchmarks' output (kept as it
# is printed, so a run stopped by its time limit still returns the rows it finished) and
# the report are copied there.
set -uo pipefail
cd "$(dirname "$0")/.."
TEST_SECONDS="${1:-300}"
BENCH_SECONDS="${2:-300}"
shift 2 2>/dev/null || shift $#
SUITES=("$@")
[ ${#SUITES[@]} -eq 0 ] && SUITES=(neural_ode fixed_point)
PY="${PYTHON:-python3}"
LOGS="${OUT:-benchmarks/results}"
mkdir -p "$LOGS"

if [ -d .whl ]; then
    "$PY" -m pip install --quiet --no-index --find-links .whl --no-deps .whl/*.whl || exit 1
fi
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
"$PY" -c "import jax; print('devices:', jax.devices())"

echo "## tests (GPU)"
ignore=()
if ! "$PY" -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
    echo "nbclient/nbformat/ipykernel not installed: tests/test_notebooks.py left out"
    ignore=(--ignore=tests/test_notebooks.py)
fi
XLA_PYTHON_CLIENT_PREALLOCATE=false TEST_XLA_CODEGEN=default MPLBACKEND=Agg \
    timeout -k 10 "$TEST_SECONDS" "$PY" -m pytest -n "${PYTEST_WORKERS:-4}" -rfE \
    --durations=15 -p no:cacheprovider "${ignore[@]}" ${PYTEST_ARGS:-} 2>&1 | tee "$LOGS/tests_gpu.log" | tail -60
tests=$?
echo "tests exit code: $tests (124: stopped at $TEST_SECONDS s)"
pkill -f "pytest" 2>/dev/null

echo "## benchmarks (GPU, JAX_DEFAULT_MATMUL_PRECISION=highest): ${SUITES[*]}"
JAX_DEFAULT_MATMUL_PRECISION=highest MPLBACKEND=Agg PYTHONUNBUFFERED=1 \
    timeout -k 10 "$BENCH_SECONDS" "$PY" -m benchmarks "${SUITES[@]}" 2>&1 \
    | tee "$LOGS/bench_gpu.log" | grep -v "^\s*$" | tail -40
bench=$?
echo "benchmarks exit code: $bench (124: stopped at $BENCH_SECONDS s)"
if [ -n "${OUT:-}" ] && [ -f benchmarks/results/report_gpu.md ]; then
    cp benchmarks/results/report_gpu.md "$OUT"/
fi
# Non-zero when the tests or the benchmarks failed (each ran whatever the other did).
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
