"""GLM-5-Next (glm5_next) against transformers: a tiny vision-language
checkpoint written by transformers (its vision tower skipped by name), the
language model's logits unrolled and scanned at lengths below and well past
the sparse-attention budget (8 tokens in pools of 4: past 11 tokens a query
reads fewer tokens than it sees), a shared-index layer after each full one,
KDA with the bounded gate, hyper-connection streams, clamped SwiGLUs, a
dense first layer and grouped sigmoid routing; packed documents; the export.
Generation against transformers' generate: tests/serving/test_engine_hf.py.

Tolerance: relative error <= 1e-4 on the logits (float32, 7 layers;
measured about 2e-7)."""

import logging

import jax.numpy as jnp
import pytest
from flax import nnx
from safetensors import safe_open

from gdnx.checkpoints.hf_config import model_config_from_hf
from gdnx.measure import relative_error
from gdnx.models import CausalLM
from tests.helpers.hf_models import assert_config_refused, assert_packed_equals_alone, GLM5_NEXT_TEXT, assert_same_model, hf_logits, tokens
from tests.helpers.tiers import fast_only

TOL = 1e-4
LAYERS = GLM5_NEXT_TEXT["layer_types"]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints):
    """The transformers model (its vision tower of one block) and its directory."""
    return hf_checkpoints.hf("glm5_next"), hf_checkpoints.path("glm5_next")


@pytest.fixture(scope="module", params=fast_only([False, True], lambda scanned: not scanned),
                ids=["unrolled", "scanned"])
def pair(checkpoint, request):
    hf, path = checkpoint
    model = CausalLM.from_pretrained(path, scan_layers=request.param)
    assert model.config.scanned == request.param
    return hf, model


@pytest.fixture(scope="module")
def unrolled(checkpoint):
    return checkpoint[0], CausalLM.from_pretrained(checkpoint[1])


@nnx.jit
def _logits(model, toks, segments=None):
    return model.forward(toks, segments=segments).logits


@pytest.mark.parametrize("length", fast_only([6, 45], lambda n: n == 45))
def test_logits_match_transformers(pair, length):
    hf, model = pair
    toks = tokens(2, length)
    err = relative_error(_logits(model, jnp.asarray(toks, jnp.int32)), hf_logits(hf, toks))
    assert err <= TOL, err


@pytest.mark.slow
def test_packed_documents_equal_each_document_alone(unrolled):
    """A row packing three documents (13, 22 and 10 tokens: pools from each
    document's first token, unfinished last pools) gives each document's
    logits alone (training and scoring pack rows so)."""
    model = unrolled[1]
    assert_packed_equals_alone(lambda toks, segments: _logits(
        model, jnp.asarray(toks), None if segments is None else jnp.asarray(segments)))


def test_the_config_reads_as_transformers_does(checkpoint, caplog):
    """Layer, MLP and indexer patterns; the vision tower skipped with one
    line naming it."""
    _, path = checkpoint
    with caplog.at_level(logging.WARNING, logger="gdnx"):
        model = CausalLM.from_pretrained(path)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "skipped the vision tower" in notes[0], notes
    cfg = model.config
    assert cfg.family == "glm5_next" and cfg.rope_theta is None and cfg.mlp_only_layers == [0]
    assert cfg.resolved_layer_types == tuple("full_attention" if t == "indexed_attention" else t for t in LAYERS)
    assert cfg.shared_index_layers == (False,) * 3 + (True, False, False, True)
    assert cfg.linear_gate_lower_bound == -5.0 and cfg.swiglu_limit == 0.8 and cfg.streams == 4
    # transformers' defaults and patterns for what a config.json leaves out
    default = model_config_from_hf({"model_type": "glm5_next", "text_config": {"num_hidden_layers": 8}})
    assert default.resolved_layer_types[3] == "full_attention" and default.mlp_only_layers == [0, 1, 2]
    patterned = model_config_from_hf({"model_type": "glm5_next", "text_config": {
        "num_hidden_layers": 8, "index_topk_pattern": "FFFFFFFS"}})
    assert patterned.shared_index_layers == (False,) * 7 + (True,)


def test_save_pretrained_loads_in_transformers_bit_identical(unrolled, checkpoint, tmp_path, caplog):
    """gdnx -> save_pretrained (carrying the source's vision tower) ->
    transformers: every tensor equals the original's bit for bit, and so do
    the logits. Without vision_from: the language model alone, said once."""
    hf, model = unrolled
    _, source = checkpoint
    model.save_pretrained(tmp_path / "with", vision_from=source)
    back = type(hf).from_pretrained(tmp_path / "with").eval()
    assert_same_model(back, hf)
    with caplog.at_level(logging.WARNING, logger="gdnx"):
        model.save_pretrained(tmp_path / "alone")
    assert [r.getMessage() for r in caplog.records if "without a vision tower" in r.getMessage()]
    assert _file_keys(tmp_path / "alone") == {k for k in _file_keys(source) if not k.startswith("model.visual.")}
    assert _file_keys(tmp_path / "with") == _file_keys(source)


def _file_keys(path) -> set[str]:
    with safe_open(path / "model.safetensors", "np") as f:
        return set(f.keys())


@pytest.mark.parametrize("edit, named", [
    ({"index_topk": 10}, "index_topk: must be a multiple of index_kpool=4, got 10"),
    ({"indexer_types": ["full", "full", "shared", "full", "full", "full", "shared"]},
     "indexer_types: the first attention layer (2) has no full layer before it"),
    ({"qk_rope_head_dim": 4}, "qk_rope_head_dim: glm5_next's latent attention has no rope part"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail: without the query's unfinished pool"),
])
def test_config_mistakes_name_the_field(edit, named):
    assert_config_refused("glm5_next", GLM5_NEXT_TEXT, edit, named)