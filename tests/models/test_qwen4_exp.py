"""Qwen4-Exp (qwen4_exp) against transformers: a tiny vision-language
checkpoint written by transformers (its vision tower skipped by name), the
language model's logits at lengths below and well past the sparse-attention
budget (8 tokens in blocks of 4), GDN with the sigmoid output gate, gated
residuals over 4 streams, hashed n-gram per-layer embeddings (their ids
hashed on the device, end-of-sequence resetting the n-grams), every layer
routed; greedy generation through the cache; packed documents; the export
bit for bit, its split n-gram tables included.

Tolerance: relative error <= 1e-4 on the logits (float32, 4 layers;
measured about 2e-7)."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open

from gdnx.checkpoints.hf_config import model_config_from_hf
from gdnx.config.schema import ModelConfig
from gdnx.generate import generate
from gdnx.measure import relative_error
from gdnx.models import CausalLM
from gdnx.models.causal_lm import parameter_count
from tests.helpers.hf_models import assert_config_refused, assert_packed_equals_alone, QWEN4_EXP_TEXT, assert_same_model, hf_logits, tokens
from tests.helpers.tiers import fast_only

TOL = 1e-4
EOS = QWEN4_EXP_TEXT["eos_token_id"]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints):
    """The transformers model (its vision tower of one block) and its directory."""
    return hf_checkpoints.hf("qwen4_exp"), hf_checkpoints.path("qwen4_exp")


@pytest.fixture(scope="module")
def pair(checkpoint):
    return checkpoint[0], CausalLM.from_pretrained(checkpoint[1])


@nnx.jit
def _logits(model, toks, segments=None):
    return model.forward(toks, segments=segments).logits


@pytest.mark.parametrize("length", fast_only([6, 45], lambda n: n == 45))
def test_logits_match_transformers(pair, length):
    """With an end-of-sequence token inside a row (the n-grams after it
    start afresh)."""
    hf, model = pair
    toks = tokens(2, length)
    toks[0, length // 2] = EOS
    err = relative_error(_logits(model, jnp.asarray(toks, jnp.int32)), hf_logits(hf, toks))
    assert err <= TOL, err


@pytest.mark.slow
def test_greedy_generation_matches_transformers(pair):
    """gdnx's cache (the index keys, each PLE layer's convolution inputs and
    n-gram context) against transformers' generate: the same 24 tokens from
    a 5-token prompt, past the budget, through end-of-sequence tokens
    (generated, not stopped at: the n-grams after one start afresh)."""
    hf, model = pair
    prompt = tokens(2, 5, seed=3)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert (ref[:, 5:] == EOS).any()
    ours = generate(model, jnp.asarray(prompt, jnp.int32), 24)
    np.testing.assert_array_equal(np.asarray(ours), ref[:, 5:].numpy())


@pytest.mark.slow
def test_packed_documents_equal_each_document_alone(pair):
    """A row packing three documents (13, 22 and 10 tokens) gives each
    document's logits alone: blocks, n-grams and the PLE convolution
    restart at each document."""
    model = pair[1]
    assert_packed_equals_alone(lambda toks, segments: _logits(
        model, jnp.asarray(toks), None if segments is None else jnp.asarray(segments)))


def test_the_config_reads_as_transformers_does(checkpoint, caplog):
    """Fields under transformers' names, the 1-based PLE ids, the layer
    pattern by default; the vision tower skipped with one line naming it."""
    _, path = checkpoint
    with caplog.at_level(logging.WARNING, logger="gdnx"):
        model = CausalLM.from_pretrained(path)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "skipped the vision tower" in notes[0], notes
    cfg = model.config
    assert cfg.family == "qwen4_exp" and cfg.ple_layers == [0, 2] and cfg.streams == 4 and cfg.hc_lowrank == 8
    assert (cfg.index_topk, cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim) == (8, 4, 4, 8)
    assert cfg.linear_output_gate == "sigmoid" and cfg.ngram_split_parts == 4 and cfg.partial_rotary_factor == 0.25
    default = model_config_from_hf({"model_type": "qwen4_exp_text", "num_hidden_layers": 8, "indexer_n_heads": 4,
                                    "indexer_head_dim": 256, "indexer_budget": 64, "indexer_compress_ratio": 16})
    assert default.resolved_layer_types[3] == "full_attention" and default.linear_output_gate == "silu"
    assert (default.rope_theta, default.partial_rotary_factor) == (10000.0, 1.0)


def test_save_pretrained_loads_in_transformers_bit_identical(pair, checkpoint, tmp_path):
    """gdnx -> save_pretrained (carrying the source's vision tower) ->
    transformers: every tensor, the n-gram tables' pieces and hashing
    constants included, equals the original's bit for bit."""
    hf, model = pair
    _, source = checkpoint
    model.save_pretrained(tmp_path / "with", vision_from=source)
    assert_same_model(type(hf).from_pretrained(tmp_path / "with").eval(), hf)
    with safe_open(tmp_path / "with" / "model.safetensors", "np") as f, \
            safe_open(source / "model.safetensors", "np") as g:
        assert set(f.keys()) == set(g.keys())


def test_parameter_count_with_two_ple_layers_matches_transformers():
    """transformers' default sizes at 8 layers with two PLE layers (the
    second's tables on the primes after the first's): gdnx's parameter
    count equals transformers' on the meta device."""
    import transformers

    text = dict(num_hidden_layers=8, ple_layer_ids=[1, 5], eos_token_id=248044, indexer_n_heads=16,
                indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=16,
                ngram_vocab_size_base=200_000, heads_per_ngram=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
    with torch.device("meta"):
        theirs = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text))
    want = sum(p.numel() for p in theirs.parameters())
    cfg = model_config_from_hf({"model_type": "qwen4_exp_text", **text})
    assert parameter_count(cfg) == want


@pytest.mark.parametrize("edit, named", [
    ({"indexer_budget": 10}, "index_topk: must be a multiple of index_kpool=4, got 10"),
    ({"indexer_head_dim": 2}, "index_head_dim: the indexer rotates as the attention does (4 features)"),
    ({"indexer_budget": None}, "indexer_budget: Qwen4-Exp's attention layers read the tokens its indexer picks"),
    ({"ple_layer_ids": [2]}, "ple_layers: per-layer embeddings go on linear_attention layers only"),
    ({"ple_embed_dim": 10}, "ple_embed_dim: must be a multiple of the 4 n-gram tables"),
    ({"eos_token_id": None}, "eos_token_id: the n-gram context restarts after end-of-sequence"),
    ({"hc_count": 1}, "hc_mult: qwen4_exp's gated residual mixes at least 2 streams"),
    ({"ngram_vocab_size_base": 600_000_000}, "ngram_vocab_base: a layer's 4 tables of at least 600000000 rows"),
])
def test_config_mistakes_name_the_field(edit, named):
    assert_config_refused("qwen4_exp", QWEN4_EXP_TEXT, edit, named)


def test_a_checkpoint_hashing_otherwise_is_refused(checkpoint):
    """The checkpoint's n-gram tables were hashed with primes from 50 on:
    a config that hashes from 60 on is refused naming the field, not run
    on the wrong rows."""
    with pytest.raises(ValueError, match="check model.ngram_vocab_base"):
        CausalLM.from_pretrained(checkpoint[1], ngram_vocab_base=60)


def test_other_families_refuse_qwen4_fields():
    with pytest.raises(ValueError, match="ple_layers: per-layer embeddings are qwen4_exp's"):
        ModelConfig(family="qwen3_next", ple_layers=[0])


@pytest.mark.slow
def test_scanned_stack_equals_unrolled(pair):
    """Six layers, a PLE layer first (its own kind), then a cycle of
    indexed attention + GDN repeated twice under the scan and the last
    attention layer after it: logits equal the unrolled stack's, and greedy
    tokens through the scanned cache (the index caches sliced and written
    back per repeat) are the unrolled stack's argmax."""
    cfg = pair[1].config.model_copy(update={
        "num_hidden_layers": 6, "layer_types": ["linear_attention", "full_attention"] * 3, "ple_layers": [0]})
    unrolled, scanned = (CausalLM(cfg.model_copy(update={"scan_layers": s})) for s in (False, True))
    assert scanned.config.scanned and (scanned.config.layer_head, scanned.config.cycle_repeats) == (1, 2)
    toks = jnp.asarray(tokens(2, 21, seed=5), jnp.int32)
    assert relative_error(_logits(scanned, toks), _logits(unrolled, toks)) <= 1e-5
    drawn = generate(scanned, toks[:, :5], 16)  # each the argmax of the unrolled stack's logits before it
    whole = jnp.concatenate([toks[:, :5], drawn], axis=1)
    np.testing.assert_array_equal(np.asarray(drawn), np.asarray(jnp.argmax(_logits(unrolled, whole), -1)[:, 4:-1]))

