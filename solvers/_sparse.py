"""Structured Jacobians (``jac_sparsity=``): compressed forward-mode Jacobians and
block-tridiagonal LU solves, shared by ``odeint(method="bdf" | "kvaerno5")`` and
``root(method="newton")``.

From the static sparsity pattern (a NumPy boolean ``(n, n)`` array, or an int ``w``: the
band ``|i - j| <= w``), at trace time:

- the pattern is symmetrised (``P | Pᵀ``, so that one structure serves ``J`` and ``Jᵀ``,
  the transposed solves of reverse mode) and its diagonal added;
- a reverse Cuthill–McKee permutation (``scipy.sparse.csgraph``) narrows its band to
  half-width ``bw``; the permuted matrix is cut into blocks of ``B >= bw`` rows and
  columns (``B = max(bw, MIN_BLOCK)``), so that it is block tridiagonal with ``nb =
  ceil(n / B)`` diagonal blocks (padded with the identity);
- the columns are coloured greedily (two columns that share a row get different colours),
  so the Jacobian is ``J S`` for a seed matrix ``S`` with one column per colour: one
  ``jvp`` per colour (batched with ``vmap``), the entries scattered into the blocks.

The blocks are factored by block LU (the block Thomas algorithm: ``S_0 = D_0``,
``X_i = L_i S_{i-1}⁻¹``, ``S_i = D_i - X_i U_{i-1}``) with partial pivoting inside each
diagonal block ``S_i`` (``jax.scipy.linalg.lu_factor``), in a ``lax.scan``:
``O(n B²)`` work and ``O(n B)`` memory. There is no pivoting across blocks: that is stable
for block diagonally dominant matrices (``I - cJ`` for small ``c``, discretised diffusion)
and symmetric positive definite ones; where a Schur block ``S_i`` is singular the solve
returns non-finite values, which the callers treat as a failed step (``odeint`` retries
with a smaller step; ``root`` reports the ``nonfinite`` status), never silently.

The solve is a ``jax.lax.custom_linear_solve`` whose transpose uses the same factors
(``Aᵀ = Uᵀ Lᵀ``), so the adjoints get an ``O(n B)`` transposed solve instead of
differentiating through the scans.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Structure", "structure", "MIN_BLOCK"]

#: The smallest block size: fewer, larger blocks mean a shorter sequential scan (a
#: sequential step costs more than a small dense block's arithmetic on CPU).
MIN_BLOCK = 16


def structure(jac_sparsity, n, name="jac_sparsity"):
    """The :class:`Structure` of ``jac_sparsity`` for ``n`` unknowns (``None`` for None).

    Example:
      >>> import numpy as np
      >>> s = structure(1, 40)  # tridiagonal
      >>> s.num_colors, s.bandwidth
      (3, 1)
      >>> structure(np.eye(3, dtype=bool), 3).num_colors
      1
    """
    if jac_sparsity is None:
        return None
    if isinstance(jac_sparsity, Structure):
        if jac_sparsity.n != n:
            raise ValueError(f"`{name}` is for {jac_sparsity.n} unknowns, the state has {n}")
        return jac_sparsity
    # The reordering and the colouring run in Python (a tenth of a second at n = 10,000):
    # once per pattern, not at every call of the solver that is given it.
    pat = _pattern(jac_sparsity, int(n), name)
    key = (pat.indptr.dtype.str, pat.indptr.tobytes(), pat.indices.dtype.str,
           pat.indices.tobytes())
    return _prepared(int(n), *key)


@functools.lru_cache(maxsize=32)
def _prepared(n, indptr_dtype, indptr, indices_dtype, indices):
    """The :class:`Structure` of a validated CSR pattern, given by its index arrays."""
    import scipy.sparse as sp

    indices = np.frombuffer(indices, indices_dtype).copy()
    pat = sp.csr_matrix((np.ones(indices.size, bool), indices,
                         np.frombuffer(indptr, indptr_dtype).copy()), shape=(n, n))
    return Structure(pat, n)


def _pattern(jac_sparsity, n, name):
    """The validated boolean ``(n, n)`` pattern (NumPy), symmetrised, diagonal added."""
    import scipy.sparse as sp

    if isinstance(jac_sparsity, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be an int (a band half-width) or a boolean (n, n) "
                        f"array, got {jac_sparsity!r}")
    if isinstance(jac_sparsity, numbers.Integral):
        w = int(jac_sparsity)
        if w < 0:
            raise ValueError(f"`{name}` as a band half-width must be >= 0, got {w}")
        offsets = list(range(-min(w, n - 1), min(w, n - 1) + 1))
        return sp.diags([np.ones(n - abs(k)) for k in offsets], offsets,
                        format="csr").astype(bool)
    if sp.issparse(jac_sparsity):
        mat = jac_sparsity
    else:
        try:
            mat = np.asarray(jac_sparsity)
        except Exception as e:  # noqa: BLE001 (re-raised with the argument named)
            raise TypeError(f"`{name}` must be concrete: an int or a boolean (n, n) NumPy "
                            f"array known when the solver is traced, got "
                            f"{type(jac_sparsity).__name__}") from e
    if mat.ndim != 2 or mat.shape != (n, n):
        raise ValueError(f"`{name}` must have shape ({n}, {n}) (the flattened state's "
                         f"size, twice), got {mat.shape}")
    if mat.dtype != np.bool_:
        raise TypeError(f"`{name}` must be a boolean array (True where the Jacobian may be "
                        f"nonzero), got dtype {mat.dtype}")
    mat = sp.csr_matrix(mat, dtype=bool)
    mat.eliminate_zeros()  # (stored False entries are not part of the pattern)
    mat.sort_indices()
    return mat


class Structure:
    """A Jacobian sparsity pattern, prepared at trace time (hashable: a static argument).

    Attributes: ``n`` (unknowns), ``perm`` (the RCM order: permuted position ``i`` holds
    unknown ``perm[i]``), ``bandwidth`` (half-width of the permuted, symmetrised pattern),
    ``block`` (``B``), ``num_blocks`` (``nb``), ``colors`` (the colour of each permuted
    column) and ``num_colors`` (jvps per Jacobian).
    """

    def __init__(self, jac_sparsity, n, name="jac_sparsity"):
        import scipy.sparse as sp
        from scipy.sparse.csgraph import reverse_cuthill_mckee

        n = int(n)
        pat = _pattern(jac_sparsity, n, name)
        pat = (pat + pat.T + sp.identity(n, dtype=bool, format="csr")).tocsr().astype(bool)
        pat.sort_indices()
        perm = np.asarray(reverse_cuthill_mckee(pat, symmetric_mode=True), np.int64)
        pp = pat[perm][:, perm].tocoo()
        rows, cols = pp.row.astype(np.int64), pp.col.astype(np.int64)
        bw = int(np.max(np.abs(rows - cols))) if rows.size else 0
        B = max(bw, min(MIN_BLOCK, n), 1)
        nb = -(-n // B)
        colors = _greedy_colors(pp.tocsc(), pp.tocsr(), n)
        k = int(colors.max()) + 1
        self.n, self.perm, self.bandwidth, self.block, self.num_blocks = n, perm, bw, B, nb
        self.colors, self.num_colors = colors, k
        self.iperm = np.argsort(perm)
        # The seeds (original order): unknown perm[j] gets a one in its column's colour.
        seeds = np.zeros((k, n))
        seeds[colors, perm] = 1.0
        self._seeds = seeds
        # Entry (i, j) of the permuted matrix: jvp number colors[j], original row perm[i];
        # it goes to block type (j//B - i//B + 1: 0 = below, 1 = diagonal, 2 = above).
        bi, bj = rows // B, cols // B
        self._src = colors[cols] * n + perm[rows]
        self._dest = (((bj - bi + 1) * nb + bi) * B + rows % B) * B + cols % B
        pad = np.zeros((nb, B, B), bool)
        idx = np.arange(n, nb * B)
        pad[idx // B, idx % B, idx % B] = True
        self._pad = pad
        self._key = (n, B, perm.tobytes(), rows.tobytes(), cols.tobytes())

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, Structure) and self._key == other._key

    def __repr__(self):
        return (f"Structure(n={self.n}, bandwidth={self.bandwidth}, block={self.block}, "
                f"num_colors={self.num_colors})")

    # --- the Jacobian ------------------------------------------------------------------

    def jacobian(self, fun, x):
        """The blocks ``(3, nb, B, B)`` (below, diagonal, above) of ``∂fun/∂x`` at ``x``
        (permuted), from ``num_colors`` jvps."""
        return self.scatter(self.compressed(fun, x))

    def compressed(self, fun, x):
        """The compressed Jacobian ``(num_colors, n)``: one jvp per colour (``vmap``).
        ``num_colors x n`` numbers: the most compact form to keep (:meth:`scatter`)."""
        seeds = jnp.asarray(self._seeds, x.dtype)
        return jax.vmap(lambda s: jax.jvp(fun, (x,), (s,))[1])(seeds)

    def scatter(self, compressed):
        """Blocks from the compressed Jacobian ``(num_colors, n)`` (jvp per colour)."""
        nb, B = self.num_blocks, self.block
        vals = compressed.reshape(-1)[self._src]
        flat = jnp.zeros((3 * nb * B * B,), compressed.dtype).at[self._dest].set(
            vals, unique_indices=True)
        return flat.reshape(3, nb, B, B)

    def dense(self, blocks):
        """The ``(n, n)`` matrix (original order) of ``blocks``: for tests."""
        nb, B, n = self.num_blocks, self.block, self.n
        full = jnp.zeros((nb * B, nb * B), blocks.dtype)
        for i in range(nb):
            sl = slice(i * B, (i + 1) * B)
            full = full.at[sl, sl].set(blocks[1, i])
            if i > 0:
                full = full.at[sl, (i - 1) * B : i * B].set(blocks[0, i])
            if i + 1 < nb:
                full = full.at[sl, (i + 1) * B : (i + 2) * B].set(blocks[2, i])
        full = full[:n, :n]
        return full[self.iperm][:, self.iperm]

    @staticmethod
    def eye_minus(c, blocks):
        """``I - c J`` in block form."""
        B = blocks.shape[-1]
        return (-c * blocks).at[1].add(jnp.eye(B, dtype=blocks.dtype))

    # --- factor and solve --------------------------------------------------------------

    def factor(self, blocks):
        """Block LU of ``blocks`` (padding: the identity): ``(X, Sinv, blocks)`` with
        ``X_i = L_i S_{i-1}⁻¹`` and the inverses ``S_i⁻¹`` of the Schur blocks (each
        by LU with partial pivoting), so that a solve is matrix-vector products only."""
        dtype = blocks.dtype
        B = self.block
        lo, d, up = blocks[0], blocks[1], blocks[2]
        d = jnp.where(jnp.asarray(self._pad), jnp.ones((), dtype), d)
        blocks = blocks.at[1].set(d)
        up_prev = jnp.concatenate([jnp.zeros((1, B, B), dtype), up[:-1]])

        def body(sinv_prev, inp):
            lo_i, d_i, up_p = inp
            X = lo_i @ sinv_prev
            sinv = jnp.linalg.inv(d_i - X @ up_p)
            return sinv, (X, sinv)

        _, (X, sinv) = jax.lax.scan(body, jnp.zeros((B, B), dtype), (lo, d, up_prev))
        return X, sinv, blocks

    def _to_blocks(self, b):
        nb, B = self.num_blocks, self.block
        bp = b[self.perm]
        return jnp.pad(bp, (0, nb * B - self.n)).reshape(nb, B)

    def _from_blocks(self, xb):
        return xb.reshape(-1)[: self.n][self.iperm]

    def matvec(self, blocks, x):
        """``A x`` for ``A`` in block form (original order)."""
        xb = self._to_blocks(x)
        zero = jnp.zeros_like(xb[:1])
        below = jnp.concatenate([zero, xb[:-1]])
        above = jnp.concatenate([xb[1:], zero])
        y = (jnp.einsum("kij,kj->ki", blocks[1], xb) + jnp.einsum("kij,kj->ki", blocks[0], below)
             + jnp.einsum("kij,kj->ki", blocks[2], above))
        return self._from_blocks(y)

    def _solve_blocks(self, X, sinv, up, bb):

        def fwd(y_prev, inp):  # L y = b
            X_i, b_i = inp
            y = b_i - X_i @ y_prev
            return y, y

        _, y = jax.lax.scan(fwd, jnp.zeros_like(bb[0]), (X, bb))

        def bwd(x_next, inp):  # U x = y
            sinv_i, up_i, y_i = inp
            x = sinv_i @ (y_i - up_i @ x_next)
            return x, x

        _, x = jax.lax.scan(bwd, jnp.zeros_like(bb[0]), (sinv, up, y), reverse=True)
        return x

    def _solve_blocks_t(self, factors, bb):
        X, sinv, blocks = factors
        B = self.block
        zero = jnp.zeros((1, B, B), X.dtype)
        up_prev = jnp.concatenate([zero, blocks[2][:-1]])

        def fwd(z_prev, inp):  # Uᵀ z = b
            sinv_i, up_p, b_i = inp
            z = sinv_i.T @ (b_i - up_p.T @ z_prev)
            return z, z

        _, z = jax.lax.scan(fwd, jnp.zeros_like(bb[0]), (sinv, up_prev, bb))
        X_next = jnp.concatenate([X[1:], zero])

        def bwd(x_next, inp):  # Lᵀ x = z
            X_n, z_i = inp
            x = z_i - X_n.T @ x_next
            return x, x

        _, x = jax.lax.scan(bwd, jnp.zeros_like(bb[0]), (X_next, z), reverse=True)
        return x

    def apply_inverse(self, X, sinv, up, b):
        """``A⁻¹ b`` from the factors ``X``, ``S⁻¹`` of :meth:`factor` and ``A``'s blocks
        above the diagonal ``up`` (no ``custom_linear_solve``: for loops that are not
        differentiated, and callers that keep ``A`` in another form)."""
        return self._from_blocks(self._solve_blocks(X, sinv, up, self._to_blocks(b)))

    def solve(self, factors, b):
        """``A⁻¹ b`` (original order) for ``factors = factor(A)``; a
        ``custom_linear_solve`` (its transpose solves with ``Aᵀ`` from the same factors)."""
        blocks = factors[2]

        def matvec(x):
            return self.matvec(blocks, x)

        def solve(_, rhs):
            return self.apply_inverse(factors[0], factors[1], blocks[2], rhs)

        def transpose_solve(_, rhs):
            return self._from_blocks(self._solve_blocks_t(factors, self._to_blocks(rhs)))

        return jax.lax.custom_linear_solve(matvec, b, solve, transpose_solve)


def _greedy_colors(csc, csr, n):
    """Greedy colouring of the columns: a column gets the smallest colour that no column
    sharing a row with it has."""
    colors = -np.ones(n, np.int64)
    indptr_c, rows_of = csc.indptr, csc.indices
    indptr_r, cols_of = csr.indptr, csr.indices
    for j in range(n):
        rows = rows_of[indptr_c[j] : indptr_c[j + 1]]
        nbrs = np.concatenate([cols_of[indptr_r[r] : indptr_r[r + 1]] for r in rows])
        used = colors[nbrs]
        used = used[used >= 0]
        mark = np.zeros(used.size + 1, bool)
        mark[used[used <= used.size]] = True
        colors[j] = int(np.argmin(mark))
    return colors
