"""Loop carries and contractions under JAX's SPMD sharding (``shard_map``, meshes).

:func:`while_loop` and :func:`scan` are the ``lax`` loops with their start values cast
to vary over the ``shard_map`` axes their body's outputs vary over (``check_vma=True``
needs equal carry types; a constant start value is otherwise invariant), and, on an
Explicit mesh, put on the mesh; :func:`replicated`, :func:`stackable`, :func:`vary_like`
and :func:`like_output` type the few values that an Explicit mesh or ``shard_map``
needs typed. Outside ``shard_map`` and Explicit meshes every helper returns its input.

What the device decides, in one place: the solvers' own products (:func:`matmul`,
:func:`dot`, precision :data:`EXACT`) and whether they run on an accelerator
(:func:`on_accelerator`, behind the defaults that take several steps per loop trip).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

try:  # JAX 0.11 removed it, with no public replacement: split_like then ties nothing
    from jax.experimental.shard_alike import shard_alike
except ImportError:
    shard_alike = None

__all__ = [
    "cond",
    "cond_once",
    "context_manual_axes",
    "dot",
    "EXACT",
    "fori_loop",
    "gathered",
    "like_output",
    "map_like",
    "match_varying",
    "matmul",
    "mesh_of",
    "on_accelerator",
    "on_mesh",
    "on_several_devices",
    "replicated",
    "rows_like",
    "scan",
    "sharded_explicit",
    "split_like",
    "stackable",
    "vary",
    "vary_like",
    "varying",
    "while_loop",
    "zeros_like",
    "zeros_of",
]


# --- varying manual axes (shard_map's check_vma) -----------------------------------------


def varying(x):
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(kind.varying) if kind is not None else frozenset()


def context_manual_axes():
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def vary(x, axes):
    """``x`` cast to vary over ``axes`` (those it does not vary over yet)."""
    missing = tuple(a for a in axes if a not in varying(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _union(tree):
    return frozenset().union(*[varying(v) for v in jax.tree.leaves(tree)])


def match_varying(init, body):
    """``init`` with every leaf cast to vary over the ``shard_map`` axes that any leaf of
    the carry (or of ``body(init)``) varies over.

    All of a loop's carries vary alike: ``vmap`` of a ``while_loop`` with a varying
    predicate mixes every carry with it, and carries that are invariant in the traced
    body then clash with their varying batched values when the loop is lowered. A
    no-op outside ``shard_map`` (and costs nothing there); inside, ``body`` is traced
    abstractly once more.
    """
    if not context_manual_axes():
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
    if not context_manual_axes():
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
    if not context_manual_axes():
        return tree
    axes = tuple(sorted(set().union(*[varying(v) for v in jax.tree.leaves(like)])))
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


#: The precision of every product the solvers compute themselves (:func:`matmul`,
#: :func:`dot`, and the few einsums): full float32 whatever the default matmul precision,
#: which on a GPU is TF32 (about 1e-3 relative), too coarse for a step's error estimate,
#: an orthogonal basis or a difference array. The user's function keeps its own.
EXACT = jax.lax.Precision.HIGHEST


def matmul(a, b, *, out_sharding=None):
    """``jnp.matmul(a, b)`` at :data:`EXACT` precision."""
    return jnp.matmul(a, b, out_sharding=out_sharding, precision=EXACT)


def dot(a, b):
    """:func:`matmul` of vectors and matrices, its result replicated where ``a`` or ``b``
    is split over an Explicit mesh (which asks where a contraction over a split axis
    goes: an inner product of split vectors, a split Jacobian's product)."""
    return matmul(a, b, out_sharding=P() if sharded_explicit((a, b)) else None)


def on_accelerator():
    """Whether computations run on a GPU/TPU (the default backend, read at trace time),
    where every loop trip syncs its predicate with the host: the solvers then take
    several cheap steps per trip (``check_every``, the Neumann adjoint)."""
    return jax.default_backend() != "cpu"


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


def batched_alike(init, *funs):
    """``(init, *funs)``, with every leaf of ``init`` tied to every other and to the values
    ``funs`` close over, on an Explicit mesh (unchanged elsewhere).

    ``vmap`` of a loop over an Explicit-sharded batch (JAX 0.10) first traces its body
    with the unbatched start values left unbatched; a buffer or constant carry indexed
    there with a batched (sharded) index, or meeting a batched value in ``concatenate``
    or ``select``, then fails ("Use .at[...].get(out_sharding=)", "All operands should
    have the same sharding"). A select that keeps each value, with one element of every
    start value and closed-over value on its other side, batches every carry from the
    start, as the loop would end up batching them anyway (values sharded themselves, a
    whole sharded array, are left out of that side: one element of one is a slice of a
    sharded axis, which an Explicit mesh refuses).

    Finding the closed-over values traces each function (``jax.closure_convert``); the
    functions returned evaluate those traces, so the loop does not trace the Python
    functions again (a loop nested ``d`` deep inside others was traced ``2^d`` times:
    bdf's discrete adjoint on an Explicit mesh spent 5 of its 6 s of tracing so).
    """
    init = on_mesh(init)
    if _explicit_mesh(init) is None:
        return (init, *funs)
    refs = list(jax.tree.leaves(init))
    converted = []
    for fun in funs:
        fun, consts = jax.closure_convert(fun, init)
        refs += list(consts)
        converted.append(functools.partial(_call_with, fun, tuple(consts)))

    def plain(v):  # numbers and booleans (not keys)
        dtype = jnp.result_type(v)
        return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)

    def unsharded(v):  # one element of a sharded (whole) array would be a slice of it
        spec = getattr(getattr(jax.typeof(v), "sharding", None), "spec", ())
        return all(s is None for s in spec)

    refs = [jnp.real(jnp.ravel(r)[0]).astype(jnp.float32) for r in refs
            if jnp.size(r) and plain(r) and unsharded(r)]
    if not refs:
        return (init, *converted)
    total = on_mesh(functools.reduce(jnp.add, refs))

    def tie(v):
        return jnp.where(True, v, total.astype(jnp.result_type(v))) if plain(v) else v

    return (jax.tree.map(tie, init), *converted)


def _call_with(fun, consts, carry):
    """``fun(carry, *consts)``: a closure-converted loop function (see :func:`batched_alike`)."""
    return fun(carry, *consts)


def zeros_like(tree):
    """``jax.tree.map(jnp.zeros_like, tree)``, batched where ``tree`` is on an Explicit
    mesh (``jnp.zeros_like`` of a batched value is not batched; stacking it with batched
    values then fails there, as in :func:`stackable`)."""
    if _explicit_mesh(tree) is None:
        return jax.tree.map(jnp.zeros_like, tree)
    return jax.tree.map(lambda v: jnp.where(False, v, jnp.zeros((), v.dtype)), tree)


def zeros_of(shapes):
    """Zeros shaped as ``jax.eval_shape``'s ``shapes`` (a pytree), split as they are over
    an Explicit mesh (a loop's placeholder for values its body computes)."""

    def one(s):
        sharding = getattr(s, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        split = any(p is not None for p in getattr(sharding, "spec", ()))
        if split and any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
            return jnp.zeros(s.shape, s.dtype, out_sharding=sharding)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree.map(one, shapes)


def sharded_explicit(tree):
    """Whether a leaf of ``tree`` is itself split over an Explicit mesh axis (a whole
    sharded state, not a ``vmap``ped element of a sharded batch)."""
    if _explicit_mesh(tree) is None:
        return False
    for v in jax.tree.leaves(tree):
        spec = getattr(getattr(jax.typeof(v), "sharding", None), "spec", ())
        if any(s is not None for s in spec):
            return True
    return False


def gathered(x):
    """``x`` replicated over the Explicit mesh it is split over (``x`` itself where it is
    not split over one): for a computation XLA does not partition (an LU)."""
    if not sharded_explicit(x):
        return x
    return jax.sharding.reshard(x, NamedSharding(_explicit_mesh(x), P()))


def split_like(x, like):
    """``x`` (of ``like``'s shape) split as ``like`` is: the inverse of :func:`gathered`.

    On an Explicit mesh, resharded to ``like``'s sharding where ``like`` is split (the
    element of a ``vmap``ped batch is not: unchanged); elsewhere outside ``shard_map``,
    tied to ``like`` by ``shard_alike`` (on an Auto mesh, XLA's sharding
    propagation would otherwise replicate what an unpartitioned computation, an LU,
    returns, and a gradient would come back replicated; a no-op on one device). JAX 0.11
    removed ``shard_alike``: there such a result is left to the propagation (the same
    values, possibly replicated).
    """
    if sharded_explicit(like):
        return jax.sharding.reshard(x, jax.typeof(like).sharding)
    if (context_manual_axes() or _explicit_mesh((x, like)) is not None
            or jnp.shape(x) != jnp.shape(like) or shard_alike is None):
        return x
    return shard_alike(x, like)[0]


def map_like(f, xs, like):
    """``jax.vmap(f)(xs)``, or ``jax.lax.map(f, xs)`` (one element after another) where
    ``like`` (what ``f`` closes over) holds an array sharded over an Explicit mesh.

    ``vmap`` of a loop whose carries hold such an array, with a batched predicate,
    selects between batched carries with an unsharded mask (JAX 0.10: "select `which`
    must be scalar or have the same sharding as cases"); a sequential map batches
    nothing. A batch of one is ``f`` of its element, unbatched: a ``vmap``ped loop
    selects between batched carries at every trip, which costs tracing and compile time
    for nothing there (the ODE page's dense-output ``jax.jacrev`` example: 360 -> 330
    computations, 7.2 -> 5.7 s).
    """
    if jnp.shape(jax.tree.leaves(xs)[0])[0] == 1:  # a batch of one
        x = jax.tree.map(lambda v: v[0], xs)
        return jax.tree.map(lambda v: v[None], f(*x) if isinstance(xs, tuple) else f(x))
    if sharded_explicit(like):
        return jax.lax.map(lambda x: f(*x) if isinstance(x, tuple) else f(x), xs)
    return jax.vmap(f)(*xs) if isinstance(xs, tuple) else jax.vmap(f)(xs)


def rows_like(x, n):
    """``n`` rows of zeros shaped, sharded and batched like ``x`` (``(n,) + x.shape``):
    a buffer of states that keeps the state's sharding on an Explicit mesh (a
    ``jnp.zeros((n,) + x.shape)`` there is unsharded, and mixing it with the sharded
    state fails)."""
    return jnp.broadcast_to(zeros_like(x)[None], (n,) + jnp.shape(x))


def while_loop(cond, body, init):
    """``jax.lax.while_loop`` whose start values vary as its body's outputs do (batched
    alike on an Explicit mesh: see :func:`batched_alike`)."""
    if not context_manual_axes():
        init, cond, body = batched_alike(init, cond, body)
        return jax.lax.while_loop(cond, body, init)
    init = match_varying(init, body)

    axes = tuple(sorted(_union(init)))

    def typed_body(carry):  # outputs as varying as the carry (e.g. a constant reset)
        return jax.tree.map(lambda o: vary(o, axes), body(carry))

    return jax.lax.while_loop(cond, typed_body, init)


def scan(f, init, xs):
    """``jax.lax.scan`` whose carry varies alike (see :func:`match_varying`)."""
    if not context_manual_axes():
        return jax.lax.scan(f, on_mesh(init), xs)
    first = jax.tree.map(lambda x: x[0], xs)
    init = match_varying(init, lambda c: f(c, first)[0])
    axes = tuple(sorted(_union(init)))

    def typed(carry, x):
        carry, y = f(carry, x)
        return jax.tree.map(lambda o: vary(o, axes), carry), y

    return jax.lax.scan(typed, init, xs)


def fori_loop(lower, upper, body, init):
    """``jax.lax.fori_loop`` whose carry varies alike (see :func:`scan`; traced bounds:
    see :func:`while_loop`)."""
    if not all(isinstance(b, int) for b in (lower, upper)):
        # As jax.lax.fori_loop does with traced bounds, but the counter is a carry of
        # this module's while_loop (on the mesh, batched alike).
        i0 = jnp.asarray(lower, jnp.int32)
        _, out = while_loop(
            lambda c: c[0] < upper, lambda c: (c[0] + 1, body(c[0], c[1])), (i0, init)
        )
        return out
    if not context_manual_axes():
        return jax.lax.fori_loop(lower, upper, body, on_mesh(init))
    return scan(lambda carry, i: (body(i, carry), None), init, jnp.arange(lower, upper))[0]


def cond(pred, true_fun, false_fun, *operands):
    """``jax.lax.cond(pred, true_fun, false_fun, *operands)`` (differentiable); inside
    ``shard_map`` both branches are evaluated and their results selected: there JAX 0.10
    turns a ``vmap``ped ``cond`` with a batched predicate into a select after casting
    every operand to vary as the predicate does, which a branch traced with invariant
    operands refuses where it casts one to varying itself ("pvary is a
    invariant->variant collective"; :func:`cond_once` is the loop form, which is not
    differentiable in reverse mode)."""
    if not context_manual_axes():
        return jax.lax.cond(pred, true_fun, false_fun, *operands)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fun(*operands),
                        false_fun(*operands))


def cond_once(pred, true_fun, false_fun, *operands, explicit=True):
    """``cond(pred, true_fun, false_fun, *operands)`` for a costly, rarely taken
    ``true_fun``, as a loop of at most one trip where arrays may be sharded (inside
    ``shard_map`` or on an Explicit mesh; :func:`cond` elsewhere).

    ``vmap`` with a batched predicate turns a ``cond`` into a select of both branches
    evaluated for every element, and inside ``shard_map`` (JAX 0.10) first casts every
    operand to vary as the predicate does, which fails in a branch traced with invariant
    operands that casts one to varying itself ("pvary is a invariant->variant
    collective"); on an Explicit mesh it batches the constants the branches close over,
    which belong to no mesh. A loop's batched form takes ``true_fun`` only while some
    element needs it, with its carries (the result) typed alike by :func:`while_loop`.
    ``explicit=False`` keeps the ``cond`` on an Explicit mesh (the loop form is only
    needed inside ``shard_map``), where the loop form fails for branches that close over
    values of no mesh ("Resource axis ... is not found in mesh").
    """
    explicit = explicit and _explicit_mesh((pred, operands)) is not None
    if not context_manual_axes() and not explicit:
        return cond(pred, true_fun, false_fun, *operands)
    out = false_fun(*operands)
    _, out = while_loop(
        lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), true_fun(*operands)), (pred, out)
    )
    return out


def mesh_of(*arrays):
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
    return mesh_of(x) is not None
