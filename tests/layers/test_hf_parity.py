"""Each layer type on its own against its transformers counterpart, on the
same weights (loaded through the checkpoint map) and the same input.
Tolerance: relative error <= 1e-5 (float32, one layer)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gdnx.layers.rope import rope_tables, rotary_dim
from gdnx.measure import relative_error

TOL = 1e-5
T = 45


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    return hf_checkpoints.hf_and_gdnx("qwen3_next_moe")


def _x(width, seed=0):
    return np.random.default_rng(seed).standard_normal((2, T, width)).astype(np.float32)


def _check(ours, ref):
    err = relative_error(ours, ref.detach().numpy() if hasattr(ref, "detach") else ref)
    assert err <= TOL, err


def test_gated_deltanet(models):
    hf, model = models
    x = _x(32)
    with torch.no_grad():
        ref = hf.model.layers[0].linear_attn(torch.tensor(x))
    _check(model.layers[0].mixer(jnp.asarray(x))[0], ref)


def test_gated_attention(models):
    hf, model = models
    x = _x(32, 1)
    pos = np.arange(T)
    mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)[None, None]
    with torch.no_grad():
        pe = hf.model.rotary_emb(torch.tensor(x), torch.tensor(pos)[None])
        ref, _ = hf.model.layers[1].self_attn(torch.tensor(x), position_embeddings=pe, attention_mask=mask)
    cfg = model.config
    rope = rope_tables(jnp.asarray(pos, jnp.int32)[None], rotary_dim(cfg.head_dim, cfg.partial_rotary_factor),
                       cfg.rope_theta)
    ours, _ = model.layers[1].mixer(jnp.asarray(x), rope, jnp.asarray(pos, jnp.int32))
    _check(ours, ref)


def test_sparse_moe(models):
    hf, model = models
    x = _x(32, 2)
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(torch.tensor(x))
    _check(model.layers[0].mlp(jnp.asarray(x))[0], ref)


def test_shared_expert_mlp(models):
    hf, model = models
    x = _x(32, 3)
    with torch.no_grad():
        ref = hf.model.layers[2].mlp.shared_expert(torch.tensor(x))
    _check(model.layers[2].mlp.shared_expert(jnp.asarray(x)), ref)


def test_zero_centred_rmsnorm(models):
    hf, model = models
    x = _x(32, 4)
    with torch.no_grad():
        ref = hf.model.layers[3].post_attention_layernorm(torch.tensor(x))
    _check(model.layers[3].post_attention_layernorm(jnp.asarray(x)), ref)


def test_dense_mlp(hf_checkpoints):
    hf, model = hf_checkpoints.hf_and_gdnx("qwen3_next")
    x = _x(32, 5)
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(torch.tensor(x))
    _check(model.layers[1].mlp(jnp.asarray(x)), ref)


def test_gated_deltanet_with_qwen4_exps_sigmoid_output_gate(hf_checkpoints):
    """Qwen4-Exp's GDN layer is Qwen3.5's with a selectable output gate:
    transformers' Qwen4-Exp layer holding a Qwen3.5 layer's weights, its
    output gate sigmoid, against gdnx's layer with output_gate="sigmoid"."""
    import transformers
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedDeltaNet

    hf, model = hf_checkpoints.hf_and_gdnx("qwen3_5")
    source = hf.model.layers[0].linear_attn
    c = hf.config
    config = transformers.Qwen4ExpTextConfig(
        hidden_size=c.hidden_size, linear_num_value_heads=c.linear_num_value_heads,
        linear_num_key_heads=c.linear_num_key_heads, linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim, linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        rms_norm_eps=c.rms_norm_eps, output_gate_type="sigmoid", layer_types=["linear_attention"],
        num_hidden_layers=1)
    theirs = Qwen4ExpTextGatedDeltaNet(config, 0).eval()
    theirs.load_state_dict(source.state_dict())
    x = _x(c.hidden_size, 3)
    with torch.no_grad():
        ref = theirs(torch.tensor(x))
        plain = source(torch.tensor(x))
    mixer = model.layers[0].mixer
    mixer.output_gate = "sigmoid"
    _check(mixer(jnp.asarray(x))[0], ref)
    assert relative_error(ref.numpy(), plain.numpy()) > 1e-2  # the gate changes the output
