"""pytest plugin: per test, the seconds JAX spends tracing, lowering and XLA-compiling.

Where the suite's time goes (compilation, not running, on CPU)::

    PYTHONPATH=tools .venv/bin/python -m pytest -n 2 -q -p compile_profile
    .venv/bin/python tools/compile_profile.py            # the summary, per file and test

Each worker writes ``{test: {event: seconds, "n_" + event: count, "wall": seconds}}`` to
``$PROF_OUT/<pid>.json`` (default ``build/compile_profile``) from ``jax.monitoring``'s
duration events (``jaxpr_trace_duration``, ``jaxpr_to_mlir_module_duration``,
``backend_compile_duration``). Subprocesses (tests/test_sharding.py, the notebooks,
tests/test_ode_x64.py) are counted in ``wall`` only.
"""

import collections
import glob
import json
import os
import sys
import time

OUT = os.environ.get("PROF_OUT", os.path.join("build", "compile_profile"))
EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")

if "pytest" in sys.modules:  # loaded as a plugin
    import jax
    import pytest

    _current = ["<collection>"]
    _seconds = collections.defaultdict(lambda: collections.defaultdict(float))

    def _listener(event, duration, **kwargs):
        name = event.rsplit("/", 1)[-1]
        _seconds[_current[0]][name] += duration
        _seconds[_current[0]]["n_" + name] += 1

    jax.monitoring.register_event_duration_secs_listener(_listener)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _current[0] = item.nodeid
        start = time.perf_counter()
        yield
        _seconds[item.nodeid]["wall"] += time.perf_counter() - start

    def pytest_unconfigure(config):
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, f"{os.getpid()}.json"), "w") as f:
            json.dump({test: dict(v) for test, v in _seconds.items()}, f)


def summary(out=OUT, top=25):
    tests = {}
    for path in glob.glob(os.path.join(out, "*.json")):
        with open(path) as f:
            tests.update(json.load(f))
    files = collections.defaultdict(lambda: collections.defaultdict(float))
    for test, v in tests.items():
        for key, seconds in v.items():
            files[test.split("::")[0]][key] += seconds
    total = {key: sum(v.get(key, 0.0) for v in tests.values()) for key in ("wall", *EVENTS)}
    print("seconds summed over workers: " + ", ".join(f"{k} {v:.0f}" for k, v in total.items()))
    print(f"{'file':44s} {'wall':>7s} {'trace':>7s} {'lower':>7s} {'xla':>7s} {'programs':>8s}")
    for name, v in sorted(files.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        print(f"{name:44s} {v['wall']:7.1f} {v[EVENTS[0]]:7.1f} {v[EVENTS[1]]:7.1f} "
              f"{v[EVENTS[2]]:7.1f} {int(v['n_' + EVENTS[2]]):8d}")
    print()
    for name, v in sorted(tests.items(), key=lambda kv: -kv[1].get("wall", 0.0))[:top]:
        print(f"{v.get('wall', 0.0):7.1f} {name}")


if __name__ == "__main__":
    summary()
