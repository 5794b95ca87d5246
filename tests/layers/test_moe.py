"""The routed experts taken in passes of CHUNK_TOKENS tokens give what one
pass gives: outputs, routing counts and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdnx.layers import moe


def _layer():
    return moe.SparseMoE(16, num_experts=8, top_k=2, expert_size=8, shared_expert_size=8, norm_topk_prob=True,
                         init_std=0.2, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def _run(layer, x):
    graphdef, params = nnx.split(layer)

    def loss(params, x):
        y, stats = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * jnp.cos(y)), (y, stats.counts)

    (_, (y, counts)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, counts, grads


def test_tokens_in_passes_equal_one_pass(monkeypatch):
    layer = _layer()
    x = jax.random.normal(jax.random.key(1), (2, 13, 16), jnp.float32)  # 26 tokens: 4 passes of 8, the last padded
    whole = _run(layer, x)
    monkeypatch.setattr(moe, "CHUNK_TOKENS", 8)
    passes = _run(layer, x)
    np.testing.assert_array_equal(passes[1], whole[1])  # padding tokens are not counted
    # float32, the same products per token in another grouping: agreement to a few ulps
    for got, want in zip(jax.tree.leaves(passes[::2]), jax.tree.leaves(whole[::2]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
