"""Context parallelism for Gated DeltaNet and KDA: the sequence split over a
mesh axis, run inside shard_map (every function here takes that axis's name).

Delta rule. Across a shard's span the state map is affine,
S_out = P S_in + B (P in R^{K x K}, per value head), because each value
column of the state evolves on its own (under a per-head or a per-channel
decay alike). So one call of the op on the local
tokens with the value dim widened to V + K, values [v | 0] and initial
state [0 | I], returns both at once: the first V columns are the outputs
O0 and final state B of a zero start, the last K columns are P itself and
Q = scale P_t^T q_t per token. The (P, B) of every shard are all-gathered
and folded in shard order, which gives each shard its incoming state S_in,
and its outputs are O0 + Q S_in. Cost: the op at V + K instead of V (at
most twice the work for K = V; docs/sharding.md has the measured cost), one
all-gather of C states of size K (V + K), and C small matmuls, for C
shards.

Conv. Each shard needs the kernel_size - 1 inputs before its first token:
the previous shard sends its last ones (ppermute); the first shard uses
the layer's conv state.

Packed sequences (cu_seqlens, global offsets, one row): each shard runs the
op on its slice of the packing with local offsets. Only the sequence that
crosses into the shard continues from the previous shards: it alone gets
the halo (masked to its own tokens, its conv state before them) and the
identity block, so a shard that holds a sequence start passes on P = 0 and
the fold restarts there by itself. Each sequence's final state comes from
the shard holding its last token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gdnx.ops import causal_conv1d
from gdnx.ops.causal_conv1d import cross_document_terms

HIGHEST = jax.lax.Precision.HIGHEST


def _is_first(axis):
    return jax.lax.axis_index(axis) == 0


def _from_last(x, axis):
    """x of the last shard, on every shard."""
    last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
    return jax.lax.psum(jnp.where(last, x, jnp.zeros_like(x)), axis)


def _halo(x, axis, hist):
    """The previous shard's last `hist` inputs [B, D, hist], oldest first
    (zeros on the first shard)."""
    tail = jnp.swapaxes(x[:, x.shape[1] - hist:], 1, 2)
    n = jax.lax.axis_size(axis)
    return jax.lax.ppermute(tail, axis, [(i, i + 1) for i in range(n - 1)])


def _widen(v, dk):
    """Values [v | 0]: the op then also carries the K identity columns."""
    return jnp.concatenate([v, jnp.zeros(v.shape[:3] + (dk,), v.dtype)], axis=-1)


def _fold(maps, offsets, s0, axis):
    """All-gather every shard's (P, B) and fold them in shard order from s0:
    (this shard's incoming state, the state after the last shard)."""
    maps, offsets = jax.lax.all_gather(maps, axis), jax.lax.all_gather(offsets, axis)
    me = jax.lax.axis_index(axis)
    s, s_in = s0, jnp.zeros_like(s0)
    for j in range(maps.shape[0]):
        s_in = jnp.where(me == j, s, s_in)
        s = jnp.einsum("...ij,...jv->...iv", maps[j], s, precision=HIGHEST) + offsets[j]
    return s_in, s


def _outputs(o_wide, dv, s_in):
    """O0 + Q S_in from the widened outputs [B, T, HV, V + K], S_in [B, HV, K, V]."""
    o0, oq = o_wide[..., :dv], o_wide[..., dv:]
    carry = jnp.einsum("bthk,bhkv->bthv", oq.astype(s_in.dtype), s_in, precision=HIGHEST)
    return (o0.astype(s_in.dtype) + carry).astype(o0.dtype)


class _Packing:
    """This shard's view of global packed offsets cu [N + 1] (B = 1)."""

    def __init__(self, cu, axis, local_len):
        cu = cu.astype(jnp.int32)
        me = jax.lax.axis_index(axis)
        self.offset = me * local_len
        self.local = jnp.clip(cu - self.offset, 0, local_len)       # sequences elsewhere become empty here
        self.first = jnp.searchsorted(cu, self.offset, side="right").astype(jnp.int32) - 1
        self.first_start = cu[self.first]
        self.continues = self.first_start < self.offset               # the first sequence began before this shard
        # the sequence holding this shard's last token: its map is the one passed on
        self.last = jnp.searchsorted(cu, self.offset + local_len - 1, side="right").astype(jnp.int32) - 1
        last_tok = jnp.maximum(cu[1:] - 1, 0)
        # the shard that holds each sequence's last token (shard 0 for empty ones: their state passes through)
        self.owner = jnp.where(cu[1:] > cu[:-1], last_tok // local_len, 0)
        self.me = me

    def pick_final(self, final: jax.Array, axis: str) -> jax.Array:
        """Each sequence's final state [N, ...] from its owner shard."""
        mine = (self.owner == self.me).reshape((-1,) + (1,) * (final.ndim - 1))
        return jax.lax.psum(jnp.where(mine, final, jnp.zeros_like(final)), axis)


def context_causal_conv1d(x: jax.Array, weight: jax.Array, *, axis: str, initial_state: jax.Array | None = None,
                          output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
                          activation: str | None = "silu") -> tuple[jax.Array, jax.Array | None]:
    """causal_conv1d over a sequence split on `axis`; x [B, T_local, D] with
    T_local >= kernel_size - 1. cu_seqlens: global offsets of sequences
    packed in one row (B = 1), initial_state then [N, D, W - 1]. Returns
    (y, final state of the whole sequence(s) or None)."""
    if cu_seqlens is not None:
        if activation != "silu":
            raise ValueError("activation: packed sequences (cu_seqlens) take the default silu")
        return _packed_conv(x, weight, axis, initial_state, output_final_state, cu_seqlens)
    halo = _halo(x, axis, weight.shape[1] - 1)
    start = jnp.zeros_like(halo) if initial_state is None else initial_state.astype(halo.dtype)
    halo = jnp.where(_is_first(axis), start, halo)
    y, final = causal_conv1d(x, weight, initial_state=halo, output_final_state=output_final_state,
                             activation=activation)
    return y, (_from_last(final, axis) if output_final_state else None)


def context_cross_document_terms(x: jax.Array, weight: jax.Array, starts: jax.Array, *, axis: str) -> jax.Array:
    """cross_document_terms over a sequence split on `axis`: the windows of a
    shard's first tokens reach into the previous shard (its last inputs and
    document starts come as a halo; none on the first shard)."""
    hist = weight.shape[1] - 1
    halo_x = jnp.swapaxes(_halo(x, axis, hist), 1, 2)                          # [B, hist, D]
    halo_starts = _halo(starts[..., None].astype(x.dtype), axis, hist)[:, 0] > 0   # [B, hist]
    wide = cross_document_terms(jnp.concatenate([halo_x, x], axis=1), weight,
                                jnp.concatenate([halo_starts, starts], axis=1))
    return wide[:, hist:]


def _packed_conv(x, weight, axis, initial_state, output_final_state, cu):
    hist, d = weight.shape[1] - 1, x.shape[-1]
    pk = _Packing(cu, axis, x.shape[1])
    init = jnp.zeros((cu.shape[0] - 1, d, hist), x.dtype) if initial_state is None else initial_state.astype(x.dtype)
    halo = _halo(x, axis, hist)[0]                                    # [D, W - 1]
    # halo slot i holds global position offset - hist + i; before the sequence's start, its conv state
    pos = pk.offset - hist + jnp.arange(hist, dtype=jnp.int32)
    own = init[pk.first][:, jnp.clip(pos - pk.first_start + hist, 0, hist - 1)]
    halo = jnp.where(pos[None, :] >= pk.first_start, halo, own)
    start = jnp.where(pk.continues, halo, init[pk.first])
    y, final = causal_conv1d(x, weight, initial_state=init.at[pk.first].set(start),
                             output_final_state=output_final_state, cu_seqlens=pk.local)
    return y, (pk.pick_final(final, axis) if output_final_state else None)


def context_delta_rule(op: Callable, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                       axis: str, initial_state: jax.Array | None = None, output_final_state: bool = False,
                       cu_seqlens: jax.Array | None = None, **op_kw: Any,
                       ) -> tuple[jax.Array, jax.Array | None]:
    """A chunked delta-rule op (`op`: chunk_gated_delta_rule, or chunk_kda
    with its per-channel g [B, T, HV, K]) over a sequence split on `axis`
    (the op's arguments, local shards of [B, T, ...]; cu_seqlens global).
    Returns (o, final state of the whole sequence(s) or None)."""
    if cu_seqlens is not None:
        return _packed_delta_rule(op, q, k, v, g, beta, axis, initial_state, output_final_state, cu_seqlens, op_kw)
    b, _, hv, dv = v.shape
    dk = q.shape[-1]
    state_dtype = jnp.dtype(op_kw.get("state_dtype", jnp.float32))
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=state_dtype), (b, hv, dk, dk))
    wide_h0 = jnp.concatenate([jnp.zeros((b, hv, dk, dv), state_dtype), eye], axis=-1)
    o_wide, s_wide = op(q, k, _widen(v, dk), g, beta, initial_state=wide_h0, output_final_state=True,
                            **op_kw)[:2]
    assert s_wide is not None  # asked for
    s0 = jnp.zeros((b, hv, dk, dv), state_dtype) if initial_state is None else initial_state.astype(state_dtype)
    s_in, final = _fold(s_wide[..., dv:], s_wide[..., :dv], s0, axis)
    return _outputs(o_wide, dv, s_in), (final if output_final_state else None)


def _packed_delta_rule(op, q, k, v, g, beta, axis, initial_state, output_final_state, cu, op_kw):
    hv, dv = v.shape[2:]
    dk = q.shape[-1]
    n_seq = cu.shape[0] - 1
    pk = _Packing(cu, axis, v.shape[1])
    state_dtype = jnp.dtype(op_kw.get("state_dtype", jnp.float32))
    h0 = jnp.zeros((n_seq, hv, dk, dv), state_dtype) if initial_state is None else initial_state.astype(state_dtype)
    wide_h0 = jnp.concatenate([h0, jnp.zeros((n_seq, hv, dk, dk), state_dtype)], axis=-1)
    carried = jnp.concatenate([jnp.zeros((hv, dk, dv), state_dtype),
                               jnp.broadcast_to(jnp.eye(dk, dtype=state_dtype), (hv, dk, dk))], axis=-1)
    wide_h0 = wide_h0.at[pk.first].set(jnp.where(pk.continues, carried, wide_h0[pk.first]))
    o_wide, s_wide = op(q, k, _widen(v, dk), g, beta, initial_state=wide_h0, output_final_state=True,
                            cu_seqlens=pk.local, **op_kw)
    passed = s_wide[pk.last]
    s_in, _ = _fold(passed[..., dv:], passed[..., :dv], jnp.zeros((hv, dk, dv), state_dtype), axis)
    # Q is zero outside the continuing sequence (its identity block is)
    o = _outputs(o_wide, dv, s_in[None])
    if not output_final_state:
        return o, None
    finals = s_wide[..., :dv] + jnp.einsum("nhij,hjv->nhiv", s_wide[..., dv:], s_in, precision=HIGHEST)
    return o, pk.pick_final(finals, axis)
