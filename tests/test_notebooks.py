"""Execute every notebook in ``notebooks/`` on a fresh kernel; check the tutorial's numbers.

Each notebook is its own test, so ``pytest -n`` spreads them over workers. The notebook
``custom_derivative_rules.ipynb`` reproduces JAX's "Custom derivative rules" tutorial
(``/work/shared/seeds/002_*.txt`` in the project's sources): its code cells tagged
``seed-N`` run the tutorial's cell ``[N]``, and cells tagged ``ours-...`` compute the same
quantities with this project's API; ``custom-gradient-N`` cells run the examples of the
``jax.custom_gradient`` reference page (``seeds/000_*.txt``). ``SEED_OUTPUTS`` holds, for
each tag, the output these documents print, copied from them (never from running our
code).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import numpy as np
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
#: The issue asks for each notebook to run in under 2 minutes on 2 CPU cores; the limit
#: here leaves room for a loaded machine (the suite runs two notebooks at once).
NOTEBOOK_LIMIT_S = 240
#: Where each executed notebook is saved (with its figures) for the documentation site:
#: ``tools/mkdocs_hooks.py`` renders it in place of the output-free source it was run
#: from (``SOURCE_HASH_KEY`` in its metadata says which source that was).
EXECUTED_DIR = NOTEBOOK_DIR.parent / "build" / "notebooks"
SOURCE_HASH_KEY = "implicit_solvers_source_sha256"

# --------------------------------------------------------------------------------------
# Expected outputs, copied from the tutorial. Text mode: the printed text must match
# after normalising whitespace and the array repr (2020's ``DeviceArray(x, dtype=...)``
# is ``Array(x, dtype=..., weak_type=True)`` today). Numbers mode: the numbers printed
# must match, in order (used where the tutorial shows a `pdb` session we cannot run, or
# where our API prints the numbers in a different layout).
# --------------------------------------------------------------------------------------

SEED_OUTPUTS = {
    "seed-2": ("text", "2.7278922\n2.7278922\n-1.2484405\n-1.2484405"),
    "seed-4": ("text", "2.7278922\n2.7278922\n-1.2484405\n-1.2484405"),
    "seed-6": ("text", "-1.2484405"),
    "seed-7": ("numbers", "DeviceArray(3.0485873, dtype=float32)"),
    "seed-8": ("text", "3.0485873\n0.95257413\n[0.5       0.7310586 0.8807971]"),
    "seed-9": ("text", "nan"),
    "seed-12": ("text", "1.0"),
    "seed-13": ("text", "3.0485873\n0.95257413\n[0.5       0.7310586 0.8807971]"),
    "seed-15": ("text", "1.0\n3.0485873\n0.95257413\n[0.5       0.7310586 0.8807971]"),
    "seed-17": ("text", "nan"),
    "seed-19": ("text", "1.0"),
    "seed-21": ("text", "1.0"),
    "seed-27": ("text", "1.4142135"),
    "seed-28": ("text", "[1.        1.4142135 1.7320509 2.       ]"),
    "seed-30": ("text", "1.4142135"),
    "seed-31": ("text", "0.35355338\n-0.088388346"),
    "seed-32": ("text", "0.35355338\n-0.08838835"),
    "seed-34": ("text", "0.14112\n0.14112\n-0.9899925"),
    "seed-35": ("text", "-0.9899925\n-0.14112"),
    "seed-37": ("text", "12.0"),
    "seed-39": ("text", "-0.9899925"),
    "seed-41": ("text", "12.0\n12.0\n4.0"),
    "seed-43": ("text", "12.0\n12.0\n0.0"),
    "seed-45": ("text", "called f!\n0.14112"),
    "seed-46": ("text", "called f!\n[0.         0.84147096 0.9092974 ]\ncalled f!\n0.14112"),
    "seed-47": ("text", "called f_jvp!\ncalled f!\n-0.9899925"),
    "seed-48": ("text", "called f_jvp!\ncalled f!\n-0.9899925"),
    "seed-49": (
        "text",
        "called f_jvp!\ncalled f_jvp!\ncalled f!\nDeviceArray(-0.14112, dtype=float32)",
    ),
    "seed-51": ("text", "2.0\n3.0"),
    "seed-53": ("text", "0.14112\n-0.9899925"),
    "seed-55": ("text", "-1.2484405"),
    "seed-57": ("text", "called f!\n0.14112"),
    "seed-58": ("text", "called f_fwd!\ncalled f!\ncalled f_bwd!\n-0.9899925"),
    "seed-59": ("text", "called f_fwd!\ncalled f!\n0.14112"),
    "seed-60": ("text", "called f_bwd!\n(DeviceArray(-0.9899925, dtype=float32),)"),
    "seed-61": (
        "text",
        "called f_fwd!\ncalled f!\n"
        "ERROR! can't apply forward-mode autodiff (jvp) to a custom_vjp function.",
    ),
    # The tutorial stops in pdb here and prints x and g at the prompt.
    "seed-63": (
        "numbers",
        "(Pdb) p x\nDeviceArray(9., dtype=float32)\n"
        "(Pdb) p g\nDeviceArray(-0.91113025, dtype=float32)",
    ),
    "seed-65": (
        "text",
        "{'a': 1.0, 'b': (DeviceArray(0.84147096, dtype=float32), "
        "DeviceArray(-0.41614684, dtype=float32))}",
    ),
    "seed-66": (
        "text",
        "Point(x=DeviceArray(2.5403023, dtype=float32), y=array(0., dtype=float32))",
    ),
    "seed-68": (
        "text",
        "{'a': 1.0, 'b': (DeviceArray(0.84147096, dtype=float32), "
        "DeviceArray(-0.41614684, dtype=float32))}",
    ),
    "seed-69": (
        "text",
        "Point(x=DeviceArray(2.5403023, dtype=float32), y=DeviceArray(-0., dtype=float32))",
    ),
    "seed-71": ("text", "27.0"),
    "seed-72": ("text", "2.0"),
    "seed-74": ("text", "3375.0"),
    "seed-75": ("text", "3.0"),
    "seed-77": ("text", "16.0"),
    "seed-78": ("text", "5.0"),
    # The two examples of the jax.custom_gradient reference page (seeds/000_*.txt).
    "custom-gradient-1": ("text", "9.0\n3.0"),
    "custom-gradient-2": (
        "text",
        "12.0\n(Array(4., dtype=float32, weak_type=True), "
        "Array(3., dtype=float32, weak_type=True))",
    ),
    # Our API, same quantities: implicit.log1pexp (tutorial cell [15]).
    "ours-15": ("numbers", "1.0\n3.0485873\n0.95257413\n[0.5       0.7310586 0.8807971]"),
    # implicit.x_over_1p_sqrt and implicit.with_derivative (cells [19] and [21]).
    "ours-21": ("numbers", "1.0\n1.0"),
    # solvers.fixed_point's newton_sqrt (cells [27], [28] and [31]).
    "ours-31": (
        "numbers",
        "1.4142135\n[1.        1.4142135 1.7320509 2.       ]\n0.35355338\n-0.088388346",
    ),
    # implicit.custom_fixed_point around the tutorial's while_loop (cells [30], [31]).
    "ours-closure": ("numbers", "1.4142135\n0.35355338\n-0.088388346"),
    # implicit.debug_backward sees the tutorial's x and g (cell [63]'s pdb session).
    "ours-63": (
        "numbers",
        "DeviceArray(9., dtype=float32)\nDeviceArray(-0.91113025, dtype=float32)",
    ),
    # A solver whose function closes over the parameter (cells [30], [31]).
    "ours-nondiff": ("numbers", "1.4142135\n0.35355338"),
}

# Values our API computes in float32 through a different sequence of roundings than the
# tutorial, allowed to differ from it by a few units in the last place (ulps); every
# other number must match exactly.
#   * implicit.log1pexp's derivative at 2 is the logistic sigmoid 1 / (1 + e^-2), which
#     rounds to 0.880797 (the tutorial's 1 - 1 / (1 + e^2) gives 0.8807971; the exact
#     value 0.88079707797... lies between them, 0.83 and 0.17 ulp away).
#   * grad(grad(newton_sqrt))(2.) is -1/4 2^(-3/2) = -0.0883883476...; the tutorial's
#     custom_vjp gives -0.088388346, jnp.sqrt -0.08838835, and our implicit rule (an
#     adjoint linear solve, differentiated again) -0.08838836: 2 ulps from the tutorial.
ULP_TOLERANCE = {
    ("ours-15", 0.8807971): 1,
    ("ours-31", -0.088388346): 2,
    ("ours-closure", -0.088388346): 2,
}

_NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:nan|inf|(?:\d+\.\d*|\.\d+|\d+)(?:e[-+]?\d+)?)(?![\w])", re.IGNORECASE
)


def _numbers(text):
    return [float(token) for token in _NUMBER.findall(text)]


def _normalise(text):
    text = re.sub(r"\b(?:DeviceArray|array)\(", "Array(", text)
    text = text.replace(", weak_type=True", "")
    return " ".join(text.split())


def _cell_output(cell):
    """What a cell printed (stdout) and displayed as its result, in order."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif out.output_type == "execute_result":
            parts.append(out.data.get("text/plain", ""))
    return "\n".join(parts)


def _tagged(nb):
    cells = {}
    for cell in nb.cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            assert tag not in cells, f"tag {tag!r} is used twice"
            cells[tag] = cell
    return cells


def _same_numbers(tag, actual, expected):
    got, want = _numbers(actual), _numbers(expected)
    assert len(got) == len(want), f"{tag}: printed {actual!r}, the tutorial prints {expected!r}"
    for g, w in zip(got, want):
        ulps = ULP_TOLERANCE.get((tag, w), 0)
        w32 = np.float32(w)
        if np.isnan(w32):
            assert np.isnan(g), f"{tag}: printed {g}, the tutorial prints nan"
            continue
        diff = abs(np.float64(np.float32(g)) - np.float64(w32))
        assert diff <= ulps * np.spacing(np.abs(w32)), (
            f"{tag}: printed {g!r}, the tutorial prints {w!r} (allowed: {ulps} ulp)\n"
            f"cell output: {actual!r}"
        )


def check_custom_derivative_rules(nb):
    cells = _tagged(nb)
    assert set(cells) == set(SEED_OUTPUTS), "tags and SEED_OUTPUTS must cover the same cells"
    for tag, (mode, expected) in SEED_OUTPUTS.items():
        actual = _cell_output(cells[tag])
        if mode == "text":
            assert _normalise(actual) == _normalise(expected), (
                f"{tag}: printed {actual!r}, the tutorial prints {expected!r}"
            )
        else:
            _same_numbers(tag, actual, expected)


EXTRA_CHECKS = {"custom_derivative_rules.ipynb": check_custom_derivative_rules}


def _execute(path):
    nb = nbformat.read(path, as_version=4)
    # First cell (in memory only): report which interpreter runs the kernel.
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    # Inline figures (rendered to PNG, headless) rather than whatever MPLBACKEND says.
    env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute(env=env)
    return nb, time.perf_counter() - start


def _save_for_docs(path, nb):
    """Write the executed notebook, less the interpreter cell, to ``EXECUTED_DIR``."""
    saved = nbformat.from_dict(nb)
    saved.cells = saved.cells[1:]
    saved.metadata[SOURCE_HASH_KEY] = hashlib.sha256(path.read_bytes()).hexdigest()
    EXECUTED_DIR.mkdir(parents=True, exist_ok=True)
    tmp = EXECUTED_DIR / f".{path.name}.{os.getpid()}.tmp"
    nbformat.write(saved, tmp)
    tmp.replace(EXECUTED_DIR / path.name)


def test_notebooks_are_found():
    names = {path.name for path in NOTEBOOKS}
    assert {
        "custom_derivative_rules.ipynb",
        "deq_with_optax.ipynb",
        "root_finding.ipynb",
        "ode_fitting.ipynb",
        "ode_events.ipynb",
        "hyperparameter_optimization.ipynb",
        "brusselator.ipynb",
    } <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name}: clear the outputs before committing"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    nb, seconds = _execute(path)
    kernel_python = _cell_output(nb.cells[0]).strip()
    assert Path(kernel_python).resolve() == Path(sys.executable).resolve(), (
        f"the kernel runs {kernel_python}, not this interpreter ({sys.executable})"
    )
    images = [
        out
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert images, f"{path.name} drew no figure"
    errors = [
        out.text
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.output_type == "stream" and out.name == "stderr" and "Traceback" in out.text
    ]
    assert not errors, f"{path.name} printed a traceback:\n{errors[0]}"
    assert seconds < NOTEBOOK_LIMIT_S, f"{path.name} took {seconds:.0f} s"
    check = EXTRA_CHECKS.get(path.name)
    if check is not None:
        check(nb)
    _save_for_docs(path, nb)
