"""The routed experts taken in passes of CHUNK_TOKENS tokens give what one
pass gives: outputs, routing counts and gradients; GLM-5-Next's MoE is the
sigmoid router with gates clamped before the activation (transformers'
module)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdnx.layers import moe
from gdnx.measure import relative_error


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


@pytest.mark.slow
def test_glm5_next_moe_is_the_sigmoid_router_with_clamped_gates():
    """GLM-5-Next's MoE (DeepSeek-V3's group-limited sigmoid router with its
    correction bias, experts and an ungated shared expert whose SwiGLU
    gates are clamped before the activation) is SparseMoE with
    router="sigmoid", shared_gate=False and clamp_gate: transformers'
    outputs within 1e-5 (float32), with a limit the projections pass."""
    import torch
    import transformers
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE

    h, e, i = 16, 8, 8
    config = transformers.Glm5NextTextConfig(hidden_size=h, num_local_experts=e, num_experts_per_tok=2,
                                             moe_intermediate_size=i, n_shared_experts=1, n_group=4, topk_group=2,
                                             routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=0.4)
    torch.manual_seed(0)
    theirs = Glm5NextTextMoE(config)
    with torch.no_grad():
        for p in [*theirs.parameters(), theirs.gate.e_score_correction_bias]:
            p.copy_(0.5 * torch.randn_like(p))
    ours = moe.SparseMoE(h, num_experts=e, top_k=2, expert_size=i, shared_expert_size=i, norm_topk_prob=True,
                     init_std=0.02, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0), router="sigmoid",
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, limit=0.4, shared_limit=0.4,
                     shared_gate=False, clamp_gate=True)

    def value(t):
        return jnp.asarray(t.detach().numpy())
    ours.gate.kernel[...] = value(theirs.gate.weight).T
    ours.e_score_correction_bias[...] = value(theirs.gate.e_score_correction_bias)
    gate_up = value(theirs.experts.gate_up_proj)            # [E, 2I, H]
    ours.experts_gate[...] = gate_up[:, :i].swapaxes(1, 2)
    ours.experts_up[...] = gate_up[:, i:].swapaxes(1, 2)
    ours.experts_down[...] = value(theirs.experts.down_proj).swapaxes(1, 2)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(ours.shared_expert, name).kernel[...] = value(getattr(theirs.shared_experts, name).weight).T
    x = np.random.default_rng(0).standard_normal((2, 7, h)).astype(np.float32)
    with torch.no_grad():
        want = theirs(torch.from_numpy(x)).numpy()
    got, _ = ours(jnp.asarray(x))
    assert relative_error(got, want) <= 1e-5
    ours.limit = ours.shared_expert.limit = None  # the bounds bite here: without them the output moves
    unbounded, _ = ours(jnp.asarray(x))
    assert relative_error(unbounded, want) > 1e-2
