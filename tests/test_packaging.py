"""The distribution as another project gets it: a wheel built from this checkout,
installed into a fresh virtual environment, imports and solves (issue 38 item 1).

The fresh environment has no pip and no network: the wheel is installed by this
environment's pip (``pip --python``), and the dependencies (JAX, SciPy, ...) are this
environment's, reached through a ``.pth`` file (its site directory's own ``.pth`` files,
among them the editable install of the checkout, are not processed from there, so
``solvers`` can only come from the wheel)."""

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: pip's environment without PYTHONPATH: pointing at a checkout (its egg-info), it made
#: pip take the package for installed already in the fresh venv, and skip the wheel.
PIP_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_wheel_installs_into_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist), str(ROOT)],
                   check=True, capture_output=True, text=True, timeout=300, env=PIP_ENV)
    (wheel,) = dist.glob("implicit_solvers-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "implicit/ift.py" in names and "solvers/root.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta

    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300, env=PIP_ENV)
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = ("import jax.numpy as jnp, implicit, solvers; "
            "print(solvers.__file__); print(implicit.__file__); "
            "print(float(solvers.root(lambda x: x ** 2 - 4.0, 1.0)))")
    run = subprocess.run([str(python), "-I", "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={"JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    solvers_file, implicit_file, value = run.stdout.split()
    assert Path(solvers_file).is_relative_to(env_dir), solvers_file
    assert Path(implicit_file).is_relative_to(env_dir), implicit_file
    assert float(value) == 2.0
