"""Every docs snippet as a new user runs it: each ```python block of README.md and
docs/*.md (the blocks ``tests/test_docs.py`` runs) in a fresh Python process with
XLA's default flags and no compilation cache, timed from the interpreter's start to its
exit (imports included). Issue 35's target: under 5 s each.

Run: ``python -m benchmarks docs_snippets`` (part of ``make bench``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 5.0


def _blocks():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_docs
    finally:
        sys.path.pop(0)
    return test_docs, [b for b in test_docs.BLOCKS if not test_docs._skip_reason(b)]


def _env(devices):
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "TEST_XLA_CODEGEN")}
    env["MPLBACKEND"] = "Agg"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def time_block(block, devices):
    """Seconds for ``python -c <block>`` (None if it failed) and the block's label."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", block.code], env=_env(devices),
                         cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return (seconds if run.returncode == 0 else None), f"{block.file}:{block.line}"


def main():
    test_docs, blocks = _blocks()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import jax, jax.numpy, solvers, implicit"],
                   env=_env(None), cwd=ROOT, check=True)
    import_s = time.perf_counter() - start
    print(f"# Docs snippets: a fresh process each, XLA's default flags (target < {TARGET_S:g} s)")
    print(f"\n- `import jax, solvers, implicit` alone: {import_s:.1f} s\n")
    print("| snippet (file:line) | seconds |")
    print("|---|---|")
    over = 0
    for block in blocks:
        seconds, label = time_block(block, test_docs._devices(block))
        if seconds is None:
            print(f"| {label} | FAILED |", flush=True)
            over += 1
            continue
        over += seconds >= TARGET_S
        print(f"| {label} | {seconds:.1f}{' (over)' if seconds >= TARGET_S else ''} |",
              flush=True)
    print(f"\n- {over} of {len(blocks)} snippets at or over {TARGET_S:g} s.")


if __name__ == "__main__":
    main()
