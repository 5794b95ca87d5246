"""Multi-head latent attention (MLA, DeepSeek-V2's; Kimi Linear's full
attention layers).

Keys and values come from one compressed latent per token: kv_a_proj_with_mqa
gives kv_lora_rank latent features (RMS-normed, kv_a_layernorm) and a
qk_rope_head_dim key part shared by every head (rotated by RoPE when the
model has one); kv_b_proj expands the latent into each head's key part
(qk_nope_head_dim) and value (v_head_dim). The query is q_proj, or a
q_lora_rank bottleneck (q_a_proj, q_a_layernorm, q_b_proj). Scores are
scaled by (qk_nope_head_dim + qk_rope_head_dim)^-1/2.

The generation cache holds the latent and the shared key part per token
(LatentCache), not the expanded keys and values. A call with a cache can
attend in the latent space instead (`absorb`, DeepSeek's trick): the query's
key part is multiplied into the latent space by kv_b_proj's key block, the
scores and the weighted sum run over the cached latents directly, and the
value block maps the result out, so no token's keys and values are
expanded. Per query and cached token that costs 2 rank + rope FLOP units
against nope + rope + v for expanded keys, plus rank (nope + v) per cached
token to expand them: the latent order wins below
rank (nope + v) / (2 rank - nope - v) queries (170 at Kimi Linear's sizes),
which decode and verify always are, and it is taken there. Without a cache
(training, scoring) keys and values are expanded.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.attention import Rope, causal_attention, write_cache
from gdnx.layers.linear import linear
from gdnx.layers.norms import RMSNorm
from gdnx.layers.rope import apply_rope_interleaved
from gdnx.parallel.rules import HIDDEN, constrain, out_sharding

# the latent's and the shared key part's logical axes: one "head", kept whole
_LATENT = ("batch", None, None)


class LatentCache(NamedTuple):
    """Per token: the normed latent [B, max_len, kv_lora_rank] and the
    shared (rotated) key part [B, max_len, qk_rope_head_dim]."""
    latent: jax.Array
    rope: jax.Array

    @property
    def capacity(self) -> int:
        """Tokens the cache holds."""
        return self.latent.shape[-2]


class LatentStack(NamedTuple):
    """Inside a scanned cycle: the cycle's latent caches stacked over its
    repeats [R, B, max_len, ...] and the repeat `layer` a call is (written
    in the stack itself, as gdnx.layers.attention.KVStack)."""
    latent: jax.Array
    rope: jax.Array
    layer: jax.Array


class LatentAttention(nnx.Module):
    """Multi-head latent attention with an optional low-rank query."""

    def __init__(self, hidden_size: int, *, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, bias: bool, norm_eps: float,
                 absorb: bool, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 head_gate: bool = False):
        self.num_heads, self.rank = num_heads, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.absorb = absorb
        h, std, dq = hidden_size, init_std, qk_nope_head_dim + qk_rope_head_dim
        self.q_proj = None if q_lora_rank is not None else linear(h, num_heads * dq, dtype, param_dtype, std, rngs)
        self.q_a_proj = None if q_lora_rank is None else linear(h, q_lora_rank, dtype, param_dtype, std, rngs,
                                                                bias=bias)
        self.q_a_layernorm = None if q_lora_rank is None else RMSNorm(q_lora_rank, eps=norm_eps,
                                                                      param_dtype=param_dtype)
        self.q_b_proj = None if q_lora_rank is None else linear(q_lora_rank, num_heads * dq, dtype, param_dtype,
                                                                std, rngs)
        self.kv_a_proj_with_mqa = linear(h, kv_lora_rank + qk_rope_head_dim, dtype, param_dtype, std, rngs,
                                         bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps, param_dtype=param_dtype)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), dtype, param_dtype, std,
                                rngs)
        self.o_proj = linear(num_heads * v_head_dim, h, dtype, param_dtype, std, rngs, bias=bias)
        self.g_proj = linear(h, num_heads, dtype, param_dtype, std, rngs) if head_gate else None

    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The query [B, T, H, dn + dr], and the normed low-rank one it comes
        from (None without q_lora_rank)."""
        if self.q_proj is not None:
            q, resid = self.q_proj(x), None
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(resid)
        b, t, _ = x.shape
        return constrain(q.reshape(b, t, self.num_heads, self.dn + self.dr), ("batch", "length", "heads", None)), resid

    def _project(self, x: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """q_nope, q_rope [B, T, H, ...], the normed latent [B, T, rank], the
        shared key part [B, T, dr] (both rotated by rope unless None) and the
        low-rank query."""
        q, resid = self._query(x)
        q_nope, q_rope = q[..., :self.dn], q[..., self.dn:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :self.rank])
        k_rope = compressed[..., self.rank:]
        if rope is not None:
            q_rope = apply_rope_interleaved(q_rope, *rope)
            k_rope = apply_rope_interleaved(k_rope[:, :, None], *rope)[:, :, 0]
        return q_nope, q_rope, latent, k_rope, resid

    @staticmethod
    def _cached(cache: LatentCache | LatentStack, latent: jax.Array, k_rope: jax.Array, start: jax.Array | int
                ) -> tuple[LatentCache | LatentStack, jax.Array, jax.Array]:
        """The call's latents written at [start, start + T); returns the cache
        and every slot's latent and shared key part, in the call's dtype."""
        layer = cache.layer if isinstance(cache, LatentStack) else None
        cache = cache._replace(latent=write_cache(cache.latent, latent, start, _LATENT, layer),
                               rope=write_cache(cache.rope, k_rope, start, _LATENT, layer))
        all_latent, all_rope = cache.latent, cache.rope
        if layer is not None:
            all_latent, all_rope = (jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
                                    for a in (all_latent, all_rope))
        return cache, all_latent.astype(latent.dtype), all_rope.astype(latent.dtype)

    def _mix(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, positions: jax.Array,
             k_pos: jax.Array, segments: jax.Array | None, cached: bool, allowed: jax.Array | None = None
             ) -> jax.Array:
        """Attention over every slot's latent [B, S, rank] (absorbed when
        cached and cheaper, else expanded), each key visible as
        causal_attention decides. Returns [B, T, H, dv]."""
        b, t = q_nope.shape[:2]
        r, dn, dv = self.rank, self.dn, self.dv
        if cached and self.absorb and t * (2 * r - dn - dv) < r * (dn + dv):
            return self._absorbed(q_nope, q_rope, latent, k_rope, positions, k_pos, allowed)
        s = latent.shape[1]
        kv = self.kv_b_proj(latent).reshape(b, s, self.num_heads, self.dn + self.dv)
        heads = ("batch", None, "heads", None)  # keys whole along the length, as attend keeps them
        kv = constrain(kv, heads)
        shared = constrain(jnp.broadcast_to(k_rope[:, :, None], (b, s, self.num_heads, self.dr)), heads)
        k = jnp.concatenate([kv[..., :self.dn], shared], axis=-1)
        return causal_attention(jnp.concatenate([q_nope, q_rope], axis=-1), k, kv[..., self.dn:], positions,
                                k_pos, segments, allowed=allowed)

    def _output(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """out [B, T, H, dv] through the head gate (if any) and o_proj."""
        b, t, _ = x.shape
        if self.g_proj is not None:
            out = out * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32)).astype(out.dtype)[..., None]
        out = out.reshape(b, t, self.num_heads * self.dv)
        return self.o_proj(out, out_sharding=out_sharding(HIDDEN, x.shape))

    def __call__(self, x: jax.Array, rope: Rope, positions: jax.Array, cache: LatentCache | LatentStack | None = None,
                 start: jax.Array | int = 0, segments: jax.Array | None = None,
                 ) -> tuple[jax.Array, LatentCache | LatentStack | None]:
        """As GatedAttention.__call__: x [B, T, hidden], rope for each
        token's position (None: no rotary embedding; else turning adjacent
        pairs of the rope parts), positions [T] or
        [B, T], the cache written at [start, start + T)."""
        q_nope, q_rope, latent, k_rope, _ = self._project(x, rope)
        if cache is not None:
            cache, latent, k_rope = self._cached(cache, latent, k_rope, start)
            k_pos = jnp.arange(latent.shape[1], dtype=positions.dtype)
        else:
            k_pos = positions
        out = self._mix(q_nope, q_rope, latent, k_rope, positions, k_pos, segments, cache is not None)
        return self._output(x, out), cache

    def _absorbed(self, q_nope, q_rope, latent, k_rope, q_pos, k_pos, allowed=None):
        """Attention in the latent space: q_nope [B, T, H, dn] into it by
        kv_b_proj's key block, scores against the latents [B, S, rank] plus
        the rope parts', the probabilities' sum of latents out by its value
        block; keys visible by position (and where allowed [B, T, S] holds).
        Returns [B, T, H, dv]."""
        w = self.kv_b_proj.weight().astype(q_nope.dtype).reshape(self.rank, self.num_heads, self.dn + self.dv)
        f32 = jnp.float32
        q_latent = jnp.einsum("bthd,rhd->bthr", q_nope, w[..., :self.dn], preferred_element_type=f32)
        scores = (jnp.einsum("bthr,bsr->bhts", q_latent.astype(latent.dtype), latent, preferred_element_type=f32)
                  + jnp.einsum("bthd,bsd->bhts", q_rope, k_rope, preferred_element_type=f32))
        scores = scores * (self.dn + self.dr) ** -0.5
        visible = k_pos[None, :] <= q_pos[..., :, None]  # [T, S], or [B, T, S] for positions per row
        if allowed is not None:
            visible = visible & allowed
        scores = jnp.where(visible if visible.ndim == 2 else visible[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(latent.dtype)
        out_latent = jnp.einsum("bhts,bsr->bthr", probs, latent, preferred_element_type=f32)
        out = jnp.einsum("bthr,rhd->bthd", out_latent.astype(latent.dtype), w[..., self.dn:],
                         preferred_element_type=f32)
        return constrain(out.astype(q_nope.dtype), ("batch", "length", "heads", None))
