"""YAML files, base inheritance, key=value overrides, bundled configs."""

import pytest

from gdnx.config import ConfigError, bundled_names, load_config
from gdnx.config.reading import DEFAULT_CONFIG


def test_bundled_configs_validate():
    assert {"base", "tiny", "qwen3-next-80b-a3b"} <= set(bundled_names())
    for name in bundled_names():
        # finetune is a base: it needs the data (and the checkpoint) named
        load_config(name, ["data.path=examples.jsonl"] if name == "finetune" else [])


def test_published_model_dimensions():
    m = load_config("qwen3-next-80b-a3b").model
    assert (m.hidden_size, m.num_hidden_layers, m.num_experts, m.num_experts_per_tok, m.head_dim,
            m.linear_num_value_heads, m.rope_theta) == (2048, 48, 512, 10, 256, 32, 1e7)


def test_default_is_tiny_and_inherits_base():
    cfg = load_config()
    assert DEFAULT_CONFIG == "tiny" and cfg.model.hidden_size == 64
    assert cfg.train.learning_rate == 3e-3  # from base.yml
    assert cfg.data.num_pairs >= 16 and cfg.model.vocab_size >= 256 and cfg.data.seq_len >= 128


def test_overrides_are_type_checked():
    cfg = load_config("tiny", ["train.steps=120", "model.gdn_implementation=xla", "model.gdn_chunk_size=32",
                               "train.learning_rate=1e-3", "model.layer_types=[full_attention, linear_attention]"])
    assert (cfg.train.steps, cfg.model.gdn_implementation, cfg.model.gdn_chunk_size, cfg.train.learning_rate) == \
        (120, "xla", 32, 1e-3)
    assert cfg.model.layer_types == ["full_attention", "linear_attention"]
    with pytest.raises(ConfigError, match=r"^train.steps: Input should be a valid integer"):
        load_config("tiny", ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"^model.no_such_knob: unknown key$"):
        load_config("tiny", ["model.no_such_knob=1"])
    with pytest.raises(ConfigError, match=r"expected key=value"):
        load_config("tiny", ["train.steps"])


def test_file_with_base(tmp_path):
    (tmp_path / "parent.yml").write_text("base: tiny\ntrain:\n  steps: 170\n")
    (tmp_path / "child.yml").write_text("base: parent.yml\nmodel:\n  hidden_size: 48\n")
    cfg = load_config(str(tmp_path / "child.yml"))
    assert (cfg.train.steps, cfg.model.hidden_size, cfg.model.num_hidden_layers) == (170, 48, 2)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"config 'nope': no such file"):
        load_config("nope")
    (tmp_path / "bad.yml").write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(str(tmp_path / "bad.yml"))
    (tmp_path / "loop.yml").write_text("base: loop.yml\n")
    with pytest.raises(ConfigError, match=r"loops back"):
        load_config(str(tmp_path / "loop.yml"))


def test_a_hash_in_an_override_value_is_kept(tmp_path):
    """`#` would start a YAML comment: an override value holding one is taken
    as written, not cut (which could resume another run's directory)."""
    cfg = load_config("tiny", [f"train.out_dir={tmp_path}/exp #2", "data.eos_token=<|end #1|>"])
    assert cfg.train.out_dir == str(tmp_path / "exp #2") and cfg.data.eos_token == "<|end #1|>"
    assert load_config("tiny", ["model.mlp_only_layers=[0, 1]"]).model.mlp_only_layers == [0, 1]


def test_a_yaml_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("model:\n  hidden_size: [1, 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(bad))
    assert "not valid YAML" in str(e.value) and "\n" not in str(e.value)


def test_a_base_chain_that_loops_through_dotdot_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.yml").write_text("base: ../d/b.yml\n")
    (tmp_path / "d" / "b.yml").write_text("base: ../d/a.yml\n")
    with pytest.raises(ConfigError, match=r"`base` chain loops back to itself"):
        load_config(str(tmp_path / "d" / "a.yml"))
