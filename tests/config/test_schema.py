"""Each config knob: parsing, defaults, and an error that names the field."""

import pytest

from gdnx.config import ConfigError, ModelConfig, build_config


def _model_error(**fields) -> str:
    with pytest.raises(ConfigError) as e:
        build_config({"model": fields})
    return str(e.value)


def test_defaults_are_the_published_model():
    cfg = ModelConfig()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.linear_num_key_heads, cfg.linear_num_value_heads) == \
        (2048, 48, 16, 32)
    assert (cfg.gdn_implementation, cfg.gdn_state_dtype, cfg.gdn_decay_dtype, cfg.gdn_chunk_size,
            cfg.gdn_residuals, cfg.gdn_matmul_dtype) == ("auto", "float32", "float32", 64, "save", None)
    assert cfg.resolved_layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)


@pytest.mark.parametrize("value", ["auto", "xla", "pallas_tpu", "pallas_gpu", "reference"])
def test_gdn_implementation_parses(value):
    assert ModelConfig(gdn_implementation=value).gdn_implementation == value


def test_gdn_implementation_rejects_other_values():
    msg = _model_error(gdn_implementation="cuda")
    assert "model.gdn_implementation: expected one of auto, xla, pallas_tpu" in msg and "'cuda'" in msg


@pytest.mark.parametrize("old", [True, False, "auto"])
def test_use_gdn_kernel_names_its_new_key(old):
    msg = _model_error(use_gdn_kernel=old)
    assert msg.startswith("model.use_gdn_kernel: renamed gdn_implementation") and "false is xla" in msg


@pytest.mark.parametrize("field", ["gdn_state_dtype", "gdn_decay_dtype", "dtype", "param_dtype",
                                   "gdn_matmul_dtype"])
def test_dtype_strings_resolve_with_jnp_dtype(field):
    assert getattr(ModelConfig(**{field: "bfloat16"}), field) == "bfloat16"
    assert getattr(ModelConfig(**{field: "f4"}), field) == "float32"
    msg = _model_error(**{field: "float33"})
    assert f"model.{field}" in msg and "unknown dtype 'float33'" in msg
    assert f"model.{field}" in _model_error(**{field: "int32"})


@pytest.mark.parametrize("size", [16, 32, 64, 128])
def test_chunk_size_allowed(size):
    assert ModelConfig(gdn_chunk_size=size).gdn_chunk_size == size


def test_chunk_size_outside_the_set():
    msg = _model_error(gdn_chunk_size=48)
    assert "model.gdn_chunk_size" in msg and "16, 32, 64, 128" in msg and "48" in msg


def test_value_heads_must_be_a_multiple_of_key_heads():
    msg = _model_error(linear_num_key_heads=4, linear_num_value_heads=6)
    assert "model.linear_num_value_heads" in msg and "multiple of linear_num_key_heads=4" in msg


def test_attention_heads_must_be_a_multiple_of_kv_heads():
    assert "model.num_attention_heads" in _model_error(num_attention_heads=6, num_key_value_heads=4)


@pytest.mark.parametrize("field", ["hidden_size", "linear_num_key_heads", "linear_key_head_dim", "vocab_size",
                                   "num_hidden_layers"])
def test_negative_or_zero_sizes(field):
    msg = _model_error(**{field: -1})
    assert f"model.{field}" in msg and "greater than 0" in msg


def test_unknown_key():
    assert _model_error(hidden_sise=64) == "model.hidden_sise: unknown key"
    with pytest.raises(ConfigError, match="^trian: unknown key$"):
        build_config({"trian": {}})


def test_residuals_knob():
    assert ModelConfig(gdn_residuals="recompute").gdn_residuals == "recompute"
    assert "model.gdn_residuals" in _model_error(gdn_residuals="never")


def test_kernel_knob_needs_the_kernel():
    msg = _model_error(gdn_implementation="xla", gdn_interpret=True)
    assert "model.gdn_interpret" in msg and "gdn_implementation" in msg
    assert ModelConfig(gdn_implementation="pallas_tpu", gdn_interpret=True).gdn_interpret is True


def test_layer_types():
    cfg = ModelConfig(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    assert cfg.resolved_layer_types == ("full_attention", "linear_attention")
    assert "model.layer_types" in _model_error(num_hidden_layers=3, layer_types=["full_attention"])
    assert "model.layer_types" in _model_error(num_hidden_layers=1, layer_types=["conv"])
    assert ModelConfig(num_hidden_layers=8, full_attention_interval=2).resolved_layer_types[1] == "full_attention"


def test_moe_fields():
    assert "model.num_experts_per_tok" in _model_error(num_experts=4, num_experts_per_tok=5)
    assert "model.mlp_only_layers" in _model_error(num_hidden_layers=2, mlp_only_layers=[2])
    cfg = ModelConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                      mlp_only_layers=[3])
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not ModelConfig(num_experts=0).is_moe_layer(0)


def test_fields_of_unbuilt_layers_are_not_checked():
    """Every layer dense through mlp_only_layers, MoE fields at values no MoE
    layer could take; attention heads that do not divide, in a model without
    attention layers: transformers loads both, and so does gdnx."""
    dense = ModelConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=10, mlp_only_layers=[0, 1])
    assert not any(dense.is_moe_layer(i) for i in range(2))
    assert ModelConfig(num_hidden_layers=2, layer_types=["linear_attention"] * 2, num_attention_heads=3,
                       num_key_value_heads=2).num_attention_heads == 3
    assert "model.num_attention_heads" in _model_error(num_hidden_layers=2, num_attention_heads=3,
                                                       num_key_value_heads=2, layer_types=["full_attention"] * 2)


def test_remat_policy():
    assert ModelConfig(remat_policy="save_gdn_residuals").remat_policy == "save_gdn_residuals"
    assert "model.remat_policy" in _model_error(remat_policy="some")


def test_train_and_data_checks():
    with pytest.raises(ConfigError, match=r"train.warmup_steps: must be < steps=10"):
        build_config({"train": {"steps": 10, "warmup_steps": 10}})
    with pytest.raises(ConfigError, match=r"data.path: data.source=text needs data.path"):
        build_config({"data": {"source": "text"}})
    with pytest.raises(ConfigError, match=r"data.seq_len: 16 pairs and one query need >= 33"):
        build_config({"data": {"seq_len": 32}})
    with pytest.raises(ConfigError, match=r"model.vocab_size: MQAR with 128 keys and 128 values needs >= 256"):
        build_config({"model": {"vocab_size": 200}})
    # accepted for training, generation would refuse it later: refused now
    with pytest.raises(ConfigError, match=r"data.seq_len: 512 is more than the model's 256 positions"):
        build_config({"data": {"seq_len": 512}, "model": {"max_position_embeddings": 256}})
    with pytest.raises(ConfigError, match=r"train.learning_rate: .*greater than 0"):
        build_config({"train": {"learning_rate": 0}})
