"""Run-time failure reports from compiled code: a host check taken only on failure.

:func:`host_check` takes a host check only on failure. Under SPMD sharding (a sharded
``jit`` on an ``Auto`` or ``Explicit`` mesh, ``shard_map``, ``pmap``, several processes)
a raise from a host callback on one device while the others wait in a collective
makes XLA abort the whole process ("Termination timeout for 'all reduce'"). So there
the check is global: the failure flags and the operands are gathered first, every
device takes the same decision from the same data, and either none or all of them
raise: the error is catchable, and its index is global (the message says which shard
held the first failed element).
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from implicit._reduce import all_
from implicit._sharding import context_manual_axes, mesh_of, vary, varying

__all__ = ["host_check"]


# --- the host check ------------------------------------------------------------------------


def _gather(x, axes):
    """All of ``x`` over the manual ``axes``: tiled along axis 0 (stacked if 0-d)."""
    x = vary(x, axes)
    if jnp.ndim(x) == 0:
        return jax.lax.all_gather(x, axes)
    return jax.lax.all_gather(x, axes, tiled=True)


class _Quiet(logging.Filter):
    """Let only the first of the identical per-device reports of a sharded failure be
    logged by JAX's callback machinery (every device raises the same error)."""

    seen: set = set()

    def filter(self, record):
        err = record.exc_info[1] if record.exc_info else None
        key = getattr(err, "_solvers_sharded", None)
        if key is None:
            return True
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


_quiet_installed = False


def _install_quiet():
    """Silence the duplicate per-device logs of a caught sharded failure. (JAX keeps the
    failed execution's runtime tokens and blocks on them at interpreter exit, which
    prints the caught error once more there: not silenced, as only JAX's private API
    could.)"""
    global _quiet_installed
    if _quiet_installed:
        return
    _quiet_installed = True
    # The logger of the module that defines jax.pure_callback (it logs a failed callback).
    logging.getLogger(jax.pure_callback.__module__).addFilter(_Quiet())


def _where(first, shape, shards):
    """`` (shard s of n ...)`` for the first failed element, when the shards are known."""
    if not shards or not first:
        return ""
    axes, n, local = shards
    s = first[0] // local
    return (f" [sharded over {'x'.join(axes)}: the first failed element is on shard {s} of "
            f"{n} (local index {(first[0] % local,) + tuple(first[1:])})]")


def _pack(leaves):
    """``leaves`` as one flat vector of their widest floating dtype, and the host-side
    ``split(flat) -> leaves`` (NumPy: shapes and dtypes restored; integers and booleans
    travel exactly up to 2**24 in float32, plenty for step counts and status codes)."""
    if not leaves:
        return jnp.zeros((0,), jnp.float32), lambda flat: []
    dtype = jnp.result_type(jnp.float32, *[jnp.result_type(v) for v in leaves
                                           if jnp.issubdtype(jnp.result_type(v), jnp.floating)])
    shapes = [jnp.shape(v) for v in leaves]
    dtypes = [np.dtype(jnp.result_type(v)) for v in leaves]
    # A sum of zero-padded leaves rather than a concatenate: elementwise, so XLA makes it
    # one loop fusion (a concatenate of converted slices of a loop's outputs was a dozen
    # kernels after an ODE solve's loop).
    sizes = [math.prod(shape) for shape in shapes]
    total, start = sum(sizes), 0
    flat = jnp.zeros((total,), dtype)
    for v, size in zip(leaves, sizes):
        leaf = jnp.ravel(jnp.asarray(v)).astype(dtype)
        flat = flat + jnp.pad(leaf, (start, total - start - size))
        start += size

    def split(flat_host):
        flat_host = np.asarray(flat_host)
        out, start = [], 0
        for shape, dt in zip(shapes, dtypes):
            size = math.prod(shape)
            out.append(flat_host[start:start + size].reshape(shape).astype(dt))
            start += size
        return out

    return flat, split


def host_check(ok, host, operands):
    """Call ``host(operands)`` (NumPy leaves) on the host unless ``all(ok)``; return True.

    ``host`` raises to report a failure. The callback is skipped at run time when
    everything is fine (a host round trip costs as much as a small solve), and under
    ``vmap`` the whole batch is checked by one call rather than one per element.
    Fold the returned flag into an output (``jnp.where(flag, out, nan)``) so that the
    check cannot be dropped as dead code. Under sharding the check is global (see the
    module docstring): every device raises, or none.
    """
    leaves, treedef = jax.tree.flatten(jax.tree.map(jax.lax.stop_gradient, operands))
    ok = jax.lax.stop_gradient(ok)

    def on_host(shards, ok_host, *host_leaves):
        try:
            host(jax.tree.unflatten(treedef, host_leaves))
        except Exception as err:
            if shards is None:  # not sharded
                raise
            failed = np.argwhere(~np.asarray(ok_host))
            first = tuple(int(i) for i in failed[0]) if failed.size else ()
            try:
                new = type(err)(f"{err}{_where(first, np.shape(ok_host), shards)}")
            except Exception:  # noqa: BLE001 - an exception type we cannot rebuild
                new = err
            new._solvers_sharded = str(new)
            _install_quiet()
            raise new from None
        return np.bool_(True)

    def decide(shards, ok, *leaves):
        # The operands travel packed in one fresh buffer: a solver loop's own outputs
        # passed to the conditional made XLA keep copies of the loop's buffers (dense
        # Broyden n=64: 20% slower per solve, measured).
        flat, split = _pack(leaves)

        def call(ok, flat):
            return jax.pure_callback(
                lambda ok_host, flat_host: on_host(shards, ok_host, *split(flat_host)),
                jax.ShapeDtypeStruct((), jnp.bool_), ok, flat, vmap_method="sequential",
            )

        return jax.lax.cond(all_(ok), lambda *_: jnp.bool_(True), call, ok, flat)

    @jax.custom_batching.custom_vmap
    def guard(ok, *leaves):
        mesh = mesh_of(ok, *leaves)
        if mesh is None:
            return decide(None, ok, *leaves)
        manual = context_manual_axes()
        if manual:
            # shard_map / pmap: each device holds its block; gather them all.
            local = jnp.shape(ok)[0] if jnp.ndim(ok) else 1
            n = math.prod(mesh.shape[a] for a in manual)
            flag = decide((manual, n, local), _gather(ok, manual),
                          *[_gather(leaf, manual) for leaf in leaves])
            return jax.lax.pmin(flag, manual) if varying(flag) else flag
        # A sharded jit: every device decides on the replicated (global) values.
        shards = ()  # sharded, the shards of the batch unknown (an Auto mesh's trace)
        spec = getattr(getattr(jax.typeof(ok), "sharding", None), "spec", None)
        if jnp.ndim(ok) and spec and spec[0] is not None:
            names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
            n = math.prod(mesh.shape[a] for a in names)
            shards = (names, n, max(jnp.shape(ok)[0] // n, 1))
        replicated = NamedSharding(mesh, P())
        args = [jax.sharding.reshard(a, replicated) for a in (ok, *leaves)]
        return jax.shard_map(
            lambda *a: decide(shards, *a), mesh=mesh, in_specs=P(), out_specs=P(),
            check_vma=False,
        )(*args)

    @guard.def_vmap
    def _guard_batched(axis_size, in_batched, ok, *leaves):
        args = [
            a if batched else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a))
            for a, batched in zip((ok, *leaves), in_batched)
        ]
        return guard(*args), False  # one check for the whole batch

    return guard(ok, *leaves)
