"""The engine's greedy tokens equal transformers' generate for ragged
prompts, on tiny random models of every family gdnx loads."""

import numpy as np
import pytest
import torch

from gdnx.serving import Engine, SamplingParams
from tests.helpers.hf_models import KINDS, tokens
from tests.helpers.tiers import fast_only


@pytest.mark.parametrize("kind,scanned", fast_only([(kind, False) for kind in KINDS] + [("qwen3_5", True)],
                                              lambda case: case == ("kimi_linear", False)))
def test_ragged_prompts_match_transformers_greedy(hf_checkpoints, kind, scanned):
    # weights scaled up so the next-token distribution is peaked (greedy ties
    # between near-equal logits would be about float noise)
    hf, model = hf_checkpoints.hf_and_gdnx(kind, scale=5.0, scan_layers=scanned, gdn_chunk_size=16)
    prompts = [tokens(1, n, seed=n)[0].tolist() for n in (3, 20, 9, 30)]
    engine = Engine(model, max_slots=4, max_length=48, block_size=16, decode_steps=4)
    out = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, got in zip(prompts, out):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        np.testing.assert_array_equal(got.tokens, ref[0, len(prompt):].numpy())


@pytest.mark.parametrize("batch_invariant", fast_only([False, True], lambda invariant: not invariant))
def test_prompt_logprobs_are_transformers_log_softmax(hf_checkpoints, batch_invariant):
    """prompt_logprobs: each prompt token's log-probability after the ones
    before it and the top N, from the prefill's own pass (whole, or block by
    block in batch-invariant mode: a block's last position scores the next
    block's first token), equal to transformers' log_softmax within 1e-5
    relative (float32); a prompt whose prefix is cached is still prefilled
    whole, so every token gets its logprob."""
    hf, model = hf_checkpoints.hf_and_gdnx("qwen3_next", scale=5.0, gdn_chunk_size=16)
    prompts = [tokens(1, n, seed=n)[0].tolist() for n in (3, 20, 37)]
    prompts.append(prompts[2][:32] + [5, 6])  # its first two blocks cached by the prompt before it
    engine = Engine(model, max_slots=2, max_length=48, block_size=16, decode_steps=4, prefix_cache_bytes=1 << 24,
                    batch_invariant=batch_invariant)
    engine.generate(prompts[2:3], SamplingParams(max_tokens=1, temperature=0.0))  # fills the prefix cache
    out = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))
    for prompt, got in zip(prompts, out):
        assert got.cached_tokens == 0 and got.logprobs is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].double(), dim=-1).numpy()
        want = ref[np.arange(len(prompt) - 1), prompt[1:]]
        lp = np.asarray([x for x, _ in got.prompt_logprobs])
        np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
        for row, (_, top) in zip(ref, got.prompt_logprobs):
            assert list(top) == np.argsort(-row)[:3].tolist()
            np.testing.assert_allclose(list(top.values()), np.sort(row)[::-1][:3], rtol=1e-5, atol=1e-5)



@pytest.fixture(scope="module", params=["glm5_next", "qwen4_exp"])
def sparse_family(hf_checkpoints, request):
    """A family with sparse attention loaded, its prompts (the last sharing
    its first two blocks with the one before) and transformers' greedy
    tokens (through end-of-sequence tokens: Qwen4-Exp's n-grams restart
    after one)."""
    hf, model = hf_checkpoints.hf_and_gdnx(request.param, scale=5.0, gdn_chunk_size=16)
    prompts = [tokens(1, n, seed=n)[0].tolist() for n in (3, 20, 37)]
    prompts.append(prompts[2][:32] + [5, 6, 7])
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        refs.append(ref[0, len(prompt):].numpy())
    return model, prompts, refs


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"prefix_cache_bytes": 1 << 24}, {"draft_method": "ngram", "draft_tokens": 3},
                                      {"batch_invariant": True, "prefix_cache_bytes": 1 << 24}],
                         ids=["prefix-cache", "ngram", "batch-invariant"])
def test_sparse_attention_in_the_engine(sparse_family, settings):
    """GLM-5-Next (a budget of 8 tokens in pools of 4, shared-index layers,
    hyper-connection streams) and Qwen4-Exp (blocks of 4, gated residual
    streams, per-layer n-gram embeddings) in the engine: transformers'
    greedy tokens, with a prefix cache (a second pass restores the
    indexer's per-token entries and block keys with the attention's, and a
    PLE layer's convolution inputs and n-gram context with its GDN states:
    hits, the same tokens), n-gram speculation (a refused draft's block
    keys rebuilt, the PLE states rolled back) and block-by-block prefill."""
    model, prompts, refs = sparse_family
    engine = Engine(model, max_slots=2, max_length=64, block_size=16, decode_steps=4, **settings)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = [engine.generate(prompts, greedy)]
    if settings.get("prefix_cache_bytes"):
        runs.append(engine.generate(prompts[::-1], greedy)[::-1])
        assert sum(c.cached_tokens for c in runs[1]) > 0
    for out in runs:
        for got, ref in zip(out, refs, strict=True):
            np.testing.assert_array_equal(got.tokens, ref)
