"""Make the executed notebook copies the documentation site renders, where they are stale.

Run by ``make docs`` (and ``make docs-check``) before ``mkdocs build``. The site shows
each notebook of ``notebooks/`` from the executed copy that ``tests/test_notebooks.py``
saves under ``build/notebooks/`` (``tools/mkdocs_hooks.py``). After ``make test`` every
copy is up to date and this script does nothing; on a clean clone, or after a notebook
was edited, it runs the notebook test of just the stale notebooks (which executes them,
checks them and saves the copies), so the site always has outputs and figures.

Usage: ``python tools/execute_notebooks.py [-n WORKERS]``. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from mkdocs_hooks import SOURCE_DIR, notebook_to_render  # noqa: E402


def stale_notebooks() -> list[Path]:
    """The notebooks without an executed copy made from their current source."""
    return [p for p in sorted(SOURCE_DIR.glob("*.ipynb")) if not notebook_to_render(p)[1]]


def execute(stale: list[Path], workers: int) -> int:
    node_ids = [f"tests/test_notebooks.py::test_notebook_executes[{p.stem}]" for p in stale]
    print(f"notebooks: executing {[p.name for p in stale]} for the site's outputs", flush=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    workers = min(workers, len(stale))
    command += ["-n", str(workers)] if workers > 1 else ["-n", "0"]
    return subprocess.run(
        command + node_ids, cwd=ROOT, env=dict(os.environ, MPLBACKEND="Agg")
    ).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--workers", type=int, default=2,
                        help="pytest-xdist workers (default 2)")
    args = parser.parse_args(argv)
    stale = stale_notebooks()
    if not stale:
        print("notebooks: executed copies in build/notebooks are up to date")
        return 0
    return execute(stale, args.workers)


if __name__ == "__main__":
    sys.exit(main())
