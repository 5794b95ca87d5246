"""The tiny models and runs the tests build (few compiled shapes, shared)."""

# a hybrid of every layer kind: GDN, attention, GDN, attention; GVA 2 (4 value heads on 2 key heads); dense MLPs
TINY_HYBRID = dict(vocab_size=61, hidden_size=32, num_hidden_layers=4, full_attention_interval=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=48,
                   num_experts=0, gdn_chunk_size=16)
# TINY_HYBRID's fields as Kimi Linear takes them: KDA (2 heads), latent
# attention (no RoPE), the grouped sigmoid router once MoE is added
KIMI = dict(family="kimi_linear", rope_theta=None, linear_num_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=12, n_group=2, topk_group=1, routed_scaling_factor=2.0)
# and as Ling 3 takes them: KDA with the bounded gate, latent attention with
# RoPE (on adjacent pairs), a head gate and a low-rank query, bounded SwiGLUs
LING = dict(KIMI, family="bailing_hybrid", rope_theta=10000.0, linear_gate_lower_bound=-5.0, q_lora_rank=12,
            linear_num_key_heads=4, linear_num_value_heads=4,
            swiglu_limits=[0.0, 0.5, 0.0, 0.7], swiglu_limits_shared=[0.0, 0.3, 0.0, 0.0])
# and as Lara 4 Mini takes them: GDN, a sliding window of 5 tokens with RoPE,
# GDN, full attention without RoPE (q/k normed per head, no gate)
LARA = dict(family="lara_mini", layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                             "full_attention"], sliding_window=5, partial_rotary_factor=1.0,
            rope_theta=10000.0)
# its MLPs as a mixture of experts (with a shared expert)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)

# `gdnx train tiny` overrides for a run of a few seconds (MQAR, 32 tokens of vocabulary)
SMALL_RUN = ["model.hidden_size=32", "model.intermediate_size=32", "data.seq_len=40", "data.num_pairs=4",
             "data.num_keys=16", "data.num_values=16", "model.vocab_size=32", "train.batch_size=4",
             "train.warmup_steps=2", "train.log_every=2", "train.eval_every=4", "train.target_accuracy=null"]
