"""config.json as transformers reads it: a field the file leaves out takes
transformers' default for the family, and OLMo Hybrid's head_dim comes from
the file when it is there."""

import pytest
import transformers

from gdnx.checkpoints.hf_config import TRANSFORMERS_DEFAULTS, hf_config_from_model, model_config_from_hf

CLASSES = {"qwen3_next": transformers.Qwen3NextConfig, "qwen3_5": transformers.Qwen3_5TextConfig,
           "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig, "olmo_hybrid": transformers.OlmoHybridConfig,
           "lara_mini": transformers.LaraMiniConfig}
MODEL_TYPE = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
              "olmo_hybrid": "olmo_hybrid", "lara_mini": "lara_mini"}


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


def test_kimi_linear_defaults_are_transformers_defaults():
    """gdnx's table of Kimi Linear's defaults is transformers' (by its
    attribute names), and a config.json of nothing but model_type reads
    as transformers reads it: the layer pattern, the dense first layer,
    the KDA sizes, one shared expert."""
    theirs = transformers.KimiLinearConfig()
    for field, value in TRANSFORMERS_DEFAULTS["kimi_linear"].items():
        if field != "first_k_dense_replace":  # read from kwargs only, into mlp_layer_types
            assert getattr(theirs, field) == value, field
    ours = model_config_from_hf({"model_type": "kimi_linear"})
    assert list(ours.resolved_layer_types) == list(theirs.layer_types)
    assert [("dense" if i in ours.mlp_only_layers else "sparse") for i in range(27)] == theirs.mlp_layer_types
    assert (ours.linear_num_key_heads, ours.linear_key_head_dim) == (theirs.linear_num_heads, theirs.linear_head_dim)
    assert ours.shared_expert_intermediate_size == theirs.moe_intermediate_size * theirs.n_shared_experts
    assert ours.rope_theta is None and ours.router_aux_loss_coef == 0.0


def test_kimi_linear_reads_a_published_config_json():
    """The published checkpoint's spelling: linear_attn_config (1-indexed
    layers, heads, conv), first_k_dense_replace, the attribute_map names;
    written back under transformers' names, which read the same."""
    hf = {"model_type": "kimi_linear", "num_hidden_layers": 6, "first_k_dense_replace": 2, "num_experts": 8,
          "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 16, "num_expert_group": 4,
          "topk_group": 2, "moe_renormalize": False, "model_max_length": 4096, "q_lora_rank": 24,
          "linear_attn_config": {"full_attn_layers": [3, 6], "kda_layers": [1, 2, 4, 5], "num_heads": 4,
                                 "head_dim": 16, "short_conv_kernel_size": 3}}
    cfg = model_config_from_hf(hf)
    theirs = transformers.KimiLinearConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert list(cfg.resolved_layer_types) == theirs.layer_types == ["linear_attention", "linear_attention",
                                                                    "full_attention"] * 2
    assert cfg.mlp_only_layers == [0, 1] and theirs.mlp_layer_types[:3] == ["dense", "dense", "sparse"]
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, 2, False)
    assert (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim) == (4, 16, 3)
    assert (cfg.max_position_embeddings, cfg.q_lora_rank, cfg.shared_expert_intermediate_size) == (4096, 24, 32)
    back = hf_config_from_model(cfg)
    assert model_config_from_hf(back) == cfg
    reread = transformers.KimiLinearConfig(**{k: v for k, v in back.items() if k not in ("model_type", "architectures",
                                                                                          "dtype")})
    assert (reread.layer_types, reread.mlp_layer_types, reread.n_group, reread.num_experts_per_tok) == (
        theirs.layer_types, theirs.mlp_layer_types, 4, 2)


@pytest.mark.parametrize("hf,match", [
    ({"linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1]}, "num_hidden_layers": 3},
     r"config.json: linear_attn_config: layer 3 is in neither full_attn_layers nor kda_layers"),
    ({"linear_attn_config": {"full_attn_layers": [0], "kda_layers": [1]}, "num_hidden_layers": 1},
     r"linear_attn_config.full_attn_layers: layer numbers count from 1 to num_hidden_layers=1, got 0"),
    ({"mlp_layer_types": ["dense", "moe"], "num_hidden_layers": 2}, r"mlp_layer_types: expected a list of"),
    ({"num_expert_group": 3}, r"model.n_group: must divide num_experts=256, got 3"),
    ({"layer_types": ["linear_attention", "sliding_attention"], "num_hidden_layers": 2},
     r"model.layer_types"),
])
def test_kimi_linear_bad_config_json_is_one_line(hf, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf({"model_type": "kimi_linear", **hf})


def test_ling_defaults_and_fields_read_as_transformers_reads_them():
    """Ling 3 (bailing_hybrid): the defaults table is transformers', a bare
    config.json gives its layer groups, dense first layers, RoPE base and
    bounded KDA gate; the unbounded gate, SwiGLU limits and a layer pattern
    read back as written."""
    theirs = transformers.BailingHybridConfig()
    renamed = {"swiglu_limits": None, "swiglu_limits_shared": None}  # transformers fills them with zeros
    for field, value in TRANSFORMERS_DEFAULTS["bailing_hybrid"].items():
        if field not in ("first_k_dense_replace", "head_dim", *renamed):
            assert getattr(theirs, field) == value, field
    ours = model_config_from_hf({"model_type": "bailing_hybrid"})
    assert list(ours.resolved_layer_types) == list(theirs.layer_types)
    assert [("dense" if i in ours.mlp_only_layers else "sparse") for i in range(42)] == theirs.mlp_layer_types
    assert (ours.linear_num_key_heads, ours.linear_key_head_dim) == (theirs.linear_num_heads, theirs.linear_head_dim)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.linear_gate_lower_bound == -5.0
    hf = {"model_type": "bailing_hybrid", "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 16,
          "kda_safe_gate": False, "expert_swiglu_limit_list": [0, 7, 7], "layer_group_size": 3,
          "first_k_dense_replace": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    cfg = model_config_from_hf(hf)
    assert cfg.linear_gate_lower_bound is None and cfg.swiglu_limits == [0, 7, 7] and cfg.rope_theta == 1e6
    assert cfg.resolved_layer_types == ("linear_attention", "linear_attention", "full_attention")
    back = hf_config_from_model(cfg)
    assert model_config_from_hf(back) == cfg and back["num_nextn_predict_layers"] == 0
    with pytest.raises(ValueError, match="model.linear_num_key_heads: bailing_hybrid's KDA layers have its 4 "
                                         "attention heads"):
        model_config_from_hf(hf, {"linear_num_key_heads": 2, "linear_num_value_heads": 2})


@pytest.mark.parametrize("model_type, edit, named", [
    ("qwen3_next", {"num_attention_heads": 0}, "num_attention_heads: expected a positive integer, got 0"),
    ("qwen3_next", {"num_attention_heads": None}, "num_attention_heads: expected a positive integer, got None"),
    ("olmo_hybrid", {"num_attention_heads": None}, "num_attention_heads: expected a positive integer, got None"),
    ("qwen3_next", {"hidden_size": "32"}, "hidden_size: expected a positive integer, got '32'"),
    ("lara_mini", {"num_hidden_layers": "5"}, "num_hidden_layers: expected a positive integer, got '5'"),
    ("qwen3_next", {"num_experts": -1}, "num_experts: expected a non-negative integer, got -1"),
    ("qwen3_next", {"rope_parameters": [1, 2]}, "rope_parameters: expected an object, got [1, 2]"),
    ("qwen3_5", {"text_config": 5}, "text_config: expected an object, got 5"),
    ("qwen3_5", {"text_config": "abc"}, "text_config: expected an object, got 'abc'"),
    ("glm5_next", {"text_config": {"hidden_size": True}}, "text_config: hidden_size: expected a positive integer"),
    ("qwen3_next", {"layer_types": "linear_attention"}, "layer_types: expected a list of layer kinds"),
    ("qwen3_next", {"model_type": ["qwen3_next"]}, "model_type ['qwen3_next'] is not a GDN hybrid gdnx builds"),
])
def test_config_json_fields_of_the_wrong_type_or_range_are_one_line_naming_the_field_and_file(tmp_path, model_type,
                                                                                               edit, named):
    """Checked before any arithmetic (a zero or null head count divided, a
    string multiplied): one ValueError naming the field and the file."""
    import json

    from gdnx.checkpoints.hf import read_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **edit}))
    with pytest.raises(ValueError) as e:
        read_config(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: {named}"), str(e.value)
    assert "\n" not in str(e.value)
