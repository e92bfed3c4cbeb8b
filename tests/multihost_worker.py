"""One process of a 2-process (multi-host) run on CPU: 4 devices here, 8 in all.

Run by tests/test_sharding.py as ``python tests/multihost_worker.py PORT PROCESS_ID``
twice. Both processes solve one batch of 64 bracketed problems and one vmapped fixed
point sharded over all 8 devices, take gradients, and check a failing element raises a
catchable error in both processes (no abort). Prints ``MULTIHOST OK <process_id>``.
"""

import os
import sys

if __name__ == "__main__":  # not when collected by pytest
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import solvers  # noqa: E402


def cube(x, a):
    return x**3 - a


def contraction(x, a):
    return a * x + 1.0


def main(port, process_id):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    mesh = jax.make_mesh((8,), ("b",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("b"))

    def global_array(values):
        values = np.asarray(values, np.float32)
        return jax.make_array_from_callback(values.shape, sharding, lambda idx: values[idx])

    def loss(a):
        x = solvers.bisection(cube, 0.0, 10.0, a)
        y = jax.vmap(lambda a: solvers.fixed_point(contraction, 0.0, a / 16.0))(a)
        return jnp.sum(x) + jnp.sum(y)

    a = global_array(np.full(64, 8.0))
    value, grad = jax.jit(jax.value_and_grad(loss))(a)
    # x = a^(1/3) = 2 and y = 1 / (1 - a/16) = 2 per element; d/da: 1/12 + 4/16.
    expected_grad = 1.0 / 12.0 + (1.0 / 16.0) / (1.0 - 0.5) ** 2
    assert abs(float(value) - 64 * 4.0) < 1e-2, float(value)
    local = np.concatenate([np.asarray(s.data) for s in grad.addressable_shards])
    assert np.allclose(local, expected_grad, rtol=1e-3), local
    assert grad.sharding.spec == P("b"), grad.sharding

    bad = global_array(np.where(np.arange(64) == 37, 2000.0, 8.0))
    try:
        jax.block_until_ready(jax.jit(lambda a: solvers.bisection(cube, 0.0, 10.0, a))(bad))
    except Exception as err:  # noqa: BLE001 - a catchable error, its message checked
        assert "first at index (37,)" in str(err), str(err)
    else:
        raise AssertionError("no error for the failing element")
    print(f"MULTIHOST OK {process_id}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
