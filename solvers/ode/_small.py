"""Products of a step's small matrices (tableau weights, backward differences, output
weights) with states.

``A @ B`` for a small ``A`` is a broadcast product summed over ``k`` where it has few
entries: XLA fuses that with its neighbours, where a dot is a kernel of its own, and on
CPU a dot costs about 0.4 µs even at 6 x 6 x 3, eight times the fused form (measured in a
``while_loop``: 0.40 against 0.05 µs at 6 x 6 x 3, 0.72 against 0.19 at 6 x 6 x 64; past
that the dot is faster: 1.0 against 2.3 µs at 6 x 6 x 128).

Under ``vmap`` that sum is a reduction over a middle axis of a batch, which XLA:CPU
(jaxlib 0.10) hands to YNNPACK from about 10,000 products on, at a few hundred MFLOP/s for
these shapes: 65 µs against 8 µs written as ``k`` scaled rows added up, for 512 products
(1, 7) @ (7, 2) (a dopri5 stage of Lotka–Volterra). 512 vmapped Lotka–Volterra solves
took 100 ms against 16 ms, their gradients 2.5 s against 0.71 s, 64 vmapped Robertson
solves with bdf 76 against 30 ms. Unbatched, the rows' sum is the slower one (Robertson's
bdf gradient: 326 against 357 kernels, 25% more run time), so the batched form is
:func:`matmul`'s ``vmap`` rule alone (``jax.custom_batching.custom_vmap``; its derivatives
are the plain product's): unbatched programs are as before, and so are small batches
(``jax.hessian``'s ``vmap`` over the basis).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from implicit import _sharding

__all__ = ["matmul", "FUSED_MAX"]

#: The most products (``m k N`` for ``(m, k) @ (k, N)``) computed as a fused sum.
FUSED_MAX = 2304  # 6 x 6 x 64


def _count(A, B):
    """How many products ``A @ B`` takes, ``(..., m, k) @ (..., k, N)``, leading axes
    broadcast."""
    batch = math.prod(np.broadcast_shapes(A.shape[:-2], B.shape[:-2]))
    return batch * A.shape[-2] * A.shape[-1] * B.shape[-1]


def _products(A, B):
    """``A[..., i, j] B[..., j, n]`` for every ``i, j, n``: ``A @ B`` before summing over
    ``j``."""
    return A[..., :, :, None] * B[..., None, :, :]


def _summed(A, B):
    """``A @ B``, ``(..., m, k) @ (..., k, N)``: the broadcast product summed over ``k``."""
    return jnp.sum(_products(A, B), axis=-2)


@jax.custom_batching.custom_vmap
def _fused(A, B):
    return _summed(A, B)


@_fused.def_vmap
def _fused_batched(axis_size, in_batched, A, B):
    """``Σ_j A[:, j] B[j]``, batched: ``k - 1`` elementwise additions (see the module
    docstring); a batch of at most ``FUSED_MAX`` products in all (``jax.hessian``'s basis)
    as unbatched."""
    del axis_size  # (the batched operand's leading axis)
    A = A if in_batched[0] else A[None]
    B = B if in_batched[1] else B[None]
    if _count(A, B) <= FUSED_MAX:
        return _summed(A, B), True
    out = A[..., :, 0, None] * B[..., None, 0, :]
    for j in range(1, A.shape[-1]):
        out = out + A[..., :, j, None] * B[..., None, j, :]
    return out, True


@jax.custom_jvp
def _product(A, B):
    return _fused(A, B)


def _product_jvp(primals, tangents):
    # (the derivative jnp.sum(A * B) would have: one sum of both products; a zero
    # tangent's product left out)
    (A, B), (dA, dB) = primals, tangents
    out = _product(A, B)
    terms = []
    if not isinstance(dA, SymbolicZero):
        terms.append(_products(dA, B))
    if not isinstance(dB, SymbolicZero):
        terms.append(_products(A, dB))
    if not terms:
        return out, jnp.zeros_like(out)
    return out, jnp.sum(sum(terms[1:], terms[0]), axis=-2)


_product.defjvp(_product_jvp, symbolic_zeros=True)


def matmul(A, B):
    """``A @ B`` for ``A`` ``(..., m, k)`` or ``(k,)`` and ``B`` ``(..., k, N)`` or ``(k,)``
    (the leading axes broadcast)."""
    if A.ndim == 1:
        return matmul(A[None], B)[..., 0, :]
    if B.ndim == 1:
        return matmul(A, B[:, None])[..., 0]
    if _count(A, B) <= FUSED_MAX:
        return _product(A, B)
    return _sharding.matmul(A, B)  # (full precision: see _sharding.EXACT)
