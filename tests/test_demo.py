"""`make demo` (``python -m solvers.demo``): plots written, gradients match finite differences."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from solvers import demo

PLOTS = (
    "convergence.png",
    "gradient_check.png",
    "log1pexp.png",
    "gradient_clipping.png",
    "ode_trajectory.png",
)


def _floats(pattern, text):
    return [float(value) for value in re.findall(pattern, text)]


def test_demo_runs_end_to_end(tmp_path, capsys):
    checks = demo.main(["--output", str(tmp_path / "plots")])
    out = capsys.readouterr().out

    folder = (tmp_path / "plots").resolve()
    assert f"Plots written to {folder}" in out
    for name in PLOTS:
        path = folder / name
        assert path.is_file() and path.stat().st_size > 10_000, f"{name} missing or empty"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # One problem of each kind, each with a value, a gradient, an FD check and a time.
    titles = re.findall(r"^\[(.+?)\]", out, flags=re.MULTILINE)
    assert titles == ["fixed point", "root (Newton)", "bracketed root", "ODE"]
    assert len(checks) == 4
    assert len(_floats(r"loss = (\S+)", out)) == 4
    assert len(re.findall(r"^  gradient ", out, flags=re.MULTILINE)) == 4
    assert len(_floats(r"value_and_grad (\S+) ms compiled", out)) == 4

    # float64 central differences agree with the implicit (and adjoint) gradients.
    fd_errors = _floats(r"FD check\s+relative error (\S+)", out)
    assert len(fd_errors) == 4
    assert max(fd_errors) < 1e-6, out
    assert fd_errors == pytest.approx([check.fd_error for check in checks], rel=0.1)

    # The ODE gradient matches the float64 SciPy reference of DESIGN.md.
    (ode_value,) = _floats(r"\[ODE\].*\n  value\s+loss = (\S+)", out)
    assert ode_value == pytest.approx(demo.LV_REFERENCE_VALUE, rel=1e-8)
    (ode_ref_error,) = _floats(r"SciPy Radau: .* gradient relative error (\S+)", out)
    assert ode_ref_error < 1e-6


def test_output_folder_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv(demo.OUTPUT_ENV, raising=False)
    assert demo._parse([]).output == demo.DEFAULT_OUTPUT
    monkeypatch.setenv(demo.OUTPUT_ENV, "from_env")
    assert demo._parse([]).output == "from_env"
    assert demo._parse(["--output", "from_cli"]).output == "from_cli"


def test_demo_module_has_a_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "solvers.demo", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "--output" in result.stdout
