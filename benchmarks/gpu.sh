#!/usr/bin/env bash
# One call on a lent GPU machine (JAX with CUDA preinstalled, no package registry):
#   bash benchmarks/gpu.sh [SECONDS_FOR_THE_TESTS]
# 1. installs this checkout (and the peers' wheels, if a session carried them in .whl/:
#    `pip download -d .whl jaxopt optimistix lineax diffrax equinox` on a machine with a
#    registry; .whl/ is ignored by git and named in the device tool's `carry`),
# 2. runs the test suite on the GPU (XLA's default code generation: conftest.py's cheaper
#    CPU flags are for CPU CI), 4 workers,
# 3. runs the benchmarks with full float32 matmuls, writing benchmarks/results/report_gpu.md
#    (copied to $OUT when the device tool provides it, for docs/results/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
TEST_SECONDS="${1:-300}"
PY="${PYTHON:-python}"

if [ -d .whl ]; then
    "$PY" -m pip install --quiet --no-index --find-links .whl --no-deps .whl/*.whl
fi
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
"$PY" -c "import jax; print('devices:', jax.devices())"

echo "## tests (GPU)"
TEST_XLA_CODEGEN=default MPLBACKEND=Agg timeout "$TEST_SECONDS" \
    "$PY" -m pytest -q -n 4 --durations=10 -p no:cacheprovider
tests=$?
echo "tests exit code: $tests"

echo "## benchmarks (GPU, JAX_DEFAULT_MATMUL_PRECISION=highest)"
JAX_DEFAULT_MATMUL_PRECISION=highest MPLBACKEND=Agg "$PY" -m benchmarks
bench=$?
if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/report_*.md "$OUT"/
fi
# Non-zero when the tests or the benchmarks failed (each ran whatever the other did).
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
