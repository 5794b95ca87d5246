"""What generation carries between calls: attention keys and values per
full-attention layer, conv and recurrent state per GDN layer, and how many
tokens are already in it."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from gdnx.layers.attention import KVCache

if TYPE_CHECKING:  # the model imports this module
    from gdnx.models.causal_lm import CausalLM


class Cache(NamedTuple):
    layers: tuple  # KVCache or GDNState, one per layer
    length: jax.Array  # int32 scalar: tokens already seen

    @property
    def max_length(self) -> int:
        kv = [c for c in self.layers if isinstance(c, KVCache)]
        return kv[0].k.shape[1] if kv else -1

    @classmethod
    def init(cls, model, batch: int, max_length: int) -> "Cache":
        """An empty cache for `batch` rows and up to `max_length` tokens."""
        cfg, dtype = model.config, jnp.dtype(model.config.dtype)
        layers = []
        for layer in model.layers:
            if layer.layer_type == "full_attention":
                shape = (batch, max_length, cfg.num_key_value_heads, cfg.head_dim)
                layers.append(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
            else:
                layers.append(layer.mixer.zero_state(batch, dtype))
        return cls(tuple(layers), jnp.zeros((), jnp.int32))


def cache_bytes(model: CausalLM, length: int, batch: int = 1) -> int:
    """Bytes of the cache Cache.init(model, batch, length) holds."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
        lambda: Cache.init(model, batch, length))))
