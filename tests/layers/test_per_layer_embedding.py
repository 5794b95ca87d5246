"""Qwen4-Exp's per-layer embedding (PLE) against transformers' module."""

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from gdnx.layers.ngram_embedding import NGramHash
from gdnx.layers.per_layer_embedding import PerLayerEmbedding, states_at
from gdnx.measure import relative_error

EOS = 0


def test_per_layer_embedding_matches_qwen4_exp_and_continues():
    """Qwen4-Exp's PLE layer (n-gram keys and value gating each stream, a
    dilated causal depthwise convolution): transformers' outputs (1e-5,
    float32), and two calls carrying the convolution's inputs equal one."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    h, n, dim = 8, 4, 16
    config = transformers.Qwen4ExpTextConfig(vocab_size=50, hidden_size=h, hc_count=n, ngram_size=3,
                                             heads_per_ngram=2, ngram_vocab_size_base=97,
                                             make_ngram_vocab_size_divisible_by=8, ple_embed_dim=dim,
                                             ple_conv_kernel_size=3, eos_token_id=EOS, seed=1234)
    torch.manual_seed(0)
    theirs = Qwen4ExpTextPLELayer(config, layer_idx=0, ple_layer_index=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    hashing = NGramHash.build(vocab_size=50, ngram_size=3, heads_per_ngram=2, vocab_base=97, layer_index=0,
                              seed=1234, divisible_by=8, eos=EOS)
    ours = PerLayerEmbedding(h, n, rows=hashing.rows, heads=4, embed_dim=dim, conv_kernel=3, dilation=3,
                             eps=config.rms_norm_eps, init_std=0.02, dtype=jnp.float32, param_dtype=jnp.float32,
                             rngs=nnx.Rngs(0))

    def weight(t):
        return jnp.asarray(t.detach().numpy())
    ours.embedding.table[...] = weight(theirs.ple_embedding.ngram_embedding.weight)
    ours.key_proj.kernel[...] = weight(theirs.key_proj.weight).T
    ours.value_proj.kernel[...] = weight(theirs.value_proj.weight).T
    for name in ("norm_key", "norm_query", "norm_conv"):
        getattr(ours, name).weight[...] = weight(getattr(theirs, name).weight)
    ours.conv_weight[...] = weight(theirs.conv1d.weight)[:, 0, :].T
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, (2, 13))
    tokens[1, 4] = EOS
    streams = rng.standard_normal((2, 13, n * h)).astype(np.float32)
    with torch.no_grad():
        want = theirs(torch.from_numpy(streams), torch.from_numpy(tokens), None).numpy()
    got, _ = ours(jnp.asarray(streams), jnp.asarray(hashing.ids(tokens)))
    assert relative_error(got, want) <= 1e-5
    cut = 7
    first, window = ours(jnp.asarray(streams[:, :cut]), jnp.asarray(hashing.ids(tokens[:, :cut])))
    state = states_at(window, jnp.full((2, 1), cut), ours.state_length)[:, 0]  # after the first call's tokens
    second, _ = ours(jnp.asarray(streams[:, cut:]), jnp.asarray(hashing.ids(tokens[:, cut:], tokens[:, cut - 2:cut])),
                     state)
    assert relative_error(jnp.concatenate([first, second], axis=1), got) <= 1e-6
