"""pytest plugin: run the suite on CPU with the defaults a GPU/TPU gets.

``make test-gpu-defaults`` (``PYTHONPATH=tests pytest -p gpu_defaults``): the cheap-step
solvers test convergence every few steps (``check_every``'s accelerator default) and the
Neumann adjoint takes several steps per loop trip, as on an accelerator. It found the
bracket methods' lost roots under ``check_every > 1`` (see ``solvers._runner.Method``)
before a GPU did. What it cannot show: TF32 matmuls and asynchronous host callbacks
(see docs/gpu.md).
"""


def pytest_configure(config):
    import implicit._sharding

    # (the one switch behind both defaults; TF32 and asynchronous callbacks stay CPU's)
    implicit._sharding.on_accelerator = lambda: True
