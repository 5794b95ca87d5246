"""Meshes and comparisons shared by the sharding tests."""

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.config.schema import ParallelConfig
from gdnx.parallel import make_mesh
from gdnx.measure import relative_error

# the meshes the sharding contract is checked on (8 devices)
MESHES = {
    "data8": dict(data=8),
    "data2_tensor4": dict(data=2, tensor=4),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "data2_expert2_tensor2": dict(data=2, expert=2, tensor=2),
    "context8": dict(data=1, context=8),
    "context4_tensor2": dict(data=1, context=4, tensor=2),
}


def mesh(mode: str, **axes):
    return make_mesh(ParallelConfig(shard_mode=mode, **axes))


def worst_relative_error(tree, ref_tree) -> tuple[float, str]:
    """The largest relative error over matching leaves, and its path."""
    flat = jax.tree_util.tree_flatten_with_path(ref_tree)[0]
    got = jax.tree.leaves(tree)
    errs = [(relative_error(g, r), jax.tree_util.keystr(p)) for (p, r), g in zip(flat, got, strict=True)]
    return max(errs)


# the tiny model the sharded tests build, per family and scanned
MODEL = ["model.vocab_size=256", "model.hidden_size=64", "model.num_hidden_layers=3",
         "model.layer_types=[linear_attention, full_attention, linear_attention]",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16",
         "model.linear_num_key_heads=4", "model.linear_num_value_heads=8", "model.linear_key_head_dim=16",
         "model.linear_value_head_dim=16", "model.intermediate_size=64", "model.num_experts=4",
         "model.num_experts_per_tok=2", "model.moe_intermediate_size=32", "model.shared_expert_intermediate_size=32",
         "model.mlp_only_layers=[0]", "model.router_aux_loss_coef=0.01", "model.tie_word_embeddings=false",
         "model.gdn_chunk_size=16"]


# the other families' own paths: Qwen3.5 with GVA groups of 3 (a key head's
# three value heads stay on its tensor shard), OLMo Hybrid (q/k norms across
# the heads of a tensor-sharded projection, post-norm attention, beta in [0,
# 2]), Kimi Linear (KDA heads over tensor and its per-channel gates over
# context, latent attention's heads over tensor, the grouped sigmoid
# router), Ling 3 (RoPE on the latent attention's rope part, the head gate),
# GLM-5-Next (sparse attention, hyper-connection streams), Qwen4-Exp (gated
# residual streams, QSA, the n-gram tables' rows over the mesh)
FAMILIES = {
    "kimi_linear": ["model.family=kimi_linear", "model.rope_theta=null", "model.linear_num_value_heads=4",
                    "model.num_key_value_heads=4", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
                    "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.n_group=2", "model.topk_group=1",
                    "model.routed_scaling_factor=2.0"],
    # Lara 4 Mini: a sliding window of 8 (of 32 tokens) under context, q/k normed per head
    "lara_mini": ["model.family=lara_mini", "model.sliding_window=8", "model.partial_rotary_factor=1.0",
                  "model.layer_types=[linear_attention, sliding_attention, full_attention]", "model.mlp_only_layers=[]"],
    # Ling 3: latent attention with RoPE under context, its head gate and KDA's bounded gate over tensor
    "bailing_hybrid": ["model.family=bailing_hybrid", "model.rope_theta=10000.0", "model.linear_num_value_heads=4",
                       "model.num_key_value_heads=4", "model.kv_lora_rank=16", "model.q_lora_rank=8",
                       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
                       "model.linear_gate_lower_bound=-5.0", "model.swiglu_limits=[0, 0.5, 0.7]"],
    "qwen3_5_gva3": ["model.family=qwen3_5", "model.linear_num_value_heads=12"],
    # GLM-5-Next: KDA, latent attention without RoPE reading 8 tokens in pools of 4 (a full-index layer,
    # then a shared one), the indexer's heads whole, 4 hyper-connection streams, clamped SwiGLUs
    "glm5_next": ["model.family=glm5_next", "model.rope_theta=null", "model.linear_num_value_heads=4",
                  "model.num_key_value_heads=4", "model.kv_lora_rank=16", "model.q_lora_rank=8",
                  "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=0", "model.v_head_dim=16",
                  "model.linear_gate_lower_bound=-5.0", "model.index_topk=8", "model.index_kpool=4",
                  "model.index_n_heads=4", "model.index_head_dim=8", "model.hc_sinkhorn_iters=1",
                  "model.swiglu_limit=0.8", "model.layer_types=[linear_attention, full_attention, full_attention]",
                  "model.indexer_types=[full, full, shared]"],
    # Qwen4-Exp: GDN with the sigmoid output gate, gated attention reading 8 tokens in blocks of 4, 4 streams of
    # rank-8 gates, a per-layer embedding on the first layer (240 table rows, split over the mesh)
    "qwen4_exp": ["model.family=qwen4_exp", "model.partial_rotary_factor=0.5", "model.index_topk=8",
                  "model.index_kpool=4", "model.index_n_heads=4", "model.index_head_dim=8", "model.hc_lowrank=8",
                  "model.ple_layers=[0]", "model.ple_embed_dim=16", "model.heads_per_ngram=2",
                  "model.ngram_vocab_base=50", "model.ngram_rows_multiple=8", "model.eos_token_id=3",
                  "model.linear_output_gate=sigmoid"],
    "olmo_hybrid": ["model.family=olmo_hybrid", "model.num_experts=0", "model.linear_allow_neg_eigval=true",
                    "model.partial_rotary_factor=1.0"],
}


# 5 layers: two repeats of (GDN dense, attention MoE), one GDN dense left over
SCANNED = ["model.num_hidden_layers=5", "model.mlp_only_layers=[0, 2, 4]",
           "model.layer_types=[" + ", ".join(["linear_attention", "full_attention"] * 2
                                             + ["linear_attention"]) + "]"]



def max_relative(got, ref) -> float:
    """The largest per-step relative difference of two loss curves."""
    got, ref = np.asarray(got), np.asarray(ref)
    return float(np.max(np.abs(got - ref) / np.abs(ref)))


def losses(trainer, steps=3):
    """The losses of the trainer's first steps (its prefetch thread closed after)."""
    params, opt = trainer.params, trainer.init_opt_state(trainer.params)
    out = []
    for s in range(steps):
        params, opt, metrics = trainer.step(params, opt, jnp.int32(s))
        out.append(float(metrics["loss"]))
    trainer.close()
    return np.array(out)
