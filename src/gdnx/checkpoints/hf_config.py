"""Hugging Face config.json <-> gdnx ModelConfig, for every family gdnx
builds. A config.json's model_type picks the family; a vision-language
checkpoint (qwen3_5, qwen3_5_moe, glm5_next) gives its text_config. Kimi Linear's and
Ling 3's config.json spell several fields their own way (KIMI_NAMES);
Kimi's may hold its KDA layers' sizes and pattern in linear_attn_config,
Ling's KDA layers take the attention heads and head_dim, and its pattern
follows layer_group_size."""

from __future__ import annotations

import pydantic

from gdnx.config.reading import format_validation_error
from gdnx.config.schema import ModelConfig

# Architecture fields with the same name and meaning on both sides, per family.
_COMMON = ("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
           "initializer_range", "layer_types", "num_attention_heads", "num_key_value_heads", "attention_bias",
           "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
           "linear_value_head_dim", "linear_conv_kernel_dim", "bos_token_id", "eos_token_id", "pad_token_id")
_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "router_aux_loss_coef")
FIELDS = {
    "qwen3_next": (*_COMMON, "head_dim", "intermediate_size", *_MOE, "norm_topk_prob", "decoder_sparse_step",
                   "mlp_only_layers", "full_attention_interval"),
    "qwen3_5": (*_COMMON, "head_dim", "intermediate_size"),
    "qwen3_5_moe": (*_COMMON, "head_dim", *_MOE),
    "olmo_hybrid": (*_COMMON, "head_dim", "intermediate_size", "linear_allow_neg_eigval"),
    "lara_mini": (*_COMMON, "head_dim", *_MOE, "norm_topk_prob", "sliding_window"),
}
# What transformers (5.24) takes for a field config.json leaves out: its config
# class's default, per family; gdnx reads a missing field as it does.
# tests/checkpoints/test_hf.py compares this table with transformers' classes.
_QWEN_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                  "initializer_range": 0.02, "num_attention_heads": 16, "attention_bias": False,
                  "max_position_embeddings": 32768, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                  "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                  "head_dim": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.25}}
_MOE_DEFAULTS = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}
TRANSFORMERS_DEFAULTS: dict[str, dict] = {
    "qwen3_next": {**_QWEN_DEFAULTS, **_MOE_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048,
                   "num_hidden_layers": 48, "num_key_value_heads": 2, "intermediate_size": 5632, "num_experts": 512,
                   "num_experts_per_tok": 10, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": []},
    "qwen3_5": {**_QWEN_DEFAULTS, "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 32,
                "num_key_value_heads": 4, "intermediate_size": 12288},
    "qwen3_5_moe": {**_QWEN_DEFAULTS, **_MOE_DEFAULTS, "vocab_size": 248320, "hidden_size": 2048,
                    "num_hidden_layers": 40, "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8},
    "olmo_hybrid": {"vocab_size": 100352, "hidden_size": 3840, "num_hidden_layers": 32, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02,
                    "num_attention_heads": 30, "num_key_value_heads": 30, "attention_bias": False,
                    "max_position_embeddings": 65536, "linear_num_key_heads": 30, "linear_num_value_heads": 30,
                    "linear_key_head_dim": 96, "linear_value_head_dim": 192, "linear_conv_kernel_dim": 4,
                    "eos_token_id": 100257, "pad_token_id": 100277, "intermediate_size": 11008,
                    "linear_allow_neg_eigval": True, "rope_parameters": {"rope_type": "default",
                                                                         "rope_theta": 10000.0}},
}
TRANSFORMERS_DEFAULTS["lara_mini"] = {
    "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 34, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "initializer_range": 0.02, "num_attention_heads": 16,
    "num_key_value_heads": 4, "attention_bias": False, "max_position_embeddings": 131072, "linear_num_key_heads": 8,
    "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "head_dim": 128, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "router_aux_loss_coef": 0.001, "num_experts": 128, "num_experts_per_tok": 4, "norm_topk_prob": True,
    "sliding_window": 512, "eos_token_id": 151643, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# Lara 4 Mini's layer pattern when config.json gives none: period 5
LARA_PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")
# Kimi Linear: transformers' defaults under gdnx's field names
TRANSFORMERS_DEFAULTS["kimi_linear"] = {
    "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02, "num_attention_heads": 32,
    "attention_bias": False, "max_position_embeddings": 1048576, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446, "n_shared_experts": 1, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839}
# Ling 3 (Ling-3.0-Flash): transformers' defaults under gdnx's field names
TRANSFORMERS_DEFAULTS["bailing_hybrid"] = {
    "vocab_size": 157184, "hidden_size": 2560, "num_hidden_layers": 42, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02, "num_attention_heads": 32,
    "attention_bias": False, "max_position_embeddings": 262144, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 512, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 128,
    "short_conv_kernel_size": 4, "first_k_dense_replace": 2, "layer_group_size": 6, "rope_theta": 6_000_000.0,
    "kda_safe_gate": True, "kda_lower_bound": -5.0, "num_mtp_layers": 1, "swiglu_limits": None,
    "swiglu_limits_shared": None, "bos_token_id": None, "eos_token_id": 156895, "pad_token_id": 156892}
# Kimi Linear's and Ling 3's config.json names (transformers' attribute_map) for gdnx's field names
KIMI_NAMES = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
              "n_group": "num_expert_group", "num_experts_per_tok": "num_experts_per_token",
              "n_shared_experts": "num_shared_experts", "num_mtp_layers": "num_nextn_predict_layers",
              "swiglu_limits": "expert_swiglu_limit_list", "swiglu_limits_shared": "share_expert_swiglu_limit_list"}
_KIMI_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings",
                "hidden_act", "initializer_range", "num_attention_heads", "attention_bias", "max_position_embeddings",
                "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                "n_group", "topk_group", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "bos_token_id", "eos_token_id", "pad_token_id")
# GLM-5-Next (GLM-5.3-Flash): transformers' text config defaults, under its own names
TRANSFORMERS_DEFAULTS["glm5_next"] = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 1048576,
    "initializer_range": 0.02, "rms_norm_eps": 1e-5, "pad_token_id": 154820, "bos_token_id": None,
    "eos_token_id": None, "tie_word_embeddings": False, "attention_bias": False, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "swiglu_limit": 10.0, "linear_head_dim": 128,
    "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20, "router_aux_loss_coef": 0.001, "index_kpool": 16,
    "index_kpool_always_select_tail": True}
# the fields gdnx reads under the same name
_GLM_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
               "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
               "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
               "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_bias",
               "index_topk", "index_head_dim", "index_n_heads", "swiglu_limit", "linear_conv_kernel_dim",
               "hc_mult", "hc_eps", "hc_sinkhorn_iters", "router_aux_loss_coef", "index_kpool",
               "index_kpool_always_select_tail")
# Qwen4-Exp: transformers' text config defaults, under its own names
TRANSFORMERS_DEFAULTS["qwen4_exp"] = {
    **_QWEN_DEFAULTS, **_MOE_DEFAULTS, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_key_value_heads": 2, "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
    "hc_count": 4, "hc_lowrank": 320, "ple_layer_ids": None, "ple_embed_dim": None, "ple_conv_kernel_size": 4,
    "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128, "seed": 1234, "split_ngram_parts": 512, "indexer_n_heads": None,
    "indexer_kv_heads": None, "indexer_head_dim": None, "indexer_budget": None, "indexer_compress_ratio": None,
    "output_gate_type": None, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# Qwen4-Exp's config.json names for gdnx's fields
QWEN4_NAMES = {"hc_mult": "hc_count", "ple_embed_dim": "ple_embed_dim", "ple_conv_kernel": "ple_conv_kernel_size",
               "ngram_vocab_base": "ngram_vocab_size_base", "ngram_rows_multiple": "make_ngram_vocab_size_divisible_by",
               "ngram_seed": "seed", "ngram_split_parts": "split_ngram_parts", "index_n_heads": "indexer_n_heads",
               "index_head_dim": "indexer_head_dim", "index_topk": "indexer_budget",
               "index_kpool": "indexer_compress_ratio"}
_QWEN4_FIELDS = (*_COMMON, "head_dim", *_MOE, "norm_topk_prob", "hc_lowrank", "ngram_size", "heads_per_ngram")
# model_type -> (family, the FIELDS entry); the vision-language ones carry a text_config
MODEL_TYPES = {
    "qwen3_next": ("qwen3_next", "qwen3_next"),
    "qwen3_5": ("qwen3_5", "qwen3_5"), "qwen3_5_text": ("qwen3_5", "qwen3_5"),
    "qwen3_5_moe": ("qwen3_5", "qwen3_5_moe"), "qwen3_5_moe_text": ("qwen3_5", "qwen3_5_moe"),
    "olmo_hybrid": ("olmo_hybrid", "olmo_hybrid"),
    "kimi_linear": ("kimi_linear", "kimi_linear"),
    "bailing_hybrid": ("bailing_hybrid", "bailing_hybrid"),
    "lara_mini": ("lara_mini", "lara_mini"),
    "glm5_next": ("glm5_next", "glm5_next"), "glm5_next_text": ("glm5_next", "glm5_next"),
    "qwen4_exp": ("qwen4_exp", "qwen4_exp"), "qwen4_exp_text": ("qwen4_exp", "qwen4_exp"),
}
VISION_LANGUAGE = ("qwen3_5", "qwen3_5_moe")
# Qwen3.5's multimodal RoPE sections: with text-only positions (the same
# position on every section) they are 1-D RoPE, which is what gdnx runs.
_ROPE_IGNORED = ("mrope_section", "mrope_interleaved")


def _rope_fields(hf: dict, family: str) -> dict:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if family == "olmo_hybrid" and rope.get("rope_theta", hf.get("rope_theta")) is None:
        return {"rope_theta": None}  # OLMo Hybrid without rotary embeddings
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (only 'default')")
    fields = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        value = rope.get(key, hf.get(key))
        if value is not None:
            fields[key] = value
    if family in ("olmo_hybrid", "lara_mini"):
        fields["partial_rotary_factor"] = 1.0
    return fields


def language_model_config(hf: dict) -> dict:
    """The text model's config.json dict (a vision-language one's text_config,
    with the top-level embedding tie)."""
    if hf.get("model_type") not in VISION_LANGUAGE:
        return hf
    text = dict(hf.get("text_config") or {})
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return {**text, "model_type": hf["model_type"] + "_text"}


def _kda_family(hf: dict, family: str) -> dict:
    """ModelConfig fields of a Kimi Linear or Ling 3 config.json, read as
    transformers reads it (a name transformers maps, else gdnx's; then its
    default)."""
    defaults = TRANSFORMERS_DEFAULTS[family]
    kimi = family == "kimi_linear"

    def get(name: str):
        for key in (KIMI_NAMES.get(name), name, {"num_experts": "num_local_experts"}.get(name)):
            if key is not None and key in hf:
                return hf[key]
        return defaults[name]

    n = get("num_hidden_layers")
    linear = hf.get("linear_attn_config") or {} if kimi else {}
    if not isinstance(linear, dict):
        raise ValueError("config.json: linear_attn_config: expected an object")
    layer_types = hf.get("layer_types")
    if layer_types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        # 1-indexed layer numbers
        layer_types = [None] * n
        for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
            for i in linear[key]:
                if not (isinstance(i, int) and 1 <= i <= n):
                    raise ValueError(f"config.json: linear_attn_config.{key}: layer numbers count from 1 to "
                                     f"num_hidden_layers={n}, got {i!r}")
                layer_types[i - 1] = kind
        if None in layer_types:
            raise ValueError(f"config.json: linear_attn_config: layer {layer_types.index(None) + 1} is in neither "
                             "full_attn_layers nor kda_layers")
    elif layer_types is None and kimi:
        layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    elif layer_types is None:  # the last layer of each group is latent attention
        group = get("layer_group_size")
        layer_types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)]
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        dense = hf.get("first_k_dense_replace", defaults["first_k_dense_replace"])
        mlp_types = ["dense" if i < dense else "sparse" for i in range(n)]
    if not isinstance(mlp_types, list) or not set(mlp_types) <= {"dense", "sparse"}:
        raise ValueError(f"config.json: mlp_layer_types: expected a list of 'dense' and 'sparse', got {mlp_types!r}")
    fields = {k: get(k) for k in _KIMI_FIELDS}
    fields.update(layer_types=layer_types, mlp_only_layers=[i for i, t in enumerate(mlp_types) if t == "dense"],
                  shared_expert_intermediate_size=get("moe_intermediate_size") * get("n_shared_experts"),
                  num_key_value_heads=get("num_attention_heads"), router_aux_loss_coef=0.0)
    if kimi:
        heads, dim = linear.get("num_heads", get("linear_num_heads")), linear.get("head_dim", get("linear_head_dim"))
        conv = linear.get("short_conv_kernel_size", get("linear_conv_kernel_dim"))
        fields["rope_theta"] = None
    else:
        # KDA's heads are the attention heads, of head_dim each; a config.json transformers wrote itself holds
        # them as linear_* (its head_dim then is the latent attention's rope dimension), and those win, as there
        heads = hf.get("linear_num_heads") or get("num_attention_heads")
        dim = hf.get("linear_head_dim") or get("head_dim")
        conv = hf.get("linear_conv_kernel_dim") or get("short_conv_kernel_size")
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_type {rope['rope_type']!r} is not supported (only 'default')")
        fields["rope_theta"] = rope.get("rope_theta", get("rope_theta"))
        fields["linear_gate_lower_bound"] = get("kda_lower_bound") if get("kda_safe_gate") else None
        fields.update(swiglu_limits=get("swiglu_limits"), swiglu_limits_shared=get("swiglu_limits_shared"))
    fields.update(linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim,
                  linear_value_head_dim=dim, linear_conv_kernel_dim=conv)
    return fields


def _glm5_next(hf: dict) -> dict:
    """ModelConfig fields of a GLM-5-Next config.json (its text_config, or
    the text fields at the top level of a flat one), read as transformers
    reads it: its defaults, its layer, MLP and indexer patterns."""
    text = dict(hf.get("text_config") or hf)
    if "tie_word_embeddings" in hf and "text_config" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    linear = text.get("linear_attn_config")
    if linear is not None and not isinstance(linear, dict):
        raise ValueError("config.json: linear_attn_config: expected an object")
    if linear:  # the original layout's names for the KDA layers' fields
        text = {**text, "linear_head_dim": linear.get("head_dim", text.get("linear_head_dim")),
                "linear_num_heads": linear.get("num_heads", text.get("linear_num_heads")),
                "linear_conv_kernel_dim": linear.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim")),
                "linear_lower_bound": linear.get("gate_lower_bound", text.get("linear_lower_bound"))}
        if linear.get("safe_gate", True) and text.get("linear_lower_bound") is None:
            text["linear_lower_bound"] = -5.0
    cfg = {**TRANSFORMERS_DEFAULTS["glm5_next"], **{k: v for k, v in text.items() if v is not None or k in (
        "q_lora_rank", "linear_lower_bound", "swiglu_limit", "bos_token_id", "eos_token_id", "pad_token_id")}}
    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention"
                                             for i in range(n)]
    if not isinstance(layer_types, list) or not set(layer_types) <= {
            "linear_attention", "indexed_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types: expected a list of 'linear_attention' and 'indexed_attention', "
                         f"got {layer_types!r}")
    mlp_types = cfg.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    if not isinstance(mlp_types, list) or not set(mlp_types) <= {"dense", "sparse"}:
        raise ValueError(f"config.json: mlp_layer_types: expected a list of 'dense' and 'sparse', got {mlp_types!r}")
    indexer_types = cfg.get("indexer_types")
    if indexer_types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        try:
            indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) \
                else list(pattern)
        except KeyError:
            raise ValueError(f"config.json: index_topk_pattern: expected F and S, got {pattern!r}") from None
    elif indexer_types is None:
        freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
        indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    shared = cfg["n_shared_experts"]
    if not isinstance(shared, int) or shared < 1:
        raise ValueError(f"config.json: n_shared_experts: gdnx builds GLM-5-Next's MoE with its shared experts "
                         f"(1 or more), got {shared!r}")
    fields = {k: cfg[k] for k in _GLM_FIELDS}
    heads, dim = cfg["linear_num_heads"], cfg["linear_head_dim"]
    fields.update(
        layer_types=["linear_attention" if t == "linear_attention" else "full_attention" for t in layer_types],
        mlp_only_layers=[i for i, t in enumerate(mlp_types) if t == "dense"], indexer_types=indexer_types,
        num_experts=cfg.get("num_local_experts", cfg["n_routed_experts"]),
        shared_expert_intermediate_size=cfg["moe_intermediate_size"] * shared, rope_theta=None,
        linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim, linear_value_head_dim=dim,
        linear_gate_lower_bound=cfg["linear_lower_bound"])
    return fields


def _qwen4_exp(hf: dict) -> dict:
    """ModelConfig fields of a Qwen4-Exp config.json (its text_config, or a
    text one), read as transformers reads it: its defaults, its layer
    pattern (every full_attention_interval-th layer indexed attention), the
    PLE layers' 1-based ids, the output gate's activation defaulting to
    hidden_act; the indexer's fields are required with attention layers."""
    text = dict(hf.get("text_config") or hf)
    if "tie_word_embeddings" in hf and "text_config" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    cfg = {**TRANSFORMERS_DEFAULTS["qwen4_exp"], **{k: v for k, v in text.items() if v is not None or k in (
        "bos_token_id", "eos_token_id", "pad_token_id")}}
    n = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    layer_types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % interval else "indexed_attention"
                                             for i in range(n)]
    if not isinstance(layer_types, list) or not set(layer_types) <= {
            "linear_attention", "indexed_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types: expected a list of 'linear_attention' and 'indexed_attention', "
                         f"got {layer_types!r}")
    fields = {k: cfg[k] for k in _QWEN4_FIELDS if cfg.get(k) is not None or k in (
        "bos_token_id", "eos_token_id", "pad_token_id")}
    fields.update({ours: cfg[theirs] for ours, theirs in QWEN4_NAMES.items() if cfg.get(theirs) is not None})
    fields["layer_types"] = ["linear_attention" if t == "linear_attention" else "full_attention" for t in layer_types]
    if any(t != "linear_attention" for t in layer_types):
        missing = [k for k in ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
                   if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json: {', '.join(missing)}: Qwen4-Exp's attention layers read the tokens its "
                             "indexer picks; the indexer's fields are required")
        if cfg.get("indexer_kv_heads", 1) not in (None, 1):
            raise ValueError(f"config.json: indexer_kv_heads: Qwen4-Exp's indexer has one key head, got "
                             f"{cfg['indexer_kv_heads']!r}")
    ple = cfg.get("ple_layer_ids") or []
    if not isinstance(ple, list) or not all(isinstance(i, int) and 1 <= i <= n for i in ple):
        raise ValueError(f"config.json: ple_layer_ids: expected 1-based layer ids in [1, {n}], got {ple!r}")
    fields["ple_layers"] = sorted({i - 1 for i in ple})
    fields["linear_output_gate"] = cfg.get("output_gate_type") or cfg["hidden_act"]
    fields.update(_rope_fields(cfg, "qwen4_exp"))
    fields.setdefault("partial_rotary_factor", 1.0)  # transformers' default: the whole head turns
    return fields


# config.json's sizes that gdnx divides and multiplies by, under any family's name: a positive integer where
# given; the first four never null (a model has them), the others null for "not set" (a family's default)
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_SIZES = (*_REQUIRED, "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
          "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "linear_num_heads",
          "linear_head_dim", "num_experts_per_tok", "full_attention_interval", "kv_lora_rank", "v_head_dim",
          "qk_nope_head_dim", "index_n_heads", "index_head_dim", "indexer_n_heads", "indexer_head_dim")
# sizes that may be 0 or null (head_dim: save_pretrained writes an MLA model's rope size there, 0 for none)
_COUNTS = ("head_dim", "num_experts", "n_routed_experts", "num_local_experts", "shared_expert_intermediate_size",
           "q_lora_rank", "qk_rope_head_dim", "sliding_window", "mtp_num_hidden_layers")
_OBJECTS = ("text_config", "rope_parameters", "rope_scaling", "linear_attn_config")
_LISTS = ("layer_types", "mlp_layer_types")


def check_fields(hf: object, where: str = "config.json") -> None:
    """config.json's fields that gdnx computes with, checked for type and
    range before any arithmetic (text_config's too): one ValueError naming
    the field."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(hf).__name__}")
    for name in _SIZES + _COUNTS:
        if name not in hf:
            continue
        value, positive = hf[name], name in _SIZES
        if value is None and name not in _REQUIRED:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
            raise ValueError(f"{where}: {name}: expected a {'positive' if positive else 'non-negative'} integer, "
                             f"got {value!r}")
    for name in _OBJECTS:
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            raise ValueError(f"{where}: {name}: expected an object, got {hf[name]!r}"[:300])
    for name in _LISTS:
        value = hf.get(name)
        if value is not None and not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise ValueError(f"{where}: {name}: expected a list of layer kinds, got {value!r}"[:300])
    if isinstance(hf.get("text_config"), dict):
        check_fields(hf["text_config"], f"{where}: text_config")


def model_config_from_hf(hf: dict, overrides: dict | None = None) -> ModelConfig:
    """ModelConfig from a config.json dict; overrides are ModelConfig fields."""
    check_fields(hf)
    model_type = hf.get("model_type", "qwen3_next")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not a GDN hybrid gdnx builds "
                         f"(supported: {', '.join(MODEL_TYPES)})")
    family, kind = MODEL_TYPES[model_type]
    if family in ("kimi_linear", "bailing_hybrid"):
        return _validated({"family": family, **_kda_family(hf, family), **(overrides or {})})
    if family == "glm5_next":
        return _validated({"family": family, **_glm5_next(hf), **(overrides or {})})
    if family == "qwen4_exp":
        return _validated({"family": family, **_qwen4_exp(hf), **(overrides or {})})
    # a field config.json leaves out is transformers' default (an explicit null stays null)
    given = language_model_config(hf)
    defaults = dict(TRANSFORMERS_DEFAULTS[kind])
    if "rope_parameters" not in given and ("rope_scaling" in given or "rope_theta" in given):
        del defaults["rope_parameters"]  # the older spelling of the same fields is given
    hf = {**defaults, **given}
    fields: dict = {"family": family}
    fields.update({k: hf[k] for k in FIELDS[kind] if hf.get(k) is not None})
    fields.update(_rope_fields(hf, family))
    if family == "olmo_hybrid":  # as transformers: config.json's head_dim, else hidden / heads
        fields["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        fields["num_experts"] = 0
    elif kind == "qwen3_5":
        fields["num_experts"] = 0
    if family == "lara_mini" and given.get("layer_types") is None:
        fields["layer_types"] = [LARA_PATTERN[i % len(LARA_PATTERN)] for i in range(hf["num_hidden_layers"])]
    if family in ("qwen3_next", "qwen3_5") and given.get("mtp_num_hidden_layers"):
        fields["mtp_num_layers"] = given["mtp_num_hidden_layers"]
    fields.update(overrides or {})
    return _validated(fields)


def _validated(fields: dict) -> ModelConfig:
    try:
        return ModelConfig.model_validate(fields)
    except pydantic.ValidationError as e:
        raise ValueError(format_validation_error(e, "model")) from None


def _refuse(cfg: ModelConfig, kind: str, checks: dict[str, object]) -> None:
    for field, value in checks.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"model.{field}: a {kind} checkpoint stores only {value!r}, got {getattr(cfg, field)!r}")


def _kda_family_config(cfg: ModelConfig) -> dict:
    kimi = cfg.family == "kimi_linear"
    if cfg.num_experts and cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size:
        raise ValueError(f"model.shared_expert_intermediate_size: a {cfg.family} checkpoint stores shared experts of "
                         f"moe_intermediate_size={cfg.moe_intermediate_size} each, got "
                         f"{cfg.shared_expert_intermediate_size}")
    _refuse(cfg, cfg.family, {"decoder_sparse_step": 1, "num_key_value_heads": cfg.num_attention_heads})
    if not kimi:  # Ling's KDA heads are its attention heads
        _refuse(cfg, cfg.family, {"linear_num_key_heads": cfg.num_attention_heads})
    arch = "KimiLinearForCausalLM" if kimi else "BailingHybridForCausalLM"
    out: dict[str, object] = {"architectures": [arch], "model_type": cfg.family}
    for field in _KIMI_FIELDS:
        out[KIMI_NAMES.get(field, field)] = getattr(cfg, field)
    out["num_shared_experts"] = cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size
    out["num_key_value_heads"] = cfg.num_attention_heads
    out["layer_types"] = list(cfg.resolved_layer_types)
    out["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)]
    if kimi:
        out.update(linear_num_heads=cfg.linear_num_key_heads, linear_head_dim=cfg.linear_key_head_dim,
                   linear_conv_kernel_dim=cfg.linear_conv_kernel_dim)
    else:
        out.update(head_dim=cfg.linear_key_head_dim, short_conv_kernel_size=cfg.linear_conv_kernel_dim,
                   rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                   kda_safe_gate=cfg.linear_gate_lower_bound is not None,
                   kda_lower_bound=cfg.linear_gate_lower_bound if cfg.linear_gate_lower_bound is not None else -5.0,
                   num_nextn_predict_layers=cfg.mtp_num_layers,
                   expert_swiglu_limit_list=cfg.swiglu_limits, share_expert_swiglu_limit_list=cfg.swiglu_limits_shared)
        if cfg.mtp_num_layers:  # what transformers' MTP module builds its layer from
            out.update(mtp_layer_types=["full_attention"],
                       mtp_mlp_layer_types=["sparse" if cfg.is_moe_layer(cfg.num_hidden_layers - 1) else "dense"])
    out["dtype"] = cfg.param_dtype
    return out


def _glm5_next_config(cfg: ModelConfig) -> dict:
    """GLM-5-Next's config.json: transformers' vision-language layout, the
    language model's fields in text_config (no vision_config: the caller
    adds the tower's, or transformers builds its default)."""
    if cfg.num_experts and cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size:
        raise ValueError(f"model.shared_expert_intermediate_size: a glm5_next checkpoint stores shared experts of "
                         f"moe_intermediate_size={cfg.moe_intermediate_size} each, got "
                         f"{cfg.shared_expert_intermediate_size}")
    _refuse(cfg, "glm5_next", {"decoder_sparse_step": 1, "num_key_value_heads": cfg.num_attention_heads,
                               "linear_num_value_heads": cfg.linear_num_key_heads,
                               "linear_value_head_dim": cfg.linear_key_head_dim})
    text: dict[str, object] = {k: getattr(cfg, k) for k in _GLM_FIELDS}
    shared = cfg.shared_index_layers
    text.update(
        model_type="glm5_next_text", n_routed_experts=cfg.num_experts,
        n_shared_experts=cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
        layer_types=["indexed_attention" if t == "full_attention" else t for t in cfg.resolved_layer_types],
        mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)],
        indexer_types=["shared" if s else "full" for s in shared], linear_num_heads=cfg.linear_num_key_heads,
        linear_head_dim=cfg.linear_key_head_dim, linear_lower_bound=cfg.linear_gate_lower_bound)
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": cfg.param_dtype}


def _qwen4_exp_config(cfg: ModelConfig) -> dict:
    """Qwen4-Exp's config.json: transformers' vision-language layout, the
    language model's fields in text_config (no vision_config: the caller
    adds the tower's, or transformers builds its default)."""
    _refuse(cfg, "qwen4_exp", {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True})
    text: dict[str, object] = {k: getattr(cfg, k) for k in _QWEN4_FIELDS}
    text.update({theirs: getattr(cfg, ours) for ours, theirs in QWEN4_NAMES.items()})
    text.update(
        model_type="qwen4_exp_text", indexer_kv_heads=1, ple_embed_dim=cfg.ple_width,
        layer_types=["indexed_attention" if t == "full_attention" else t for t in cfg.resolved_layer_types],
        ple_layer_ids=[i + 1 for i in cfg.ple_layers], output_gate_type=cfg.linear_output_gate,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor})
    return {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp", "text_config": text,
            "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": cfg.param_dtype}


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """A config.json dict of the family's text model that transformers reads."""
    if cfg.family in ("kimi_linear", "bailing_hybrid"):
        return _kda_family_config(cfg)
    if cfg.family == "glm5_next":
        return _glm5_next_config(cfg)
    if cfg.family == "qwen4_exp":
        return _qwen4_exp_config(cfg)
    moe = cfg.num_experts > 0
    if cfg.family == "qwen3_next":
        kind, arch = "qwen3_next", "Qwen3NextForCausalLM"
    elif cfg.family == "qwen3_5":
        kind, arch = ("qwen3_5_moe", "Qwen3_5MoeForCausalLM") if moe else ("qwen3_5", "Qwen3_5ForCausalLM")
    elif cfg.family == "lara_mini":
        kind, arch = "lara_mini", "LaraMiniForCausalLM"
    else:
        kind, arch = "olmo_hybrid", "OlmoHybridForCausalLM"
    if cfg.family != "olmo_hybrid":
        _refuse(cfg, kind, {"linear_allow_neg_eigval": False})
    if kind == "qwen3_5_moe":  # every layer routed, top-k probabilities renormalised
        _refuse(cfg, kind, {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []})
    if kind == "lara_mini":  # every layer routed
        if not moe:
            raise ValueError("model.num_experts: a lara_mini checkpoint routes every layer's MLP; got 0")
        _refuse(cfg, kind, {"decoder_sparse_step": 1, "mlp_only_layers": []})
    if cfg.family in ("olmo_hybrid", "lara_mini"):
        _refuse(cfg, kind, {"partial_rotary_factor": 1.0})
    model_type = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(kind, kind)
    out: dict[str, object] = {"architectures": [arch], "model_type": model_type}
    out.update({k: getattr(cfg, k) for k in FIELDS[kind]})
    out["layer_types"] = list(cfg.resolved_layer_types)
    if cfg.mtp_num_layers:
        out["mtp_num_hidden_layers"] = cfg.mtp_num_layers
    if cfg.rope_theta is None:
        out["rope_parameters"] = None
    else:
        rope: dict[str, object] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.family not in ("olmo_hybrid", "lara_mini"):
            rope["partial_rotary_factor"] = out["partial_rotary_factor"] = cfg.partial_rotary_factor
        out["rope_parameters"] = rope
    out["dtype"] = cfg.param_dtype
    return out
