"""Products of a step's small matrices (tableau weights, backward differences, output
weights) with states.

``A @ B`` for a small ``A`` is a broadcast product and sum where it has few entries: XLA
fuses that with its neighbours, where a dot is a kernel of its own, and on CPU a dot
costs about 0.4 µs even at 6 x 6 x 3, eight times the fused form (measured in a
``while_loop``: 0.40 against 0.05 µs at 6 x 6 x 3, 0.72 against 0.19 at 6 x 6 x 64; past
that the dot is faster: 1.0 against 2.3 µs at 6 x 6 x 128).
"""

from __future__ import annotations

import jax.numpy as jnp

from implicit import _sharding

__all__ = ["matmul", "FUSED_MAX"]

#: The most products (``m k N`` for ``(m, k) @ (k, N)``) computed as a fused sum.
FUSED_MAX = 2304  # 6 x 6 x 64


def matmul(A, B):
    """``A @ B`` for ``A`` ``(m, k)`` or ``(k,)`` and ``B`` ``(k, N)`` or ``(k,)``."""
    if A.ndim == 1:
        return matmul(A[None], B)[0]
    if B.ndim == 1:
        return matmul(A, B[:, None])[:, 0]
    if A.shape[0] * A.shape[1] * B.shape[1] <= FUSED_MAX:
        return jnp.sum(A[:, :, None] * B[None], axis=1)
    return _sharding.matmul(A, B)  # (full precision: see _sharding.EXACT)
