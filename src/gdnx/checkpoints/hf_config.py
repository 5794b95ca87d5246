"""Hugging Face Qwen3-Next config.json <-> gdnx ModelConfig."""

from __future__ import annotations

import pydantic

from gdnx.config.loading import format_validation_error
from gdnx.config.schema import ModelConfig

# Architecture fields that carry the same name and meaning on both sides.
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
    "initializer_range", "layer_types", "num_attention_heads", "num_key_value_heads", "head_dim",
    "attention_bias", "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "full_attention_interval",
)


def model_config_from_hf(hf: dict, overrides: dict | None = None) -> ModelConfig:
    """ModelConfig from a config.json dict; overrides are ModelConfig fields."""
    if hf.get("model_type") not in (None, "qwen3_next"):
        raise ValueError(f"config.json: model_type {hf['model_type']!r} is not qwen3_next")
    fields = {k: hf[k] for k in SHARED_FIELDS if hf.get(k) is not None}
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (only 'default')")
    for key in ("rope_theta", "partial_rotary_factor"):
        value = rope.get(key, hf.get(key))
        if value is not None:
            fields[key] = value
    fields.update(overrides or {})
    try:
        return ModelConfig.model_validate(fields)
    except pydantic.ValidationError as e:
        raise ValueError(format_validation_error(e, "model")) from None


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """A config.json dict that transformers' Qwen3NextConfig reads."""
    out: dict[str, object] = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
    out.update({k: getattr(cfg, k) for k in SHARED_FIELDS})
    out["layer_types"] = list(cfg.resolved_layer_types)
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                              "partial_rotary_factor": cfg.partial_rotary_factor}
    out["partial_rotary_factor"] = cfg.partial_rotary_factor
    out["dtype"] = cfg.param_dtype
    return out
