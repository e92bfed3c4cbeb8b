"""Plotting utilities: derivatives, custom rules, solver convergence and gradient checks.

matplotlib is imported inside the functions, so ``import implicit`` never imports it.
Every function draws into ``ax`` when given one, and otherwise creates a new figure
with ``matplotlib.pyplot.subplots`` (so it shows inline in notebooks); it returns
``(fig, ax)`` and never calls ``show``. Headless use works with whatever backend
matplotlib picks (Agg when there is no display); close figures you no longer need
with ``matplotlib.pyplot.close(fig)``.

Non-finite derivative values are drawn as gaps in their line and marked by ``x``
markers placed just above the bottom edge of the axes (x in data coordinates, y in
axes coordinates), with a legend entry saying "non-finite derivative".

:func:`finite_difference_errors` and :func:`gradient_error` compute the numbers that
:func:`plot_gradient_check` draws; they need no matplotlib.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

__all__ = [
    "finite_difference_errors",
    "gradient_error",
    "plot_convergence",
    "plot_custom_vs_naive",
    "plot_function_and_derivative",
    "plot_gradient_check",
    "plot_gradient_clipping",
]

NONFINITE_LABEL = "non-finite derivative"
_MARK_Y = 0.03  # height of the non-finite markers, as a fraction of the axes height
_FIGSIZE = (6.4, 4.2)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _new_axes(ax, figsize=_FIGSIZE):
    """Return ``(fig, ax)``: ``ax``'s figure, or a new figure with one Axes."""
    if ax is not None:
        return ax.figure, ax
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    return fig, ax


def _xs_array(xs):
    xs = jnp.asarray(xs)
    if xs.ndim != 1:
        raise ValueError(f"`xs` must be a 1-D array of points, got shape {xs.shape}.")
    if not jnp.issubdtype(xs.dtype, jnp.floating):
        xs = xs.astype(jnp.result_type(float))
    return xs


def _name(fn, default="f"):
    name = getattr(fn, "__name__", default)
    return default if not name.isidentifier() else name


def _derivative(fn, xs):
    """``fn`` and its derivative at each point of the 1-D array ``xs`` (NumPy arrays)."""
    # One compiled program: much faster than op-by-op dispatch for a handful of points.
    ys, dys = jax.jit(lambda t: (jax.vmap(fn)(t), jax.vmap(jax.grad(fn))(t)))(xs)
    return np.asarray(ys), np.asarray(dys)


def _finite_or_nan(values):
    values = np.asarray(values, dtype=float)
    return np.where(np.isfinite(values), values, np.nan)


def _mark_nonfinite(ax, xs, values, *, color="red", label=NONFINITE_LABEL, y=_MARK_Y):
    """Mark with ``x`` the points of ``xs`` where ``values`` is not finite.

    Returns the marker line, or ``None`` when every value is finite.
    """
    bad = ~np.isfinite(np.asarray(values))
    if not bad.any():
        return None
    xb = np.asarray(xs)[bad]
    (line,) = ax.plot(
        xb,
        np.full(xb.shape, y),
        linestyle="none",
        marker="x",
        markersize=7,
        color=color,
        label=label,
        transform=ax.get_xaxis_transform(),  # x: data, y: axes fraction
        clip_on=False,
        zorder=5,
    )
    return line


# --------------------------------------------------------------------------------------
# Custom derivative rules
# --------------------------------------------------------------------------------------


def plot_function_and_derivative(
    fn: Callable, xs, ax=None, *, name: str | None = None, title: str | None = None
):
    """Plot a scalar function and its autodiff derivative, marking non-finite derivatives.

    Draws ``fn(x)`` and ``fn'(x) = jax.vmap(jax.grad(fn))(xs)`` over the points ``xs``;
    where the derivative is ``nan`` or ``inf`` its line has a gap and a red ``x``
    marks the point (legend entry "non-finite derivative").

    Args:
      fn: scalar function ``fn(x) -> y`` of one scalar.
      xs: 1-D array of points.
      ax: Axes to draw into; a new figure when ``None``.
      name: name used in the legend (default: ``fn.__name__``, or ``"f"``).
      title: axes title (default: ``"<name> and its derivative"``).

    Returns:
      ``(fig, ax)``. The lines are labelled ``"<name>(x)"``, ``"<name>'(x)"`` and, if
      any, ``"non-finite derivative"``; the derivative line holds ``nan`` where the
      derivative is not finite.

    Example:
      >>> import jax.numpy as jnp
      >>> from implicit import plot
      >>> fig, ax = plot.plot_function_and_derivative(jnp.sqrt, jnp.linspace(0.0, 4.0, 9))
      >>> [line.get_label() for line in ax.get_lines()]
      ['sqrt(x)', "sqrt'(x)", 'non-finite derivative']
    """
    xs = _xs_array(xs)
    name = name or _name(fn)
    ys, dys = _derivative(fn, xs)
    fig, ax = _new_axes(ax)
    x = np.asarray(xs)
    ax.plot(x, _finite_or_nan(ys), label=f"{name}(x)")
    ax.plot(x, _finite_or_nan(dys), label=f"{name}'(x)")
    _mark_nonfinite(ax, x, dys)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("x")
    ax.set_ylabel("value")
    ax.set_title(title if title is not None else f"{name} and its derivative")
    ax.legend()
    return fig, ax


def plot_custom_vs_naive(
    naive_fn: Callable,
    custom_fn: Callable,
    xs,
    ax=None,
    *,
    labels: Sequence[str] = ("naive autodiff", "custom rule"),
    title: str | None = None,
):
    """Plot the derivatives of a naive implementation and of a custom rule on one axes.

    The ``log1pexp`` story: ``d/dx log(1 + e^x) = sigmoid(x)``, but autodiff of
    ``jnp.log(1. + jnp.exp(x))`` gives ``nan`` once ``e^x`` overflows (x > 88 in
    float32) while the custom rule stays finite. Both derivatives are computed with
    ``jax.vmap(jax.grad(fn))(xs)``; the non-finite points of each are marked with
    ``x`` markers in the colour of its line (two rows just above the bottom edge).

    Args:
      naive_fn: scalar function differentiated by plain autodiff.
      custom_fn: the same function with a custom derivative rule.
      xs: 1-D array of points.
      ax: Axes to draw into; a new figure when ``None``.
      labels: legend names of ``(naive_fn, custom_fn)``.
      title: axes title.

    Returns:
      ``(fig, ax)``. Derivative lines are labelled ``labels[i]``, the markers
      ``"<labels[i]>: non-finite derivative"``.

    Example:
      >>> import jax.numpy as jnp
      >>> from implicit import plot
      >>> from implicit.rules import log1pexp
      >>> naive = lambda x: jnp.log(1.0 + jnp.exp(x))
      >>> xs = jnp.array([0.0, 50.0, 100.0])
      >>> fig, ax = plot.plot_custom_vs_naive(naive, log1pexp, xs)
      >>> [line.get_label() for line in ax.get_lines()]
      ['naive autodiff', 'naive autodiff: non-finite derivative', 'custom rule']
    """
    if len(labels) != 2:
        raise ValueError(f"`labels` must hold two names (naive, custom), got {labels!r}.")
    xs = _xs_array(xs)
    x = np.asarray(xs)
    fig, ax = _new_axes(ax)
    styles = (
        {"linestyle": "-", "linewidth": 2.5, "alpha": 0.7},
        {"linestyle": "--", "linewidth": 1.5},
    )
    for i, (fn, label, style) in enumerate(zip((naive_fn, custom_fn), labels, styles)):
        _, dys = _derivative(fn, xs)
        (line,) = ax.plot(x, _finite_or_nan(dys), label=label, **style)
        _mark_nonfinite(
            ax,
            x,
            dys,
            color=line.get_color(),
            label=f"{label}: {NONFINITE_LABEL}",
            y=_MARK_Y + 0.05 * i,
        )
    ax.set_xlabel("x")
    ax.set_ylabel("derivative")
    ax.set_title(title if title is not None else "Derivative: naive autodiff vs custom rule")
    ax.legend()
    return fig, ax


def plot_gradient_clipping(
    fn: Callable, xs, lo, hi, ax=None, *, name: str | None = None, title: str | None = None
):
    """Plot a function, its derivative, and its derivative with the cotangent clipped.

    The notebook's ``sin`` vs ``clip_sin``: with ``clip_fn(x) = fn(clip_gradient(x,
    lo, hi))`` the value is unchanged and the reverse-mode derivative becomes
    ``clip(fn'(x), lo, hi)``. Dotted grey lines show scalar bounds.

    Args:
      fn: scalar function of one scalar.
      xs: 1-D array of points.
      lo, hi: cotangent bounds passed to :func:`implicit.rules.clip_gradient`.
      ax: Axes to draw into; a new figure when ``None``.
      name: name used in the legend (default: ``fn.__name__``, or ``"f"``).
      title: axes title.

    Returns:
      ``(fig, ax)`` with lines labelled ``"<name>(x)"``, ``"<name>'(x)"``,
      ``"<name>'(x), cotangent clipped to [lo, hi]"`` and ``"clip bounds"``.

    Example:
      >>> import jax.numpy as jnp
      >>> from implicit import plot
      >>> fig, ax = plot.plot_gradient_clipping(jnp.sin, jnp.linspace(0, 10, 50), -0.75, 0.75)
      >>> [line.get_label() for line in ax.get_lines()][:3]
      ['sin(x)', "sin'(x)", "sin'(x), cotangent clipped to [-0.75, 0.75]"]
    """
    from implicit.rules import clip_gradient

    xs = _xs_array(xs)
    x = np.asarray(xs)
    name = name or _name(fn)
    ys, dys = _derivative(fn, xs)
    _, clipped = _derivative(lambda t: fn(clip_gradient(t, lo, hi)), xs)
    fig, ax = _new_axes(ax)
    ax.plot(x, _finite_or_nan(ys), label=f"{name}(x)")
    ax.plot(x, _finite_or_nan(dys), label=f"{name}'(x)", alpha=0.6)
    ax.plot(
        x,
        _finite_or_nan(clipped),
        label=f"{name}'(x), cotangent clipped to [{_fmt(lo)}, {_fmt(hi)}]",
        linestyle="--",
        linewidth=2,
    )
    label = "clip bounds"
    for bound in (lo, hi):
        if bound is not None and np.ndim(bound) == 0:  # scalar bounds only
            ax.axhline(float(bound), color="0.5", linestyle=":", linewidth=1, label=label)
            label = "_nolegend_"
    _mark_nonfinite(ax, x, clipped)
    ax.set_xlabel("x")
    ax.set_ylabel("value")
    ax.set_title(title if title is not None else f"Gradient clipping of {name}")
    ax.legend()
    return fig, ax


def _fmt(v):
    if v is None:
        return "None"
    try:
        return f"{float(v):g}"
    except TypeError:  # an array bound
        return "array"


# --------------------------------------------------------------------------------------
# Solver convergence
# --------------------------------------------------------------------------------------


def _field(info, name, default=None):
    if isinstance(info, Mapping):
        return info.get(name, default)
    return getattr(info, name, default)


def _as_labelled(infos, labels):
    if isinstance(infos, Mapping) and "residual" not in infos:  # {label: info}
        if labels is not None:
            raise ValueError("Pass `labels` only with a list of infos, not with a dict.")
        return list(infos.items())
    if _field(infos, "residual") is not None:  # a single info record
        infos = [infos]
    infos = list(infos)
    if labels is None:
        labels = [f"method {i + 1}" for i in range(len(infos))]
    labels = list(labels)
    if len(labels) != len(infos):
        raise ValueError(f"Got {len(infos)} infos but {len(labels)} labels.")
    return list(zip(labels, infos))


def _history_curve(info, batch):
    """The ``(steps, residuals)`` rows to draw for one info (list of pairs)."""
    history = _field(info, "residual_history")
    if history is None:  # only the final residual: one point at the last step
        res = np.atleast_1d(np.asarray(_field(info, "residual"), dtype=float))
        steps = np.atleast_1d(np.asarray(_field(info, "num_steps", 0))) * np.ones_like(res)
        rows = [(np.array([s]), np.array([r])) for s, r in zip(steps, res)]
        if batch == "max" and len(rows) > 1:
            k = int(np.nanargmax(res))
            rows = [rows[k]]
    else:
        history = np.asarray(history, dtype=float)
        if history.ndim == 1:
            history = history[None]
        elif history.ndim > 2:
            history = history.reshape(-1, history.shape[-1])
        if batch == "max" and history.shape[0] > 1:
            finite = np.isfinite(history)
            worst = np.where(finite, history, -np.inf).max(axis=0)
            history = np.where(finite.any(axis=0), worst, np.nan)[None]
        k = np.arange(1, history.shape[-1] + 1)
        rows = [(k, h) for h in history]
    out = []
    for s, r in rows:
        keep = np.isfinite(r) & (r > 0)  # a log axis shows positive finite values only
        out.append((s[keep], r[keep]))
    return out


def _summary(info):
    converged = np.asarray(_field(info, "converged", True))
    num_steps = np.asarray(_field(info, "num_steps", 0))
    if converged.size == 1:
        status = "" if bool(converged) else ", not converged"
        return f"{int(num_steps.max())} steps{status}"
    return f"≤{int(num_steps.max())} steps, {int(converged.sum())}/{converged.size} converged"


def plot_convergence(
    infos,
    labels: Sequence[str] | None = None,
    ax=None,
    *,
    batch: str = "max",
    tol: float | None = None,
    title: str | None = None,
):
    """Plot residual norm against step number for one or several solver runs.

    Each info's ``residual_history`` (entry ``k`` is the residual after step
    ``k + 1``; ``nan`` past ``num_steps``) is drawn on a log y-axis against the step
    number; only finite positive entries are drawn. An info without
    ``residual_history`` is drawn as one point ``(num_steps, residual)``.

    Batched infos (a 2-D ``residual_history`` from ``vmap``): with ``batch="max"``
    (default) one line per method, the maximum residual over the batch elements
    still running at each step (the worst case); with ``batch="all"`` one line per
    batch element, in one colour, labelled once.

    Args:
      infos: a dict ``{label: info}``, a list of infos (with ``labels``), or a single
        info. An info has ``converged``, ``num_steps``, ``residual`` and, ideally,
        ``residual_history`` (attributes, or keys of a dict).
      labels: legend names when ``infos`` is a list (default ``"method 1"``, ...).
      ax: Axes to draw into; a new figure when ``None``.
      batch: ``"max"`` or ``"all"``, how to draw batched infos (see above).
      tol: if given, a dashed horizontal line at this tolerance.
      title: axes title.

    Returns:
      ``(fig, ax)``. The legend entry of each method is
      ``"<label> (<n> steps)"``, with ``", not converged"`` or the converged count
      of a batch.

    Example:
      >>> import numpy as np
      >>> from types import SimpleNamespace
      >>> from implicit import plot
      >>> hist = np.array([1e-1, 1e-3, 1e-7, np.nan])
      >>> info = SimpleNamespace(converged=True, num_steps=3, residual=1e-7,
      ...                        residual_history=hist)
      >>> fig, ax = plot.plot_convergence({"newton": info})
      >>> ax.get_yscale(), ax.get_lines()[0].get_label()
      ('log', 'newton (3 steps)')
    """
    if batch not in ("max", "all"):
        raise ValueError(f"`batch` must be 'max' or 'all', got {batch!r}.")
    labelled = _as_labelled(infos, labels)
    fig, ax = _new_axes(ax)
    for label, info in labelled:
        style = {"label": f"{label} ({_summary(info)})"}
        for steps, res in _history_curve(info, batch):
            (line,) = ax.plot(steps, res, marker=".", **style)
            style = {"label": "_nolegend_", "color": line.get_color()}  # batch rows
    if tol is not None:
        ax.axhline(tol, color="0.4", linestyle="--", linewidth=1, label="tolerance")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("residual norm")
    ax.set_title(title if title is not None else "Convergence")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return fig, ax


# --------------------------------------------------------------------------------------
# Gradient checks
# --------------------------------------------------------------------------------------


def _flat64(tree) -> np.ndarray:
    """A pytree's leaves, flattened and concatenated into one float64 NumPy vector."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return np.zeros(0)
    return np.concatenate([np.ravel(np.asarray(leaf, dtype=np.float64)) for leaf in leaves])


def gradient_error(grad: Any, reference: Any, *, relative: bool = True) -> float:
    """Return the (relative) error of a gradient against a reference, in the 2-norm.

    ``||grad - reference|| / ||reference||`` when ``relative`` (the denominator is
    taken as 1 if the reference is zero), else ``||grad - reference||``; both
    arguments are pytrees of the same structure, flattened to vectors.

    Args:
      grad: the gradient to check (pytree of arrays).
      reference: the reference gradient (same structure).
      relative: divide by the reference's norm.

    Returns:
      The error as a Python float.

    Example:
      >>> from implicit.plot import gradient_error
      >>> print(round(gradient_error({"a": 1.01, "b": 0.0}, {"a": 1.0, "b": 0.0}), 6))
      0.01
    """
    g = _flat64(grad)
    r = _flat64(reference)
    if g.shape != r.shape:
        raise ValueError(f"`grad` has {g.size} entries but `reference` has {r.size}.")
    err = float(np.linalg.norm(g - r))
    if relative:
        scale = float(np.linalg.norm(r))
        err = err / scale if scale > 0 else err
    return err


def finite_difference_errors(
    fun: Callable,
    x: Any,
    reference_grad: Any,
    steps,
    *,
    method: str = "central",
    direction: Any = None,
    relative: bool = True,
) -> np.ndarray:
    """Return the error of finite-difference gradients of ``fun`` at ``x``, one per step.

    For each step ``h``, the finite-difference derivative along each coordinate
    ``e_i`` of ``x`` is ``(fun(x + h e_i) - fun(x - h e_i)) / (2h)`` (``"central"``,
    error ``O(h^2)``) or ``(fun(x + h e_i) - fun(x)) / h`` (``"forward"``, ``O(h)``);
    roundoff adds ``O(eps / h)``. With ``direction=v`` only the directional
    derivative along ``v`` is formed and compared with ``<reference_grad, v>``
    (two evaluations per step instead of ``2 n``). The error is
    :func:`gradient_error` of the estimate. The evaluations for all steps share one
    compilation. Use float64 (``jax.enable_x64``) for meaningful small errors.

    Args:
      fun: scalar function ``fun(x) -> float``; ``x`` may be a pytree of arrays.
      x: point of evaluation.
      reference_grad: the gradient to compare with (``x``'s structure), e.g. the
        implicit gradient or an analytic one.
      steps: sequence of positive step sizes ``h``.
      method: ``"central"`` or ``"forward"``.
      direction: optional pytree like ``x``: check the directional derivative only.
      relative: relative (default) or absolute error.

    Returns:
      A NumPy float array of errors, one per step, for :func:`plot_gradient_check`.

    Example:
      >>> import jax.numpy as jnp
      >>> from implicit.plot import finite_difference_errors
      >>> errs = finite_difference_errors(jnp.sin, 1.0, jnp.cos(1.0), [1e-1, 1e-2])
      >>> bool(errs[1] < errs[0] < 1e-2)
      True
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {type(fun).__name__}.")
    if method not in ("central", "forward"):
        raise ValueError(f"`method` must be 'central' or 'forward', got {method!r}.")
    steps = np.atleast_1d(np.asarray(steps, dtype=np.float64))
    if steps.ndim != 1 or not np.all(steps > 0):
        raise ValueError("`steps` must be a 1-D sequence of positive step sizes.")
    ref = _flat64(reference_grad)
    size = sum(int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(x))
    if ref.size != size:
        raise ValueError(f"`reference_grad` has {ref.size} entries but `x` has {size}.")
    if direction is None:
        target = ref
    else:
        v = _flat64(direction)
        if v.size != size:
            raise ValueError(f"`direction` has {v.size} entries but `x` has {size}.")
        target = np.array([np.dot(ref, v)])

    @jax.jit
    def estimate(x, h):
        x = jax.tree_util.tree_map(
            lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(float), x
        )
        flat, unravel = ravel_pytree(x)
        h = h.astype(flat.dtype)

        def f_flat(u):
            out = jnp.asarray(fun(unravel(u)))
            if out.shape != ():
                raise ValueError(f"`fun` must return a scalar, got shape {out.shape}.")
            return out

        if direction is None:
            dirs = jnp.eye(size, dtype=flat.dtype)
        else:
            dirs = ravel_pytree(direction)[0].astype(flat.dtype)[None]

        def one(e):
            if method == "central":
                return (f_flat(flat + h * e) - f_flat(flat - h * e)) / (2 * h)
            return (f_flat(flat + h * e) - f_flat(flat)) / h

        return jax.vmap(one)(dirs)

    # One compilation for all steps: the step is a traced argument.
    errors = [gradient_error(estimate(x, np.asarray(h)), target, relative=relative) for h in steps]
    return np.asarray(errors)


def plot_gradient_check(
    fd_steps=None,
    fd_errors=None,
    *,
    unrolled_iters=None,
    unrolled_errors=None,
    implicit_error: float | None = None,
    ax=None,
    title: str | None = None,
):
    """Plot gradient errors: finite differences vs step size, unrolled autodiff vs iterations.

    Up to two panels, each with the implicit (IFT) gradient's error as a dashed
    horizontal line: (1) the error of finite differences against the step size
    ``h`` (log-log: truncation error falls with ``h``, roundoff rises as ``eps/h``);
    (2) the error of autodiff through an unrolled solver loop against the number of
    iterations (log y). All numbers are precomputed (see
    :func:`finite_difference_errors` and :func:`gradient_error`); non-finite or
    non-positive errors are left out (they cannot be drawn on a log axis), and an
    ``implicit_error`` of exactly 0 is written as text instead of a line.

    Args:
      fd_steps, fd_errors: step sizes and the matching errors (panel 1), or ``None``.
      unrolled_iters, unrolled_errors: iteration counts and the matching errors of
        unrolled autodiff (panel 2), or ``None``.
      implicit_error: error of the implicit gradient, or ``None``.
      ax: an Axes (one panel) or a sequence of Axes (one per panel drawn); a new
        figure with the panels side by side when ``None``.
      title: figure title (``suptitle``) for a new figure.

    Returns:
      ``(fig, axes)``: ``axes`` is a tuple with one Axes per panel drawn, finite
      differences first.

    Example:
      >>> from implicit import plot
      >>> fig, axes = plot.plot_gradient_check([1e-2, 1e-4], [1e-5, 1e-9],
      ...     unrolled_iters=[1, 2, 4], unrolled_errors=[1e-1, 1e-2, 1e-4],
      ...     implicit_error=1e-12)
      >>> len(axes), axes[0].get_xscale(), axes[1].get_yscale()
      (2, 'log', 'log')
    """
    panels = []
    if fd_steps is not None or fd_errors is not None:
        if fd_steps is None or fd_errors is None:
            raise ValueError("Pass both `fd_steps` and `fd_errors`, or neither.")
        panels.append("fd")
    if unrolled_iters is not None or unrolled_errors is not None:
        if unrolled_iters is None or unrolled_errors is None:
            raise ValueError("Pass both `unrolled_iters` and `unrolled_errors`, or neither.")
        panels.append("unrolled")
    if not panels:
        raise ValueError(
            "Nothing to plot: pass `fd_steps`/`fd_errors` and/or "
            "`unrolled_iters`/`unrolled_errors`."
        )

    if ax is None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(
            1, len(panels), figsize=(5.2 * len(panels), 4.2), layout="constrained", squeeze=False
        )
        axes = tuple(axes[0])
        if title is not None:
            fig.suptitle(title)
    else:
        axes = tuple(ax) if isinstance(ax, (list, tuple, np.ndarray)) else (ax,)
        if len(axes) != len(panels):
            raise ValueError(f"Got {len(axes)} Axes for {len(panels)} panel(s).")
        fig = axes[0].figure

    for kind, a in zip(panels, axes):
        if kind == "fd":
            xs, errs = _positive_pairs(fd_steps, fd_errors, "fd")
            a.plot(xs, errs, marker="o", label="finite differences")
            a.set_xscale("log")
            a.set_xlabel("finite-difference step h")
            a.set_title("Finite differences vs step size")
        else:
            xs, errs = _positive_pairs(unrolled_iters, unrolled_errors, "unrolled")
            a.plot(xs, errs, marker="o", color="C1", label="unrolled autodiff")
            a.set_xlabel("unrolled iterations")
            a.set_title("Unrolled autodiff vs iterations")
        a.set_yscale("log")
        a.set_ylabel("gradient error")
        if implicit_error is not None:
            e = float(implicit_error)
            if e > 0 and np.isfinite(e):
                a.axhline(e, color="C2", linestyle="--", label="implicit (IFT) gradient")
            else:
                a.text(
                    0.02,
                    0.02,
                    f"implicit (IFT) gradient error: {e:g}",
                    transform=a.transAxes,
                    color="C2",
                )
        a.grid(True, which="major", alpha=0.3)
        a.legend()
    return fig, axes


def _positive_pairs(xs, errs, what):
    xs = np.asarray(xs, dtype=float).ravel()
    errs = np.asarray(errs, dtype=float).ravel()
    if xs.shape != errs.shape:
        raise ValueError(f"{what}: got {xs.size} x values but {errs.size} errors.")
    keep = np.isfinite(errs) & (errs > 0)
    return xs[keep], errs[keep]
