"""Run every benchmark suite: `python -m benchmarks [suite ...]` (default: all)."""

import importlib
import sys

SUITES = ["fixed_point", "root", "bracket", "ode", "minimize"]


def main(argv):
    chosen = argv or SUITES
    unknown = [s for s in chosen if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; valid: {SUITES}")
    for name in chosen:
        module = importlib.import_module(f"benchmarks.{name}")
        module.main()


if __name__ == "__main__":
    main(sys.argv[1:])
