"""Tile primitives every delta-rule chunk algebra is written in.

2-D blocks only: dot products with an explicit operand precision, bfloat16
splits of float32 operands, row/column moves with iotas and masks, the exact
inverse of a unit lower triangular chunk matrix, segment sums of gates and
l2norm. No cumsum, slicing or reshapes inside a kernel's path, which kernel
lowerings (Mosaic, Triton) do not all have, so the same code runs inside
Pallas kernels and, under `jax.vmap`, in the XLA path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
# Diagonal blocks of (I + A) are inverted by forward substitution at this size,
# then merged pairwise; every step is exact algebra, no matrix powers.
INVERSE_BLOCK = 16
# The TPU kernels' inverse solves blocks of 8 rows (unit_lower_inverse_rows):
# on a TPU v5e 16 and 32 were slower (more vector work in the serial steps).
KERNEL_INVERSE_BLOCK = 8


def dot(a, b, contract, matmul_dtype=None):
    """dot_general of a and b over `contract` ((a dims,), (b dims,)), in the
    wider operand's dtype."""
    # matmul_dtype: None keeps the accumulation dtype; a dtype (bfloat16) rounds
    # both operands to it, accumulating in the accumulation dtype all the same.
    # HIGHEST asks for full float32 products (several MXU passes); on operands
    # of 16 bits or fewer there is nothing to split and Mosaic refuses it.
    # A DotAlgorithmPreset keeps the operands and names the algorithm (a
    # kernel that lowers float32 products to tensor-core passes).
    # A bfloat16 operand (a raw input block) with a float32 one, products in
    # float32: `exact_dot`, as exact at half the registers of split pairs.
    if a.dtype != b.dtype and jnp.bfloat16 in (a.dtype, b.dtype) and (
            matmul_dtype is None or isinstance(matmul_dtype, jax.lax.DotAlgorithmPreset)):
        return exact_dot(a, b, contract, exact=0 if a.dtype == jnp.bfloat16 else 1)
    acc = jnp.promote_types(a.dtype, b.dtype)
    if isinstance(matmul_dtype, jax.lax.DotAlgorithmPreset):
        return jax.lax.dot_general(a, b, (contract, ((), ())), precision=matmul_dtype, preferred_element_type=acc)
    if matmul_dtype is not None:
        a, b = a.astype(matmul_dtype), b.astype(matmul_dtype)
    precision = HIGHEST if a.dtype.itemsize >= 4 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc)


def mm(a, b, matmul_dtype=None):
    """a @ b."""
    return dot(a, b, ((1,), (0,)), matmul_dtype)


def mm_nt(a, b, matmul_dtype=None):
    """a @ b^T."""
    return dot(a, b, ((1,), (1,)), matmul_dtype)


def mm_tn(a, b, matmul_dtype=None):
    """a^T @ b."""
    return dot(a, b, ((0,), (0,)), matmul_dtype)


def bf16_parts(x, parts: int = 3) -> list:
    """float32 x as `parts` bfloat16 terms that sum to it (8 bits of
    mantissa each: three cover float32's 24)."""
    out = []
    for _ in range(parts):
        part = x.astype(jnp.bfloat16)
        out.append(part)
        x = x - part.astype(x.dtype)
    return out


def exact_dot(a, b, contract, *, exact: int = 0):
    """dot_general of a and b where operand `exact` (0: a, 1: b) holds values
    that are exactly bfloat16 (a bfloat16 input, a 0/1 mask) and the other is
    float32: bfloat16 passes over the float32 operand's three parts, each
    product exact, the sums in float32, so float32's accuracy at half the
    registers of TF32 parts (what a GPU kernel runs out of first)."""
    x, y = (a, b) if exact == 0 else (b, a)
    x = x.astype(jnp.bfloat16)
    out = None
    for part in bf16_parts(y):
        pair = (x, part) if exact == 0 else (part, x)
        term = jax.lax.dot_general(*pair, (contract, ((), ())), preferred_element_type=y.dtype)
        out = term if out is None else out + term
    return out


def batched_like(mask, x):
    """The constant 0/1 matrix `mask` mapped as x is: the same values, with
    the axes a jax.vmap maps x over (none outside one). The TPU kernels run
    a tile's value heads as one vmapped chunk algebra; with the mask mapped
    too, its product with x is a batched [heads, C, C] product, which Mosaic
    lowers on every TPU generation (a constant times a mapped operand
    becomes a reshape that v4's Mosaic refuses)."""
    anchor = jnp.max(x, keepdims=True)
    return jnp.where(anchor == anchor, mask, mask)  # both branches are mask: NaN in x changes nothing


def iotas(c: int):
    """(row index, column index) of a [c, c] tile."""
    return jax.lax.broadcasted_iota(jnp.int32, (c, c), 0), jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)


def row_to_col(x):
    """[1, C] -> [C, 1]."""
    c = x.shape[-1]
    r, j = iotas(c)
    return jnp.sum(jnp.where(r == j, jnp.broadcast_to(x, (c, c)), 0), axis=1, keepdims=True)


def col_to_row(x):
    """[C, 1] -> [1, C]."""
    c = x.shape[0]
    r, j = iotas(c)
    return jnp.sum(jnp.where(r == j, jnp.broadcast_to(x, (c, c)), 0), axis=0, keepdims=True)


def unit_lower_inverse(a):
    """Exact (I + a)^-1 for strictly lower triangular a [C, C] (XLA).

    Blocked forward substitution: invert the diagonal blocks row by row, then
    merge neighbouring blocks with inv21 = -inv22 a21 inv11 until one block
    covers the chunk. Static slices and concatenation: fine for XLA, not for
    every kernel lowering (see `unit_lower_inverse_loop`).
    """
    c = a.shape[-1]
    b = min(INVERSE_BLOCK, c)
    if c % b:
        raise ValueError(f"chunk size {c} is not a multiple of {b}")
    inv = []
    for blk in range(c // b):
        d = a[blk * b:(blk + 1) * b, blk * b:(blk + 1) * b]
        eye = jnp.eye(b, dtype=a.dtype)
        t = eye
        for i in range(1, b):
            # rows < i of t are final and d[i, j >= i] = 0
            t = t.at[i, :].set(eye[i] - mm(d[i:i + 1, :], t)[0])
        inv.append(t)
    size = b
    while len(inv) > 1:
        merged = []
        for m in range(0, len(inv), 2):
            lo, hi = m * size, (m + 1) * size
            i11, i22 = inv[m], inv[m + 1]
            i21 = -mm(i22, mm(a[hi:hi + size, lo:hi], i11))
            top = jnp.concatenate([i11, jnp.zeros_like(i11)], axis=1)
            merged.append(jnp.concatenate([top, jnp.concatenate([i21, i22], axis=1)], axis=0))
        inv = merged
        size *= 2
    return inv[0]


def unit_lower_inverse_loop(a):
    """Exact (I + a)^-1 for strictly lower triangular a [C, C] (kernels).

    Forward substitution one row at a time, row i of T being
    e_i - sum_j a[i, j] T[j] (rows j < i final), written with masks and
    reductions in a loop that is not unrolled: every kernel lowering has
    these, and the kernel holds one step's code whatever C is, so it
    compiles quickly (matmul-based forms multiplied Triton's compile time:
    each float32 matmul becomes thousands of FMAs per thread).
    """
    c = a.shape[-1]
    r, j = iotas(c)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1)
    at = jnp.transpose(a)

    def row(i, t):
        a_i = jnp.sum(jnp.where(j == i, at, 0), axis=1, keepdims=True)  # a[i, :] as a column
        new = (col == i).astype(a.dtype) - jnp.sum(a_i * t, axis=0, keepdims=True)
        return jnp.where(r == i, new, t)

    # int32 bounds: an int64 loop index (under x64) is one Mosaic cannot lower
    return jax.lax.fori_loop(jnp.int32(1), jnp.int32(c), row, (r == j).astype(a.dtype))


def unit_lower_inverse_rows(a):
    """Exact (I + a)^-1 for strictly lower triangular a [C, C] (TPU kernels,
    their value heads vmapped into [heads, C, C] operations).

    Forward substitution by blocks of KERNEL_INVERSE_BLOCK rows: block i of
    the inverse is X_i = (I + D_i)^-1 (E_i - a_{i,<i} X_{<i}), D_i its
    diagonal block. The rows already solved enter through one float32
    product (the MXU's, small); the block's own rows are solved on the
    vector units column by column (right-looking): once row r is final,
    every later row takes away a[., r] times it, one multiply and one
    subtract of the block, with no reduction across lanes or sublanes. A
    product per serial step (the blocked form with merges by matrix powers)
    spent 15 of a 23 ms forward on a TPU v5e (T=32768, 32 value heads);
    rows solved left-looking (a masked sum per row) in blocks of 16, 11.8 ms;
    this form in blocks of 8, 9.7 ms.
    """
    c = a.shape[-1]
    b = min(KERNEL_INVERSE_BLOCK, c)
    if c % b:
        raise ValueError(f"chunk size {c} is not a multiple of {b}")
    rows = jax.lax.broadcasted_iota(jnp.int32, (b, c), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (b, c), 1)
    solved = []
    for lo in range(0, c, b):
        x = (rows + lo == cols).astype(a.dtype)  # rows lo..lo+b of the identity
        if lo:
            x = x - mm(a[lo:lo + b, :lo], jnp.concatenate(solved, axis=0))
        diag = a[lo:lo + b, lo:lo + b]  # strictly lower: column r is zero in rows <= r
        for r in range(b - 1):
            x = x - diag[:, r:r + 1] * x[r:r + 1, :]
        solved.append(x)
    return jnp.concatenate(solved, axis=0)


def segment_sums(g, *, split=False):
    """[1, C] gates -> [C, C] with entry (i, j) = sum_{j < l <= i} g_l for
    i >= j (zero above the diagonal).

    The pairwise log decay G_i - G_j, summed over its own segment: a
    difference of two cumulative sums cancels when both are large (gates far
    below zero before the segment), leaving float32 an absolute error of
    eps |G| in a decay near 1. As a matmul with a 0/1 matrix, every output
    is a sum of terms of one sign.

    split: float32 gates as three bfloat16 parts (8 bits of mantissa each),
    one bfloat16 matmul per part with float32 sums: products with 0/1 are
    exact, so this matches the float32 matmul, and it fits in a GPU
    kernel's registers where a float32 FMA dot of [C, C] tiles does not.
    """
    c = g.shape[-1]
    r, j = iotas(c)
    tril = batched_like((j <= r).astype(g.dtype), g)         # [i, l]: l <= i
    after = jnp.where(r > j, jnp.broadcast_to(row_to_col(g), (c, c)), 0)  # [l, j]: g_l for l > j
    if split:
        return exact_dot(tril, after, ((1,), (0,)))
    return jax.lax.dot_general(tril, after, (((1,), (0,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=g.dtype)


L2NORM_EPS = 1e-6


def l2norm_scale(x):
    """1 / sqrt(sum x^2 + 1e-6) over the last axis (keepdims), in x's dtype."""
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def l2norm(x):
    """x / sqrt(sum x^2 + 1e-6) over the last axis, in x's dtype."""
    return x * l2norm_scale(x)
