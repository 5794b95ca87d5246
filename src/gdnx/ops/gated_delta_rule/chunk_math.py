"""Intra-chunk algebra of the gated delta rule, written once.

Pure jnp on blocks with arbitrary leading dims. Block layout (h = key head,
g = value head inside the key head's group, c = token in the chunk):

    q, k        [..., h, c, K]        shared by the value heads of a group
    v           [..., h, g, c, V]
    gate, beta  [..., h, g, c]
    state       [..., h, g, K, V]

QK^T and KK^T are formed once per key head and broadcast over g, so grouped
value heads never materialise repeated q or k.

Forward of one chunk (DESIGN.md), G = cumsum(gate), D_ij = exp(G_i - G_j):

    A  = strict_tril(beta_i (k_i . k_j) D_ij)      T = (I + A)^-1
    U  = T (beta v)                                W = T (beta exp(G) k)
    Vn = U - W S
    O  = Qg S + P Vn        Qg = scale exp(G) q,   P = scale tril(QK^T * D)
    S' = gamma S + Kd^T Vn  gamma = exp(G_last),   Kd = exp(G_last - G) k

The split into `chunk_prepare` (needs no state, vectorises over chunks),
`chunk_step` (the sequential state update) and their adjoints is what lets a
scan or a kernel walk chunks without repeating any of the algebra.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
# Diagonal blocks of (I + A) are inverted by forward substitution at this size,
# then merged pairwise; every step is exact algebra, no matrix powers.
INVERSE_BLOCK = 16


def _einsum(spec, *xs):
    return jnp.einsum(spec, *xs, precision=HIGHEST)


def causal_mask(c: int, strict: bool = False) -> jax.Array:
    i = jnp.arange(c)[:, None]
    j = jnp.arange(c)[None, :]
    return i > j if strict else i >= j


def decay_matrix(gcum: jax.Array) -> jax.Array:
    """exp(G_i - G_j) on and below the diagonal, 0 above; dtype of `gcum`.

    The mask goes in before the exponential: above the diagonal G_i - G_j >= 0
    and can overflow.
    """
    c = gcum.shape[-1]
    diff = gcum[..., :, None] - gcum[..., None, :]
    return jnp.exp(jnp.where(causal_mask(c), diff, -jnp.inf))


def _forward_substitution(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower triangular a [..., b, b], row by row."""
    b = a.shape[-1]
    eye = jnp.eye(b, dtype=a.dtype)
    t = jnp.broadcast_to(eye, a.shape)
    for i in range(1, b):
        # Rows < i of t are final and a[i, j >= i] = 0, so a[i] @ t only
        # touches finished rows.
        row = eye[i] - _einsum("...j,...jk->...k", a[..., i, :], t)
        t = t.at[..., i, :].set(row)
    return t


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """Exact (I + a)^-1 for strictly lower triangular a [..., C, C].

    Blocked forward substitution: invert the diagonal blocks row by row, then
    merge neighbouring blocks with inv21 = -inv22 a21 inv11 until one block
    covers the chunk. C must be a power of two times the block (or smaller).
    """
    c = a.shape[-1]
    b = min(INVERSE_BLOCK, c)
    if c % b:
        raise ValueError(f"chunk size {c} is not a multiple of {b}")
    blocks = [a[..., i * b:(i + 1) * b, i * b:(i + 1) * b] for i in range(c // b)]
    inv = [_forward_substitution(blk) for blk in blocks]
    size = b
    while len(inv) > 1:
        merged = []
        for m in range(0, len(inv), 2):
            lo, hi = m * size, (m + 1) * size
            a21 = a[..., hi:hi + size, lo:hi]
            i11, i22 = inv[m], inv[m + 1]
            i21 = -_einsum("...ij,...jk,...kl->...il", i22, a21, i11)
            top = jnp.concatenate([i11, jnp.zeros_like(i11)], axis=-1)
            bottom = jnp.concatenate([i21, i22], axis=-1)
            merged.append(jnp.concatenate([top, bottom], axis=-2))
        inv = merged
        size *= 2
    return inv[0]


class Prepared(NamedTuple):
    """Per-chunk quantities that do not depend on the incoming state."""

    q: jax.Array      # [..., h, c, K]     acc dtype
    k: jax.Array      # [..., h, c, K]
    gcum: jax.Array   # [..., h, g, c]     decay dtype
    dm: jax.Array     # [..., h, g, c, c]  decay dtype
    qk: jax.Array     # [..., h, c, c]
    kk: jax.Array     # [..., h, c, c]
    tinv: jax.Array   # [..., h, g, c, c]
    u: jax.Array      # [..., h, g, c, V]
    w: jax.Array      # [..., h, g, c, K]
    p: jax.Array      # [..., h, g, c, c]  scale tril(QK^T * D)
    eq: jax.Array     # [..., h, g, c]     scale exp(G): row factor of Qg
    ek: jax.Array     # [..., h, g, c]     exp(G_last - G): row factor of Kd
    gamma: jax.Array  # [..., h, g]        exp(G_last)


def chunk_prepare(q, k, v, gate, beta, *, scale, acc_dtype, decay_dtype, tinv=None):
    """Everything a chunk needs before it sees the state.

    Pass `tinv` (a saved (I + A)^-1) to skip the inverse, as the backward does.
    Qg and Kd stay factored as (row factor, shared q or k) so they are never
    materialised per value head.
    """
    q, k, v, beta = (x.astype(acc_dtype) for x in (q, k, v, beta))
    gcum = jnp.cumsum(gate.astype(decay_dtype), axis=-1)
    dm = decay_matrix(gcum)
    dma = dm.astype(acc_dtype)
    eg = jnp.exp(gcum).astype(acc_dtype)
    ek = jnp.exp(gcum[..., -1:] - gcum).astype(acc_dtype)
    kk = _einsum("...hik,...hjk->...hij", k, k)
    qk = _einsum("...hik,...hjk->...hij", q, k)
    if tinv is None:
        c = gate.shape[-1]
        a = jnp.where(causal_mask(c, strict=True), beta[..., :, None] * kk[..., None, :, :] * dma, 0)
        tinv = unit_lower_inverse(a)
    u = _einsum("...ij,...jv->...iv", tinv, beta[..., None] * v)
    w = _einsum("...ij,...jk->...ik", tinv, (beta * eg)[..., None] * k[..., :, None, :, :])
    p = scale * qk[..., None, :, :] * dma
    gamma = jnp.exp(gcum[..., -1]).astype(acc_dtype)
    return Prepared(q, k, gcum, dm, qk, kk, tinv, u, w, p, scale * eg, ek, gamma)


def _shared_in(x, state):
    """x [..., h, c, K] (one per key head) times state [..., h, g, K, V]."""
    return _einsum("...hck,...hgkv->...hgcv", x, state)


def _shared_out(x, y):
    """x [..., h, c, K] (one per key head) transposed times y [..., h, g, c, V]."""
    return _einsum("...hck,...hgcv->...hgkv", x, y)


def chunk_step(state, u, w, p, q, k, eq, ek, gamma):
    """One chunk's output and outgoing state from the incoming state."""
    vn = u - _einsum("...ck,...kv->...cv", w, state)
    o = eq[..., None] * _shared_in(q, state) + _einsum("...ij,...jv->...iv", p, vn)
    new_state = gamma[..., None, None] * state + _shared_out(k, ek[..., None] * vn)
    return o, new_state


def chunk_step_bwd(do, dstate_out, w, p, q, k, eq, ek, gamma):
    """Adjoint of `chunk_step` along the state path: (dVn, dS_in)."""
    dvn = _einsum("...ij,...iv->...jv", p, do) + ek[..., None] * _shared_in(k, dstate_out)
    dstate_in = (
        _shared_out(q, eq[..., None] * do)
        + gamma[..., None, None] * dstate_out
        - _einsum("...ck,...cv->...kv", w, dvn)
    )
    return dvn, dstate_in


class StepGrads(NamedTuple):
    """Cotangents from the state pass, per value head."""

    du: jax.Array      # of U
    dw: jax.Array      # of W
    dp: jax.Array      # of P
    dqs: jax.Array     # dO S^T: Qg's cotangent before its row factor
    dks: jax.Array     # Vn dS'^T: Kd's cotangent before its row factor
    dgamma: jax.Array  # of gamma


def step_grads(state, dstate_out, do, dvn, prep: Prepared) -> StepGrads:
    """Cotangents of U, W, P, Qg, Kd, gamma given each chunk's incoming state,
    its outgoing-state cotangent and dVn (vectorises over chunks)."""
    vn = prep.u - _einsum("...ck,...kv->...cv", prep.w, state)
    return StepGrads(
        du=dvn,
        dw=-_einsum("...cv,...kv->...ck", dvn, state),
        dp=_einsum("...iv,...jv->...ij", do, vn),
        dqs=_einsum("...cv,...kv->...ck", do, state),
        dks=_einsum("...cv,...kv->...ck", vn, dstate_out),
        dgamma=jnp.sum(state * dstate_out, axis=(-2, -1)),
    )


def chunk_prepare_bwd(v, beta, prep: Prepared, grads: StepGrads, *, scale):
    """Adjoint of `chunk_prepare`: (dq, dk, dv, dgate, dbeta) in acc dtype.

    The inverse is not differentiated through: with X = (beta exp(G) k),
    dA = -T^T (dU (beta v)^T + dW X^T) T^T = -(T^T dU) U^T - (T^T dW) W^T.
    """
    q, k = prep.q, prep.k
    acc_dtype = q.dtype
    v, beta = v.astype(acc_dtype), beta.astype(acc_dtype)
    c = q.shape[-2]
    dm = prep.dm.astype(acc_dtype)
    eg = jnp.exp(prep.gcum).astype(acc_dtype)
    kg = k[..., :, None, :, :]
    qg = q[..., :, None, :, :]

    # U = T (beta v),  W = T (beta exp(G) k)
    dbv = _einsum("...ji,...jv->...iv", prep.tinv, grads.du)
    dx = _einsum("...ji,...jk->...ik", prep.tinv, grads.dw)
    da = -(_einsum("...iv,...jv->...ij", dbv, prep.u) + _einsum("...ik,...jk->...ij", dx, prep.w))
    da = jnp.where(causal_mask(c, strict=True), da, 0)
    kdx = jnp.sum(kg * dx, axis=-1)
    dv = beta[..., None] * dbv
    dbeta = jnp.sum(v * dbv, axis=-1) + eg * kdx
    dgcum = beta * eg * kdx
    dk = jnp.sum((beta * eg)[..., None] * dx, axis=-3)

    # A = strict_tril(beta_i kk_ij D_ij)
    dbeta = dbeta + jnp.sum(da * prep.kk[..., None, :, :] * dm, axis=-1)
    dkk = jnp.sum(da * beta[..., :, None] * dm, axis=-3)
    ddm = da * beta[..., :, None] * prep.kk[..., None, :, :]

    # P = scale tril(qk * D)   (D is already 0 above the diagonal)
    dqk = scale * jnp.sum(grads.dp * dm, axis=-3)
    ddm = ddm + scale * grads.dp * prep.qk[..., None, :, :]

    # D_ij = exp(G_i - G_j)
    m = ddm * dm
    dgcum = dgcum + jnp.sum(m, axis=-1) - jnp.sum(m, axis=-2)

    # Qg = eq q   (eq = scale exp(G))
    rq = prep.eq * jnp.sum(grads.dqs * qg, axis=-1)
    dgcum = dgcum + rq
    dq = jnp.sum(prep.eq[..., None] * grads.dqs, axis=-3)

    # Kd = ek k   (ek = exp(G_last - G)),  gamma = exp(G_last)
    rk = prep.ek * jnp.sum(grads.dks * kg, axis=-1)
    dk = dk + jnp.sum(prep.ek[..., None] * grads.dks, axis=-3)
    dlast = jnp.sum(rk, axis=-1) + prep.gamma * grads.dgamma
    dgcum = dgcum - rk
    dgcum = dgcum.at[..., -1].add(dlast)

    dq = dq + _einsum("...ij,...jk->...ik", dqk, k)
    dk = dk + _einsum("...ij,...ik->...jk", dqk, q) + _einsum("...ij,...jk->...ik", dkk + jnp.swapaxes(dkk, -1, -2), k)
    # G = cumsum(gate): the adjoint is a reverse cumulative sum.
    dgate = jnp.flip(jnp.cumsum(jnp.flip(dgcum, -1), axis=-1), -1)
    return dq, dk, dv, dgate, dbeta
