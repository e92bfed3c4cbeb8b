"""Structured Jacobians (``jac_sparsity=``): compressed forward-mode Jacobians and
block-tridiagonal solves, shared by ``odeint(method="bdf" | "kvaerno5")`` and
``root(method="newton")``.

From the static sparsity pattern (a NumPy boolean ``(n, n)`` array, or an int ``w``: the
band ``|i - j| <= w``), at trace time:

- the pattern is symmetrised (``P | Pᵀ``, so that one structure serves ``J`` and ``Jᵀ``,
  the transposed solves of reverse mode) and its diagonal added;
- a reverse Cuthill–McKee permutation (``scipy.sparse.csgraph``) narrows its band to
  half-width ``bw`` (where it does not, as for a band, the given order is kept); the
  permuted matrix is cut into blocks of ``B >= bw`` rows and columns (``B = max(bw,
  MIN_BLOCK)``), so that it is block tridiagonal with ``nb = ceil(n / B)`` diagonal
  blocks (padded with the identity);
- the columns are coloured greedily (two columns that share a row get different colours),
  so the Jacobian is ``J S`` for a seed matrix ``S`` with one column per colour: one
  ``jvp`` per colour (batched with ``vmap``), the entries scattered into the blocks.

Small blocks (``B <= REDUCE_MAX_BLOCK``: a narrow band) are solved by block cyclic
reduction: each level eliminates the odd-numbered block unknowns with the inverses of
their diagonal blocks (LAPACK's LU with partial pivoting inside each block, batched over
the level), which leaves a block-tridiagonal system in the even-numbered ones, half as
large, until at most ``DENSE_TAIL`` unknowns are left, inverted whole. ``O(n B²)`` work
and ``O(n B)`` memory in ``log2(nb)`` levels, each a few batched operations: on CPU a
sequential loop over many small blocks costs more than their arithmetic (Brusselator,
n = 2000: a solve 4x, a factorisation 2x faster than a ``lax.scan`` over the blocks).
Larger blocks are factored by block LU (the block Thomas algorithm: ``S_0 = D_0``,
``X_i = L_i S_{i-1}⁻¹``, ``S_i = D_i - X_i U_{i-1}``, each ``S_i`` inverted by LU with
partial pivoting) in a ``lax.scan``, which does about half the arithmetic. Neither
pivots across blocks: that is stable for block diagonally dominant matrices (``I - cJ``
for small ``c``, discretised diffusion; the reduced systems of cyclic reduction stay so:
Heller, SIAM J. Numer. Anal. 13, 1976) and for symmetric positive definite ones; where a
block to invert is singular the solve returns non-finite values, which the callers treat
as a failed step (``odeint`` retries with a smaller step; ``root`` reports the
``nonfinite`` status), never silently.

The solve is a ``jax.lax.custom_linear_solve`` whose transpose is the transpose of the
same linear elimination (``jax.linear_transpose``), so the adjoints get an ``O(n B)``
solve with ``Aᵀ`` from the same factors instead of differentiating through them.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from implicit import _lu, _sharding

__all__ = ["Structure", "structure", "MIN_BLOCK"]

#: The smallest block size: fewer, larger blocks mean fewer (batched) operations over
#: more arithmetic. Measured on CPU, Brusselator N = 1000 (half-width 2), one bdf solve:
#: 30.5 ms with 4, 35.0 with 6, 35.5 with 8; kvaerno5: 40 ms with 4, 48 with 8.
MIN_BLOCK = 4

#: The largest block size solved by cyclic reduction; larger blocks (a wide band) by block
#: LU in a sequential scan, which does about half the arithmetic. Cyclic reduction over
#: block LU on CPU, n = 4000, B = 8 / 16 / 24 / 32: factor 0.48x / 1.17x / 1.7x / 2.7x,
#: solve 0.40x / 0.59x / 0.68x / 0.78x; at B = 100 (2-D Bratu, n = 10,000) a Newton
#: solve took 220 ms against 121 ms.
REDUCE_MAX_BLOCK = 16

#: The reduction stops once the system left has at most this many unknowns (or one block),
#: which is then inverted whole: fewer levels, each a few more operations to compile.
DENSE_TAIL = 16


def structure(jac_sparsity, n, name="jac_sparsity", *, fun=None, x=None, args=(),
              has_aux=False):
    """The :class:`Structure` of ``jac_sparsity`` for ``n`` unknowns (``None`` for None).
    ``"auto"``: the pattern of ``fun``'s Jacobian in ``x`` read from its jaxpr
    (:func:`solvers._sparsity.jacobian_pattern`, ``args`` its other inputs).

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
    if isinstance(jac_sparsity, str) and jac_sparsity == "auto":
        from solvers._sparsity import jacobian_pattern

        jac_sparsity = jacobian_pattern(fun, x, *args, name=name, has_aux=has_aux)
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

    if isinstance(jac_sparsity, str):
        raise ValueError(f"`{name}` must be 'auto', an int (a band half-width) or a boolean "
                         f"(n, n) array, got {jac_sparsity!r}")
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

    Attributes: ``n`` (unknowns), ``perm`` (the RCM order, or the given one where RCM does not
    narrow the band: permuted position ``i`` holds unknown ``perm[i]``), ``bandwidth``
    (half-width of the permuted, symmetrised pattern), ``block`` (``B``), ``num_blocks``
    (``nb``), ``colors`` (the colour of each permuted column) and ``num_colors`` (jvps per
    Jacobian).
    """

    def __init__(self, jac_sparsity, n, name="jac_sparsity"):
        import scipy.sparse as sp
        from scipy.sparse.csgraph import reverse_cuthill_mckee

        n = int(n)
        pat = _pattern(jac_sparsity, n, name)
        pat = (pat + pat.T + sp.identity(n, dtype=bool, format="csr")).tocsr().astype(bool)
        pat.sort_indices()

        def banded(perm):
            pp = pat[perm][:, perm].tocoo()
            rows, cols = pp.row.astype(np.int64), pp.col.astype(np.int64)
            return int(np.max(np.abs(rows - cols))) if rows.size else 0, perm, pp, rows, cols

        # The given order where RCM does not narrow the band (a band stays as it is: no
        # permutation of every right-hand side and solution); ties keep the given order.
        rcm = np.asarray(reverse_cuthill_mckee(pat, symmetric_mode=True), np.int64)
        bw, perm, pp, rows, cols = min(banded(np.arange(n)), banded(rcm), key=lambda c: c[0])
        self._identity = bool(np.all(perm == np.arange(n)))
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

    def diag_minus(self, diag, c, blocks):
        """``D - c J`` in block form, ``D = diag(diag)`` (``diag`` a NumPy vector in the
        original order: a diagonal mass matrix)."""
        nb, B, n = self.num_blocks, self.block, self.n
        d = np.ones(nb * B)
        d[:n] = np.asarray(diag, np.float64)[self.perm]
        eye = jnp.asarray(d.reshape(nb, B), blocks.dtype)[:, :, None] * jnp.eye(
            B, dtype=blocks.dtype)
        return (-c * blocks).at[1].add(eye)

    # --- factor and solve --------------------------------------------------------------

    def factor(self, blocks):
        """The factors of ``A`` (``blocks``, padded with the identity) for :meth:`solve`:
        ``(elimination, blocks)``, ``elimination`` what :meth:`apply_inverse` needs (the
        levels of the cyclic reduction, or the block LU for blocks larger than
        :data:`REDUCE_MAX_BLOCK`: see the module docstring)."""
        dtype = blocks.dtype
        d = jnp.where(jnp.asarray(self._pad), jnp.ones((), dtype), blocks[1])
        blocks = blocks.at[1].set(d)
        # (16-bit floats eliminated in float32: LAPACK inverts no 16-bit blocks)
        lo, d, up = (_lu.factorable(v) for v in (blocks[0], d, blocks[2]))
        return self._elimination()[0](lo, d, up), blocks

    def _elimination(self):
        """``(factor, solve)`` on blocks: cyclic reduction for blocks of up to
        :data:`REDUCE_MAX_BLOCK`, block LU for larger ones."""
        if self.block > REDUCE_MAX_BLOCK:
            return _block_lu, _block_lu_solve
        return _reduce, _reduced_solve

    def _to_blocks(self, b):
        nb, B = self.num_blocks, self.block
        bp = b if self._identity else b[self.perm]
        return jnp.pad(bp, (0, nb * B - self.n)).reshape(nb, B)

    def _from_blocks(self, xb):
        x = xb.reshape(-1)[: self.n]
        return x if self._identity else x[self.iperm]

    def matvec(self, blocks, x):
        """``A x`` for ``A`` in block form (original order)."""
        xb = self._to_blocks(x)
        y = (_mv(blocks[1], xb) + _mv(blocks[0], _shift(xb))
             + _mv(blocks[2], _shift(xb, up=True)))
        return self._from_blocks(y)

    def apply_inverse(self, elimination, b):
        """``A⁻¹ b`` (original order) from ``elimination``, the first of :meth:`factor`'s
        factors (no ``custom_linear_solve``: for loops that are not differentiated)."""
        solve = self._elimination()[1]
        xb = solve(elimination, _lu.factorable(self._to_blocks(b)))  # (as factor lifted)
        return self._from_blocks(xb).astype(b.dtype)

    def solve(self, factors, b):
        """``A⁻¹ b`` (original order) for ``factors = factor(A)``; a
        ``custom_linear_solve`` whose transpose is the transpose of the same (linear)
        elimination, so reverse mode gets an ``O(n B)`` solve with ``Aᵀ``."""
        elimination, blocks = factors

        def matvec(x):
            return self.matvec(blocks, x)

        def solve(_, rhs):
            return self.apply_inverse(elimination, rhs)

        def transpose_solve(_, rhs):
            return jax.linear_transpose(lambda v: self.apply_inverse(elimination, v),
                                        rhs)(rhs)[0]

        return jax.lax.custom_linear_solve(matvec, b, solve, transpose_solve)


def _mv(a, x):
    """Block-wise ``a[k] @ x[k]``."""
    return jnp.einsum("...ij,...j->...i", a, x, precision=_sharding.EXACT)


def _shift(x, up=False):
    """``x[k - 1]`` at ``k`` (zero at ``k = 0``); ``up``: ``x[k + 1]`` (zero at the end)."""
    zero = jnp.zeros_like(x[:1])
    return jnp.concatenate([x[1:], zero]) if up else jnp.concatenate([zero, x[:-1]])


def _block_lu(lo, d, up):
    """Block LU (the block Thomas algorithm) of the block-tridiagonal ``(lo, d, up)``, in a
    ``lax.scan`` over the blocks: ``S_0 = D_0``, ``X_i = L_i S_{i-1}⁻¹``, ``S_i = D_i - X_i
    U_{i-1}``, each ``S_i`` inverted by LU with partial pivoting. Returns ``(X, S⁻¹,
    up)``."""
    up_prev = _shift(up)

    def body(sinv_prev, inp):
        lo_i, d_i, up_p = inp
        X = _sharding.matmul(lo_i, sinv_prev)
        sinv = _lu.inverses(d_i - _sharding.matmul(X, up_p))
        return sinv, (X, sinv)

    _, (X, sinv) = jax.lax.scan(body, jnp.zeros_like(d[0]), (lo, d, up_prev))
    return X, sinv, up


def _block_lu_solve(factors, b):
    """``A⁻¹ b`` for ``b`` in blocks ``(m, B)`` from :func:`_block_lu`'s factors."""
    X, sinv, up = factors

    def fwd(y_prev, inp):  # L y = b
        X_i, b_i = inp
        y = b_i - _sharding.matmul(X_i, y_prev)
        return y, y

    _, y = jax.lax.scan(fwd, jnp.zeros_like(b[0]), (X, b))

    def bwd(x_next, inp):  # U x = y
        sinv_i, up_i, y_i = inp
        x = _sharding.matmul(sinv_i, y_i - _sharding.matmul(up_i, x_next))
        return x, x

    _, x = jax.lax.scan(bwd, jnp.zeros_like(b[0]), (sinv, up, y), reverse=True)
    return x


def _reduce(lo, d, up):
    """Block cyclic reduction of the block-tridiagonal ``(lo, d, up)`` (each ``(m, B,
    B)``; ``lo[0]`` and ``up[-1]`` zero). Per level, the odd-numbered unknowns are
    eliminated with their own diagonal blocks: with ``W_j = D_j⁻¹ [L_j | U_j]`` for odd
    ``j``, even unknown ``i`` (between odd ``i - 1`` and ``i + 1``) gets ``D'_i = D_i -
    L_i W_{i-1}[U] - U_i W_{i+1}[L]``, ``L'_i = -L_i W_{i-1}[L]``, ``U'_i = -U_i
    W_{i+1}[U]``: a block-tridiagonal system half as large, until at most
    :data:`DENSE_TAIL` unknowns (or one block) are left. Returns ``(levels, tail)``: each
    level's ``(D_odd⁻¹, W_odd, [L_even | U_even])`` and the inverse of the system left,
    assembled dense."""
    levels, B = [], d.shape[-1]
    while d.shape[0] * B > DENSE_TAIL and d.shape[0] > 1:
        if d.shape[0] % 2:  # an identity block (and no coupling) makes the count even
            zero = jnp.zeros_like(d[:1])
            lo, up = jnp.concatenate([lo, zero]), jnp.concatenate([up, zero])
            d = jnp.concatenate([d, jnp.eye(d.shape[-1], dtype=d.dtype)[None]])
        d_inv = _lu.inverses(d[1::2])  # partial pivoting inside each block
        w = _sharding.matmul(d_inv, jnp.concatenate([lo[1::2], up[1::2]], -1))
        left, right = _sharding.matmul(lo[0::2], _shift(w)), _sharding.matmul(up[0::2], w)
        levels.append((d_inv, w, jnp.concatenate([lo[0::2], up[0::2]], -1)))
        d = d[0::2] - left[..., B:] - right[..., :B]
        lo, up = -left[..., :B], -right[..., B:]
    m = d.shape[0]  # the rest, dense (LU with partial pivoting across all of it)
    # (placing blocks with a 0/1 matrix: in full precision, or a GPU rounds them to TF32)
    tail = sum(jnp.einsum("ij,iab->iajb", jnp.eye(m, k=k, dtype=d.dtype), blocks,
                          precision=_sharding.EXACT)
               for k, blocks in ((-1, lo), (0, d), (1, up)))
    return tuple(levels), _lu.inverses(tail.reshape(m * B, m * B))


def _reduced_solve(reduction, b):
    """``A⁻¹ b`` for ``b`` in blocks ``(m, B)`` from :func:`_reduce`'s ``reduction``:
    reduce the right-hand side level by level (``v_j = D_j⁻¹ b_j`` for odd ``j``, ``b'_i =
    b_i - L_i v_{i-1} - U_i v_{i+1}``), solve the dense tail, then recover the odd
    unknowns on the way back, ``x_j = v_j - W_j [x_{j-1}; x_{j+1}]``."""
    levels, tail = reduction
    vs, sizes = [], []
    for d_inv, _, coupling in levels:
        sizes.append(b.shape[0])
        if b.shape[0] % 2:
            b = jnp.concatenate([b, jnp.zeros_like(b[:1])])
        v = _mv(d_inv, b[1::2])
        vs.append(v)
        b = b[0::2] - _mv(coupling, jnp.concatenate([_shift(v), v], -1))
    x = _sharding.matmul(tail, b.reshape(-1)).reshape(b.shape)
    for (_, w, _), v, m in zip(levels[::-1], vs[::-1], sizes[::-1]):
        x_odd = v - _mv(w, jnp.concatenate([x, _shift(x, up=True)], -1))
        x = jnp.stack([x, x_odd], 1).reshape(-1, x.shape[-1])[:m]
    return x


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
