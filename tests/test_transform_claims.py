"""The transformations table of the docs claims only what the test suite checks.

``tests/transform_claims.py`` states, once, which JAX transformations each solver
supports (and with which option); ``docs/transforms.md`` shows it as a table. This reads
the test files (no test is run: it takes milliseconds) and requires, for every claimed
cell, a test that

- is marked ``@pytest.mark.transforms(row, transform, ..., option=...)`` with that row,
  transformation and option,
- runs in CI (neither it nor its module is marked ``slow``; a parametrization whose
  every case is slow does not count, one fast case does),
- and whose source applies the transformation (``jax.hessian(`` for ``"hessian"``),
  names one of the row's functions (in the test or in its module: a helper may make the
  call) and, for an option, contains its value (``"jvp"`` for ``rule="jvp"``).

Marks that claim what the table does not (a row, transformation or option it lacks) fail
too, so that the table and the marks are kept in step.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import transform_claims
from transform_claims import CLAIMS, DEFAULT, TRANSFORMS

ROOT = Path(__file__).resolve().parents[1]


def _marks(node, name):
    """The ``pytest.mark.<name>(...)`` calls decorating ``node``."""
    return [d for d in node.decorator_list
            if ast.unparse(d.func if isinstance(d, ast.Call) else d)
            in (f"pytest.mark.{name}", f"mark.{name}")]


def _mark(node, name):
    """The first ``pytest.mark.<name>(...)`` decorating ``node``, or None."""
    return next(iter(_marks(node, name)), None)


def _all_slow(node, source, module_slow):
    """Whether every case of the test is ``slow`` (then CI does not run it)."""
    if module_slow or _mark(node, "slow") is not None or "@SLOW" in source.split("def ")[0]:
        return True
    param = _mark(node, "parametrize")
    if param is None or len(param.args) < 2:
        return False
    cases = param.args[1]
    if not isinstance(cases, (ast.List, ast.Tuple)):
        return False
    return all("slow" in ast.unparse(case).lower() for case in cases.elts)


def marked_tests():
    """``(file:name, row, transforms, option, source, module source, all slow)`` for
    every test marked ``@pytest.mark.transforms``."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        module = path.read_text(encoding="utf-8")
        if "mark.transforms(" not in module:
            continue
        tree = ast.parse(module)
        module_slow = bool(re.search(r"^pytestmark\s*=.*slow", module, flags=re.M))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            marks = _marks(node, "transforms")
            if not marks:  # (get_source_segment splits the module each call: marked only)
                continue
            source = ast.get_source_segment(module, node)
            decorators = "\n".join(ast.get_source_segment(module, d) for d in node.decorator_list)
            for mark in marks:
                row, *transforms = [ast.literal_eval(arg) for arg in mark.args]
                option = next((ast.literal_eval(k.value) for k in mark.keywords
                               if k.arg == "option"), DEFAULT)
                found.append((f"{path.name}::{node.name}", row, transforms, option,
                              decorators + "\n" + source, module,
                              _all_slow(node, decorators + "\n" + source, module_slow)))
    return found


MARKED = marked_tests()
CELLS = [(row, transform, option) for row, cells in CLAIMS.items()
         for transform, option in cells.items()]


def _value(option):
    """``rule="jvp"`` -> ``jvp``: the text a test of that option must contain."""
    return option.split("=", 1)[1].strip("\"'") if option else None


@pytest.mark.parametrize("row, transform, option", CELLS,
                         ids=[f"{r}|{t}" for r, t, _ in CELLS])
def test_every_claim_is_checked_by_a_test(row, transform, option):
    shown = f"{option} " if option else ""
    backing = [m for m in MARKED if m[1] == row and transform in m[2] and m[3] == option]
    assert backing, (
        f"docs/transforms.md claims {row} works under {transform} {shown}but no test is "
        f"marked @pytest.mark.transforms({row!r}, {transform!r}"
        + (f", option={option!r}" if option else "") + ")"
    )
    fast = [m for m in backing if not m[6]]
    assert fast, f"{row} / {transform}: only slow tests back it ({[m[0] for m in backing]})"
    calls = TRANSFORMS[transform]
    names = transform_claims.names(row)
    checked = [
        m[0] for m in fast
        if any(call in m[4] for call in calls)
        and any(re.search(rf"\b{name}\b", m[4]) or re.search(rf"\b{name}\b", m[5])
                for name in names)
        and (not option or re.search(rf"""['"]{re.escape(_value(option))}['"]""", m[4]))
    ]
    assert checked, (
        f"{row} / {transform} {shown}: the marked tests {[m[0] for m in fast]} do not "
        f"call {' or '.join(calls)} on {names}" + (f" with {option}" if option else "")
    )


def test_marks_claim_nothing_the_table_lacks():
    extra = [
        (m[0], m[1], t, m[3]) for m in MARKED for t in m[2]
        if CLAIMS.get(m[1], {}).get(t) != m[3] or t not in TRANSFORMS
    ]
    assert not extra, (
        f"marked tests claim what tests/transform_claims.py does not: {extra} "
        f"(add the claim there, or correct the mark)"
    )


def test_table_shows_every_claim():
    table = transform_claims.render().splitlines()
    assert len(table) == 2 + len(CLAIMS)
    for line, (row, cells) in zip(table[2:], CLAIMS.items()):
        assert line.count("|") == 4
        for transform, option in cells.items():
            assert all(f"`{t.strip()}`" in line for t in transform.split(","))
            assert not option or f"`{option}`" in line


def test_the_docs_show_the_table_once():
    pages = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").rglob("*.md"))
             if "<!-- transforms-table -->" in p.read_text(encoding="utf-8")]
    assert pages == ["docs/transforms.md"]
