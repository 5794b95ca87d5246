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
sequential update. The backward comes in parts a kernel may run on blocks
of K and V: `step_bwd` (the state path), `value_grads` and `state_sums`
(sums over V), `key_grads` (sums over K), `gate_terms` and `gate_grads`
(the [C, C] algebra of the gates and beta), `key_products_bwd`.
`matmul_dtype` (None or a dtype such as bfloat16) rounds the operands
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
    tril = (j <= r).astype(g.dtype)                          # [i, l]: l <= i
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


def key_products(q, k, *, matmul_dtype=None):
    """(QK^T, KK^T) of one key head's chunk."""
    return mm_nt(q, k, matmul_dtype=matmul_dtype), mm_nt(k, k, matmul_dtype=matmul_dtype)


class Decays(NamedTuple):
    """One value head's decay factors in a chunk (state- and value-free)."""

    gcum: jax.Array   # [C, 1]  G, decay dtype
    dm: jax.Array     # [C, C]  exp(G_i - G_j) on and below the diagonal, decay dtype
    eg: jax.Array     # [C, 1]  exp(G)
    ek: jax.Array     # [C, 1]  exp(G_last - G)
    gamma: jax.Array  # [1, 1]  exp(G_last)


def decays(g, *, state_dtype, decay_dtype, split_segments=False) -> Decays:
    """Decay factors from [1, C] gates; eg, ek and gamma in state_dtype
    (`split_segments`: see `segment_sums`)."""
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
    dm = jnp.exp(jnp.where(r >= j, segment_sums(g, split=split_segments), -jnp.inf))
    return Decays(gcum=gcum, dm=dm, eg=jnp.exp(gcum).astype(state_dtype), ek=jnp.exp(gtail).astype(state_dtype),
                  gamma=jnp.exp(glast).astype(state_dtype))


def output_mix(qk, dec: Decays, *, scale):
    """P = scale tril(QK^T * D), the intra-chunk output weights [C, C]."""
    return scale * qk * dec.dm.astype(qk.dtype)


def chunk_inverse(kk, beta_col, dec: Decays, *, inverse=unit_lower_inverse):
    """(I + A)^-1 with A = strict_tril(beta_i (k_i . k_j) D_ij)."""
    c = kk.shape[0]
    r, j = iotas(c)
    return inverse(jnp.where(r > j, beta_col * kk * dec.dm.astype(kk.dtype), 0))


def wy(tinv, k, v, beta_col, dec: Decays, *, matmul_dtype=None):
    """U = T (beta v) [C, V] and W = T (beta exp(G) k) [C, K]."""
    return (wy_values(tinv, v, beta_col, matmul_dtype=matmul_dtype),
            wy_keys(tinv, k, beta_col, dec, matmul_dtype=matmul_dtype))


def wy_values(tinv, v, beta_col, *, matmul_dtype=None):
    """U = T (beta v), for any columns of v."""
    return mm(tinv, beta_col * v, matmul_dtype=matmul_dtype)


def wy_keys(tinv, k, beta_col, dec: Decays, *, matmul_dtype=None):
    """W = T (beta exp(G) k), for any columns of k."""
    return mm(tinv, (beta_col * dec.eg) * k, matmul_dtype=matmul_dtype)


class ChunkTerms(NamedTuple):
    """One value head's chunk quantities that do not depend on the state."""

    dec: Decays
    beta: jax.Array   # [C, 1]
    tinv: jax.Array   # [C, C]  (I + A)^-1
    u: jax.Array      # [C, V]
    w: jax.Array      # [C, K]
    p: jax.Array      # [C, C]  scale tril(QK^T * D)
    eq: jax.Array     # [C, 1]  scale exp(G)


def chunk_terms(q, k, v, g, beta, qk, kk, *, scale, decay_dtype, tinv=None, inverse=unit_lower_inverse,
                matmul_dtype=None):
    """Everything one value head's chunk needs before it sees the state.

    q, k, v, qk, kk come in the accumulation dtype; g and beta as [1, C] rows
    in any float dtype. Pass `tinv` (a saved (I + A)^-1) to skip the inverse.
    """
    acc = q.dtype
    dec = decays(g, state_dtype=acc, decay_dtype=decay_dtype)
    beta = row_to_col(beta.astype(acc))
    if tinv is None:
        tinv = chunk_inverse(kk, beta, dec, inverse=inverse)
    u, w = wy(tinv, k, v, beta, dec, matmul_dtype=matmul_dtype)
    return ChunkTerms(dec=dec, beta=beta, tinv=tinv, u=u, w=w, p=output_mix(qk, dec, scale=scale),
                      eq=scale * dec.eg)


def step(state, q, k, prep: ChunkTerms, *, matmul_dtype=None):
    """One chunk's output [C, V] and outgoing state [K, V]."""
    vn = prep.u - mm(prep.w, state, matmul_dtype=matmul_dtype)
    o = prep.eq * mm(q, state, matmul_dtype=matmul_dtype) + mm(prep.p, vn, matmul_dtype=matmul_dtype)
    return o, prep.dec.gamma * state + mm_tn(k, prep.dec.ek * vn, matmul_dtype=matmul_dtype)


def step_bwd(do, dstate_out, q, k, prep: ChunkTerms, *, matmul_dtype=None):
    """Adjoint of `step` along the state path: (dVn, dS_in)."""
    dvn = mm_tn(prep.p, do, matmul_dtype=matmul_dtype) + prep.dec.ek * mm(k, dstate_out, matmul_dtype=matmul_dtype)
    dstate_in = (mm_tn(q, prep.eq * do, matmul_dtype=matmul_dtype) + prep.dec.gamma * dstate_out
                 - mm_tn(prep.w, dvn, matmul_dtype=matmul_dtype))
    return dvn, dstate_in


class ValueSums(NamedTuple):
    """Backward terms of one value head's chunk that sum over the value dim
    into [C, C] and [C, 1]: a kernel may add them up over V blocks."""

    dp: jax.Array      # of P: dO Vn^T              [C, C]
    dbv_u: jax.Array   # (T^T dU) U^T               [C, C]
    v_dbv: jax.Array   # rows of v * (T^T dU)       [C, 1]


def value_grads(do, dvn, vn, u, v, tinv, beta_col, *, matmul_dtype=None):
    """(dv, `ValueSums`) of one V block (or all of V); dU = dVn.

    do, dvn, vn, u, v [C, BV]; tinv [C, C].
    """
    dbv = mm_tn(tinv, dvn, matmul_dtype=matmul_dtype)
    sums = ValueSums(dp=mm_nt(do, vn, matmul_dtype=matmul_dtype), dbv_u=mm_nt(dbv, u, matmul_dtype=matmul_dtype),
                     v_dbv=jnp.sum(v * dbv, axis=1, keepdims=True))
    return beta_col * dbv, sums


class StateSums(NamedTuple):
    """Backward terms that contract the state over the value dim, for some
    rows of K: a kernel may add them up over V blocks, K block by K block."""

    dw: jax.Array      # of W: -dVn S^T             [C, BK]
    dqs: jax.Array     # dO S^T (q S's cotangent)   [C, BK]
    dks: jax.Array     # Vn dS'^T                   [C, BK]
    dgamma: jax.Array  # of gamma: <S, dS'>         [1, 1]


def state_sums(state, dstate_out, do, dvn, vn, *, matmul_dtype=None) -> StateSums:
    """`StateSums` of a [BK, BV] block of the incoming state and of the
    outgoing state's cotangent; do, dvn, vn [C, BV]."""
    return StateSums(
        dw=-mm_nt(dvn, state, matmul_dtype=matmul_dtype), dqs=mm_nt(do, state, matmul_dtype=matmul_dtype),
        dks=mm_nt(vn, dstate_out, matmul_dtype=matmul_dtype),
        dgamma=jnp.sum(jnp.sum(state * dstate_out, axis=1, keepdims=True), axis=0, keepdims=True))


def add_sums(a, b):
    """Elementwise sum of two `ValueSums`, `StateSums` or `KeySums`."""
    return type(a)(*(x + y for x, y in zip(a, b)))


class KeySums(NamedTuple):
    """Key-side backward terms of one value head's chunk that sum over the
    key dim: a kernel may add them up over K blocks."""

    dxw: jax.Array   # (T^T dW) W^T               [C, C]
    kdx: jax.Array   # rows of k * T^T dW         [C, 1]
    qdqs: jax.Array  # rows of q * dO S^T         [C, 1]
    kdks: jax.Array  # rows of k * Vn dS'^T       [C, 1]


def key_grads(q, k, w, sums: StateSums, tinv, beta_col, dec: Decays, *, scale, matmul_dtype=None):
    """(dq, dk, `KeySums`) of some columns of K (or all of K); dq and dk
    still miss the QK^T and KK^T terms (`key_products_bwd`).

    q, k, w and the sums' dw, dqs, dks: the same [C, BK] columns.
    """
    dx = mm_tn(tinv, sums.dw, matmul_dtype=matmul_dtype)  # of X = beta exp(G) k, through W = T X
    dq = (scale * dec.eg) * sums.dqs
    dk = (beta_col * dec.eg) * dx + dec.ek * sums.dks
    return dq, dk, KeySums(dxw=mm_nt(dx, w, matmul_dtype=matmul_dtype), kdx=jnp.sum(k * dx, axis=1, keepdims=True),
                           qdqs=jnp.sum(q * sums.dqs, axis=1, keepdims=True),
                           kdks=jnp.sum(k * sums.dks, axis=1, keepdims=True))


class GateTerms(NamedTuple):
    """What the gate and beta gradients of one value head's chunk need
    besides QK^T and KK^T."""

    da: jax.Array     # of A = strict_tril(beta_i kk_ij D_ij)   [C, C]
    dp: jax.Array     # of P                                    [C, C]
    dbeta: jax.Array  # without A's term                        [C, 1]
    dgcum: jax.Array  # of G, without the D_ij term             [C, 1]


def gate_terms(dec: Decays, beta_col, vsums: ValueSums, ksums: KeySums, dgamma, *, scale) -> GateTerms:
    """The sums over V and K combined into `GateTerms`.

    The inverse is not differentiated through: with X = beta exp(G) k,
    dA = -T^T (dU (beta v)^T + dW X^T) T^T = -(T^T dU) U^T - (T^T dW) W^T.
    """
    c = beta_col.shape[0]
    r, j = iotas(c)
    da = jnp.where(r > j, -(vsums.dbv_u + ksums.dxw), 0)
    # k^T (ek Vn), ek = exp(G_last - G);  gamma = exp(G_last)
    rk = dec.ek * ksums.kdks
    dlast = jnp.sum(rk, axis=0, keepdims=True) + dec.gamma * dgamma
    last_row = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
    # X = beta exp(G) k;  q S scaled by eq = scale exp(G)
    dgcum = beta_col * dec.eg * ksums.kdx + (scale * dec.eg) * ksums.qdqs - rk + jnp.where(last_row, dlast, 0)
    return GateTerms(da=da, dp=vsums.dp, dbeta=vsums.v_dbv + dec.eg * ksums.kdx, dgcum=dgcum)


class GateGrads(NamedTuple):
    dg: jax.Array     # [1, C]
    dbeta: jax.Array  # [1, C]
    dqk: jax.Array    # [C, C]  to sum over the key head's value heads
    dkk: jax.Array    # [C, C]


def gate_grads(qk, kk, dec: Decays, beta_col, terms: GateTerms, *, scale) -> GateGrads:
    """dg and dbeta of one value head's chunk, and the cotangents of QK^T
    and KK^T, from its `GateTerms`."""
    c = qk.shape[0]
    r, j = iotas(c)
    dm = dec.dm.astype(qk.dtype)
    dbeta = terms.dbeta + jnp.sum(terms.da * kk * dm, axis=1, keepdims=True)
    # P = scale tril(qk * D)   (D is already 0 above the diagonal)
    dqk = scale * terms.dp * dm
    dkk = terms.da * beta_col * dm
    # D_ij = exp(G_i - G_j)
    m = (terms.da * beta_col * kk + scale * terms.dp * qk) * dm
    dgcum = terms.dgcum + jnp.sum(m, axis=1, keepdims=True) - row_to_col(jnp.sum(m, axis=0, keepdims=True))
    # G = cumsum(g): dg_j = sum_{i >= j} dG_i
    dg = jnp.sum(jnp.where(r >= j, jnp.broadcast_to(dgcum, (c, c)), 0), axis=0, keepdims=True)
    return GateGrads(dg=dg, dbeta=col_to_row(dbeta), dqk=dqk, dkk=dkk)


def key_products_bwd(q, k, dqk, dkk, *, matmul_dtype=None):
    """(dq, dk) through QK^T and KK^T, with dqk, dkk summed over value heads."""
    dq = mm(dqk, k, matmul_dtype=matmul_dtype)
    dk = mm_tn(dqk, q, matmul_dtype=matmul_dtype) + mm(dkk + jnp.transpose(dkk), k, matmul_dtype=matmul_dtype)
    return dq, dk


def value_head_forward(q, k, v, g, beta, qk, kk, state, *, scale, decay_dtype, inverse=unit_lower_inverse,
                       matmul_dtype=None):
    """One value head's chunk: (o [C, V], outgoing state [K, V], (I + A)^-1)."""
    prep = chunk_terms(q, k, v, g, beta, qk, kk, scale=scale, decay_dtype=decay_dtype, inverse=inverse,
                       matmul_dtype=matmul_dtype)
    o, new_state = step(state, q, k, prep, matmul_dtype=matmul_dtype)
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
                        matmul_dtype=None):
    """Adjoint of `value_head_forward` given the chunk's saved inverse and
    incoming state, the output cotangent and the outgoing state's cotangent."""
    prep = chunk_terms(q, k, v, g, beta, qk, kk, scale=scale, decay_dtype=decay_dtype, tinv=tinv,
                       matmul_dtype=matmul_dtype)
    vn = prep.u - mm(prep.w, state, matmul_dtype=matmul_dtype)
    dvn, dstate_in = step_bwd(do, dstate_out, q, k, prep, matmul_dtype=matmul_dtype)
    dv, vsums = value_grads(do, dvn, vn, prep.u, v, prep.tinv, prep.beta, matmul_dtype=matmul_dtype)
    ssums = state_sums(state, dstate_out, do, dvn, vn, matmul_dtype=matmul_dtype)
    dq, dk, ksums = key_grads(q, k, prep.w, ssums, prep.tinv, prep.beta, prep.dec, scale=scale,
                              matmul_dtype=matmul_dtype)
    terms = gate_terms(prep.dec, prep.beta, vsums, ksums, ssums.dgamma, scale=scale)
    gg = gate_grads(qk, kk, prep.dec, prep.beta, terms, scale=scale)
    return ValueHeadGrads(dv, gg.dg, gg.dbeta, dq, dk, gg.dqk, gg.dkk, dstate_in)
