"""Run every benchmark suite: `python -m benchmarks [suite ...]` (default: all).

Besides printing, the run writes its headings and tables (the progress lines left out)
to ``benchmarks/results/report_<platform>.md`` under a header naming the machine (device,
CPU, cores, JAX and peer versions, commit, date): the file that ``docs/results/`` keeps
a copy of for the documentation's benchmarks page.
"""

import datetime
import importlib
import importlib.metadata
import io
import os
import platform
import subprocess
import sys
from pathlib import Path

SUITES = ["fixed_point", "root", "robustness", "bracket", "ode", "neural_ode", "minimize",
          "price", "hessian", "stiff", "work_precision", "docs_snippets"]
RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ["jax", "jaxlib", "jaxopt", "optimistix", "lineax", "diffrax", "optax", "scipy"]


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text):
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def _cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_header(suites):
    import jax

    device = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True, cwd=RESULTS.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    precision = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION", "default")
    versions = ", ".join(f"{n} {_version(n)}" for n in PEERS)
    return "\n".join([
        f"Machine: {device.platform} ({getattr(device, 'device_kind', '?')}), CPU {_cpu_model()}, "
        f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} available to this run); "
        f"matmul precision {precision}.  ",
        f"Versions: {versions}.  ",
        f"Commit {commit}, {datetime.date.today().isoformat()}; suites: {' '.join(suites)}.",
        "",
    ])


def report_lines(text):
    """The headings, tables and best-peer lines of a run's output (not the progress lines)."""
    keep = [line for line in text.splitlines()
            if line.startswith(("#", "|", "- ", "best peer")) or not line.strip()]
    # Headings two levels down: the report is included under a section of the docs page.
    keep = ["##" + line if line.startswith("#") else line for line in keep]
    out = []
    for line in keep:  # no runs of blank lines
        if line.strip() or (out and out[-1].strip()):
            out.append(line)
    return "\n".join(out).strip() + "\n"


def main(argv):
    chosen = argv or SUITES
    unknown = [s for s in chosen if s not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; valid: {SUITES}")
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    import jax

    try:
        for name in chosen:
            # Each suite runs in the float64 mode it declares (X64: its float64
            # references), whichever suites ran before it (run after neural_ode, which
            # turned float64 on for good, jaxopt's Anderson raised a dtype error).
            module = importlib.import_module(f"benchmarks.{name}")
            with jax.enable_x64(getattr(module, "X64", False)):
                module.main()
    finally:
        sys.stdout = tee.stream

    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"report_{jax.devices()[0].platform}.md"
    path.write_text(machine_header(chosen) + "\n" + report_lines(tee.copy.getvalue()))
    print(f"\nreport written to {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
