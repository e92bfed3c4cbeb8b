"""Run-time failure reports from compiled code, and loop carries under ``shard_map``.

:func:`host_check` takes a host check only on failure. Under SPMD sharding (a sharded
``jit`` on an ``Auto`` or ``Explicit`` mesh, ``shard_map``, ``pmap``, several processes)
a raise from a host callback on one device while the others wait in a collective
makes XLA abort the whole process ("Termination timeout for 'all reduce'"). So there
the check is global: the failure flags and the operands are gathered first, every
device takes the same decision from the same data, and either none or all of them
raise: the error is catchable, and its index is global (the message says which shard
held the first failed element).

:func:`while_loop` is ``lax.while_loop`` with its start values cast to vary over the
``shard_map`` axes its body's outputs vary over (``check_vma=True`` needs equal carry
types; a constant start value is otherwise invariant).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["host_check", "match_varying", "scan", "vary_like", "while_loop"]


# --- varying manual axes (shard_map's check_vma) -----------------------------------------


def _varying(x):
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(kind.varying) if kind is not None else frozenset()


def _context_manual_axes():
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def vary(x, axes):
    """``x`` cast to vary over ``axes`` (those it does not vary over yet)."""
    missing = tuple(a for a in axes if a not in _varying(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _union(tree):
    return frozenset().union(*[_varying(v) for v in jax.tree.leaves(tree)])


def match_varying(init, body):
    """``init`` with every leaf cast to vary over the ``shard_map`` axes that any leaf of
    the carry (or of ``body(init)``) varies over.

    All of a loop's carries vary alike: ``vmap`` of a ``while_loop`` with a varying
    predicate mixes every carry with it, and carries that are invariant in the traced
    body then clash with their varying batched values when the loop is lowered. A
    no-op outside ``shard_map`` (and costs nothing there); inside, ``body`` is traced
    abstractly once more.
    """
    if not _context_manual_axes():
        return init
    axes = _union(init)
    out = jax.eval_shape(body, jax.tree.map(lambda x: vary(x, tuple(sorted(axes))), init))
    for o in jax.tree.leaves(out):
        kind = getattr(o, "manual_axis_type", None)
        if kind is not None:
            axes = axes | frozenset(kind.varying)
    axes = tuple(sorted(axes))
    return jax.tree.map(lambda x: vary(x, axes), init) if axes else init


def like_output(solver, x0, args, has_aux=False):
    """``x0`` cast to vary over the ``shard_map`` axes ``solver(x0, *args)``'s solution
    varies over (``x0`` itself outside ``shard_map``)."""
    if not _context_manual_axes():
        return x0
    out = jax.eval_shape(solver, x0, *args)
    out = out[0] if has_aux else out

    def cast(x, o):
        kind = getattr(o, "manual_axis_type", None)
        return vary(x, tuple(sorted(kind.varying))) if kind is not None else x

    return jax.tree.map(cast, x0, out)


def vary_like(tree, like):
    """``tree`` with each leaf cast to vary over every ``shard_map`` axis that a leaf of
    ``like`` varies over (``tree`` itself outside ``shard_map``)."""
    if not _context_manual_axes():
        return tree
    axes = tuple(sorted(set().union(*[_varying(v) for v in jax.tree.leaves(like)])))
    return jax.tree.map(lambda t: vary(t, axes), tree) if axes else tree


def _explicit_mesh(tree):
    """The Explicit mesh of the context (or of a leaf of ``tree``), else ``None``."""
    candidates = [jax.sharding.get_abstract_mesh()]
    candidates += [getattr(getattr(jax.typeof(v), "sharding", None), "mesh", None)
                   for v in jax.tree.leaves(tree)]
    for mesh in candidates:
        types = getattr(mesh, "axis_types", ())
        if getattr(mesh, "shape", None) and any(t == AxisType.Explicit for t in types):
            return mesh
    return None


def replicated(*arrays):
    """``P()`` when ``arrays`` live on an Explicit mesh, else ``None``: the
    ``out_sharding`` of a contraction over a possibly sharded axis (a Gram matrix, an
    inner product), which an Explicit mesh asks for."""
    return P() if _explicit_mesh(arrays) is not None else None


def on_mesh(tree):
    """Leaves that belong to no mesh (constants) put, replicated, on the Explicit mesh
    that others are on.

    ``vmap`` of a loop over an Explicit-sharded batch axis (JAX 0.10) inserts the
    batch's mesh axis into every carry's sharding, which fails for a carry whose
    sharding has no mesh ("Resource axis ... is not found in mesh: ()").
    """
    mesh = _explicit_mesh(tree)
    if mesh is None:
        return tree

    def put(x):
        own = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if getattr(own, "shape", None):
            return x
        return jax.sharding.reshard(x, NamedSharding(mesh, P()))

    return jax.tree.map(put, tree)


def stackable(values):
    """Scalars ready for ``jnp.stack`` on an Explicit mesh (``values`` itself elsewhere).

    Under ``vmap`` over an Explicit-sharded batch, stacking batched and unbatched
    scalars fails (JAX 0.10: the unbatched ones are broadcast unsharded). Tying each
    to all of them (a select that keeps the value) batches them alike.
    """
    if _explicit_mesh(values) is None:
        return values
    values = on_mesh(values)
    total = functools.reduce(jnp.add, [jnp.asarray(v, jnp.float32) for v in values])
    return [jnp.where(True, v, total.astype(jnp.result_type(v))) for v in values]


def while_loop(cond, body, init):
    """``jax.lax.while_loop`` whose start values vary as its body's outputs do."""
    if not _context_manual_axes():
        return jax.lax.while_loop(cond, body, on_mesh(init))
    init = match_varying(init, body)

    axes = tuple(sorted(_union(init)))

    def typed_body(carry):  # outputs as varying as the carry (e.g. a constant reset)
        return jax.tree.map(lambda o: vary(o, axes), body(carry))

    return jax.lax.while_loop(cond, typed_body, init)


def like(x, value, dtype=None):
    """A scalar ``value`` typed to vary over the same ``shard_map`` axes as ``x``."""
    out = jnp.asarray(value, dtype)
    axes = tuple(sorted(set().union(*[_varying(v) for v in jax.tree.leaves(x)] or [set()])))
    return vary(out, axes) if axes else out


def scan(f, init, xs):
    """``jax.lax.scan`` whose carry varies alike (see :func:`match_varying`)."""
    if not _context_manual_axes():
        return jax.lax.scan(f, on_mesh(init), xs)
    first = jax.tree.map(lambda x: x[0], xs)
    init = match_varying(init, lambda c: f(c, first)[0])
    axes = tuple(sorted(_union(init)))

    def typed(carry, x):
        carry, y = f(carry, x)
        return jax.tree.map(lambda o: vary(o, axes), carry), y

    return jax.lax.scan(typed, init, xs)


# --- the host check ------------------------------------------------------------------------


def _mesh_of(*arrays):
    """The mesh of more than one device that the check's values (or the context) live
    on, else ``None``."""
    candidates = [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
                  for x in arrays]
    candidates.append(jax.sharding.get_abstract_mesh())
    for mesh in candidates:
        if getattr(mesh, "shape", None) and mesh.size > 1:
            return mesh
    return None


def on_several_devices(x):
    """Whether ``x`` (being traced) may be spread over more than one device: it lives
    on a mesh of several devices, or the trace is inside ``shard_map``/``pmap``."""
    return _mesh_of(x) is not None


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
        def call(ok, *leaves):
            return jax.pure_callback(
                lambda *a: on_host(shards, *a),
                jax.ShapeDtypeStruct((), jnp.bool_), ok, *leaves, vmap_method="sequential",
            )

        return jax.lax.cond(jnp.all(ok), lambda *_: jnp.bool_(True), call, ok, *leaves)

    @jax.custom_batching.custom_vmap
    def guard(ok, *leaves):
        mesh = _mesh_of(ok, *leaves)
        if mesh is None:
            return decide(None, ok, *leaves)
        manual = _context_manual_axes()
        if manual:
            # shard_map / pmap: each device holds its block; gather them all.
            local = jnp.shape(ok)[0] if jnp.ndim(ok) else 1
            n = math.prod(mesh.shape[a] for a in manual)
            flag = decide((manual, n, local), _gather(ok, manual),
                          *[_gather(leaf, manual) for leaf in leaves])
            return jax.lax.pmin(flag, manual) if _varying(flag) else flag
        # A sharded jit: every device decides on the replicated (global) values.
        shards = ()  # sharded, the shards of the batch unknown (an Auto mesh's trace)
        spec = getattr(getattr(jax.typeof(ok), "sharding", None), "spec", None)
        if jnp.ndim(ok) and spec and spec[0] is not None:
            names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
            n = math.prod(mesh.shape[a] for a in names)
            shards = (names, n, max(jnp.shape(ok)[0] // n, 1))
        replicated = NamedSharding(mesh, P())
        args = [jax.sharding.reshard(a, replicated) if hasattr(jax.sharding, "reshard")
                else jax.reshard(a, replicated) for a in (ok, *leaves)]
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
