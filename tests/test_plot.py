"""Tests of implicit.plot: the plotted data, not just that a figure exists."""

import doctest
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")  # headless (conftest also sets MPLBACKEND=Agg)
import matplotlib.pyplot as plt

from implicit import plot
from implicit.rules import log1pexp


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _lines(ax):
    """Labelled lines of an Axes, by label."""
    return {line.get_label(): line for line in ax.get_lines()}


def _marked_x(ax, label=plot.NONFINITE_LABEL):
    line = _lines(ax).get(label)
    return None if line is None else np.asarray(line.get_xdata())


def _naive_x_over_1p_sqrt(x):
    return x / (1 + jnp.sqrt(x))


class Info(NamedTuple):
    converged: object
    num_steps: object
    residual: object
    residual_history: object


def test_importing_implicit_does_not_import_matplotlib():
    code = (
        "import sys, implicit, implicit.rules, implicit.plot; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------------------
# Custom derivative rules
# --------------------------------------------------------------------------------------


def test_function_and_derivative_data_and_nonfinite_marks():
    xs = jnp.array([0.0, 0.25, 1.0, 4.0])
    fig, ax = plot.plot_function_and_derivative(_naive_x_over_1p_sqrt, xs, name="f")
    assert fig is ax.figure
    lines = _lines(ax)
    assert set(lines) == {"f(x)", "f'(x)", plot.NONFINITE_LABEL}
    x = np.asarray(xs, dtype=np.float64)
    np.testing.assert_allclose(lines["f(x)"].get_xdata(), x)
    np.testing.assert_allclose(lines["f(x)"].get_ydata(), x / (1 + np.sqrt(x)), rtol=1e-6)
    d = np.asarray(lines["f'(x)"].get_ydata())
    assert np.isnan(d[0])  # autodiff gives nan at 0: a gap in the line ...
    s = np.sqrt(x[1:])
    np.testing.assert_allclose(d[1:], (s + 2) / (2 * (s + 1) ** 2), rtol=1e-6)
    np.testing.assert_array_equal(_marked_x(ax), [0.0])  # ... and exactly one mark
    # The mark sits at a finite height inside the axes (axes coordinates).
    ymark = lines[plot.NONFINITE_LABEL].get_ydata()
    assert np.all((ymark > 0) & (ymark < 1))
    assert ax.get_legend() is not None and ax.get_title() and ax.get_xlabel()


def test_function_and_derivative_all_finite_has_no_marks_and_draws_into_ax():
    fig, ax = plt.subplots()
    xs = np.linspace(-1.0, 1.0, 5)
    fig2, ax2 = plot.plot_function_and_derivative(jnp.sin, xs, ax=ax, name="sin")
    assert (fig2, ax2) == (fig, ax)
    lines = _lines(ax)
    assert set(lines) == {"sin(x)", "sin'(x)"}
    np.testing.assert_allclose(lines["sin'(x)"].get_ydata(), np.cos(xs), rtol=1e-6)
    assert _marked_x(ax) is None


def test_custom_vs_naive_marks_exactly_the_naive_nans():
    xs = jnp.array([-1000.0, 0.0, 50.0, 100.0, 1000.0], dtype=jnp.float32)
    naive = lambda x: jnp.log(1.0 + jnp.exp(x))
    _, ax = plot.plot_custom_vs_naive(naive, log1pexp, xs, labels=("naive", "rule"))
    lines = _lines(ax)
    assert set(lines) == {"naive", "rule", f"naive: {plot.NONFINITE_LABEL}"}
    np.testing.assert_array_equal(_marked_x(ax, f"naive: {plot.NONFINITE_LABEL}"), [100.0, 1000.0])
    x = np.asarray(xs, np.float64)
    sig = np.exp(-np.logaddexp(0.0, -x))
    np.testing.assert_allclose(lines["rule"].get_ydata(), sig, rtol=1e-6)
    naive_d = np.asarray(lines["naive"].get_ydata())
    assert np.all(np.isnan(naive_d[3:])) and np.all(np.isfinite(naive_d[:3]))
    # Marks take the colour of their line.
    assert lines[f"naive: {plot.NONFINITE_LABEL}"].get_color() == lines["naive"].get_color()
    with pytest.raises(ValueError, match="labels"):
        plot.plot_custom_vs_naive(naive, log1pexp, xs, labels=("one",))


def test_gradient_clipping_data():
    xs = jnp.linspace(0.0, 10.0, 11)
    _, ax = plot.plot_gradient_clipping(jnp.sin, xs, -0.75, 0.75)
    lines = _lines(ax)
    clipped_label = "sin'(x), cotangent clipped to [-0.75, 0.75]"
    assert {"sin(x)", "sin'(x)", clipped_label, "clip bounds"} <= set(lines)
    x = np.asarray(xs, np.float64)
    np.testing.assert_allclose(lines["sin(x)"].get_ydata(), np.sin(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lines["sin'(x)"].get_ydata(), np.cos(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        lines[clipped_label].get_ydata(), np.clip(np.cos(x), -0.75, 0.75), rtol=1e-6, atol=1e-6
    )
    bounds = sorted(line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == ":")
    assert bounds == [-0.75, 0.75]
    assert _marked_x(ax) is None


# --------------------------------------------------------------------------------------
# Convergence
# --------------------------------------------------------------------------------------


def _hist(*values, n=6):
    h = np.full(n, np.nan)
    h[: len(values)] = values
    return h


def test_convergence_dict_of_infos_with_a_batched_one():
    single = Info(np.bool_(True), np.int32(3), 1e-7, _hist(1e-1, 1e-3, 1e-7))
    batched = Info(
        np.array([True, False]),
        np.array([2, 6]),
        np.array([1e-6, 1e-2]),
        np.stack([_hist(1e-2, 1e-6), _hist(2e-1, 1e-1, 1e-1, 5e-2, 3e-2, 1e-2)]),
    )
    _, ax = plot.plot_convergence({"newton": single, "iterate": batched})
    assert ax.get_yscale() == "log"
    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert len(lines) == 2  # one line per method
    newton, iterate = lines
    assert newton.get_label() == "newton (3 steps)"
    assert iterate.get_label() == "iterate (≤6 steps, 1/2 converged)"
    np.testing.assert_array_equal(newton.get_xdata(), [1, 2, 3])  # finite entries only
    np.testing.assert_array_equal(newton.get_ydata(), [1e-1, 1e-3, 1e-7])
    # Batched, batch="max": worst residual among the elements still running.
    np.testing.assert_array_equal(iterate.get_xdata(), [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(iterate.get_ydata(), [2e-1, 1e-1, 1e-1, 5e-2, 3e-2, 1e-2])
    assert ax.get_legend() is not None and ax.get_xlabel() == "step"


def test_convergence_list_with_labels_batch_all_and_tolerance():
    batched = SimpleNamespace(
        converged=np.array([True, True, True]),
        num_steps=np.array([1, 2, 3]),
        residual=np.array([1e-9, 1e-9, 1e-9]),
        residual_history=np.stack([_hist(1e-9), _hist(1e-3, 1e-9), _hist(1, 1e-3, 1e-9)]),
    )
    no_history = {"converged": False, "num_steps": 50, "residual": 0.5}
    _, ax = plot.plot_convergence(
        [batched, no_history], labels=["anderson", "chord"], batch="all", tol=1e-6
    )
    lines = ax.get_lines()
    rows = [line for line in lines if line.get_color() == lines[0].get_color()]
    assert len(rows) == 3  # one line per batch element, one colour, one legend entry
    assert [line.get_label() for line in rows].count("_nolegend_") == 2
    for line, n in zip(rows, (1, 2, 3)):
        np.testing.assert_array_equal(line.get_xdata(), np.arange(1, n + 1))
    labelled = {line.get_label(): line for line in lines}
    chord = labelled["chord (50 steps, not converged)"]
    np.testing.assert_array_equal(chord.get_xdata(), [50])
    np.testing.assert_array_equal(chord.get_ydata(), [0.5])
    np.testing.assert_array_equal(labelled["tolerance"].get_ydata(), [1e-6, 1e-6])
    legend_texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend_texts == [
        "anderson (≤3 steps, 3/3 converged)",
        "chord (50 steps, not converged)",
        "tolerance",
    ]


def test_convergence_single_info_default_labels_and_errors():
    info = Info(True, 2, 1e-8, _hist(1e-4, 1e-8))
    _, ax = plot.plot_convergence(info)
    assert [line.get_label() for line in ax.get_lines()] == ["method 1 (2 steps)"]
    with pytest.raises(ValueError, match="labels"):
        plot.plot_convergence([info, info], labels=["one"])
    with pytest.raises(ValueError, match="batch"):
        plot.plot_convergence([info], batch="mean")


# --------------------------------------------------------------------------------------
# Gradient checks
# --------------------------------------------------------------------------------------


def test_gradient_error():
    assert plot.gradient_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    np.testing.assert_allclose(
        plot.gradient_error({"a": 3.0, "b": 4.0}, {"a": 0.0, "b": 0.0}), 5.0
    )  # zero reference: absolute
    np.testing.assert_allclose(
        plot.gradient_error(np.array([1.0, 1.0]), np.array([0.0, 2.0]), relative=True),
        np.sqrt(2.0) / 2.0,
    )
    with pytest.raises(ValueError, match="entries"):
        plot.gradient_error([1.0], [1.0, 2.0])


def test_finite_difference_errors_match_the_truncation_error(x64):
    x0 = 0.7
    steps = [1e-1, 1e-2, 1e-3]
    central = plot.finite_difference_errors(jnp.sin, x0, np.cos(x0), steps)
    forward = plot.finite_difference_errors(jnp.sin, x0, np.cos(x0), steps, method="forward")
    h = np.asarray(steps)
    # Central: (sin(x+h) - sin(x-h)) / 2h = cos(x) sin(h)/h, relative error 1 - sin(h)/h.
    np.testing.assert_allclose(central, 1 - np.sin(h) / h, rtol=1e-5)
    exact_forward = (np.sin(x0 + h) - np.sin(x0)) / h
    np.testing.assert_allclose(forward, np.abs(exact_forward - np.cos(x0)) / np.cos(x0), rtol=1e-5)
    assert np.all(np.diff(central) < 0) and np.all(central < forward)


def test_finite_difference_errors_pytree_and_direction(x64):
    def fun(p):
        return jnp.sum(p["w"] ** 2) * p["b"]

    p = {"w": np.array([1.0, -2.0]), "b": np.float64(3.0)}
    g = {"w": 2 * p["w"] * p["b"], "b": np.sum(p["w"] ** 2)}  # the exact gradient
    errs = plot.finite_difference_errors(fun, p, g, [1e-3, 1e-5])
    # A wrong reference gradient shows up as a large error.
    wrong = {"w": g["w"] + 1.0, "b": g["b"]}
    bad = plot.finite_difference_errors(fun, p, wrong, [1e-5])
    d = {"w": np.array([0.0, 1.0]), "b": np.float64(0.0)}
    derr = plot.finite_difference_errors(fun, p, g, [1e-4], direction=d)
    with pytest.raises(ValueError, match="method"):
        plot.finite_difference_errors(fun, p, g, [1e-3], method="backward")
    with pytest.raises(ValueError, match="positive"):
        plot.finite_difference_errors(fun, p, g, [0.0])
    with pytest.raises(ValueError, match="reference_grad"):
        plot.finite_difference_errors(fun, p, [1.0], [1e-3])
    assert np.all(errs < 1e-8)  # fun is quadratic in w, linear in b: central FD is exact
    assert bad[0] > 0.1
    assert derr.shape == (1,) and derr[0] < 1e-8


def test_gradient_check_two_panels_data_and_scales():
    steps = np.array([1e-1, 1e-3, 1e-5, 1e-7])
    fd_errors = np.array([1e-3, 1e-7, 0.0, np.nan])  # 0 and nan cannot be drawn
    iters = np.array([1, 2, 4, 8])
    unrolled = np.array([0.5, 0.1, 1e-3, 1e-6])
    fig, axes = plot.plot_gradient_check(
        steps,
        fd_errors,
        unrolled_iters=iters,
        unrolled_errors=unrolled,
        implicit_error=1e-12,
        title="check",
    )
    assert len(axes) == 2 and all(a.figure is fig for a in axes)
    fd_ax, un_ax = axes
    assert (fd_ax.get_xscale(), fd_ax.get_yscale()) == ("log", "log")
    assert (un_ax.get_xscale(), un_ax.get_yscale()) == ("linear", "log")
    fd_line = _lines(fd_ax)["finite differences"]
    np.testing.assert_array_equal(fd_line.get_xdata(), [1e-1, 1e-3])
    np.testing.assert_array_equal(fd_line.get_ydata(), [1e-3, 1e-7])
    un_line = _lines(un_ax)["unrolled autodiff"]
    np.testing.assert_array_equal(un_line.get_xdata(), iters)
    np.testing.assert_array_equal(un_line.get_ydata(), unrolled)
    for a in axes:
        np.testing.assert_array_equal(
            _lines(a)["implicit (IFT) gradient"].get_ydata(), [1e-12, 1e-12]
        )
        assert a.get_legend() is not None and a.get_title() and a.get_ylabel()


def test_gradient_check_one_panel_into_given_ax_and_errors():
    fig, ax = plt.subplots()
    fig2, axes = plot.plot_gradient_check(
        unrolled_iters=[1, 2], unrolled_errors=[1e-1, 1e-2], implicit_error=0.0, ax=ax
    )
    assert fig2 is fig and axes == (ax,)
    assert "implicit (IFT) gradient" not in _lines(ax)  # error 0: written as text
    assert any("implicit" in t.get_text() for t in ax.texts)
    with pytest.raises(ValueError, match="Nothing to plot"):
        plot.plot_gradient_check()
    with pytest.raises(ValueError, match="fd_errors"):
        plot.plot_gradient_check([1e-3])
    with pytest.raises(ValueError, match="Axes"):
        plot.plot_gradient_check([1e-3], [1e-6], unrolled_iters=[1], unrolled_errors=[1.0], ax=ax)


def test_docstring_examples_run():
    tests = [t for t in doctest.DocTestFinder().find(plot) if t.examples]
    names = {t.name.rsplit(".", 1)[-1] for t in tests}
    assert set(plot.__all__) <= names
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    with jax.enable_x64(False):
        for t in tests:
            runner.run(t)
    assert runner.summarize(verbose=False).failed == 0
