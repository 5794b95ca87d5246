"""The whole model against transformers, for every family gdnx builds:
Qwen3-Next (dense, MoE), Qwen3.5 (dense with GVA groups of 3, MoE with
groups of 4), OLMo Hybrid (beta in [0, 2]); fp32, CPU.

Tolerance: relative error <= 1e-4 on the logits (float32 through 4 layers;
measured 2e-7 to 4e-7). Lengths 1, 77 (odd, not a multiple of the chunk
size 64, so the padded tail runs) and 130 (three chunks).
"""

import json
import logging
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from gdnx.checkpoints.hf_config import hf_config_from_model
from gdnx.config import load_config
from gdnx.generate import generate
from gdnx.measure import relative_error
from gdnx.models import CausalLM
from gdnx.models.causal_lm import parameter_count
from tests.helpers.hf_models import KINDS, _BASE, assert_same_model, hf_logits, random_hf_model, tokens
from tests.helpers.tiers import SLOW, fast_only

TOL = 1e-4


# every kind unrolled, and with its layers scanned (the stacked layout: 2
# repeats of a GDN + attention cycle)
LAYOUTS = [(kind, False) for kind in KINDS] + [(kind, True) for kind in KINDS]


@pytest.fixture(scope="module", params=[pytest.param(layout, marks=SLOW if layout[1] else ()) for layout in LAYOUTS],
                ids=[f"{k}-{'scanned' if s else 'unrolled'}" for k, s in LAYOUTS])
def pair(hf_checkpoints, request):
    kind, scanned = request.param
    hf, model = hf_checkpoints.hf_and_gdnx(kind, scan_layers=scanned)
    assert model.config.scanned == scanned
    return hf, model


@pytest.mark.parametrize("length", fast_only([1, 77, 130], lambda n: n == 77))
def test_logits_match_transformers(pair, length):
    hf, model = pair
    toks = tokens(2, length)
    err = relative_error(model(jnp.asarray(toks, jnp.int32)), hf_logits(hf, toks))
    assert err <= TOL, err


def test_save_pretrained_loads_in_transformers_bit_identical(pair, tmp_path):
    """gdnx -> save_pretrained -> transformers: every tensor equals the
    original's bit for bit, and so do the logits."""
    hf, model = pair
    model.save_pretrained(tmp_path)
    back = type(hf).from_pretrained(tmp_path).eval()
    assert_same_model(back, hf)


@pytest.mark.slow
def test_aux_loss_matches_transformers(hf_checkpoints):
    hf, model = hf_checkpoints.hf_and_gdnx("qwen3_5_moe")
    toks = tokens(2, 40)
    with torch.no_grad():
        ref = hf(torch.tensor(toks), output_router_logits=True).aux_loss.item()
    out = model.forward(jnp.asarray(toks, jnp.int32))
    assert abs(float(out.aux_loss) - ref) <= 1e-5 * abs(ref), (float(out.aux_loss), ref)


@pytest.mark.parametrize("kind,scanned", fast_only(
    [(kind, False) for kind in KINDS] + [("qwen3_5_moe", True), ("olmo_hybrid", True)],
    lambda case: case == ("qwen3_5", False)))
def test_greedy_generation_matches_transformers(hf_checkpoints, kind, scanned):
    # weights scaled up so the next-token distribution is peaked: greedy ties
    # between near-equal logits would make the comparison about float noise
    hf, model = hf_checkpoints.hf_and_gdnx(kind, scale=5.0, scan_layers=scanned)
    prompt = tokens(1, 37, seed=1)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    ours = generate(model, prompt, 16)
    np.testing.assert_array_equal(np.asarray(ours), ref[:, prompt.shape[1]:].numpy())


def test_olmo_hybrid_without_rope(tmp_path):
    """OLMo Hybrid with no rotary embedding (rope_theta None) matches."""
    hf = random_hf_model("olmo_hybrid", rope_parameters={"rope_type": "default", "rope_theta": None})
    assert hf.model.rotary_emb is None
    hf.save_pretrained(tmp_path)
    model = CausalLM.from_pretrained(tmp_path)
    assert model.config.rope_theta is None
    toks = tokens(2, 33)
    assert relative_error(model(jnp.asarray(toks, jnp.int32)), hf_logits(hf, toks)) <= TOL


@pytest.mark.parametrize("moe", fast_only([False, True], lambda moe: not moe), ids=["dense", "moe"])
def test_vision_language_checkpoint_loads_its_language_model(tmp_path, caplog, moe):
    """A Qwen3.5 ForConditionalGeneration directory: the language model
    loads (logits equal the text model's), the vision tower is skipped
    with one line that says so."""
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    text = {**_BASE, **KINDS[kind][2]}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    torch.manual_seed(0)
    hf = model_cls(config_cls(text_config=text, vision_config=vision)).eval()
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="gdnx"):
        model = CausalLM.from_pretrained(tmp_path)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "skipped the vision tower" in notes[0], notes
    assert model.config.family == "qwen3_5" and (model.config.num_experts > 0) == moe
    toks = tokens(2, 20)
    assert relative_error(model(jnp.asarray(toks, jnp.int32)), hf_logits(hf, toks)) <= TOL


def test_unsupported_model_type_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"model_type 'llama' is not a GDN hybrid gdnx builds \(supported: "):
        CausalLM.from_pretrained(tmp_path)


@pytest.mark.slow
def test_olmo_hybrid_with_its_own_head_dim(tmp_path):
    """An OLMo Hybrid config.json with head_dim other than hidden / heads
    (transformers takes it from the file) loads and matches."""
    hf = random_hf_model("olmo_hybrid", head_dim=12)
    assert hf.model.layers[1].self_attn.head_dim == 12
    hf.save_pretrained(tmp_path)
    model = CausalLM.from_pretrained(tmp_path)
    assert model.config.head_dim == 12
    toks = tokens(2, 33)
    assert relative_error(model(jnp.asarray(toks, jnp.int32)), hf_logits(hf, toks)) <= TOL


def test_a_latent_rank_that_does_not_fit_the_tensors_names_the_field(tmp_path):
    """The first tensor whose shape follows the rank (parameters are checked
    in name order: kv_a_layernorm before kv_a_proj_with_mqa) names it."""
    random_hf_model("kimi_linear").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"kv_a_layernorm.weight: the file's shape \(16,\) does not fit .*"
                                         r"needs \(8,\).*its shape follows model.kv_lora_rank$"):
        CausalLM.from_pretrained(tmp_path, kv_lora_rank=8)


@pytest.mark.parametrize("kind, edit, named", [
    ("kimi_linear", {"linear_attn_config": {"num_heads": 4, "head_dim": 8}},
     "linear_attn_config.num_heads, linear_attn_config.head_dim"),
    ("qwen3_next", {"linear_num_value_heads": 2},
     "linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim"),
])
def test_linear_attention_heads_that_do_not_fit_the_tensors_name_the_fields(hf_checkpoints, tmp_path, kind, edit,
                                                                             named):
    """A config.json whose linear-attention heads do not match the weights
    (Kimi's in its linear_attn_config) names those fields as it spells them."""
    shutil.copytree(hf_checkpoints.path(kind), tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(edit)
    if "linear_attn_config" in edit:
        del cfg["linear_num_heads"], cfg["linear_head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"does not fit this config.*its shape follows config.json's " + named + "$"):
        CausalLM.from_pretrained(tmp_path)


@pytest.mark.slow
def test_ling_multi_token_prediction_layers_left_out_are_skipped_once(tmp_path, caplog):
    """A Ling 3 checkpoint stores its multi-token prediction layer after the
    decoder's (model.layers.4.* here): loaded without it
    (model.mtp_num_layers=0; tests/models/test_mtp.py loads it), its
    tensors are skipped with one line, the logits are the model's, and the
    export holds the loaded layers only."""
    hf = random_hf_model("bailing_hybrid")
    hf.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    mtp = {k.replace("model.layers.0.", "model.layers.4."): v for k, v in tensors.items() if ".layers.0." in k}
    mtp["model.layers.4.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file({**tensors, **mtp}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="gdnx"):
        model = CausalLM.from_pretrained(tmp_path / "hf", mtp_num_layers=0)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and f"skipped the multi-token prediction layers ({len(mtp)} tensors under " \
        "model.layers.4.*)" in notes[0], notes
    toks = tokens(2, 20)
    assert relative_error(model(jnp.asarray(toks, jnp.int32)), hf_logits(hf, toks)) <= TOL
    model.save_pretrained(tmp_path / "out")
    assert not any(".layers.4." in k for k in load_file(tmp_path / "out" / "model.safetensors"))


@pytest.mark.parametrize("name,arch", [("kimi-linear-48b-a3b", "KimiLinear"), ("ling-3.0-flash", "BailingHybrid"),
                                       ("lara-4-mini", "LaraMini"), ("glm-5.3-flash", "Glm5Next"),
                                       ("qwen4-exp", "Qwen4Exp")])
def test_bundled_configs_count_transformers_parameters(name, arch):
    """The bundled Kimi-Linear-48B-A3B, Ling-3.0-Flash, Lara 4 Mini,
    GLM-5.3-Flash and Qwen4-Exp configs, exported to config.json and built by transformers
    on the meta device (no memory): gdnx's parameter count equals
    transformers' parameters (GLM's and Qwen4's language model and head:
    the vision tower aside) plus the routers' correction biases (buffers there,
    parameters without gradient here), and the layer pattern is theirs."""
    cfg = load_config(name).model
    hf = hf_config_from_model(cfg)
    config = getattr(transformers, f"{arch}Config")(**{k: v for k, v in hf.items()
                                                      if k not in ("architectures", "model_type", "dtype")})
    model_class = f"{arch}ForConditionalGeneration" if arch in ("Glm5Next", "Qwen4Exp") else f"{arch}ForCausalLM"
    with torch.device("meta"):
        theirs = getattr(transformers, model_class)(config)
    count = sum(p.numel() for n, p in theirs.named_parameters() if not n.startswith("model.visual."))
    count += sum(b.numel() for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias"))
    assert parameter_count(cfg) == count
    layer_types = theirs.config.get_text_config().layer_types
    assert [t.replace("indexed_", "full_") for t in layer_types] == list(cfg.resolved_layer_types)
