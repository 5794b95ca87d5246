"""Latent attention on its own: the latent-space (absorbed) order against
expanded keys and values, with a cache per row, RoPE and a LoRA adapter on
kv_b_proj; the cache holds latents, not keys and values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdnx.layers.latent_attention import LatentAttention, LatentCache
from gdnx.layers.lora import AdapterSpec
from gdnx.layers.rope import rope_tables
from gdnx.measure import relative_error
from gdnx.models.adapters import add_adapters

from tests.helpers.tiers import fast_only

RANK, NOPE, ROPE, V, HEADS = 16, 8, 8, 12, 4


def _layer(absorb: bool, q_lora_rank: int | None = None) -> LatentAttention:
    return LatentAttention(32, num_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                           qk_rope_head_dim=ROPE, v_head_dim=V, bias=False, norm_eps=1e-6, absorb=absorb,
                           init_std=0.3, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rope", fast_only([False, True], lambda rope: rope), ids=["nope", "rope"])
@pytest.mark.parametrize("q_lora_rank", [None, 12], ids=["q", "q_lora"])
def test_latent_order_equals_expanded_keys_and_values(rope, q_lora_rank):
    """Rows at their own lengths (5 and 11 tokens cached), 3 new tokens each:
    the latent-space order gives the expanded order's outputs (float32,
    1e-5 relative: the same sums in another order) and the same cache;
    both equal one pass without a cache over the whole row."""
    absorbed, expanded = _layer(True, q_lora_rank), _layer(False, q_lora_rank)
    for layer in (absorbed, expanded):  # adapters on kv_b_proj: folded in by the latent order too
        add_adapters(layer, AdapterSpec(4, 8.0, 0.0, frozenset({"kv_b_proj"})), param_dtype=jnp.float32,
                     rngs=nnx.Rngs(1))
        layer.kv_b_proj.lora.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(2), (4, HEADS * (NOPE + V)))
    x = jax.random.normal(jax.random.key(3), (2, 14, 32))
    starts = jnp.asarray([5, 11], jnp.int32)

    def tables(positions):
        return rope_tables(positions, ROPE, 10000.0) if rope else None

    def cached(layer):
        cache = LatentCache(jnp.zeros((2, 16, RANK)), jnp.zeros((2, 16, ROPE)))
        prefix = jnp.arange(11)
        _, cache = layer(x[:, :11], tables(prefix[None]), prefix, cache, 0)
        positions = starts[:, None] + jnp.arange(3)
        rows = jnp.stack([x[0, 5:8], x[1, 11:14]])
        return layer(rows, tables(positions), positions, cache, starts)

    (a, cache_a), (b, cache_b) = cached(absorbed), cached(expanded)
    assert relative_error(a, b) <= 1e-5
    np.testing.assert_array_equal(cache_a.latent, cache_b.latent)
    np.testing.assert_array_equal(cache_a.rope, cache_b.rope)
    assert cache_a.latent.shape == (2, 16, RANK) and cache_a.capacity == 16
    whole, _ = expanded(x, tables(jnp.arange(14)[None]), jnp.arange(14))
    assert relative_error(a[0], whole[0, 5:8]) <= 1e-5
    assert relative_error(a[1], whole[1, 11:14]) <= 1e-5
