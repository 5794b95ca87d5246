"""Intra-chunk algebra of Kimi Delta Attention (KDA): the gated delta rule
with one log decay per key channel, g [C, K] in a chunk.

One value head's chunk, as in chunk_math (whose inverse, row helpers and
matmuls it uses), with decays that are diagonal matrices over K:

    D_ijc = exp(sum_{j < l <= i} g_lc)                 i >= j, per channel c
    A  = strict_tril(beta_i sum_c k_ic k_jc D_ijc)      T = (I + A)^-1
    U  = T (beta v)            W = T (beta exp(G) * k)   G = cumsum(g) [C, K]
    Vn = U - W S
    O  = scale (exp(G) * q) S + P Vn                    P = scale tril(sum_c q_ic k_jc D_ijc)
    S' = diag(exp(G_last)) S + (exp(G_last - G) * k)^T Vn

Every exponent here is a sum of gates over a segment, so every factor is in
[0, 1] and nothing overflows for any g <= 0. The pairwise sums over c are
not a masked QK^T any more; writing them as (q exp(G)) (k exp(-G))^T
overflows once a channel's decay over the chunk passes ~-88 in float32.
`pair_products` cuts the chunk into sub-chunks of SUB tokens instead:

- between two sub-chunks I > J the decay factors through the last token r
  before sub-chunk I: D_ijc = exp(G_ic - G_rc) exp(G_rc - G_jc), both
  exponents sums over their own segments (<= 0), so the block is one
  matmul of rescaled rows with factors in [0, 1];
- inside a sub-chunk the [SUB, SUB, K] decays are exact: each exponent is
  its own segment's sum (a cumulative sum of terms of one sign), never a
  difference of two cumulative sums, which cancels when both are large.

Cost over the per-head gate: the diagonal blocks' C * SUB * K exponentials
and products (a quarter of a [C, C, K] decay tensor at C = 64) and the
exponentials of the rescaled rows; the off-diagonal products are matmuls.

The backward is hand written in the same pieces (`pair_products_bwd`).
Gate gradients go through the exponents' segments: a term exp(sum over
(j, i]) gives its gradient to the gates in (j, i], so a decay that does not
depend on a gate (the diagonal, a token's own exp(0)) never adds and then
subtracts an O(1) term: with gates of -30 and below, where the true dg is
~1e-14, no float32 residue of cancelled terms is left in it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gdnx.ops.gated_delta_rule.chunk_math import (
    HIGHEST,
    iotas,
    mm,
    mm_nt,
    mm_tn,
    row_to_col,
    col_to_row,
    unit_lower_inverse,
)

# sub-chunk of the pairwise decays: exact [SUB, SUB, K] decays inside, one
# matmul per sub-chunk row between
SUB = 16


def _einsum(spec, *xs):
    return jnp.einsum(spec, *xs, precision=HIGHEST)


class Decays(NamedTuple):
    """One value head's decay factors in a chunk, every one in [0, 1]."""

    eg: jax.Array      # [C, K] exp(G), G_i = sum_{l <= i} g_l
    ek: jax.Array      # [C, K] exp(G_last - G), the sum over l > i
    gamma: jax.Array   # [1, K] exp(G_last)
    ein: jax.Array     # [C, K] exp(sum from the start of i's sub-chunk to i)
    eout: tuple        # per sub-chunk I >= 1: [I * SUB, K] exp(sum over (j, end of sub-chunk I - 1])
    diag: tuple        # per sub-chunk: [SUB, SUB, K] exp(sum over (j, i]), zero for j > i


def _segments(g, sub: int):
    """Sums of g [C, K] over segments, each a cumulative sum of terms of one
    sign: (inclusive prefix, exclusive suffix, per-sub-chunk inclusive prefix,
    per-sub-chunk exclusive suffix, per-sub-chunk totals [NB, K])."""
    c, k = g.shape
    nb = c // sub
    blocks = g.reshape(nb, sub, k)
    prefix = jnp.cumsum(g, axis=0)
    # exclusive: the sum over l > i, as a sum of its own terms (a difference would cancel)
    suffix = jnp.concatenate([jnp.flip(jnp.cumsum(jnp.flip(g[1:], 0), axis=0), 0), jnp.zeros((1, k), g.dtype)])
    local_in = jnp.cumsum(blocks, axis=1).reshape(c, k)
    local_out = jnp.concatenate(
        [jnp.flip(jnp.cumsum(jnp.flip(blocks[:, 1:], 1), axis=1), 1), jnp.zeros((nb, 1, k), g.dtype)], axis=1)
    return prefix, suffix, local_in, local_out.reshape(c, k), jnp.sum(blocks, axis=1)


def decays(g, *, state_dtype, decay_dtype, sub: int = SUB) -> Decays:
    """Decay factors of g [C, K] (C a multiple of `sub`, or smaller than it)."""
    c, k = g.shape
    sub = min(sub, c)
    g = g.astype(decay_dtype)
    prefix, suffix, local_in, local_out, totals = _segments(g, sub)
    nb = c // sub
    r, j = iotas(sub)
    eout = []
    for b in range(1, nb):
        # to the end of sub-chunk b - 1: the rest of j's own sub-chunk, then whole ones (all terms <= 0)
        whole = jnp.cumsum(totals[:b][::-1], axis=0)[::-1]            # [b, K]: sum of sub-chunks J..b-1
        after = jnp.concatenate([whole[1:], jnp.zeros((1, k), g.dtype)])  # sub-chunks after J, up to b - 1
        seg = local_out[:b * sub] + jnp.repeat(after, sub, axis=0)
        eout.append(jnp.exp(seg).astype(state_dtype))
    diag = []
    for b in range(nb):
        gb = g[b * sub:(b + 1) * sub]
        # [i, j, c] = sum_{j < l <= i} g_lc: a cumulative sum over i of the gates after j
        seg = jnp.cumsum(jnp.where((r > j)[:, :, None], gb[:, None, :], 0), axis=0)
        diag.append(jnp.where((r >= j)[:, :, None], jnp.exp(seg), 0).astype(state_dtype))
    return Decays(eg=jnp.exp(prefix).astype(state_dtype), ek=jnp.exp(suffix).astype(state_dtype),
                  gamma=jnp.exp(jnp.sum(g, axis=0, keepdims=True)).astype(state_dtype),
                  ein=jnp.exp(local_in).astype(state_dtype), eout=tuple(eout), diag=tuple(diag))


def _sub(dec: Decays) -> int:
    return dec.diag[0].shape[0]


def pair_products(a, b, dec: Decays, *, strict: bool, matmul_dtype=None):
    """M [C, C] with M_ij = sum_c a_ic b_jc D_ijc for i >= j (i > j when
    strict), zero above."""
    c = a.shape[0]
    sub = _sub(dec)
    r, j = iotas(sub)
    keep = (r > j) if strict else (r >= j)
    rows = []
    for blk in range(c // sub):
        lo, hi = blk * sub, (blk + 1) * sub
        parts = []
        if blk:
            parts.append(mm_nt(a[lo:hi] * dec.ein[lo:hi], b[:lo] * dec.eout[blk - 1], matmul_dtype=matmul_dtype))
        parts.append(jnp.where(keep, _einsum("ic,jc,ijc->ij", a[lo:hi], b[lo:hi], dec.diag[blk]), 0))
        if hi < c:
            parts.append(jnp.zeros((sub, c - hi), a.dtype))
        rows.append(jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])
    return jnp.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]


def pair_products_bwd(a, b, dec: Decays, dm, *, strict: bool, matmul_dtype=None):
    """Adjoint of `pair_products` given dM [C, C] (read on and below the
    diagonal): (da, db, dG) with dG the cotangent of the cumulative gates
    G [C, K] through the decays (to be summed over i >= l into dg_l)."""
    c, k = a.shape
    sub = _sub(dec)
    r, j = iotas(sub)
    da_rows, db = [], jnp.zeros_like(b)
    for blk in range(c // sub):
        lo, hi = blk * sub, (blk + 1) * sub
        # inside the sub-chunk, off the diagonal: the diagonal's decay is exp(0)
        d = jnp.where(r > j, dm[lo:hi, lo:hi], 0)
        da_b = _einsum("ij,jc,ijc->ic", d, b[lo:hi], dec.diag[blk])
        db = db.at[lo:hi].add(_einsum("ij,ic,ijc->jc", d, a[lo:hi], dec.diag[blk]))
        if blk:
            x = dm[lo:hi, :lo]
            da_b = da_b + dec.ein[lo:hi] * mm(x, b[:lo] * dec.eout[blk - 1], matmul_dtype=matmul_dtype)
            db = db.at[:lo].add(dec.eout[blk - 1] * mm_tn(x, a[lo:hi] * dec.ein[lo:hi], matmul_dtype=matmul_dtype))
        da_rows.append(da_b)
    da = jnp.concatenate(da_rows, axis=0) if len(da_rows) > 1 else da_rows[0]
    dgcum = a * da - b * db
    if not strict:
        rc, jc = iotas(c)
        diag = jnp.sum(jnp.where(rc == jc, dm, 0), axis=1, keepdims=True)
        da, db = da + diag * b, db + diag * a
    return da, db, dgcum


class ChunkTerms(NamedTuple):
    """One value head's chunk quantities that do not depend on the state."""

    dec: Decays
    beta: jax.Array   # [C, 1]
    tinv: jax.Array   # [C, C]  (I + A)^-1
    u: jax.Array      # [C, V]
    w: jax.Array      # [C, K]
    p: jax.Array      # [C, C]  scale tril(sum_c q_ic k_jc D_ijc)


def chunk_terms(q, k, v, g, beta, *, scale, decay_dtype, tinv=None, matmul_dtype=None, sub: int = SUB):
    """Everything one value head's chunk needs before it sees the state.

    q, k [C, K] and v [C, V] in the accumulation dtype; g [C, K] and beta
    [1, C] in any float dtype. Pass `tinv` (a saved (I + A)^-1) to skip the
    inverse."""
    acc = q.dtype
    dec = decays(g, state_dtype=acc, decay_dtype=decay_dtype, sub=sub)
    beta = row_to_col(beta.astype(acc))
    if tinv is None:
        tinv = unit_lower_inverse(beta * pair_products(k, k, dec, strict=True, matmul_dtype=matmul_dtype))
    u = mm(tinv, beta * v, matmul_dtype=matmul_dtype)
    w = mm(tinv, (beta * dec.eg) * k, matmul_dtype=matmul_dtype)
    p = scale * pair_products(q, k, dec, strict=False, matmul_dtype=matmul_dtype)
    return ChunkTerms(dec=dec, beta=beta, tinv=tinv, u=u, w=w, p=p)


def step(state, q, k, prep: ChunkTerms, *, scale, matmul_dtype=None):
    """One chunk's output [C, V] and outgoing state [K, V]."""
    vn = prep.u - mm(prep.w, state, matmul_dtype=matmul_dtype)
    o = scale * mm(q * prep.dec.eg, state, matmul_dtype=matmul_dtype) + mm(prep.p, vn, matmul_dtype=matmul_dtype)
    new = row_to_col(prep.dec.gamma) * state + mm_tn(k * prep.dec.ek, vn, matmul_dtype=matmul_dtype)
    return o, new


def value_head_forward(q, k, v, g, beta, state, *, scale, decay_dtype, matmul_dtype=None):
    """One value head's chunk: (o [C, V], outgoing state [K, V], (I + A)^-1)."""
    prep = chunk_terms(q, k, v, g, beta, scale=scale, decay_dtype=decay_dtype, matmul_dtype=matmul_dtype)
    o, new_state = step(state, q, k, prep, scale=scale, matmul_dtype=matmul_dtype)
    return o, new_state, prep.tinv


class ValueHeadGrads(NamedTuple):
    dq: jax.Array         # [C, K]  to sum over the key head's value heads
    dk: jax.Array         # [C, K]
    dv: jax.Array         # [C, V]
    dg: jax.Array         # [C, K]
    dbeta: jax.Array      # [1, C]
    dstate_in: jax.Array  # [K, V]


def gate_grads(dgcum, dsuffix, dlast):
    """dg [C, K] from the cotangents of the prefix sums G_i = sum_{l <= i} g_l,
    of the exclusive suffix sums sum_{l > i} g_l and of the chunk total."""
    c = dgcum.shape[0]
    r, j = iotas(c)
    # dg_l = sum_{i >= l} dG_i + sum_{i < l} dsuffix_i + dlast, as 0/1 matmuls
    after = (r >= j).astype(dgcum.dtype).T   # [l, i]: i >= l
    before = (r > j).astype(dgcum.dtype)     # [l, i]: i < l
    return mm(after, dgcum) + mm(before, dsuffix) + dlast


def value_head_backward(q, k, v, g, beta, tinv, state, do, dstate_out, *, scale, decay_dtype, matmul_dtype=None):
    """Adjoint of `value_head_forward` given the chunk's saved inverse and
    incoming state, the output cotangent and the outgoing state's cotangent."""
    prep = chunk_terms(q, k, v, g, beta, scale=scale, decay_dtype=decay_dtype, tinv=tinv, matmul_dtype=matmul_dtype)
    dec, bcol = prep.dec, prep.beta
    gamma_col = row_to_col(dec.gamma)
    kek = k * dec.ek
    vn = prep.u - mm(prep.w, state, matmul_dtype=matmul_dtype)
    dvn = mm_tn(prep.p, do, matmul_dtype=matmul_dtype) + mm(kek, dstate_out, matmul_dtype=matmul_dtype)
    dstate_in = (scale * mm_tn(q * dec.eg, do, matmul_dtype=matmul_dtype) + gamma_col * dstate_out
                 - mm_tn(prep.w, dvn, matmul_dtype=matmul_dtype))
    dqs = scale * mm_nt(do, state, matmul_dtype=matmul_dtype)     # of q * eg
    dks = mm_nt(vn, dstate_out, matmul_dtype=matmul_dtype)         # of k * ek
    dgamma = col_to_row(jnp.sum(state * dstate_out, axis=1, keepdims=True))
    dw = -mm_nt(dvn, state, matmul_dtype=matmul_dtype)
    dbv = mm_tn(prep.tinv, dvn, matmul_dtype=matmul_dtype)          # of beta v, through U = T (beta v)
    dx = mm_tn(prep.tinv, dw, matmul_dtype=matmul_dtype)            # of X = beta eg k, through W = T X
    c = q.shape[0]
    r, j = iotas(c)
    # the inverse is not differentiated through: dA = -(T^T dU) U^T - (T^T dW) W^T
    da = jnp.where(r > j, -(mm_nt(dbv, prep.u, matmul_dtype=matmul_dtype)
                            + mm_nt(dx, prep.w, matmul_dtype=matmul_dtype)), 0)
    dp = jnp.where(r >= j, mm_nt(do, vn, matmul_dtype=matmul_dtype), 0)
    mkk = pair_products(k, k, dec, strict=True, matmul_dtype=matmul_dtype)
    dq_p, dk_p, dg_p = pair_products_bwd(q, k, dec, scale * dp, strict=False, matmul_dtype=matmul_dtype)
    dk_a, dk_b, dg_a = pair_products_bwd(k, k, dec, bcol * da, strict=True, matmul_dtype=matmul_dtype)
    xk = bcol * dec.eg * dx
    dq = dqs * dec.eg + dq_p
    dk = dks * dec.ek + xk + dk_p + dk_a + dk_b
    dv = bcol * dbv
    dbeta = (jnp.sum(v * dbv, axis=1, keepdims=True) + jnp.sum(dec.eg * k * dx, axis=1, keepdims=True)
             + jnp.sum(da * mkk, axis=1, keepdims=True))
    dgcum = dqs * q * dec.eg + xk * k + dg_p + dg_a
    dg = gate_grads(dgcum, dks * kek, dgamma * dec.gamma)
    return ValueHeadGrads(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=col_to_row(dbeta), dstate_in=dstate_in)
