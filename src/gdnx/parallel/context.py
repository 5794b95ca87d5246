"""Context parallelism for Gated DeltaNet: the sequence split over a mesh
axis, run inside shard_map (every function here takes that axis's name).

Delta rule. Across a shard's span the state map is affine,
S_out = P S_in + B (P in R^{K x K}, per value head), because each value
column of the state evolves on its own. So one call of the op on the local
tokens with the value dim widened to V + K, values [v | 0] and initial
state [0 | I], returns both at once: the first V columns are the outputs
O0 and final state B of a zero start, the last K columns are P itself and
Q = scale P_t^T q_t per token. The (P, B) of every shard are all-gathered
and folded in shard order, which gives each shard its incoming state S_in,
and its outputs are O0 + Q S_in. Cost: the op at V + K instead of V (twice
the work for K = V), one all-gather of C states of size K (V + K), and C
small matmuls, for C shards.

Conv. Each shard needs the kernel_size - 1 inputs before its first token:
the previous shard sends its last ones (ppermute); the first shard uses
the layer's conv state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdnx.ops import causal_conv1d, chunk_gated_delta_rule


def _is_first(axis):
    return jax.lax.axis_index(axis) == 0


def _from_last(x, axis):
    """x of the last shard, on every shard."""
    last = jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1
    return jax.lax.psum(jnp.where(last, x, jnp.zeros_like(x)), axis)


def context_causal_conv1d(x, weight, *, axis, initial_state=None, output_final_state=False):
    """causal_conv1d over a sequence split on `axis`; x [B, T_local, D] with
    T_local >= kernel_size - 1. Returns (y, final state of the whole
    sequence or None)."""
    hist = weight.shape[1] - 1
    n = jax.lax.axis_size(axis)
    tail = jnp.swapaxes(x[:, x.shape[1] - hist:], 1, 2)            # [B, D, W - 1], oldest first
    halo = jax.lax.ppermute(tail, axis, [(i, i + 1) for i in range(n - 1)])
    start = jnp.zeros_like(halo) if initial_state is None else initial_state.astype(halo.dtype)
    halo = jnp.where(_is_first(axis), start, halo)
    y, final = causal_conv1d(x, weight, initial_state=halo, output_final_state=output_final_state)
    return y, (_from_last(final, axis) if output_final_state else None)


def context_gated_delta_rule(q, k, v, g, beta, *, axis, initial_state=None, output_final_state=False, **op_kw):
    """chunk_gated_delta_rule over a sequence split on `axis` (same
    arguments, local shards of [B, T, ...]). Returns (o, final state of the
    whole sequence or None)."""
    b, _, hv, dv = v.shape
    dk = q.shape[-1]
    state_dtype = jnp.dtype(op_kw.get("state_dtype", jnp.float32))
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=state_dtype), (b, hv, dk, dk))
    wide_v = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (dk,), v.dtype)], axis=-1)
    wide_h0 = jnp.concatenate([jnp.zeros((b, hv, dk, dv), state_dtype), eye], axis=-1)
    o_wide, s_wide = chunk_gated_delta_rule(q, k, wide_v, g, beta, initial_state=wide_h0, output_final_state=True,
                                            **op_kw)
    o0, oq = o_wide[..., :dv], o_wide[..., dv:]
    maps = jax.lax.all_gather(s_wide[..., dv:], axis)             # P of every shard  [C, B, HV, K, K]
    offsets = jax.lax.all_gather(s_wide[..., :dv], axis)          # B of every shard  [C, B, HV, K, V]
    me = jax.lax.axis_index(axis)
    hp = jax.lax.Precision.HIGHEST
    s = jnp.zeros((b, hv, dk, dv), state_dtype) if initial_state is None else initial_state.astype(state_dtype)
    s_in = jnp.zeros_like(s)
    for j in range(maps.shape[0]):
        s_in = jnp.where(me == j, s, s_in)
        s = jnp.einsum("bhij,bhjv->bhiv", maps[j], s, precision=hp) + offsets[j]
    carry = jnp.einsum("bthk,bhkv->bthv", oq.astype(state_dtype), s_in, precision=hp)
    o = (o0.astype(state_dtype) + carry).astype(o0.dtype)
    return o, (s if output_final_state else None)
