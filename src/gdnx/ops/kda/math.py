"""Intra-chunk algebra of Kimi Delta Attention (KDA): the gated delta rule
with one log decay per key channel, g [C, K] in a chunk.

One value head's chunk, as in the gated delta rule's algebra, written in the
shared tile primitives (delta_rule/primitives.py), with decays that are diagonal matrices over K:

    D_ijc = exp(sum_{j < l <= i} g_lc)                 i >= j, per channel c
    A  = strict_tril(beta_i sum_c k_ic k_jc D_ijc)      T = (I + A)^-1
    U  = T (beta v)            W = T (beta exp(G) * k)   G = cumsum(g) [C, K]
    Vn = U - W S
    O  = scale (exp(G) * q) S + P Vn                    P = scale tril(sum_c q_ic k_jc D_ijc)
    S' = diag(exp(G_last)) S + (exp(G_last - G) * k)^T Vn

The pairwise sums over c are not a masked QK^T any more; writing them as
(q exp(G)) (k exp(-G))^T overflows once a channel's decay over the chunk
passes ~-88 in float32. `pair_products` splits the pairs by the highest
bit in which i and j differ (i has it set, j not): for that bit b, every
token of i's aligned block of 2^b tokens comes after every token of j's
block, so the decay factors through m, the last token of j's block:

    D_ijc = exp(sum over (m, i] of g_c) exp(sum over (j, m] of g_c)

the first factor a sum from the start of i's block to i, the second from
after j to the end of j's block. Both are in [0, 1], and for each bit the
pairs are one matmul of rows rescaled by them, masked: log2(C) matmuls of
[C, K] x [K, C] (6 at C = 64), plus the diagonal (D = 1). Each exponent is
a sum of gates over its own segment, formed as a 0/1 matrix times g, so a
sum of terms of one sign: never a difference of two cumulative sums, which
cancels when both are large (after a hard step) and leaves eps |G| of
absolute error in a decay near 1. Nothing overflows for any g <= 0, and a
factor that underflows belongs to a decay below 1e-38.

Everything is 2-D tiles, iotas, masks, matmuls and reductions (no cumsum,
slices, reshapes or 3-D decay tensors), so the same code runs in the XLA
path under vmap and inside the Pallas kernels.

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

from gdnx.ops.delta_rule.costs import matmul_flops, value_flops
from gdnx.ops.delta_rule.primitives import (
    HIGHEST,
    batched_like,
    col_to_row,
    exact_dot,
    iotas,
    mm,
    mm_nt,
    mm_tn,
    row_to_col,
    unit_lower_inverse,
    unit_lower_inverse_loop,
)
from gdnx.ops.delta_rule.variant import Variant


def num_levels(c: int) -> int:
    """Bits that tell two token positions of a chunk of c apart."""
    return (c - 1).bit_length()


def level_mask(c: int, bit: int):
    """[C, C] bool: the pairs i > j whose highest differing bit is `bit`."""
    r, j = iotas(c)
    return ((r >> bit) == (j >> bit) + 1) & (((r >> bit) & 1) == 1)


def _segment_sums(mask, g, split: bool):
    """mask [C, C] (0/1) times g [C, K]: sums of gates over segments, each of
    terms of one sign. split: as three exact bfloat16 passes (primitives.
    segment_sums), for a GPU kernel's registers."""
    m = batched_like(mask.astype(g.dtype), g)
    if split:
        return exact_dot(m, g, ((1,), (0,)))
    return jax.lax.dot_general(m, g, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=g.dtype)


class Decays(NamedTuple):
    """One value head's decay factors in a chunk (or a block of its key
    channels), every one in [0, 1]. The per-bit factors of the pairwise
    products (`level_factors`) are formed once here for XLA (`levels`),
    and where they are used in a kernel (one bit's live at a time)."""

    g: jax.Array       # [C, K] the gates, decay dtype
    eg: jax.Array      # [C, K] exp(G), G_i = sum_{l <= i} g_l
    ek: jax.Array      # [C, K] exp(G_last - G), the sum over l > i
    gamma: jax.Array   # [1, K] exp(G_last)
    levels: tuple = ()  # per bit: (ein, eout), when formed up front


def prefix_decays(g, *, state_dtype, decay_dtype, split_segments: bool = False):
    """exp(G) [C, K] alone (a kernel that needs it again after `decays`)."""
    r, j = iotas(g.shape[0])
    return jnp.exp(_segment_sums(j <= r, g.astype(decay_dtype), split_segments)).astype(state_dtype)


def decays(g, *, state_dtype, decay_dtype, split_segments: bool = False, levels: bool = False) -> Decays:
    """Decay factors of g [C, K], or of any block of its key channels
    (`split_segments`: see `_segment_sums`; `levels`: form every bit's
    factors now, for the pairwise products to share)."""
    g = g.astype(decay_dtype)
    r, j = iotas(g.shape[0])   # [i, l]: the output row i sums the gates l of its segment
    dec = Decays(g=g, eg=prefix_decays(g, state_dtype=state_dtype, decay_dtype=decay_dtype,
                                       split_segments=split_segments),
                 ek=jnp.exp(_segment_sums(j > r, g, split_segments)).astype(state_dtype),
                 gamma=jnp.exp(jnp.sum(g, axis=0, keepdims=True)).astype(state_dtype))
    if levels:
        dec = dec._replace(levels=tuple(level_factors(dec, bit, split_segments=split_segments)
                                        for bit in range(num_levels(g.shape[0]))))
    return dec


def level_factors(dec: Decays, bit, *, split_segments: bool = False):
    """(ein, eout) [C, K] of one bit (a Python int or a loop index): exp of
    the sum from the start of i's block of 2^bit tokens to i, and of the sum
    after j to the end of j's block."""
    if dec.levels:
        return dec.levels[bit]
    r, j = iotas(dec.g.shape[0])
    same = (r >> bit) == (j >> bit)
    acc = dec.eg.dtype
    return (jnp.exp(_segment_sums(same & (j <= r), dec.g, split_segments)).astype(acc),
            jnp.exp(_segment_sums(same & (j > r), dec.g, split_segments)).astype(acc))


def unrolled_bits(c: int, body, init):
    """carry = body(bit, carry) for every bit of the chunk position, unrolled
    (XLA: differentiable, each bit's masks constant)."""
    for bit in range(num_levels(c)):
        init = body(bit, init)
    return init


def looped_bits(c: int, body, init):
    """The same in a loop that is not unrolled (kernels): the kernel holds one
    bit's code and one bit's [C, C] operands, which a compiler would
    otherwise hoist out of the kernel's own loops all at once (Triton: shared
    memory past the block's limit). int32 bounds: Mosaic lowers no int64
    loop index."""
    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(num_levels(c)), body, init)


def pair_products(pairs, dec: Decays, *, matmul_dtype=None, split_segments: bool = False, bits=unrolled_bits,
                  into=None):
    """[M] for pairs [(a, b, strict)] sharing the decays: M [C, C] with
    M_ij = sum_c a_ic b_jc D_ijc for i >= j (i > j when strict), zero above.
    into: [C, C] sums to add each M to (a kernel summing over key blocks:
    its loop then carries one tile per pair, not two)."""
    c = dec.g.shape[0]

    def level(bit, ms):
        ein, eout = level_factors(dec, bit, split_segments=split_segments)
        mask = level_mask(c, bit)
        return tuple(m + jnp.where(mask, mm_nt(a * ein, b * eout, matmul_dtype=matmul_dtype), 0)
                     for m, (a, b, _) in zip(ms, pairs))

    ms = bits(c, level, tuple(jnp.zeros((c, c), a.dtype) for a, _, _ in pairs) if into is None else tuple(into))
    r, j = iotas(c)
    return [m if strict else m + jnp.where(r == j, jnp.sum(a * b, axis=1, keepdims=True), 0)
            for m, (a, b, strict) in zip(ms, pairs)]


def pair_products_bwd(terms, dec: Decays, *, matmul_dtype=None, split_segments: bool = False,
                      bits=unrolled_bits):
    """Adjoints of `pair_products` for terms [(a, b, dM, strict)] (dM [C, C]
    read on and below the diagonal): [(da, db, dG)], dG the cotangent of the
    cumulative gates G [C, K] through the decays (to be summed over i >= l
    into dg_l)."""
    c = dec.g.shape[0]

    def level(bit, grads):
        ein, eout = level_factors(dec, bit, split_segments=split_segments)
        mask = level_mask(c, bit)
        out = []
        for (da, db), (a, b, dm, _) in zip(grads, terms):
            x = jnp.where(mask, dm, 0)
            out.append((da + ein * mm(x, b * eout, matmul_dtype=matmul_dtype),
                        db + eout * mm_tn(x, a * ein, matmul_dtype=matmul_dtype)))
        return tuple(out)

    grads = bits(c, level, tuple((jnp.zeros_like(a), jnp.zeros_like(b)) for a, b, _, _ in terms))
    r, j = iotas(c)
    out = []
    for (da, db), (a, b, dm, strict) in zip(grads, terms):
        # the off-diagonal pairs only: a diagonal decay is exp(0)
        dgcum = a * da - b * db
        if not strict:
            diag = jnp.sum(jnp.where(r == j, dm, 0), axis=1, keepdims=True)
            da, db = da + diag * b, db + diag * a
        out.append((da, db, dgcum))
    return out


class ChunkTerms(NamedTuple):
    """One value head's chunk quantities that do not depend on the state."""

    dec: Decays
    beta: jax.Array   # [C, 1]
    tinv: jax.Array   # [C, C]  (I + A)^-1
    u: jax.Array      # [C, V]
    w: jax.Array      # [C, K]
    p: jax.Array      # [C, C]  scale tril(sum_c q_ic k_jc D_ijc)


def chunk_terms(q, k, v, g, beta, *, scale, decay_dtype, tinv=None, inverse=unit_lower_inverse, matmul_dtype=None,
                split_segments: bool = False, bits=unrolled_bits):
    """Everything one value head's chunk needs before it sees the state.

    q, k [C, K] and v [C, V] in the accumulation dtype; g [C, K] and beta
    [1, C] in any float dtype. Pass `tinv` (a saved (I + A)^-1) to skip the
    inverse. `inverse` is one of primitives' and `bits` one of this
    module's loops over bits (the kernels take the loops)."""
    acc = q.dtype
    # unrolled (XLA): every bit's factors formed once, shared by the pairwise products
    dec = decays(g, state_dtype=acc, decay_dtype=decay_dtype, split_segments=split_segments,
                 levels=bits is unrolled_bits)
    beta = row_to_col(beta.astype(acc))
    pairs = [(q, k, False)] + ([(k, k, True)] if tinv is None else [])
    p, *akk = pair_products(pairs, dec, matmul_dtype=matmul_dtype, split_segments=split_segments, bits=bits)
    if tinv is None:
        tinv = inverse(beta * akk[0])
    u = mm(tinv, beta * v, matmul_dtype=matmul_dtype)
    w = mm(tinv, (beta * dec.eg) * k, matmul_dtype=matmul_dtype)
    p = scale * p
    return ChunkTerms(dec=dec, beta=beta, tinv=tinv, u=u, w=w, p=p)


def step(state, q, k, prep: ChunkTerms, *, scale, matmul_dtype=None):
    """One chunk's output [C, V] and outgoing state [K, V]."""
    vn = prep.u - mm(prep.w, state, matmul_dtype=matmul_dtype)
    o = scale * mm(q * prep.dec.eg, state, matmul_dtype=matmul_dtype) + mm(prep.p, vn, matmul_dtype=matmul_dtype)
    new = row_to_col(prep.dec.gamma) * state + mm_tn(k * prep.dec.ek, vn, matmul_dtype=matmul_dtype)
    return o, new


def value_head_forward(q, k, v, g, beta, state, *, scale, decay_dtype, inverse=unit_lower_inverse, matmul_dtype=None,
                       split_segments: bool = False, bits=unrolled_bits):
    """One value head's chunk: (o [C, V], outgoing state [K, V], (I + A)^-1)."""
    prep = chunk_terms(q, k, v, g, beta, scale=scale, decay_dtype=decay_dtype, inverse=inverse,
                       matmul_dtype=matmul_dtype, split_segments=split_segments, bits=bits)
    o, new_state = step(state, q, k, prep, scale=scale, matmul_dtype=matmul_dtype)
    return o, new_state, prep.tinv


class ValueHeadGrads(NamedTuple):
    dq: jax.Array         # [C, K]  to sum over the key head's value heads
    dk: jax.Array         # [C, K]
    dv: jax.Array         # [C, V]
    dg: jax.Array         # [C, K]
    dbeta: jax.Array      # [1, C]
    dstate_in: jax.Array  # [K, V]


def gate_grads(dgcum, dsuffix, dlast, *, split_segments: bool = False):
    """dg [C, K] from the cotangents of the prefix sums G_i = sum_{l <= i} g_l,
    of the exclusive suffix sums sum_{l > i} g_l and of the chunk total."""
    c = dgcum.shape[0]
    r, j = iotas(c)
    # dg_l = sum_{i >= l} dG_i + sum_{i < l} dsuffix_i + dlast, as 0/1 matmuls ([l, i])
    return _segment_sums(j >= r, dgcum, split_segments) + _segment_sums(j < r, dsuffix, split_segments) + dlast


def state_grads(q, k, dec: Decays, beta_col, dqs, dks, dx, dgamma, *, split_segments: bool = False):
    """The part of (dq, dk, dg) of a block of key channels through the state
    and W, given the block's decays and state terms: dqs of q * eg, dks of
    k * ek, dx of beta eg k, dgamma of exp(G_last)."""
    xk = beta_col * dec.eg * dx
    kdks = k * dks * dec.ek
    dq = dqs * dec.eg
    return dq, dks * dec.ek + xk, gate_grads(q * dq + k * xk, kdks, dgamma * dec.gamma,
                                             split_segments=split_segments)


def pair_grads(q, k, dec: Decays, dps, dab, *, matmul_dtype=None, split_segments: bool = False, bits=unrolled_bits):
    """The part of (dq, dk, dg) of a block of key channels through the
    pairwise products with the decays, given their [C, C] cotangents: dps of
    q k^T's (scale dP, on and below the diagonal) and dab of k k^T's (beta
    dA, below it)."""
    (dq, dk_p, dg_p), (dk_a, dk_b, dg_a) = pair_products_bwd(
        [(q, k, dps, False), (k, k, dab, True)], dec, matmul_dtype=matmul_dtype, split_segments=split_segments,
        bits=bits)
    r, j = iotas(q.shape[0])
    return dq, dk_p + dk_a + dk_b, _segment_sums(j >= r, dg_p + dg_a, split_segments)


def key_grads(q, k, dec: Decays, beta_col, dqs, dks, dx, dgamma, dps, dab, *, split_segments: bool = False,
              **pair):
    """(dq, dk, dg) of any block of key channels: `state_grads` plus
    `pair_grads` (dg is linear in the cotangents of the gates' sums, so a
    kernel may form the parts apart, holding the [C, C] cotangents only for
    the pairs)."""
    dq_s, dk_s, dg_s = state_grads(q, k, dec, beta_col, dqs, dks, dx, dgamma, split_segments=split_segments)
    dq_p, dk_p, dg_p = pair_grads(q, k, dec, dps, dab, split_segments=split_segments, **pair)
    return dq_s + dq_p, dk_s + dk_p, dg_s + dg_p


def value_head_backward(q, k, v, g, beta, tinv, state, do, dstate_out, *, scale, decay_dtype, matmul_dtype=None,
                        split_segments: bool = False, bits=unrolled_bits):
    """Adjoint of `value_head_forward` given the chunk's saved inverse and
    incoming state, the output cotangent and the outgoing state's cotangent."""
    prep = chunk_terms(q, k, v, g, beta, scale=scale, decay_dtype=decay_dtype, tinv=tinv, matmul_dtype=matmul_dtype,
                       split_segments=split_segments, bits=bits)
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
    mkk, = pair_products([(k, k, True)], dec, matmul_dtype=matmul_dtype, split_segments=split_segments, bits=bits)
    dq, dk, dg = key_grads(q, k, dec, bcol, dqs, dks, dx, dgamma, scale * dp, bcol * da, matmul_dtype=matmul_dtype,
                           split_segments=split_segments, bits=bits)
    dv = bcol * dbv
    dbeta = (jnp.sum(v * dbv, axis=1, keepdims=True) + jnp.sum(dec.eg * k * dx, axis=1, keepdims=True)
             + jnp.sum(da * mkk, axis=1, keepdims=True))
    return ValueHeadGrads(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=col_to_row(dbeta), dstate_in=dstate_in)


def chunk_flops(c: int, dk: int, dv: int) -> dict[str, int]:
    """Analytic FLOPs per chunk and value head by part: costs.value_flops
    (the same products on the value side) and

    decays         the 0/1 matmuls of the gate segment sums (2 per bit of
                   the chunk position but the lowest, G and the suffix)
    pairs          KK^T and QK^T with the decays, one masked matmul per bit each
    pairs_bwd      their adjoints (4 per bit) and KK^T again

    no key-head parts (every product depends on the value head's gates)."""
    bits = num_levels(c)
    return {**value_flops(c, dk, dv), "decays": 2 * bits * matmul_flops(c, c, dk),
            "pairs": 2 * bits * matmul_flops(c, dk, c), "pairs_bwd": 5 * bits * matmul_flops(c, dk, c)}


def transcendentals(c: int, dk: int) -> int:
    """exp of the decay factors per chunk and value head: two [C, K] per
    bit of the chunk position, exp(G), exp(G_last - G), exp(G_last)."""
    return (2 * num_levels(c) + 2) * c * dk + dk


def _forward(q, k, v, g, beta, shared, state, *, looped: bool, inverse=None, **algebra):
    if looped:
        return value_head_forward(q, k, v, g, beta, state, inverse=inverse or unit_lower_inverse_loop,
                                  bits=looped_bits, **algebra)
    return value_head_forward(q, k, v, g, beta, state, inverse=inverse or unit_lower_inverse, **algebra)


def _backward(q, k, v, g, beta, shared, tinv, state, do, dstate_out, *, looped: bool, **algebra):
    bits = looped_bits if looped else unrolled_bits
    return value_head_backward(q, k, v, g, beta, tinv, state, do, dstate_out, bits=bits, **algebra), ()


VARIANT = Variant(
    name="kda", gate="channel", value_head_forward=_forward, value_head_backward=_backward,
    chunk_flops=chunk_flops, forward_parts=("decays", "pairs", "prepare", "state", "output"),
    backward_parts=("decays", "pairs_bwd", "prepare", "state_bwd", "grads"), transcendentals=transcendentals)
