"""Sparse-attention indexers and the attention layers around them against
transformers' own modules (random weights, float32): GLM-5-Next's pooled DSA
indexer and its MLA layer (full and shared-index), Qwen4-Exp's QSA indexer
and its gated attention. Contexts run past the index budget so the selection
really selects, end inside an unfinished pool (the tail), and the GLM
indexer runs with and without the tail. Selections must equal transformers'
token for token; outputs within 1e-5 relative (the same operations in
another order). With a cache, a prefill, a 3-token call across a pool
boundary (two pools' keys rebuilt) and one-token steps (the gathered path:
each step reads only its selected rows) give the one-call outputs."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gdnx.layers.rope import rope_tables
from gdnx.layers.sparse_attention import IndexedGatedAttention, IndexedLatentAttention, IndexedKVCache, \
    IndexedLatentCache
from gdnx.layers.attention import KVCache
from gdnx.layers.latent_attention import LatentCache
from gdnx.layers.sparse_index import IndexCache, selection_indices, selection_mask
from gdnx.measure import relative_error

H, B, T = 32, 2, 23  # 23 tokens: 5 full pools of 4 and a tail of 3; the budget keeps 2 pools
POOL, BUDGET, CAPACITY = 4, 8, 32
# many index heads: a pool all of whose heads score <= 0 scores exactly 0, and
# transformers breaks such ties in an order of its own (gdnx: the lower pool)
IDX_HEADS = 16


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _copy(theirs: torch.nn.Module, ours: nnx.Module) -> None:
    """transformers' parameters into ours by name (linear weights
    transposed into kernels)."""
    for name, p in theirs.named_parameters():
        *path, leaf = name.split(".")
        obj = ours
        for part in path:
            obj = getattr(obj, part)
        value = jnp.asarray(p.detach().numpy())
        if isinstance(obj, nnx.Linear) and leaf == "weight":
            obj.kernel[...] = value.T
        else:
            getattr(obj, leaf)[...] = value


@nnx.jit
def _step(layer, x, rope, positions, cache, start, **kw):
    """One call of a layer (a cache or None, its start), compiled: a step's
    shapes repeat, and a compiled call beats the ops one by one."""
    return layer(x, rope, positions, cache, start, **kw)


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((B, T, H)).astype(np.float32)


def _as_mask(indices: np.ndarray, length: int) -> np.ndarray:
    """transformers' token indices [B, T, K] (-1: none) as [B, T, length]."""
    mask = np.zeros((*indices.shape[:2], length + 1), bool)
    np.put_along_axis(mask, np.where(indices >= 0, indices, length), True, axis=-1)
    return mask[..., :length]


def _glm_config(tail: bool = True):
    config = transformers.Glm5NextTextConfig(
        hidden_size=H, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=6, index_n_heads=IDX_HEADS, index_head_dim=8,
        index_kpool=POOL, index_topk=BUDGET, index_kpool_always_select_tail=tail, num_hidden_layers=2,
        layer_types=["indexed_attention"] * 2, indexer_types=["full", "shared"])
    config._attn_implementation = "eager"
    return config


def _glm_ours(shared: bool = False, tail: bool = True, absorb: bool = True) -> IndexedLatentAttention:
    return IndexedLatentAttention(H, num_heads=2, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                  qk_rope_head_dim=0, v_head_dim=6, bias=False, norm_eps=1e-5, absorb=absorb,
                                  index_heads=IDX_HEADS, index_head_dim=8, block=POOL, budget=BUDGET, tail=tail,
                                  shared=shared, init_std=0.02, dtype=jnp.float32, param_dtype=jnp.float32,
                                  rngs=nnx.Rngs(0))


@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no-tail"])
def test_pooled_indexer_selects_as_glm5_next(tail):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    theirs = Glm5NextTextAttention(_glm_config(tail), 0)
    _randomize(theirs, 1)
    ours = _glm_ours(tail=tail)
    _copy(theirs, ours)
    x = _x(1)
    with torch.no_grad():
        resid = theirs.q_a_layernorm(theirs.q_a_proj(torch.tensor(x)))
        indices = theirs.indexer(torch.tensor(x), resid, torch.ones(B, T, dtype=torch.bool), None).numpy()
    assert ours.indexer is not None
    sel, _ = ours.indexer(jnp.asarray(x), jnp.asarray(resid.numpy()), jnp.arange(T))
    want = _as_mask(indices, T)
    np.testing.assert_array_equal(np.asarray(selection_mask(sel, T, POOL, tail)), want)
    # the budget bites: past 2 pools + a tail, queries read fewer tokens than they see
    assert want.sum(-1).max() == BUDGET + (POOL - 1 if tail else 0) and want[:, -1].sum() < T
    rows, valid = selection_indices(sel, POOL, tail)
    np.testing.assert_array_equal(_as_mask(np.where(np.asarray(valid), np.asarray(rows), -1), T), want)


@pytest.mark.slow
def test_indexed_latent_attention_matches_glm5_next():
    """A full layer, then a shared-index layer on its selection."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    config = _glm_config()
    full, shared = Glm5NextTextAttention(config, 0), Glm5NextTextAttention(config, 1)
    _randomize(full, 2)
    _randomize(shared, 3)
    ours_full, ours_shared = _glm_ours(), _glm_ours(shared=True)
    _copy(full, ours_full)
    _copy(shared, ours_shared)
    x = _x(2)
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        y1, _, topk = full(torch.tensor(x), mask)
        y2, _, _ = shared(torch.tensor(x), mask, prev_topk_indices=topk)
    got1, _, sel = ours_full(jnp.asarray(x), None, jnp.arange(T))
    got2, _, _ = ours_shared(jnp.asarray(x), None, jnp.arange(T), selection=sel)
    assert relative_error(got1, y1.numpy()) <= 1e-5
    assert relative_error(got2, y2.numpy()) <= 1e-5
    with pytest.raises(ValueError, match="selection"):
        ours_shared(jnp.asarray(x), None, jnp.arange(T))


def _latent_cache(layer: IndexedLatentAttention) -> IndexedLatentCache:
    index = None if layer.indexer is None else IndexCache(*(jnp.zeros((B, CAPACITY, 8)) for _ in range(3)))
    return IndexedLatentCache.of(LatentCache(jnp.zeros((B, CAPACITY, 12)), jnp.zeros((B, CAPACITY, 0))), index)


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_indexed_latent_attention_steps_equal_one_call(absorb):
    """Prefill 10 tokens, 3 more, then one token a step (each step gathers
    its 11 selected rows of the 32-slot cache), a shared layer beside: the
    one-call outputs."""
    full, shared = _glm_ours(absorb=absorb), _glm_ours(shared=True, absorb=absorb)
    rng = np.random.default_rng(4)
    for layer in (full, shared):
        for _, p in nnx.iter_graph(layer):
            if isinstance(p, nnx.Param):
                p[...] = jnp.asarray(0.3 * rng.standard_normal(p.shape), jnp.float32)
    x = jnp.asarray(_x(5))
    want1, _, sel = full(x, None, jnp.arange(T))
    want2, _, _ = shared(x, None, jnp.arange(T), selection=sel)
    c1, c2 = _latent_cache(full), _latent_cache(shared)
    got1, got2 = [], []
    for a, z in [(0, 10), (10, 13)] + [(i, i + 1) for i in range(13, T)]:
        y1, c1, sel = _step(full, x[:, a:z], None, jnp.arange(a, z), c1, jnp.int32(a))
        y2, c2, _ = _step(shared, x[:, a:z], None, jnp.arange(a, z), c2, jnp.int32(a), selection=sel)
        got1.append(y1)
        got2.append(y2)
    assert relative_error(jnp.concatenate(got1, 1), want1) <= 1e-5
    assert relative_error(jnp.concatenate(got2, 1), want2) <= 1e-5


QSA_HEADS, QSA_DIM, HEAD_DIM = 16, 8, 8


def _qwen_config():
    config = transformers.Qwen4ExpTextConfig(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, indexer_n_heads=QSA_HEADS,
        indexer_kv_heads=1, indexer_head_dim=QSA_DIM, indexer_budget=BUDGET, indexer_compress_ratio=POOL,
        num_hidden_layers=1, layer_types=["indexed_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    config._attn_implementation = "eager"
    return config


def _qwen_ours() -> IndexedGatedAttention:
    return IndexedGatedAttention(H, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, bias=False, norm_eps=1e-6,
                                 index_heads=QSA_HEADS, index_head_dim=QSA_DIM, block=POOL, budget=BUDGET,
                                 theta=10000.0, rotary_dim=HEAD_DIM // 2, init_std=0.02, dtype=jnp.float32,
                                 param_dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_indexed_gated_attention_matches_qwen4_exp():
    """The QSA selection token for token, then the layer's output; and the
    same through a cache, prefilled then stepped (gathered rows)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention, Qwen4ExpTextRotaryEmbedding

    config = _qwen_config()
    theirs = Qwen4ExpTextAttention(config, 0)
    _randomize(theirs, 6)
    ours = _qwen_ours()
    _copy(theirs, ours)
    x = _x(6)
    pos = torch.arange(T)[None].expand(B, -1)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None].expand(B, 1, T, T)
    float_mask = torch.zeros(B, 1, T, T).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.no_grad():
        pe = Qwen4ExpTextRotaryEmbedding(config)(torch.tensor(x), pos)
        want_sel = theirs.indexer(torch.tensor(x), pe, causal, None)[:, 0].numpy()
        want, _ = theirs(torch.tensor(x), pe, float_mask)
    sel, _ = ours.indexer(jnp.asarray(x), jnp.arange(T))
    np.testing.assert_array_equal(np.asarray(selection_mask(sel, T, POOL, True)), want_sel)
    assert want_sel[:, -1].sum() < T  # past the budget the selection drops tokens
    rope = rope_tables(jnp.arange(T)[None], HEAD_DIM // 2, 10000.0)
    got, _ = ours(jnp.asarray(x), rope, jnp.arange(T))
    assert relative_error(got, want.numpy()) <= 1e-5
    cache = IndexedKVCache.of(KVCache(jnp.zeros((B, CAPACITY, 2, HEAD_DIM)), jnp.zeros((B, CAPACITY, 2, HEAD_DIM))),
                           IndexCache(jnp.zeros((B, CAPACITY, QSA_DIM)), None, jnp.zeros((B, CAPACITY, QSA_DIM))))
    steps = []
    for a, z in [(0, 10), (10, 13)] + [(i, i + 1) for i in range(13, T)]:
        y, cache = _step(ours, jnp.asarray(x[:, a:z]), rope_tables(jnp.arange(a, z)[None], HEAD_DIM // 2, 10000.0),
                         jnp.arange(a, z), cache, jnp.int32(a))
        steps.append(y)
    assert relative_error(jnp.concatenate(steps, 1), want.numpy()) <= 1e-5


def test_qsa_packed_documents_equal_each_document_alone():
    """Qwen4-Exp's layer over a row packing two documents (17 and 14
    tokens; blocks from each document's first token, rotated at their
    positions in it): each document's output alone."""
    ours = _qwen_ours()
    rng = np.random.default_rng(7)
    for _, p in nnx.iter_graph(ours):
        if isinstance(p, nnx.Param):
            p[...] = jnp.asarray(0.3 * rng.standard_normal(p.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 31, H)), jnp.float32)
    segments = jnp.asarray(np.repeat([0, 1], [17, 14])[None], jnp.int32)
    doc_pos = jnp.concatenate([jnp.arange(17), jnp.arange(14)])[None]
    packed, _ = _step(ours, x, rope_tables(doc_pos, HEAD_DIM // 2, 10000.0), jnp.arange(31), None, 0,
                      segments=segments)
    for a, z in ((0, 17), (17, 31)):
        alone, _ = _step(ours, x[:, a:z], rope_tables(jnp.arange(z - a)[None], HEAD_DIM // 2, 10000.0),
                         jnp.arange(z - a), None, 0)
        assert relative_error(packed[:, a:z], alone) <= 1e-5
