"""Intra-chunk algebra of the gated delta rule, written once.

Every function works on the 2-D blocks of one chunk of C tokens, so the same
code runs inside Pallas kernels (TPU Mosaic and Triton take 2-D tiles) and,
under `jax.vmap`, in the XLA path:

    q, k        [C, K]    one key head, shared by its group of value heads
    v           [C, V]    one value head
    g, beta     [1, C]    rows, as the kernels load them
    state       [K, V]

Per key head `key_products` forms QK^T and KK^T once; the per-value-head
functions take them as arguments, so grouped value heads never repeat them.
Cumulative sums, transposes of vectors and row extraction are written with
iotas, masks and reductions: no cumsum, slicing or reshapes, which kernel
lowerings do not all have.

Forward of one chunk, G = cumsum(g), D_ij = exp(G_i - G_j) (from the
segment sums, see `segment_sums`):

    A  = strict_tril(beta_i (k_i . k_j) D_ij)      T = (I + A)^-1
    U  = T (beta v)                                W = T (beta exp(G) k)
    Vn = U - W S
    O  = eq * (q S) + P Vn       eq = scale exp(G),  P = scale tril(QK^T * D)
    S' = gamma S + k^T (ek * Vn)  gamma = exp(G_last), ek = exp(G_last - G)

`prepare` needs no state (`decays`, `chunk_inverse`, `wy`, `output_mix`
are its parts, for kernels that split the work into phases), `step` is the
sequential update; their adjoints `step_bwd`, `value_sums` (the terms that
sum over V, so a kernel may add them up block by block), `prepare_bwd` and
`key_products_bwd` make the backward. `operands` (None or a dtype such as bfloat16) rounds the operands
of every matmul outside the chunk inverse to that dtype, accumulating in the
accumulation dtype all the same: what a single bf16 MXU or tensor-core pass
does, made explicit so that its cost can be measured anywhere.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
# Diagonal blocks of (I + A) are inverted by forward substitution at this size,
# then merged pairwise; every step is exact algebra, no matrix powers.
INVERSE_BLOCK = 16


def _dot(a, b, contract, operands):
    # operands: None keeps the accumulation dtype; a dtype (bfloat16) rounds
    # both operands to it, accumulating in the accumulation dtype all the same.
    # HIGHEST asks for full float32 products (several MXU passes); on operands
    # of 16 bits or fewer there is nothing to split and Mosaic refuses it.
    # A DotAlgorithmPreset keeps the operands and names the algorithm (a
    # kernel that lowers float32 products to tensor-core passes).
    acc = a.dtype
    if isinstance(operands, jax.lax.DotAlgorithmPreset):
        return jax.lax.dot_general(a, b, (contract, ((), ())), precision=operands, preferred_element_type=acc)
    if operands is not None:
        a, b = a.astype(operands), b.astype(operands)
    precision = HIGHEST if a.dtype.itemsize >= 4 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc)


def mm(a, b, operands=None):
    """a @ b."""
    return _dot(a, b, ((1,), (0,)), operands)


def mm_nt(a, b, operands=None):
    """a @ b^T."""
    return _dot(a, b, ((1,), (1,)), operands)


def mm_tn(a, b, operands=None):
    """a^T @ b."""
    return _dot(a, b, ((0,), (0,)), operands)


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


def segment_sums(g):
    """[1, C] gates -> [C, C] with entry (i, j) = sum_{j < l <= i} g_l for
    i >= j (zero above the diagonal).

    The pairwise log decay G_i - G_j, summed over its own segment: a
    difference of two cumulative sums cancels when both are large (gates far
    below zero before the segment), leaving float32 an absolute error of
    eps |G| in a decay near 1. As a matmul with a 0/1 matrix, every output
    is a sum of terms of one sign.
    """
    c = g.shape[-1]
    r, j = iotas(c)
    tril = (j <= r).astype(g.dtype)                          # [i, l]: l <= i
    after = jnp.where(r > j, jnp.broadcast_to(row_to_col(g), (c, c)), 0)  # [l, j]: g_l for l > j
    return jax.lax.dot_general(tril, after, (((1,), (0,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=g.dtype)


L2NORM_EPS = 1e-6


def l2norm(x):
    """x / sqrt(sum x^2 + 1e-6) over the last axis, in x's dtype."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def key_products(q, k, *, operands=None):
    """(QK^T, KK^T) of one key head's chunk."""
    return mm_nt(q, k, operands=operands), mm_nt(k, k, operands=operands)


class Decays(NamedTuple):
    """One value head's decay factors in a chunk (state- and value-free)."""

    gcum: jax.Array   # [C, 1]  G, decay dtype
    dm: jax.Array     # [C, C]  exp(G_i - G_j) on and below the diagonal, decay dtype
    eg: jax.Array     # [C, 1]  exp(G)
    ek: jax.Array     # [C, 1]  exp(G_last - G)
    gamma: jax.Array  # [1, 1]  exp(G_last)


def decays(g, *, acc_dtype, decay_dtype) -> Decays:
    """Decay factors from [1, C] gates; eg, ek and gamma in acc_dtype."""
    c = g.shape[-1]
    r, j = iotas(c)
    g = g.astype(decay_dtype)
    gb = jnp.broadcast_to(g, (c, c))
    # G_i = sum_{j <= i} g_j, and the sums after i up to the chunk's end:
    # each a sum of terms of one sign, so nothing cancels.
    gcum = jnp.sum(jnp.where(j <= r, gb, 0), axis=1, keepdims=True)
    gtail = jnp.sum(jnp.where(j > r, gb, 0), axis=1, keepdims=True)
    glast = jnp.sum(g, axis=1, keepdims=True)
    # Mask before the exponential: above the diagonal the sums are >= 0 and may overflow.
    dm = jnp.exp(jnp.where(r >= j, segment_sums(g), -jnp.inf))
    return Decays(gcum=gcum, dm=dm, eg=jnp.exp(gcum).astype(acc_dtype), ek=jnp.exp(gtail).astype(acc_dtype),
                  gamma=jnp.exp(glast).astype(acc_dtype))


def output_mix(qk, dec: Decays, *, scale):
    """P = scale tril(QK^T * D), the intra-chunk output weights [C, C]."""
    return scale * qk * dec.dm.astype(qk.dtype)


def chunk_inverse(kk, beta_col, dec: Decays, *, inverse=unit_lower_inverse):
    """(I + A)^-1 with A = strict_tril(beta_i (k_i . k_j) D_ij)."""
    c = kk.shape[0]
    r, j = iotas(c)
    return inverse(jnp.where(r > j, beta_col * kk * dec.dm.astype(kk.dtype), 0))


def wy(tinv, k, v, beta_col, dec: Decays, *, operands=None):
    """U = T (beta v) [C, V] and W = T (beta exp(G) k) [C, K]."""
    return mm(tinv, beta_col * v, operands=operands), mm(tinv, (beta_col * dec.eg) * k, operands=operands)


class Prepared(NamedTuple):
    """One value head's chunk quantities that do not depend on the state."""

    dec: Decays
    beta: jax.Array   # [C, 1]
    tinv: jax.Array   # [C, C]  (I + A)^-1
    u: jax.Array      # [C, V]
    w: jax.Array      # [C, K]
    p: jax.Array      # [C, C]  scale tril(QK^T * D)
    eq: jax.Array     # [C, 1]  scale exp(G)


def prepare(q, k, v, g, beta, qk, kk, *, scale, decay_dtype, tinv=None, inverse=unit_lower_inverse,
            operands=None):
    """Everything one value head's chunk needs before it sees the state.

    q, k, v, qk, kk come in the accumulation dtype; g and beta as [1, C] rows
    in any float dtype. Pass `tinv` (a saved (I + A)^-1) to skip the inverse.
    """
    acc = q.dtype
    dec = decays(g, acc_dtype=acc, decay_dtype=decay_dtype)
    beta = row_to_col(beta.astype(acc))
    if tinv is None:
        tinv = chunk_inverse(kk, beta, dec, inverse=inverse)
    u, w = wy(tinv, k, v, beta, dec, operands=operands)
    return Prepared(dec=dec, beta=beta, tinv=tinv, u=u, w=w, p=output_mix(qk, dec, scale=scale),
                    eq=scale * dec.eg)


def step(state, q, k, prep: Prepared, *, operands=None):
    """One chunk's output [C, V] and outgoing state [K, V]."""
    vn = prep.u - mm(prep.w, state, operands=operands)
    o = prep.eq * mm(q, state, operands=operands) + mm(prep.p, vn, operands=operands)
    return o, prep.dec.gamma * state + mm_tn(k, prep.dec.ek * vn, operands=operands)


def step_bwd(do, dstate_out, q, k, prep: Prepared, *, operands=None):
    """Adjoint of `step` along the state path: (dVn, dS_in)."""
    dvn = mm_tn(prep.p, do, operands=operands) + prep.dec.ek * mm(k, dstate_out, operands=operands)
    dstate_in = (mm_tn(q, prep.eq * do, operands=operands) + prep.dec.gamma * dstate_out
                 - mm_tn(prep.w, dvn, operands=operands))
    return dvn, dstate_in


class ValueSums(NamedTuple):
    """The backward's terms that sum over the value dim, for one value head's
    chunk: a kernel may add them up over V blocks."""

    dw: jax.Array      # of W: -dVn S^T             [C, K]
    dp: jax.Array      # of P: dO Vn^T              [C, C]
    dqs: jax.Array     # dO S^T (q S's cotangent)   [C, K]
    dks: jax.Array     # Vn dS'^T                   [C, K]
    dgamma: jax.Array  # of gamma: <S, dS'>         [1, 1]
    dbv_u: jax.Array   # (T^T dU) U^T               [C, C]
    v_dbv: jax.Array   # rows of v * (T^T dU)       [C, 1]


def value_sums(state, dstate_out, do, dvn, u, v, w, tinv, beta_col, *, operands=None):
    """`ValueSums` of one V block (or all of V), and that block's dv.

    state, dstate_out [K, BV]; do, dvn, u, v [C, BV]; w [C, K]; tinv [C, C].
    """
    vn = u - mm(w, state, operands=operands)
    dbv = mm_tn(tinv, dvn, operands=operands)   # dU = dVn
    sums = ValueSums(
        dw=-mm_nt(dvn, state, operands=operands), dp=mm_nt(do, vn, operands=operands),
        dqs=mm_nt(do, state, operands=operands), dks=mm_nt(vn, dstate_out, operands=operands),
        dgamma=jnp.sum(jnp.sum(state * dstate_out, axis=1, keepdims=True), axis=0, keepdims=True),
        dbv_u=mm_nt(dbv, u, operands=operands), v_dbv=jnp.sum(v * dbv, axis=1, keepdims=True),
    )
    return sums, beta_col * dbv


def add_sums(a: ValueSums, b: ValueSums) -> ValueSums:
    return ValueSums(*(x + y for x, y in zip(a, b)))


class PreparedGrads(NamedTuple):
    """One value head's input cotangents; dq, dk still miss the QK^T, KK^T terms."""

    dq: jax.Array    # [C, K]
    dk: jax.Array    # [C, K]
    dg: jax.Array    # [1, C]
    dbeta: jax.Array  # [1, C]
    dqk: jax.Array   # [C, C]  to sum over the key head's value heads
    dkk: jax.Array   # [C, C]


def prepare_bwd(q, k, qk, kk, dec: Decays, beta, tinv, w, sums: ValueSums, *, scale,
                operands=None) -> PreparedGrads:
    """Adjoint of `prepare` for one value head, from the V sums (dv comes
    with them, from `value_sums`).

    The inverse is not differentiated through: with X = beta exp(G) k,
    dA = -T^T (dU (beta v)^T + dW X^T) T^T = -(T^T dU) U^T - (T^T dW) W^T.
    """
    acc = q.dtype
    c = q.shape[0]
    r, j = iotas(c)
    dm = dec.dm.astype(acc)
    eg, eq = dec.eg, scale * dec.eg

    # W = T (beta exp(G) k)
    dx = mm_tn(tinv, sums.dw, operands=operands)
    da = jnp.where(r > j, -(sums.dbv_u + mm_nt(dx, w, operands=operands)), 0)
    kdx = jnp.sum(k * dx, axis=1, keepdims=True)
    dk = (beta * eg) * dx
    # A = strict_tril(beta_i kk_ij D_ij)
    dbeta = sums.v_dbv + eg * kdx + jnp.sum(da * kk * dm, axis=1, keepdims=True)
    dgcum = beta * eg * kdx
    dkk = da * beta * dm
    # P = scale tril(qk * D)   (D is already 0 above the diagonal)
    dqk = scale * sums.dp * dm
    m = (da * beta * kk + scale * sums.dp * qk) * dm
    # D_ij = exp(G_i - G_j)
    dgcum = dgcum + jnp.sum(m, axis=1, keepdims=True) - row_to_col(jnp.sum(m, axis=0, keepdims=True))
    # q S scaled by eq = scale exp(G)
    dq = eq * sums.dqs
    dgcum = dgcum + eq * jnp.sum(sums.dqs * q, axis=1, keepdims=True)
    # k^T (ek Vn), ek = exp(G_last - G);  gamma = exp(G_last)
    rk = dec.ek * jnp.sum(sums.dks * k, axis=1, keepdims=True)
    dk = dk + dec.ek * sums.dks
    dlast = jnp.sum(rk, axis=0, keepdims=True) + dec.gamma * sums.dgamma
    last_row = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
    dgcum = dgcum - rk + jnp.where(last_row, dlast, 0)
    # G = cumsum(g): dg_j = sum_{i >= j} dG_i
    dg = jnp.sum(jnp.where(r >= j, jnp.broadcast_to(dgcum, (c, c)), 0), axis=0, keepdims=True)
    return PreparedGrads(dq=dq, dk=dk, dg=dg, dbeta=col_to_row(dbeta), dqk=dqk, dkk=dkk)


def key_products_bwd(q, k, dqk, dkk, *, operands=None):
    """(dq, dk) through QK^T and KK^T, with dqk, dkk summed over value heads."""
    dq = mm(dqk, k, operands=operands)
    dk = mm_tn(dqk, q, operands=operands) + mm(dkk, k, operands=operands) + mm_tn(dkk, k, operands=operands)
    return dq, dk


def value_head_forward(q, k, v, g, beta, qk, kk, state, *, scale, decay_dtype, inverse=unit_lower_inverse,
                       operands=None):
    """One value head's chunk: (o [C, V], outgoing state [K, V], (I + A)^-1)."""
    prep = prepare(q, k, v, g, beta, qk, kk, scale=scale, decay_dtype=decay_dtype, inverse=inverse,
                   operands=operands)
    o, new_state = step(state, q, k, prep, operands=operands)
    return o, new_state, prep.tinv


class ValueHeadGrads(NamedTuple):
    dv: jax.Array         # [C, V]
    dg: jax.Array         # [1, C]
    dbeta: jax.Array      # [1, C]
    dq: jax.Array         # [C, K]  to sum over the key head's value heads,
    dk: jax.Array         # [C, K]  then add `key_products_bwd`
    dqk: jax.Array        # [C, C]
    dkk: jax.Array        # [C, C]
    dstate_in: jax.Array  # [K, V]


def value_head_backward(q, k, v, g, beta, qk, kk, tinv, state, do, dstate_out, *, scale, decay_dtype,
                        operands=None):
    """Adjoint of `value_head_forward` given the chunk's saved inverse and
    incoming state, the output cotangent and the outgoing state's cotangent."""
    prep = prepare(q, k, v, g, beta, qk, kk, scale=scale, decay_dtype=decay_dtype, tinv=tinv, operands=operands)
    dvn, dstate_in = step_bwd(do, dstate_out, q, k, prep, operands=operands)
    sums, dv = value_sums(state, dstate_out, do, dvn, prep.u, v, prep.w, prep.tinv, prep.beta, operands=operands)
    pg = prepare_bwd(q, k, qk, kk, prep.dec, prep.beta, prep.tinv, prep.w, sums, scale=scale, operands=operands)
    return ValueHeadGrads(dv, pg.dg, pg.dbeta, pg.dq, pg.dk, pg.dqk, pg.dkk, dstate_in)
