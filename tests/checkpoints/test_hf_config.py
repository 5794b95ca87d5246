"""config.json as transformers reads it: a field the file leaves out takes
transformers' default for the family, and OLMo Hybrid's head_dim comes from
the file when it is there."""

import pytest
import transformers

from gdnx.checkpoints.hf_config import TRANSFORMERS_DEFAULTS, hf_config_from_model, model_config_from_hf

CLASSES = {"qwen3_next": transformers.Qwen3NextConfig, "qwen3_5": transformers.Qwen3_5TextConfig,
           "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig, "olmo_hybrid": transformers.OlmoHybridConfig}
MODEL_TYPE = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
              "olmo_hybrid": "olmo_hybrid"}


@pytest.mark.parametrize("kind", list(CLASSES))
def test_the_defaults_are_transformers_defaults(kind):
    """The table gdnx fills a missing field from is transformers' own, and
    a config.json with nothing but model_type reads as transformers reads it."""
    theirs = CLASSES[kind]()
    for field, value in TRANSFORMERS_DEFAULTS[kind].items():
        assert getattr(theirs, field) == value, field
    ours = model_config_from_hf({"model_type": MODEL_TYPE[kind]})
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "max_position_embeddings", "linear_num_value_heads", "linear_key_head_dim", "intermediate_size",
                  "num_experts", "num_experts_per_tok"):
        if hasattr(theirs, field) and not (field in ("num_experts", "num_experts_per_tok") and kind == "qwen3_5"):
            assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.head_dim == head_dim
    assert list(ours.resolved_layer_types) == list(theirs.layer_types)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


def test_olmo_hybrid_head_dim_comes_from_config_json():
    hf = {"model_type": "olmo_hybrid", "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}
    assert model_config_from_hf(hf).head_dim == 16  # hidden / heads when the file has none
    cfg = model_config_from_hf({**hf, "head_dim": 24})
    assert cfg.head_dim == 24 and hf_config_from_model(cfg)["head_dim"] == 24  # and written back
