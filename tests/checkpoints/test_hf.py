"""Hugging Face directories in and out: config mapping, sharded files,
the fused expert layout, round trip through transformers, clear errors."""

import json
import re

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file as save_numpy
import pytest
import torch
from safetensors import safe_open
from safetensors.flax import save_file
from transformers import Qwen3NextForCausalLM

from gdnx.checkpoints.hf import hf_state_dict, save_pretrained
from gdnx.checkpoints.hf_config import hf_config_from_model, model_config_from_hf
from gdnx.config import ModelConfig
from gdnx.measure import relative_error
from gdnx.models import CausalLM
from tests.helpers.hf_models import hf_logits, tokens


def test_round_trip_through_transformers(hf_checkpoints, tmp_path):
    """transformers -> gdnx -> save_pretrained -> transformers: the logits of
    the reloaded torch model equal the original's (fp32 relative 1e-6, the
    weights are copied bit for bit)."""
    hf, model = hf_checkpoints.hf_and_gdnx("qwen3_next_moe")
    model.save_pretrained(tmp_path / "out")
    back = Qwen3NextForCausalLM.from_pretrained(tmp_path / "out").eval()
    toks = tokens(2, 50)
    assert relative_error(hf_logits(back, toks), hf_logits(hf, toks)) <= 1e-6
    src = dict(hf.state_dict())
    for name, tensor in back.state_dict().items():
        torch.testing.assert_close(tensor, src[name], rtol=0, atol=0)


def test_written_names_are_the_published_per_expert_layout(hf_checkpoints, tmp_path):
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_next_moe")
    model.save_pretrained(tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="flax") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert "model.layers.0.linear_attn.conv1d.weight" in keys and "model.layers.1.self_attn.q_norm.weight" in keys
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["layer_types"][1] == "full_attention"


def test_sharded_save_and_load(hf_checkpoints, tmp_path):
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_next")
    save_pretrained(model, tmp_path / "out", shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    back = CausalLM.from_pretrained(tmp_path / "out")
    toks = jnp.asarray(tokens(1, 20), jnp.int32)
    np.testing.assert_array_equal(back(toks), model(toks))


def test_fused_expert_layout_loads(hf_checkpoints, tmp_path):
    """transformers 5 keeps experts fused ([E, 2I, H] gate|up, [E, H, I]
    down); a directory written that way loads to the same model."""
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_next_moe")
    sd = {k: np.asarray(v) for k, v in hf_state_dict(model).items()}
    fused = {}
    for layer in range(4):
        p = f"model.layers.{layer}.mlp.experts"
        gate = np.stack([sd.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)])
        up = np.stack([sd.pop(f"{p}.{e}.up_proj.weight") for e in range(4)])
        fused[f"{p}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        fused[f"{p}.down_proj"] = np.stack([sd.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    out = tmp_path / "fused"
    out.mkdir()
    save_file({k: jnp.asarray(v) for k, v in {**sd, **fused}.items()}, out / "model.safetensors")
    (out / "config.json").write_text((hf_checkpoints.path("qwen3_next_moe") / "config.json").read_text())
    toks = jnp.asarray(tokens(1, 20), jnp.int32)
    np.testing.assert_array_equal(CausalLM.from_pretrained(out)(toks), model(toks))


def test_overrides_and_load_errors(hf_checkpoints, tmp_path):
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_next", gdn_implementation="xla", gdn_chunk_size=32)
    assert (model.config.gdn_implementation, model.config.gdn_chunk_size) == ("xla", 32)
    with pytest.raises(ValueError, match=r"model.gdn_chunk_size"):
        CausalLM.from_pretrained(hf_checkpoints.path("qwen3_next"), gdn_chunk_size=48)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        CausalLM.from_pretrained(tmp_path / "nothing")
    # the file's own shape is named (not gdnx's transposed or squeezed view of it)
    shape_error = (r"model.layers.0.linear_attn.conv1d.weight: the file's shape \(96, 1, 4\) does not fit this "
                   r"config, which needs \(64, 4\)")
    with pytest.raises(ValueError, match=shape_error):
        CausalLM.from_pretrained(hf_checkpoints.path("qwen3_next"), linear_value_head_dim=8)
    sd = {k: v for k, v in hf_state_dict(model).items() if "lm_head" not in k}
    sd["model.extra.weight"] = jnp.zeros(3)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(sd, bad / "model.safetensors")
    (bad / "config.json").write_text((hf_checkpoints.path("qwen3_next") / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing weights: lm_head.weight"):
        CausalLM.from_pretrained(bad)
    # a layer of another kind than the file's: named as config.json's layer_types
    cfg = json.loads((hf_checkpoints.path("qwen3_next") / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] + cfg.get("layer_types", ["linear_attention"] * 4)[1:]
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file(hf_state_dict(model), bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"the file's model.layers.0 holds linear_attn.\* where this config's layer 0 "
                                         r"is 'full_attention': config.json's layer_types"):
        CausalLM.from_pretrained(bad)
    (bad / "config.json").write_text((hf_checkpoints.path("qwen3_next") / "config.json").read_text())
    # weights that are not weights: integers, booleans, NaN
    full = {k: np.asarray(v) for k, v in hf_state_dict(model).items()}
    key = "model.layers.0.input_layernorm.weight"
    for value, what in [(np.ones(full[key].shape, np.int64), "is int64, expected floating-point"),
                        (np.ones(full[key].shape, bool), "is bool, expected floating-point"),
                        (np.full(full[key].shape, np.nan, np.float32), "holds NaN or infinite values")]:
        save_numpy({**full, key: value}, bad / "model.safetensors")
        with pytest.raises(ValueError, match=rf"{key} {what}"):
            CausalLM.from_pretrained(bad)


def test_config_mapping():
    cfg = model_config_from_hf({"model_type": "qwen3_next", "hidden_size": 64, "rope_theta": 5e6,
                                "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16", "use_cache": True})
    assert (cfg.hidden_size, cfg.rope_theta, cfg.partial_rotary_factor) == (64, 5e6, 0.5)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        model_config_from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        model_config_from_hf({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_family_config_mapping():
    """model_type picks the family; Qwen3.5's multimodal RoPE sections
    (1-D RoPE for text) are accepted; a vision-language config gives its
    text_config with the top-level embedding tie; OLMo Hybrid's head size
    is hidden / heads and its RoPE is whole."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    dense = model_config_from_hf({"model_type": "qwen3_5_text", "intermediate_size": 96, "rope_parameters": rope})
    assert (dense.family, dense.num_experts, dense.intermediate_size, dense.rope_theta) == ("qwen3_5", 0, 96, 1e7)
    vl = model_config_from_hf({"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "text_config": {
        "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2}})
    assert (vl.family, vl.num_experts, vl.num_experts_per_tok, vl.tie_word_embeddings) == ("qwen3_5", 8, 2, True)
    olmo = model_config_from_hf({"model_type": "olmo_hybrid", "hidden_size": 96, "num_attention_heads": 6,
                                 "num_key_value_heads": 2, "linear_allow_neg_eigval": True,
                                 "rope_parameters": {"rope_theta": 5e5}})
    assert (olmo.family, olmo.head_dim, olmo.partial_rotary_factor, olmo.rope_theta) == ("olmo_hybrid", 16, 1.0, 5e5)
    assert olmo.linear_allow_neg_eigval and olmo.num_experts == 0


def test_save_refuses_what_the_family_cannot_store():
    with pytest.raises(ValueError, match=r"model.norm_topk_prob: a qwen3_5_moe checkpoint stores only True"):
        hf_config_from_model(ModelConfig(family="qwen3_5", norm_topk_prob=False))
    with pytest.raises(ValueError, match=r"model.linear_allow_neg_eigval: a qwen3_next checkpoint stores only False"):
        hf_config_from_model(ModelConfig(linear_allow_neg_eigval=True))
    with pytest.raises(ValueError, match=r"num_experts: olmo_hybrid has dense MLPs only; set it to 0, got 512"):
        ModelConfig(family="olmo_hybrid")


def test_a_wrong_shape_in_one_layer_of_a_scanned_stack_names_that_layer(hf_checkpoints, tmp_path):
    """Loading into the stacked layout checks each layer's tensor before
    stacking: the odd one out is named, not a stacking error."""
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_next", scan_layers=True)
    sd = hf_state_dict(model)
    key = "model.layers.2.linear_attn.dt_bias"
    sd[key] = jnp.zeros(sd[key].shape[0] + 1)
    odd = tmp_path / "odd"
    odd.mkdir()
    save_file(sd, odd / "model.safetensors")
    (odd / "config.json").write_text((hf_checkpoints.path("qwen3_next") / "config.json").read_text())
    odd_shape = rf"{key}: the file's shape \(5,\) does not fit this config, which needs \(4,\)"
    with pytest.raises(ValueError, match=odd_shape):
        CausalLM.from_pretrained(odd, scan_layers=True)


def _grown(src, dst, key):
    """A copy of the checkpoint at `src` with tensor `key` one row longer."""
    import shutil

    from safetensors.numpy import load_file

    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    for f in files:
        tensors = load_file(f)
        if key in tensors:
            t = tensors[key]
            tensors[key] = np.concatenate([t, t[:1]], axis=0)
            save_numpy(tensors, f, metadata={"format": "pt"})


def _layer_tensors(path) -> list[str]:
    """Each kind of tensor of the checkpoint's decoder layers once (the
    first layer that has it), the vision tower's aside."""
    seen, out = set(), []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as h:
            for key in sorted(h.keys()):
                if "visual" in key or "layers." not in key:
                    continue
                kind = key.split("layers.", 1)[1].split(".", 1)[1]
                if kind not in seen:
                    seen.add(kind)
                    out.append(key)
    return out


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "glm5_next" else pytest.mark.slow)
                                  for k in ("glm5_next", "qwen3_next_moe", "kimi_linear", "bailing_hybrid",
                                            "lara_mini", "qwen4_exp")])
def test_a_tensor_with_a_row_too_many_is_refused_naming_it(hf_checkpoints, tmp_path, kind):
    """Every kind of layer tensor, one row longer than the config makes it,
    is refused naming the tensor: the whole tensor is checked, not only the
    parts the parameters slice from it (GLM-5-Next's k_proj, sliced per key
    head, loaded with a row to spare)."""
    src = hf_checkpoints.path(kind)
    for i, key in enumerate(_layer_tensors(src)):
        _grown(src, tmp_path / str(i), key)
        named = re.escape(re.sub(r"experts\.\d+\.", "experts.<n>.", key)).replace("<n>", r"(\d+|\*)")
        # its message says why (one expert grown: experts of two shapes); the tensor named is the point
        with pytest.raises(ValueError, match=named):
            CausalLM.from_pretrained(tmp_path / str(i))
