"""The delta rule token by token: decode steps, and the readable definition.

    S_t = exp(g_t) S_{t-1} + k_t (x) beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
    o_t = scale S_t^T q_t

with g_t a scalar per value head (GDN, g [B, T, HV]) or one per key channel
(KDA, g [B, T, HV, K], exp(g_t) a diagonal matrix on the state's rows).

A scan over tokens in the state dtype; gradients by plain autodiff. Packed
sequences use the chunk plan with a chunk of one token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.layout import from_slots, make_plan, to_slots

_HIGHEST = jax.lax.Precision.HIGHEST


def recurrent_reference(q, k, v, g, beta, h0, *, cu_seqlens, scale, state_dtype, decay_dtype,
                                         token_states: bool = False):
    """(o, final), and with token_states (no cu_seqlens) the state after
    every token [B, T, HV, K, V]."""
    r, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    grp = hv // hk
    acc = jnp.dtype(state_dtype)
    if t == 1 and cu_seqlens is None:
        return _one_token(q, k, v, g, beta, h0, scale=scale, acc=acc, decay_dtype=decay_dtype,
                          token_states=token_states)
    plan = make_plan(r, t, 1, cu_seqlens)

    def tokens(x, *split):
        # [R, T, H, ...] -> [T, R, HK, (G,) ...] in the accumulation dtype
        x = to_slots(x, plan)
        x = x.reshape(x.shape[:2] + split + x.shape[3:])
        return jnp.moveaxis(x, 1, 0)

    qs, ks = tokens(q.astype(acc), hk), tokens(k.astype(acc), hk)
    vs, bs = tokens(v.astype(acc), hk, grp), tokens(beta.astype(acc), hk, grp)
    decay = jnp.exp(tokens(g.astype(decay_dtype), hk, grp)).astype(acc)
    h0 = h0.astype(acc).reshape(h0.shape[0], hk, grp, dk, dv)

    def body(carry, xs):
        state, final = carry
        qt, kt, vt, dt, bt, rs, sq, ls = xs
        state = jnp.where(rs[:, None, None, None, None], h0[sq], state)
        state, ot = _step(state, qt, kt, vt, dt, bt, scale)
        final = final.at[sq].set(jnp.where(ls[:, None, None, None, None], state, final[sq]))
        return (state, final), (ot, state) if token_states else ot

    init = (jnp.zeros((r,) + h0.shape[1:], acc), h0)
    xs = (qs, ks, vs, decay, bs, plan.reset, plan.seq, plan.last)
    (_, final), ys = jax.lax.scan(body, init, xs)
    o = jnp.moveaxis(ys[0] if token_states else ys, 0, 1).reshape(r, plan.padded_length, hv, dv)
    out = from_slots(o, plan).astype(q.dtype), final.reshape(h0.shape[0], hv, dk, dv)
    if token_states:
        return (*out, jnp.moveaxis(ys[1], 0, 1).reshape(r, t, hv, dk, dv))
    return out


def _step(state, qt, kt, vt, dt, bt, scale):
    """One token on states [R, HK, G, K, V] (the scan's body and the decode step)."""
    # a per-head decay scales the whole state, a per-channel one (KDA) its rows
    state = (dt[..., None, None] if dt.ndim == 3 else dt[..., None]) * state
    pred = jnp.einsum("rhk,rhgkv->rhgv", kt, state, precision=_HIGHEST)
    delta = bt[..., None] * (vt - pred)
    state = state + jnp.einsum("rhk,rhgv->rhgkv", kt, delta, precision=_HIGHEST)
    return state, scale * jnp.einsum("rhk,rhgkv->rhgv", qt, state, precision=_HIGHEST)


def _one_token(q, k, v, g, beta, h0, *, scale, acc, decay_dtype, token_states):
    """A decode step: one token per row, no packed sequences. The step
    alone, without the scan's per-sequence bookkeeping (a fresh zero state,
    the reset select, the final state's scatter), each of which was a pass
    over every row's state: most of a decode step's time on a TPU."""
    r, _, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    grp = hv // hk

    def token(x, *split):
        return x[:, 0].astype(acc).reshape((r, *split, *x.shape[3:]))

    decay = jnp.exp(g[:, 0].astype(decay_dtype)).astype(acc).reshape((r, hk, grp, *g.shape[3:]))
    state, o = _step(h0.astype(acc).reshape(r, hk, grp, dk, dv), token(q, hk), token(k, hk), token(v, hk, grp),
                     decay, token(beta, hk, grp), scale)
    final = state.reshape(r, hv, dk, dv)
    out = o.reshape(r, 1, hv, dv).astype(q.dtype), final
    return (*out, final[:, None]) if token_states else out


BACKEND = Backend("reference", run=recurrent_reference)
