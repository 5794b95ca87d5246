"""What generation carries between calls: attention keys and values per
full-attention layer (latents and the shared rope key part for latent
attention), conv and recurrent state per GDN or KDA layer, and how many
tokens are already in it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gdnx.config.schema import ModelConfig
from gdnx.layers.attention import KVCache, RingCache
from gdnx.layers.gated_deltanet import DeltaRuleState
from gdnx.layers.latent_attention import LatentCache
from gdnx.layers.sparse_attention import IndexedKVCache, IndexedLatentCache
from gdnx.layers.sparse_index import IndexCache
from gdnx.parallel.params import head_units
from gdnx.parallel.rules import constrain


class Cache(NamedTuple):
    # KVCache, RingCache, LatentCache or DeltaRuleState, one per layer; a scanned model's: one per position
    # in its cycle (stacked over the repeats, leading dim), then one per
    # layer after the last full cycle
    layers: tuple
    length: jax.Array  # int32: tokens already seen, a scalar, or [B] when each row has its own

    @property
    def max_length(self) -> int:
        kv = [c for c in self.layers if isinstance(c, KVCache | LatentCache | IndexedLatentCache | IndexedKVCache)]
        return kv[0].capacity if kv else -1

    @classmethod
    def init(cls, model: Any, batch: int, max_length: int, per_row: bool = False, rollback: int = 0) -> "Cache":
        """An empty cache for `batch` rows and up to `max_length` tokens of
        `model` (a CausalLM: its config and its layers, unrolled or scanned);
        per_row: each row keeps its own length (a serving engine's slots);
        rollback: the tokens a call may take back afterwards (a verify pass's
        drafts), which a sliding window's ring keeps beyond the window."""
        cfg, dtype = model.config, jnp.dtype(model.config.dtype)

        def empty(layer, lead: tuple[int, ...] = ()):
            if layer.layer_type == "full_attention":
                entry = attention_entry(cfg, batch, max_length, lead)
                if cfg.family == "qwen4_exp":
                    assert isinstance(entry, KVCache)
                    shape = (*lead, batch, max_length, cfg.index_head_dim)
                    return IndexedKVCache.of(entry, IndexCache(jnp.zeros(shape, dtype), None, jnp.zeros(shape, dtype)))
                if not isinstance(entry, LatentCache) or cfg.family != "glm5_next":
                    return entry
                index = None if layer.mixer.indexer is None else index_entry(cfg, batch, max_length, lead)
                return IndexedLatentCache.of(entry, index)
            if layer.layer_type == "sliding_attention":
                ring = min(max_length, cfg.sliding_window + rollback)
                shape = (*lead, batch, ring, cfg.num_key_value_heads, cfg.head_dim)
                return RingCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            state = layer.mixer.zero_state(batch, dtype)
            state = jax.tree.map(lambda z: jnp.zeros((*lead, *z.shape), z.dtype), state)
            if getattr(layer, "ple", None) is None:
                return state
            # a per-layer embedding's convolution inputs and n-gram context (zeros: a sequence's start)
            width = cfg.streams * cfg.hidden_size
            return state._replace(ple_conv=jnp.zeros((*lead, batch, layer.ple.state_length, width), dtype),
                                  ple_context=jnp.zeros((*lead, batch, cfg.ngram_size - 1), jnp.int32))

        length = jnp.zeros((batch,) if per_row else (), jnp.int32)
        if not cfg.scanned:
            return cls(tuple(empty(layer) for layer in model.layers), length)
        layers = [empty(layer) for layer in model.head]
        layers += [empty(layer, (cfg.cycle_repeats,)) for layer in model.cycle]
        layers += [empty(layer) for layer in model.tail]
        return cls(tuple(layers), length)


def attention_entry(cfg: ModelConfig, batch: int, length: int, lead: tuple[int, ...] = ()) -> KVCache | LatentCache:
    """An empty cache entry of a full-attention layer of this config (the
    latents and rope keys of latent attention), `lead` dims first."""
    dtype = jnp.dtype(cfg.dtype)
    if cfg.attention_kind == "latent":
        return LatentCache(jnp.zeros((*lead, batch, length, cfg.kv_lora_rank), dtype),
                           jnp.zeros((*lead, batch, length, cfg.qk_rope_head_dim), dtype))
    shape = (*lead, batch, length, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def index_entry(cfg: ModelConfig, batch: int, length: int, lead: tuple[int, ...] = ()) -> IndexCache:
    """An empty cache entry of a pooled sparse-attention indexer (glm5_next):
    per token its key and gate logits, and each pool's key at its last slot."""
    shape = (*lead, batch, length, cfg.index_head_dim)
    return IndexCache(*(jnp.zeros(shape, jnp.dtype(cfg.dtype)) for _ in range(3)))


def row_axes(model: Any) -> tuple[int, ...]:
    """Per entry of the model's Cache: the axis of its batch rows (1 for a
    scanned cycle's entries, which hold the repeats first, as init lays
    them out)."""
    if model.config.scanned:
        return (0,) * len(model.head) + (1,) * len(model.cycle) + (0,) * len(model.tail)
    return (0,) * len(model.layers)


def cache_bytes(model: Any, length: int, batch: int = 1, rollback: int = 0) -> int:
    """Bytes of the cache Cache.init(model, batch, length, rollback=rollback) holds."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
        lambda: Cache.init(model, batch, length, rollback=rollback))))


def place_cache(cache: Cache, cfg: ModelConfig, row_axes: tuple[int, ...]) -> Cache:
    """The cache placed on the ambient mesh (nothing without one): rows over
    the batch axes, each layer's state split with its heads as the layer's
    computation splits them (a GDN or KDA layer's recurrent state by key
    head, attention keys and values by key/value
    head; latents, whose one head every query head reads, and conv
    states kept whole); a
    head count the axis does not divide stays whole. row_axes: per entry,
    1 for a scanned cycle's entries (the repeats first)."""
    units = head_units(cfg)

    def place(x, axes):
        return constrain(x, axes, units=units)

    def one(entry, axis):
        lead = ("layers",) * axis
        if isinstance(entry, DeltaRuleState):
            # the conv state's channels are stored in the checkpoint's [q | k | v] order, which a split over
            # key heads would cut across: kept whole per row
            entry = entry._replace(conv=place(entry.conv, (*lead, "batch", None, None)),
                                   recurrent=place(entry.recurrent, (*lead, "batch", "value_heads", None, None)))
            if entry.ple_conv is None or entry.ple_context is None:
                return entry
            return entry._replace(ple_conv=place(entry.ple_conv, (*lead, "batch", None, None)),
                                  ple_context=place(entry.ple_context, (*lead, "batch", None)))
        if isinstance(entry, KVCache | RingCache):
            axes = (*lead, "batch", None, "kv_heads", None)
            return entry._replace(k=place(entry.k, axes), v=place(entry.v, axes))
        if isinstance(entry, LatentCache):
            return LatentCache(place(entry.latent, (*lead, "batch", None, None)),
                               place(entry.rope, (*lead, "batch", None, None)))
        if isinstance(entry, IndexedKVCache):
            # the keys and values by key/value head; the indexer's one key head whole per row
            kv = one(entry.kv, axis)
            return IndexedKVCache(kv.k, kv.v, place(entry.keys, (*lead, "batch", None, None)),
                                  place(entry.blocks, (*lead, "batch", None, None)))
        if isinstance(entry, IndexedLatentCache):
            # the indexer's entries, like the latents, are one "head" every query reads: kept whole per row
            return jax.tree.map(lambda a: place(a, (*lead, "batch", None, None)), entry)
        raise TypeError(f"a cache entry of type {type(entry).__name__}")
    length = place(cache.length, ("batch",) * cache.length.ndim)
    return Cache(tuple(one(e, a) for e, a in zip(cache.layers, row_axes, strict=True)), length)
