"""Every ```python block of README.md and docs/*.md runs as written, on its own.

Each block is executed in a fresh namespace: it may rely only on its own imports and
definitions, never on an earlier block. An HTML comment on the line before a block's
fence changes how it runs:

- ``<!-- docs-test: devices=8 -->``: in a subprocess with 8 simulated CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``);
- ``<!-- docs-test: skip REASON -->``: not run (e.g. it needs several processes). Every
  skip must be listed in ``EXPECTED_SKIPS`` below, so none creeps in unnoticed.

The API reference (``docs/api/*.md``, rendered by mkdocstrings) must name every public
name of ``implicit`` and ``solvers`` (their ``__all__``): ``test_api_reference_is_complete``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SUBPROCESS_TIMEOUT_S = 300

#: (file, reason) of every block marked ``<!-- docs-test: skip reason -->``.
EXPECTED_SKIPS = {
    ("docs/scaling.md", "multi-process: needs a coordinator and two processes"),
}

_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(?P<what>.*?)\s*-->$")


class Block(NamedTuple):
    file: str  # relative to the repository root
    line: int  # 1-based line of the first code line
    index: int  # the block's position among the file's python blocks
    code: str
    directive: str | None


def collect(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, with the directive before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT).as_posix()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```+\s*python\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        indent = len(fence.group(1))
        previous = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        match = _DIRECTIVE.match(previous)
        start, i = i + 1, i + 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            i += 1
        code = "\n".join(ln[indent:] for ln in lines[start:i]) + "\n"
        blocks.append(Block(rel, start + 1, len(blocks), code, match and match["what"]))
        i += 1
    return blocks


BLOCKS = [block for path in DOC_FILES for block in collect(path)]


def _skip_reason(block):
    if block.directive and block.directive.startswith("skip"):
        return block.directive[len("skip"):].strip() or "no reason given"
    return None


def _devices(block):
    match = re.fullmatch(r"devices=(\d+)", block.directive or "")
    return int(match.group(1)) if match else None


def test_blocks_are_found():
    files = {block.file for block in BLOCKS}
    assert {"README.md", "docs/engine.md", "docs/root.md", "docs/scaling.md"} <= files
    for block in BLOCKS:
        directive = block.directive
        assert directive is None or _skip_reason(block) or _devices(block), (
            f"{block.file}:{block.line}: unknown docs-test directive {directive!r}"
        )


def test_skips_are_the_listed_ones():
    skips = {(block.file, _skip_reason(block)) for block in BLOCKS if _skip_reason(block)}
    assert skips == EXPECTED_SKIPS


@pytest.mark.parametrize(
    "block", BLOCKS, ids=[f"{block.file}:{block.index}" for block in BLOCKS]
)
def test_block_runs(block):
    reason = _skip_reason(block)
    if reason:
        pytest.skip(f"{block.file}:{block.line}: {reason}")
    # Line numbers in tracebacks are those of the markdown file.
    source = "\n" * (block.line - 1) + block.code
    devices = _devices(block)
    if devices is not None:
        env = dict(
            os.environ,
            # (and XLA's CPU collectives' rendezvous timeout raised from 40 s for a loaded
            # CI machine: see tests/test_sharding.py's SLOW_HOST_FLAGS)
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "  # (the suite's: conftest.py)
                      f"--xla_force_host_platform_device_count={devices} "
                      "--xla_cpu_collective_call_terminate_timeout_seconds=600",
            JAX_PLATFORMS="cpu",
            MPLBACKEND="Agg",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        run = subprocess.run(
            [sys.executable, "-c", source],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert run.returncode == 0, f"{block.file}:{block.line} failed:\n{run.stderr[-4000:]}"
        return
    code = compile(source, str(ROOT / block.file), "exec")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__docs_test__"})


# --------------------------------------------------------------------------------------
# The API reference lists every public name.
# --------------------------------------------------------------------------------------


def _documented():
    """Names that docs/api/*.md render: each ``::: target`` and each ``heading:``."""
    names = set()
    for path in (ROOT / "docs" / "api").glob("*.md"):
        text = path.read_text(encoding="utf-8")
        names |= set(re.findall(r"^:::\s*([\w.]+)", text, flags=re.M))
        names |= set(re.findall(r"heading:\s*([\w.]+)", text))
    return names


def _resolve(dotted):
    """The object a dotted name documented in docs/api names (None if not importable)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


@pytest.mark.parametrize("package", ["implicit", "solvers", "solvers.ode"])
def test_api_reference_is_complete(package):
    module = importlib.import_module(package)
    documented = _documented()
    # A name that is another documented name's object (solvers.ode.odeint is
    # solvers.odeint) is documented once, under the other name.
    documented_objects = [_resolve(name) for name in documented]
    missing = [
        name
        for name in module.__all__
        if f"{package}.{name}" not in documented
        and not any(getattr(module, name) is obj for obj in documented_objects)
    ]
    assert not missing, (
        f"docs/api: add a line '::: {package}.NAME' for each of {missing} "
        f"(names in {package}.__all__)"
    )


def test_citation_version_is_the_package_version():
    """CITATION.cff and the home page's BibTeX entry cite the version in pyproject.toml."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    citation = (ROOT / "CITATION.cff").read_text(encoding="utf-8")
    assert re.search(rf'^version: "{re.escape(version)}"$', citation, flags=re.M), (
        f"CITATION.cff: set version to {version!r} (pyproject.toml)"
    )
    home = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert re.search(rf"version = \{{{re.escape(version)}\}}", home), (
        f"docs/index.md's Citing entry: set version to {{{version}}} (pyproject.toml)"
    )


#: The longest code line a page may show: wider blocks scroll sideways on a phone
#: (measured in the browser review at 390 px) and hide the end of the line.
CODE_LINE_LIMIT = 88


def test_code_lines_fit_a_phone():
    long = []
    for path in DOC_FILES:
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside and len(line) > CODE_LINE_LIMIT:
                long.append(f"{path.relative_to(ROOT)}:{number} ({len(line)} characters)")
    assert not long, "\n".join(long)
