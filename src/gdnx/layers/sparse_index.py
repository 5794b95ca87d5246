"""Sparse-attention indexers: per query, a cheap score for each block of
`block` consecutive tokens, the `top` best complete blocks kept and the
query's own unfinished block (its tail) added whole; the attention then
reads only those tokens.

Two kinds, as transformers builds them:

- `PooledIndexer` (GLM-5-Next's DSA over k-pools): per token an index key
  (wk, LayerNorm) and per-channel gate logits (a projection of the hidden
  state plus a learned bias per place in the pool); a pool's key is the
  softmax-weighted sum (over its tokens, per channel) of its tokens' keys.
  A pool's score is the sum over index heads of w_h relu(q_h . k / sqrt(d)),
  with w from the hidden state (weights_proj, / sqrt(heads)) and q from the
  attention's normed low-rank query (wq_b).
- `BlockMeanIndexer` (Qwen4-Exp's QSA): per token one raw key, projected
  with the index queries (index_qk_proj); a block's key is the mean of its
  tokens' keys, RMS-normed ((1 + w)) and rotated at the block's first
  position; the score is the sum over heads of relu(q_h . k) / sqrt(d), q
  normed per head and rotated at the query's position.

Blocks start at position 0: every row's context starts at slot 0 (a cache
slot is its position), so without a cache the call's tokens are positions
0..T-1; in packed rows (segments, no cache) each document's blocks start at
its first token (`packed_blocks`). A block is a candidate for a query once
its last token is at or before the query (and in its document); a query with fewer candidates than `top` gets all of them,
so attention is dense up to top * block + block - 1 tokens and sparse past
that.

`IndexCache` holds the per-token index keys (and gate logits) and the block
keys. A call writes its tokens, then rebuilds from the per-token entries
the key of the block it may complete (every block, after a prefill longer
than a block): a decode step's indexer pass then costs the scoring of the
blocks, not a pass over every token. A block's key is read only once the
block is complete, and the call that writes its last slot rebuilds it, so
tokens taken back (a refused draft) leave nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.attention import write_cache
from gdnx.layers.documents import document_positions
from gdnx.layers.linear import linear
from gdnx.layers.norms import LayerNorm, ZeroCenteredRMSNorm
from gdnx.layers.rope import apply_rope, rope_tables
from gdnx.parallel.rules import constrain, out_sharding

_TOKENS = ("batch", None, None)  # the cache's logical axes: the length kept whole


class IndexCache(NamedTuple):
    """Per token slot [B, max_len, d]: the index key, for pooled indexers
    the gate logits (else None), and at each block's last slot the block's
    key (the others unused). Every array is per slot so that a prefix cache
    keeps a block of positions as it keeps attention's keys."""
    keys: jax.Array
    gates: jax.Array | None
    blocks: jax.Array


class Selection(NamedTuple):
    """Per query [B, T]: the chosen blocks [B, T, n] (block b covers slots
    [b * block, (b + 1) * block), or in packed rows [starts[b], starts[b] +
    block)) and whether each is real (a context with fewer than n candidates
    fills the rest with unreal ones), and the query's slot [B, T]. Packed
    rows (documents one after another, each with its own blocks): starts
    [B, P], each block's first slot, and q_doc [B, T], each query's position
    in its document. A shared-index layer attends with another layer's."""
    blocks: jax.Array
    chosen: jax.Array
    q_pos: jax.Array
    starts: jax.Array | None = None
    q_doc: jax.Array | None = None


def select_blocks(scores: jax.Array, q_pos: jax.Array, block: int, top: int,
                  packed: "PackedBlocks | None" = None) -> Selection:
    """The `top` best-scoring candidate blocks per query: scores [B, T, P]
    (float32) for the complete blocks of the context, q_pos [B, T]; packed:
    the blocks of packed documents (a block is then a candidate for the
    queries of its own document only)."""
    b, t, p = scores.shape
    n = min(top, p)
    if n == 0:
        empty = jnp.zeros((b, t, 0), jnp.int32)
        return Selection(empty, empty.astype(bool), q_pos)
    if packed is None:
        last = (jnp.arange(p, dtype=jnp.int32) + 1) * block - 1
        candidate = last <= q_pos[..., None]
    else:
        candidate = ((packed.starts[:, None, :] + block - 1 <= q_pos[..., None])
                     & (packed.documents[:, None, :] == packed.segments[..., None]))
    _, blocks = jax.lax.top_k(jnp.where(candidate, scores, -jnp.inf), n)
    chosen = jnp.take_along_axis(candidate, blocks, axis=-1)
    if packed is None:
        return Selection(blocks.astype(jnp.int32), chosen, q_pos)
    return Selection(blocks.astype(jnp.int32), chosen, q_pos, packed.starts, packed.doc_pos)


class PackedBlocks(NamedTuple):
    """The complete blocks of packed rows ([B, T] tokens, documents one
    after another, each cut into blocks from its first token): at most
    T // block of them per row, in order; a document's unfinished last
    block is none. starts [B, P]: each block's first slot (T for none);
    documents [B, P]: its document (-1 for none); segments, doc_pos [B, T]:
    each token's document and position in it."""
    starts: jax.Array
    documents: jax.Array
    segments: jax.Array
    doc_pos: jax.Array


def packed_blocks(segments: jax.Array, block: int) -> PackedBlocks:
    """Where the complete blocks of packed rows lie (segments [B, T] number
    each token's document, non-decreasing)."""
    b, t = segments.shape
    p = t // block
    doc_pos = document_positions(segments)
    slots = jnp.arange(t, dtype=jnp.int32)
    last = jnp.minimum(slots + block - 1, t - 1)
    complete = (doc_pos % block == 0) & (slots + block - 1 < t) & (jnp.take(segments, last, axis=1) == segments)
    index = jnp.where(complete, jnp.cumsum(complete, axis=1) - 1, p)  # the block's place, p: none
    rows = jnp.arange(b)[:, None]
    starts = jnp.full((b, p + 1), t, jnp.int32).at[rows, index].set(jnp.broadcast_to(slots, (b, t)))[:, :p]
    documents = jnp.full((b, p + 1), -1, segments.dtype).at[rows, index].set(segments)[:, :p]
    return PackedBlocks(starts, documents, segments, doc_pos)


def gather_rows(rows: jax.Array, idx: jax.Array) -> jax.Array:
    """Each row's entries at its own indices: rows [B, S, ...] at idx
    [B, ...] (clamped into range) -> [B, ..., ...]."""
    return jax.vmap(lambda r, i: r[i])(rows, jnp.clip(idx, 0, rows.shape[1] - 1))


def _tail_count(q_pos: jax.Array, block: int) -> jax.Array:
    """How many of the query's context tokens lie past its last complete
    block: the unfinished block it is in."""
    return jnp.mod(q_pos + 1, block)


def selection_mask(sel: Selection, length: int, block: int, tail: bool) -> jax.Array:
    """The slots each query reads, [B, T, length] bool: its chosen blocks,
    and with `tail` its unfinished block up to itself."""
    b, t, _ = sel.blocks.shape
    p = length // block
    bi = jnp.arange(b)[:, None, None]
    ti = jnp.arange(t)[None, :, None]
    rows = ("batch", "length", None)
    hit = jnp.zeros((b, t, p + 1), bool, out_sharding=out_sharding(rows, (b, t, p + 1)))
    hit = hit.at[bi, ti, jnp.where(sel.chosen, sel.blocks, p)].set(True, out_sharding=out_sharding(rows, hit.shape))
    hit = jnp.where(jnp.arange(p + 1) < p, hit, False)  # column p: a slot in no block (or an unreal pick)
    slots = jnp.arange(length, dtype=jnp.int32)
    if sel.starts is None:
        visible = jnp.take(hit, jnp.minimum(slots // block, p), axis=-1)
    else:  # each slot's block in packed rows (p: in none), from the blocks' first slots
        starts = sel.starts[:, :p]
        owner = jnp.full((b, length + block), p, jnp.int32)
        spans = (starts[..., None] + jnp.arange(block, dtype=jnp.int32)).reshape(b, -1)
        owner = owner.at[jnp.arange(b)[:, None], spans].set(
            jnp.repeat(jnp.arange(p, dtype=jnp.int32), block)[None], mode="drop")[:, :length]
        visible = jnp.take_along_axis(hit, jnp.broadcast_to(owner[:, None, :], (b, t, length)), axis=-1)
    if tail:
        q = sel.q_pos[..., None]
        count = _tail_count(q if sel.q_doc is None else sel.q_doc[..., None], block)
        visible = visible | ((slots >= q + 1 - count) & (slots <= q))
    return visible


def selection_indices(sel: Selection, block: int, tail: bool) -> tuple[jax.Array, jax.Array]:
    """The slots each query reads as indices [B, T, K] with their validity
    (K = n * block, plus block - 1 with `tail`): what a decode step gathers
    instead of reading the whole cache (one document per row)."""
    assert sel.starts is None  # a cache holds one document per row
    b, t, n = sel.blocks.shape
    offsets = jnp.arange(block, dtype=jnp.int32)
    idx = (sel.blocks[..., None] * block + offsets).reshape(b, t, n * block)
    valid = jnp.broadcast_to(sel.chosen[..., None], (b, t, n, block)).reshape(b, t, n * block)
    if tail and block > 1:
        q = sel.q_pos[..., None]
        count = _tail_count(q, block)
        off = jnp.arange(block - 1, dtype=jnp.int32)
        idx = jnp.concatenate([idx, q + 1 - count + off], axis=-1)
        valid = jnp.concatenate([valid, jnp.broadcast_to(off < count, (b, t, block - 1))], axis=-1)
    return idx, valid


def _packed(segments: jax.Array | None, cache: IndexCache | None, block: int) -> PackedBlocks | None:
    if segments is None:
        return None
    if cache is not None:
        raise ValueError("segments: packed documents are for training and scoring; a cache holds one per row")
    return packed_blocks(segments, block)


def _query_positions(positions: jax.Array, b: int, t: int) -> jax.Array:
    return jnp.broadcast_to(positions.astype(jnp.int32).reshape(-1, t), (b, t))


PoolFn = Callable[[jax.Array, "jax.Array | None", jax.Array], jax.Array]
"""Block keys [B, n, d] from their tokens' keys (and gates) [B, n, block,
d] and the block ids [B, n]."""


def _all_blocks(pool: PoolFn, block: int, keys: jax.Array, gates: jax.Array | None,
                packed: PackedBlocks | None = None) -> jax.Array:
    b, s, d = keys.shape
    p = s // block
    if packed is not None:  # each block's tokens from its first slot (a block of none: any, never read)
        slots = (packed.starts[..., None] + jnp.arange(block, dtype=jnp.int32)).reshape(b, -1)

        def grouped(a):
            return gather_rows(a, slots).reshape(b, p, block, d)
        # a block's rotation (QSA) follows its position in its document
        ids = jnp.take_along_axis(packed.doc_pos, jnp.minimum(packed.starts, s - 1), axis=1) // block
    else:
        def grouped(a):
            return a[:, :p * block].reshape(b, p, block, d)
        ids = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    return pool(grouped(keys), None if gates is None else grouped(gates), ids)


def block_keys(pool: PoolFn, block: int, cache: IndexCache | None, keys: jax.Array, gates: jax.Array | None,
               start: jax.Array | int, packed: PackedBlocks | None = None) -> tuple[IndexCache | None, jax.Array]:
    """The call's entries [B, T, d] written at [start, start + T); returns
    the cache and the complete blocks' keys [B, P, d] (P: the cache's
    blocks, or the call's own without a cache; packed: those of packed
    documents, without a cache)."""
    if cache is None:
        return None, _all_blocks(pool, block, keys, gates, packed)
    b, t, d = keys.shape
    all_keys = write_cache(cache.keys, keys, start, _TOKENS)
    all_gates = None if gates is None or cache.gates is None else write_cache(cache.gates, gates, start, _TOKENS)
    s = all_keys.shape[1]
    p = s // block
    if t > block:  # a prefill: every block again, in one pass
        blocks = _all_blocks(pool, block, all_keys.astype(keys.dtype),
                             None if all_gates is None else all_gates.astype(keys.dtype))
        ends = cache.blocks.at[:, block - 1:p * block:block].set(blocks.astype(cache.blocks.dtype))
        return IndexCache(all_keys, all_gates, ends), blocks
    # t <= block tokens complete at most the block they start in (a later
    # block they reach is completed, and rebuilt, by a later call): rebuild it
    ids = jnp.minimum(jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,)) // block, p - 1)[:, None]  # [B, 1]
    slots = (ids[..., None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(b, -1)

    def tokens(a):
        return gather_rows(a, slots).astype(keys.dtype).reshape(b, 1, block, d)
    fresh = pool(tokens(all_keys), None if all_gates is None else tokens(all_gates), ids)
    ends = jax.vmap(lambda r, i, v: r.at[i].set(v))(cache.blocks, ids[:, 0] * block + block - 1,
                                                    fresh[:, 0].astype(cache.blocks.dtype))
    return IndexCache(all_keys, all_gates, ends), ends[:, block - 1:p * block:block].astype(keys.dtype)


class PooledIndexer(nnx.Module):
    """GLM-5-Next's DSA indexer over k-pools of `block` tokens, keeping the
    `budget // block` best pools (budget: index_topk) and, with `tail`, the
    query's unfinished pool."""

    def __init__(self, hidden_size: int, *, q_lora_rank: int, heads: int, head_dim: int, block: int, budget: int,
                 tail: bool, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs):
        if budget % block:
            raise ValueError(f"index_topk: expected a multiple of index_kpool ({block}), got {budget}")
        self.heads, self.head_dim, self.block, self.top, self.tail = heads, head_dim, block, budget // block, tail
        std = init_std
        self.wq_b = linear(q_lora_rank, heads * head_dim, dtype, param_dtype, std, rngs)
        self.wk = linear(hidden_size, head_dim, dtype, param_dtype, std, rngs)
        self.k_norm = LayerNorm(head_dim, eps=1e-6, param_dtype=param_dtype)
        self.weights_proj = linear(hidden_size, heads, dtype, param_dtype, std, rngs)
        # transformers' layout and starting values: a bias per place in the
        # pool, and the gate projection as [head_dim, hidden] of ones
        self.index_kpool_compress_ape = nnx.Param(jnp.zeros((block, head_dim), param_dtype))
        self.index_kpool_compress_gate = nnx.Param(jnp.ones((head_dim, hidden_size), param_dtype))

    def _pool(self, keys: jax.Array, gates: jax.Array | None, ids: jax.Array) -> jax.Array:
        """Each pool's key: its tokens' keys weighted per channel by the
        softmax (over the pool) of their gate logits plus the place bias."""
        assert gates is not None
        logits = gates.astype(jnp.float32) + self.index_kpool_compress_ape[...].astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=2).astype(keys.dtype)
        return jnp.sum(probs * keys, axis=2)

    def __call__(self, x: jax.Array, q_resid: jax.Array, positions: jax.Array, cache: IndexCache | None = None,
                 start: jax.Array | int = 0, segments: jax.Array | None = None
                 ) -> tuple[Selection, IndexCache | None]:
        """x [B, T, hidden]; q_resid [B, T, q_lora_rank] (the attention's
        q_a_layernorm(q_a_proj(x))); positions [T] or [B, T]; the cache
        written at [start, start + T); segments [B, T]: packed documents
        (without a cache), each indexed on its own."""
        b, t, _ = x.shape
        h, d = self.heads, self.head_dim
        q = self.wq_b(q_resid).reshape(b, t, h, d)
        keys = self.k_norm(self.wk(x))
        gates = x @ self.index_kpool_compress_gate[...].astype(x.dtype).T
        packed = _packed(segments, cache, self.block)
        cache, pooled = block_keys(self._pool, self.block, cache, keys, gates, start, packed)
        pooled = constrain(pooled, _TOKENS)  # every query scores every pool: whole along the pools (context)
        f32 = jnp.float32
        scores = jax.nn.relu(jnp.einsum("bthd,bpd->bthp", q.astype(f32), pooled.astype(f32)) * d ** -0.5)
        weights = self.weights_proj(x).astype(f32) * h ** -0.5
        index = jnp.einsum("bth,bthp->btp", weights, scores)
        q_pos = _query_positions(jnp.arange(t) if packed is not None else positions, b, t)
        return select_blocks(index, q_pos, self.block, self.top, packed), cache


class BlockMeanIndexer(nnx.Module):
    """Qwen4-Exp's QSA indexer over blocks of `block` tokens, keeping the
    `budget // block` best blocks and the query's unfinished one; keys and
    queries rotated as the attention's (default RoPE: `theta`,
    `rotary_dim`)."""

    def __init__(self, hidden_size: int, *, heads: int, head_dim: int, block: int, budget: int, theta: float,
                 rotary_dim: int, norm_eps: float, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike,
                 rngs: nnx.Rngs):
        if budget % block:
            raise ValueError(f"indexer_budget: expected a multiple of indexer_compress_ratio ({block}), got {budget}")
        self.heads, self.head_dim, self.block, self.top = heads, head_dim, block, budget // block
        self.theta, self.rotary_dim = theta, rotary_dim
        self.index_qk_proj = linear(hidden_size, (heads + 1) * head_dim, dtype, param_dtype, init_std, rngs)
        self.q_layernorm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps, param_dtype=param_dtype)
        self.k_layernorm = ZeroCenteredRMSNorm(head_dim, eps=norm_eps, param_dtype=param_dtype)

    def _pool(self, keys: jax.Array, gates: jax.Array | None, ids: jax.Array) -> jax.Array:
        """Each block's key: the mean of its tokens' keys, normed, rotated
        at the block's first position."""
        mean = jnp.mean(keys.astype(jnp.float32), axis=2).astype(keys.dtype)
        cos, sin = rope_tables(ids * self.block, self.rotary_dim, self.theta)
        return apply_rope(self.k_layernorm(mean)[:, :, None], cos, sin)[:, :, 0]

    def __call__(self, x: jax.Array, positions: jax.Array, cache: IndexCache | None = None,
                 start: jax.Array | int = 0, segments: jax.Array | None = None
                 ) -> tuple[Selection, IndexCache | None]:
        """As PooledIndexer.__call__, without the low-rank query (positions:
        the tokens' positions in their documents, which the rotation takes)."""
        b, t, _ = x.shape
        h, d = self.heads, self.head_dim
        qk = self.index_qk_proj(x)
        q = self.q_layernorm(qk[..., :h * d].reshape(b, t, h, d))
        q_pos = _query_positions(positions, b, t)
        q = apply_rope(q, *rope_tables(q_pos, self.rotary_dim, self.theta))
        packed = _packed(segments, cache, self.block)
        cache, blocks = block_keys(self._pool, self.block, cache, qk[..., h * d:], None, start, packed)
        blocks = constrain(blocks, _TOKENS)  # every query scores every block: whole along the blocks (context)
        f32 = jnp.float32
        scores = jax.nn.relu(jnp.einsum("bthd,bpd->bthp", q.astype(f32), blocks.astype(f32)))
        index = jnp.sum(scores, axis=2) / d ** 0.5
        if packed is not None:
            q_pos = _query_positions(jnp.arange(t), b, t)
        return select_blocks(index, q_pos, self.block, self.top, packed), cache
