"""Intra-chunk algebra of the gated delta rule, written once.

Every function works on the 2-D blocks of one chunk of C tokens, written in
the shared tile primitives (delta_rule/primitives.py), so the same code runs
inside Pallas kernels (TPU Mosaic and Triton take 2-D tiles) and, under
`jax.vmap`, in the XLA path:

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

from gdnx.ops.delta_rule.costs import matmul_flops, value_flops
from gdnx.ops.delta_rule.primitives import (
    col_to_row,
    iotas,
    mm,
    mm_nt,
    mm_tn,
    row_to_col,
    segment_sums,
    unit_lower_inverse,
    unit_lower_inverse_loop,
)
from gdnx.ops.delta_rule.variant import Variant


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
                matmul_dtype=None, split_segments=False):
    """Everything one value head's chunk needs before it sees the state.

    q, k, v, qk, kk come in the accumulation dtype; g and beta as [1, C] rows
    in any float dtype. Pass `tinv` (a saved (I + A)^-1) to skip the inverse.
    """
    acc = q.dtype
    dec = decays(g, state_dtype=acc, decay_dtype=decay_dtype, split_segments=split_segments)
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
                       matmul_dtype=None, split_segments=False):
    """One value head's chunk: (o [C, V], outgoing state [K, V], (I + A)^-1)."""
    prep = chunk_terms(q, k, v, g, beta, qk, kk, scale=scale, decay_dtype=decay_dtype, inverse=inverse,
                       matmul_dtype=matmul_dtype, split_segments=split_segments)
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
                        matmul_dtype=None, split_segments=False):
    """Adjoint of `value_head_forward` given the chunk's saved inverse and
    incoming state, the output cotangent and the outgoing state's cotangent."""
    prep = chunk_terms(q, k, v, g, beta, qk, kk, scale=scale, decay_dtype=decay_dtype, tinv=tinv,
                       matmul_dtype=matmul_dtype, split_segments=split_segments)
    vn = prep.u - mm(prep.w, state, matmul_dtype=matmul_dtype)
    dvn, dstate_in = step_bwd(do, dstate_out, q, k, prep, matmul_dtype=matmul_dtype)
    dv, vsums = value_grads(do, dvn, vn, prep.u, v, prep.tinv, prep.beta, matmul_dtype=matmul_dtype)
    ssums = state_sums(state, dstate_out, do, dvn, vn, matmul_dtype=matmul_dtype)
    dq, dk, ksums = key_grads(q, k, prep.w, ssums, prep.tinv, prep.beta, prep.dec, scale=scale,
                              matmul_dtype=matmul_dtype)
    terms = gate_terms(prep.dec, prep.beta, vsums, ksums, ssums.dgamma, scale=scale)
    gg = gate_grads(qk, kk, prep.dec, prep.beta, terms, scale=scale)
    return ValueHeadGrads(dv, gg.dg, gg.dbeta, dq, dk, gg.dqk, gg.dkk, dstate_in)


def chunk_flops(c: int, dk: int, dv: int) -> dict[str, int]:
    """Analytic FLOPs per chunk and value head by part (costs.value_flops),
    and the key-head parts, once per key head:

    key_products   QK^T and KK^T
    key_grads      through QK^T and KK^T
    """
    mm_flops = matmul_flops
    return {**value_flops(c, dk, dv), "key_products": 2 * mm_flops(c, dk, c), "key_grads": 4 * mm_flops(c, c, dk)}


def transcendentals(c: int, dk: int) -> int:
    """exp of the decays per chunk and value head: C x C pairwise, 2 C, 1."""
    return c * c + 2 * c + 1


def _forward(q, k, v, g, beta, shared, state, *, looped: bool, inverse=None, **algebra):
    qk, kk = shared
    inverse = inverse or (unit_lower_inverse_loop if looped else unit_lower_inverse)
    return value_head_forward(q, k, v, g, beta, qk, kk, state, inverse=inverse, **algebra)


def _backward(q, k, v, g, beta, shared, tinv, state, do, dstate_out, *, looped: bool, **algebra):
    qk, kk = shared
    vg = value_head_backward(q, k, v, g, beta, qk, kk, tinv, state, do, dstate_out, **algebra)
    return vg, (vg.dqk, vg.dkk)


VARIANT = Variant(
    name="gated_delta_rule", gate="head", value_head_forward=_forward, value_head_backward=_backward,
    key_products=key_products, key_products_bwd=key_products_bwd, chunk_flops=chunk_flops,
    forward_parts=("prepare", "state", "output"), backward_parts=("prepare", "state_bwd", "grads"),
    transcendentals=transcendentals)
