"""Shared benchmark helpers: timing, compile time, XLA memory, tables with ratios.

Every suite builds rows with :func:`measure` (or by hand) and prints them with
:func:`print_table`, which adds a ratio column (this project / best peer) per metric.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import jax

OURS = "ours"  # the `group` of rows that belong to this project


@dataclass
class Row:
    name: str
    group: str  # OURS or "peer"
    values: dict = field(default_factory=dict)


class Compiled:
    """``jax.jit(fn)``, compiled for some arguments: called through ``jit`` (what a user
    calls), with the ahead-of-time executable's ``memory_analysis``.

    Calling the ahead-of-time ``Compiled`` object itself takes a slower dispatch path for
    a program with a host callback (a solver's failure check): 0.12 against 0.085 ms for
    the Lotka–Volterra solve (measured), where a ``jit`` call costs the same with or
    without one. Timing it would charge the check to every row that has one.
    """

    def __init__(self, jitted, aot):
        self._jitted = jitted
        self._aot = aot

    def __call__(self, *args):
        return self._jitted(*args)

    def memory_analysis(self):
        return self._aot.memory_analysis()


def compile_time(fn, *args):
    """Seconds to lower and compile ``jax.jit(fn)`` for ``args``; returns (seconds,
    :class:`Compiled`). One untimed call fills ``jit``'s dispatch cache; it finds the
    executable in JAX's compilation cache (measured: 2.6 ms after a 2.4 s compile), so
    nothing is compiled twice."""
    jitted = jax.jit(fn)
    start = time.perf_counter()
    aot = jitted.lower(*args).compile()
    seconds = time.perf_counter() - start
    jax.block_until_ready(jitted(*args))
    return seconds, Compiled(jitted, aot)


def fresh_compile_time(fn, *args):
    """:func:`compile_time` from cleared caches: tracing, lowering and compiling from
    scratch (no cached traces of inner jitted functions)."""
    jax.clear_caches()
    return compile_time(lambda *a: fn(*a), *args)


def temp_memory_bytes(compiled):
    """XLA temporary (scratch) memory of a compiled function, in bytes (None if unknown)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes)


def run_time(fn, *args, repeat=20, min_time=0.2):
    """Median seconds of ``fn(*args)`` (blocked until ready), after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    start_all = time.perf_counter()
    while len(times) < repeat or (time.perf_counter() - start_all) < min_time:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
        if len(times) >= 10 * repeat:
            break
    times.sort()
    return times[len(times) // 2]


def run_times_interleaved(calls, rounds=20, statistic="min"):
    """Seconds per call for each ``name -> zero-argument callable``, timed round-robin.

    Every callable is warmed up once, then each round times one call of each in turn, so
    that load from other processes on a shared machine hits all of them alike. Returns
    ``name -> seconds`` (the fastest call, or the median with ``statistic="median"``).
    """
    for fn in calls.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    pick = min if statistic == "min" else (lambda ts: sorted(ts)[len(ts) // 2])
    return {name: pick(ts) for name, ts in times.items()}


def time_rows(rows, timers, rounds, repeat=5):
    """Fill ``row.values[metric]`` with run times in ms from ``timers[id(row)]``
    (``metric -> (function, args)``), measured in interleaved rounds; each row keeps its
    best round (a median of ``repeat`` calls), so a burst of load on the machine penalises
    no row in particular."""
    for _ in range(rounds):
        for row in rows:
            for metric, (fn, args) in timers.get(id(row), {}).items():
                ms = 1e3 * run_time(fn, *args, repeat=repeat, min_time=0.05)
                row.values[metric] = min(row.values.get(metric, float("inf")), ms)
    for row in rows:
        print(f"  {row.name}: " + ", ".join(f"{k}={v:.3g}" for k, v in row.values.items()))
    return rows


def _fmt(value):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.3g}"


def print_table(title, rows, columns, ratio_columns=(), lower_is_better=True):
    """Print rows as a table; for each metric in ``ratio_columns`` add ``metric/best peer``.

    The ratio is this project's value divided by the best (smallest) peer value, so a
    ratio below 1 means this project wins.
    """
    peers = [r for r in rows if r.group != OURS]
    best = {}
    for col in ratio_columns:
        vals = [r.values.get(col) for r in peers]
        vals = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
        best[col] = min(vals) if vals else None
    header = ["method"] + list(columns) + [f"{c} / best peer" for c in ratio_columns]
    lines = []
    for r in rows:
        cells = [r.name] + [_fmt(r.values.get(c)) for c in columns]
        for col in ratio_columns:
            v, b = r.values.get(col), best[col]
            ok = r.group == OURS and isinstance(v, (int, float)) and b
            cells.append(f"{v / b:.2f}x" if ok else "")
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in lines:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |")
    if ratio_columns:
        named = ", ".join(
            f"{c}: {next(r.name for r in peers if r.values.get(c) == best[c])}"
            for c in ratio_columns
            if best[c]
        )
        print(f"\nbest peer per metric: {named}")


def plot_work_precision(panels, path, xlabel="time per call (ms)", ylabel="relative error"):
    """Log-log panels side by side, saved to ``path``: ``panels`` is a list of ``(title,
    curves)``, ``curves`` a dict ``name -> [(time, error)]`` (ours solid, peers dashed)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5))
    for ax, (title, curves) in zip(axes if len(panels) > 1 else [axes], panels):
        for name, points in curves.items():
            if not points:
                continue
            t, e = zip(*points)
            ax.loglog(t, e, "-o" if name.startswith("ours") else "--s", label=name,
                      markersize=4)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
