"""Softmax attention that reads only the tokens a sparse-attention indexer
picks (gdnx.layers.sparse_index):

- `IndexedLatentAttention` (GLM-5-Next): multi-head latent attention (no
  RoPE at these sizes) with a `PooledIndexer`, or, on a shared-index layer,
  none: it attends with the selection the last full layer made.
- `IndexedGatedAttention` (Qwen4-Exp): gated attention with a
  `BlockMeanIndexer`, keys also visible only up to the query.

Two ways to apply a selection, the same tokens either way: over the whole
context with a mask (prefill, training: the cost of dense attention, no
gathers), or, when a call's queries together read fewer rows than the cache
holds (decode, verify), by gathering each query's rows [B, T, K] from the
cache, so a step costs the index budget, not the context.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.attention import GatedAttention, KVCache, Rope, causal_attention, maybe_rope, write_cache
from gdnx.layers.documents import document_positions
from gdnx.layers.latent_attention import LatentAttention, LatentCache
from gdnx.layers.sparse_index import (BlockMeanIndexer, IndexCache, PooledIndexer, Selection, gather_rows,
                                      selection_indices, selection_mask)
from gdnx.parallel.rules import HIDDEN, out_sharding


class IndexedLatentCache(NamedTuple):
    """A latent attention layer's cache (LatentCache's latent and rope) and
    its indexer's (IndexCache's keys, gates and blocks; None on a
    shared-index layer), every array [B, max_len, ...]."""
    latent: jax.Array
    rope: jax.Array
    keys: jax.Array | None = None
    gates: jax.Array | None = None
    blocks: jax.Array | None = None

    @property
    def capacity(self) -> int:
        """Tokens the cache holds."""
        return self.latent.shape[-2]

    @property
    def parts(self) -> tuple[LatentCache, IndexCache | None]:
        index = None if self.keys is None or self.blocks is None else IndexCache(self.keys, self.gates, self.blocks)
        return LatentCache(self.latent, self.rope), index

    @classmethod
    def of(cls, latent: LatentCache, index: IndexCache | None) -> "IndexedLatentCache":
        return cls(latent.latent, latent.rope, *(index if index is not None else (None, None, None)))


class IndexedKVCache(NamedTuple):
    """A gated attention layer's keys and values (KVCache's) and its
    indexer's keys and block keys (IndexCache's), every array
    [B, max_len, ...]: flat, so that a prefix cache keeps and restores a
    block of positions of each as it does attention's."""
    k: jax.Array
    v: jax.Array
    keys: jax.Array
    blocks: jax.Array

    @property
    def capacity(self) -> int:
        """Tokens the cache holds."""
        return self.k.shape[-3]

    @property
    def kv(self) -> KVCache:
        return KVCache(self.k, self.v)

    @property
    def indexer(self) -> IndexCache:
        return IndexCache(self.keys, None, self.blocks)

    @classmethod
    def of(cls, kv: KVCache, index: IndexCache) -> "IndexedKVCache":
        return cls(kv.k, kv.v, index.keys, index.blocks)


def _softmax_over(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """Softmax over the last axis of scores [..., T, K] where valid
    [B, T, K] (broadcast over the axes between) holds."""
    extra = scores.ndim - valid.ndim
    mask = valid.reshape(valid.shape[0], *(1,) * extra, *valid.shape[1:])
    return jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)


class IndexedLatentAttention(LatentAttention):
    """Multi-head latent attention over the tokens a PooledIndexer picks
    (`shared`: no indexer; the caller passes the selection)."""

    def __init__(self, hidden_size: int, *, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, bias: bool, norm_eps: float,
                 absorb: bool, index_heads: int, index_head_dim: int, block: int, budget: int, tail: bool,
                 shared: bool, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads=num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                         qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                         v_head_dim=v_head_dim, bias=bias, norm_eps=norm_eps, absorb=absorb, init_std=init_std,
                         dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if budget % block:
            raise ValueError(f"index_topk: expected a multiple of index_kpool ({block}), got {budget}")
        self.block, self.top, self.tail = block, budget // block, tail
        self.indexer = None if shared else PooledIndexer(
            hidden_size, q_lora_rank=q_lora_rank, heads=index_heads, head_dim=index_head_dim, block=block,
            budget=budget, tail=tail, init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rope: Rope, positions: jax.Array,  # type: ignore[override]
                 cache: IndexedLatentCache | None = None, start: jax.Array | int = 0,
                 selection: Selection | None = None, segments: jax.Array | None = None,
                 ) -> tuple[jax.Array, IndexedLatentCache | None, Selection]:
        """x [B, T, hidden], rope (None: no rotary embedding), positions [T]
        or [B, T], the cache written at [start, start + T); `selection`: the
        last full layer's (required on a shared-index layer, ignored
        otherwise); segments [B, T]: packed documents (without a cache), each
        indexed and attended on its own. Returns (y, new cache or None, the
        selection used)."""
        q_nope, q_rope, latent, k_rope, resid = self._project(x, rope)
        assert resid is not None  # the indexer reads the low-rank query; the config requires q_lora_rank
        lat_cache, index = (None, None) if cache is None else cache.parts
        if self.indexer is not None:
            selection, index = self.indexer(x, resid, positions, index, start, segments)
        else:
            if selection is None:
                raise ValueError("selection: a shared-index layer attends with a previous full layer's selection")
            index = None
        if cache is None:
            out = self._mix(q_nope, q_rope, latent, k_rope, positions, positions, segments, False,
                            selection_mask(selection, latent.shape[1], self.block, self.tail))
            return self._output(x, out), None, selection
        assert lat_cache is not None
        written, latent, k_rope = self._cached(lat_cache, latent, k_rope, start)
        assert isinstance(written, LatentCache)
        new = IndexedLatentCache.of(written, index)
        t, s = x.shape[1], latent.shape[1]
        if t * (self.top * self.block + self.block - 1) < s:
            idx, valid = selection_indices(selection, self.block, self.tail)
            out = self._gathered(q_nope, q_rope, gather_rows(latent, idx), gather_rows(k_rope, idx), valid)
        else:
            k_pos = jnp.arange(s, dtype=positions.dtype)
            out = self._mix(q_nope, q_rope, latent, k_rope, positions, k_pos, None, True,
                            selection_mask(selection, s, self.block, self.tail))
        return self._output(x, out), new, selection

    def _gathered(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                  valid: jax.Array) -> jax.Array:
        """Attention of each query over its own rows: latents [B, T, K, rank],
        shared key parts [B, T, K, dr], valid [B, T, K]; in the latent space
        (absorbed) or with the rows expanded, as `absorb` says. Returns
        [B, T, H, dv]."""
        f32 = jnp.float32
        dn, dr, dv, h = self.dn, self.dr, self.dv, self.num_heads
        w = self.kv_b_proj.weight().astype(q_nope.dtype).reshape(self.rank, h, dn + dv)
        if self.absorb:
            q_latent = jnp.einsum("bthd,rhd->bthr", q_nope, w[..., :dn], preferred_element_type=f32)
            scores = jnp.einsum("bthr,btkr->bhtk", q_latent.astype(latent.dtype), latent, preferred_element_type=f32)
        else:
            kv = jnp.einsum("btkr,rhd->btkhd", latent, w, preferred_element_type=f32).astype(latent.dtype)
            scores = jnp.einsum("bthd,btkhd->bhtk", q_nope, kv[..., :dn], preferred_element_type=f32)
        scores = scores + jnp.einsum("bthd,btkd->bhtk", q_rope, k_rope, preferred_element_type=f32)
        probs = _softmax_over(scores * (dn + dr) ** -0.5, valid).astype(latent.dtype)
        if self.absorb:
            out_latent = jnp.einsum("bhtk,btkr->bthr", probs, latent, preferred_element_type=f32)
            out = jnp.einsum("bthr,rhd->bthd", out_latent.astype(latent.dtype), w[..., dn:],
                             preferred_element_type=f32)
        else:
            out = jnp.einsum("bhtk,btkhd->bthd", probs, kv[..., dn:], preferred_element_type=f32)
        return out.astype(q_nope.dtype)


class IndexedGatedAttention(GatedAttention):
    """Gated attention over the tokens a BlockMeanIndexer picks, RoPE on
    q and k as the indexer's (default RoPE: `theta`, `rotary_dim`)."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 norm_eps: float, index_heads: int, index_head_dim: int, block: int, budget: int, theta: float,
                 rotary_dim: int, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias,
                         norm_eps=norm_eps, init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.indexer = BlockMeanIndexer(hidden_size, heads=index_heads, head_dim=index_head_dim, block=block,
                                        budget=budget, theta=theta, rotary_dim=rotary_dim, norm_eps=norm_eps,
                                        init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rope: Rope, positions: jax.Array,  # type: ignore[override]
                 cache: IndexedKVCache | None = None, start: jax.Array | int = 0,
                 segments: jax.Array | None = None) -> tuple[jax.Array, IndexedKVCache | None]:
        """As GatedAttention.__call__ (rope for each token's position in its
        document, made with the indexer's theta and rotary_dim); segments
        [B, T]: packed documents (without a cache), each indexed on its own."""
        b, t, _ = x.shape
        d, idx_block = self.head_dim, self.indexer.block
        qg = self.q_proj(x).reshape(b, t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, t, self.num_heads * d)
        q = maybe_rope(self.q_norm(q), rope)
        k = maybe_rope(self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, d)), rope)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, d)
        rotated = positions if segments is None else document_positions(segments)
        selection, index = self.indexer(x, rotated, None if cache is None else cache.indexer, start, segments)
        new: IndexedKVCache | None = None
        if cache is None:
            out = causal_attention(q, k, v, positions, positions, segments,
                                   allowed=selection_mask(selection, t, idx_block, True))
        else:
            axes = ("batch", None, "kv_heads", None)
            kv = KVCache(write_cache(cache.kv.k, k, start, axes), write_cache(cache.kv.v, v, start, axes))
            assert index is not None
            new = IndexedKVCache.of(kv, index)
            keys, values = kv.k.astype(q.dtype), kv.v.astype(q.dtype)
            s = keys.shape[1]
            if t * (self.indexer.top * idx_block + idx_block - 1) < s:
                rows, valid = selection_indices(selection, idx_block, True)
                out = self._gathered(q, gather_rows(keys, rows), gather_rows(values, rows), valid)
            else:
                slots = jnp.arange(s, dtype=positions.dtype)
                out = causal_attention(q, keys, values, positions, slots,
                                       allowed=selection_mask(selection, s, idx_block, True))
        out = out.reshape(b, t, self.num_heads * d) * jax.nn.sigmoid(gate)
        return self.o_proj(out, out_sharding=out_sharding(HIDDEN, x.shape)), new

    def _gathered(self, q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
        """q [B, T, H, D] over its own rows k, v [B, T, K, Hkv, D], valid
        [B, T, K]. Returns [B, T, H, D]."""
        b, t, h, d = q.shape
        hkv = k.shape[3]
        qg = q.reshape(b, t, hkv, h // hkv, d)
        f32 = jnp.float32
        scores = jnp.einsum("btgrd,btkgd->bgrtk", qg, k, preferred_element_type=f32) * d ** -0.5
        probs = _softmax_over(scores, valid).astype(q.dtype)
        out = jnp.einsum("bgrtk,btkgd->btgrd", probs, v, preferred_element_type=f32)
        return out.reshape(b, t, h, d).astype(q.dtype)
