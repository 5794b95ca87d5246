"""Qwen4-Exp's hashed n-gram embeddings against transformers' module: the
row ids computed on the host (int64 hashing, prime-sized tables after the
previous layers', end-of-sequence tokens resetting the n-gram context)
give its embeddings exactly (the same rows); ids computed in two calls,
the second continuing after the first's last tokens, equal one call's; the
ids the model hashes on the device equal the host's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gdnx.layers.ngram_embedding import NGramEmbedding, NGramHash, _is_prime

EOS = 0


@pytest.mark.parametrize("ngram_size,layer", [(3, 1), (4, 0)])
def test_ngram_embedding_matches_qwen4_exp(ngram_size, layer):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    heads_per_ngram = 2
    dim = (ngram_size - 1) * heads_per_ngram * 4
    config = transformers.Qwen4ExpTextConfig(vocab_size=50, ngram_size=ngram_size, heads_per_ngram=heads_per_ngram,
                                             ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8,
                                             ple_embed_dim=dim, eos_token_id=EOS, seed=1234)
    torch.manual_seed(0)
    theirs = Qwen4ExpTextNGramEmbedding(config, dim, layer_idx=0, ple_layer_index=layer)
    hashing = NGramHash.build(vocab_size=50, ngram_size=ngram_size, heads_per_ngram=heads_per_ngram, vocab_base=97,
                              layer_index=layer, seed=1234, divisible_by=8, eos=EOS)
    assert list(hashing.sizes) == theirs.head_vocab_sizes and all(map(_is_prime, hashing.sizes))
    assert hashing.rows == theirs.ngram_embedding.weight.shape[0]
    ours = NGramEmbedding(hashing.rows, 4, init_std=0.02, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ours.table[...] = jnp.asarray(theirs.ngram_embedding.weight.detach().numpy())
    rng = np.random.default_rng(ngram_size)
    tokens = rng.integers(1, 50, (2, 17))
    tokens[0, 6] = tokens[1, 2] = tokens[1, 3] = EOS  # documents end mid-row (twice in a row too)
    with torch.no_grad():
        want = theirs(torch.from_numpy(tokens), None).numpy()
    ids = hashing.ids(tokens)
    np.testing.assert_array_equal(np.asarray(ours(jnp.asarray(ids))), want)
    # in two calls: the second after the first's last ngram_size - 1 tokens
    cut = 9
    later = hashing.ids(tokens[:, cut:], tokens[:, cut - ngram_size + 1:cut])
    np.testing.assert_array_equal(np.concatenate([hashing.ids(tokens[:, :cut]), later], axis=1), ids)



@pytest.mark.parametrize("vocab,base,layer", [(50, 97, 1), (248320, 20_000_000, 3)])
def test_device_ids_equal_the_host_ids(vocab, base, layer):
    """The ids hashed inside a program in uint32 halves equal the host's
    int64 ones bit for bit: the published sizes (primes past 2^24, token
    ids past 2^17, products past 2^62) and the tiny ones; with and without the previous tokens, end-of-sequence tokens
    inside rows; packed documents each as alone."""
    hashing = NGramHash.build(vocab_size=vocab, ngram_size=3, heads_per_ngram=8, vocab_base=base, layer_index=layer,
                              seed=1234, divisible_by=128, eos=EOS)
    rng = np.random.default_rng(layer)
    tokens = rng.integers(1, vocab, (3, 40))
    tokens[0, 5] = tokens[1, 0] = tokens[2, 39] = EOS
    context = rng.integers(1, vocab, (3, 2))
    context[1, 1] = EOS
    device = jax.jit(hashing.device_ids)
    for ctx in (None, context):
        got = device(jnp.asarray(tokens, jnp.int32), None if ctx is None else jnp.asarray(ctx, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), hashing.ids(tokens, ctx))
    segments = np.repeat([0, 1, 2], [11, 20, 9])[None].repeat(3, 0)
    packed = np.asarray(device(jnp.asarray(tokens, jnp.int32), None, jnp.asarray(segments, jnp.int32)))
    for a, z in ((0, 11), (11, 31), (31, 40)):
        np.testing.assert_array_equal(packed[:, a:z], hashing.ids(tokens[:, a:z]))
