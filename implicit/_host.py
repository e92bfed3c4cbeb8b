"""Run-time failure reports from compiled code: a host check taken only on failure."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["host_check"]


def host_check(ok, host, operands):
    """Call ``host(operands)`` (NumPy leaves) on the host unless ``all(ok)``; return True.

    ``host`` raises to report a failure. The callback is skipped at run time when
    everything is fine (a host round trip costs as much as a small solve), and under
    ``vmap`` the whole batch is checked by one call rather than one per element.
    Fold the returned flag into an output (``jnp.where(flag, out, nan)``) so that the
    check cannot be dropped as dead code.
    """
    leaves, treedef = jax.tree.flatten(jax.tree.map(jax.lax.stop_gradient, operands))
    ok = jax.lax.stop_gradient(ok)

    def on_host(*host_leaves):
        host(jax.tree.unflatten(treedef, host_leaves))
        return np.bool_(True)

    @jax.custom_batching.custom_vmap
    def guard(ok, *leaves):
        def call(ok, *leaves):
            del ok
            return jax.pure_callback(
                on_host, jax.ShapeDtypeStruct((), jnp.bool_), *leaves, vmap_method="sequential"
            )

        return jax.lax.cond(jnp.all(ok), lambda *_: jnp.bool_(True), call, ok, *leaves)

    @guard.def_vmap
    def _guard_batched(axis_size, in_batched, ok, *leaves):
        args = [
            a if batched else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a))
            for a, batched in zip((ok, *leaves), in_batched)
        ]
        return guard(*args), False  # one check for the whole batch

    return guard(ok, *leaves)
