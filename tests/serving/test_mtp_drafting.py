"""The multi-token prediction module as the engine's drafter
(draft_method="mtp"): greedy tokens equal to the plain engine's in every
mode (one or chained drafts, the prefix cache, block-by-block prefill in
batch-invariant mode, constrained requests beside free ones), and every
draft the engine proposes is the module's own prediction: the argmax of
its teacher-forced logits (CausalLM.mtp_logits, checked against
transformers' pieces in tests/models/test_mtp.py) at the row's last kept
position over the sequence as it then stood. So the module's cache follows
the kept tokens exactly: a refused draft leaves no trace, a prefix-cache
hit or the next block of a prompt continues it, a decode call keeps it.

The model: the tiny hybrid with an MTP module, trained here for a few
seconds on counting sequences, so that drafts are mostly accepted and the
accepted path runs (a random module's drafts are all refused)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.config import ModelConfig
from gdnx.errors import FieldError
from gdnx.models import CausalLM
from gdnx.serving import Engine, SamplingParams
from gdnx.serving.request import RequestStatus
from tests.helpers.configs import TINY_HYBRID
from tests.helpers.mtp import progressions, trained_mtp_model

pytestmark = pytest.mark.xdist_group("mtp")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SETTINGS = dict(max_slots=4, max_length=64, block_size=16, decode_steps=4, max_logprobs=5, draft_rows=4)


@pytest.fixture(scope="module")
def model():
    return trained_mtp_model(TINY_HYBRID, steps=120, learning_rate=6e-3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    vocab = TINY_HYBRID["vocab_size"]
    counting = [progressions(rng, 1, n, vocab)[0].tolist() for n in (5, 30, 17, 40, 3)]
    # one that does not count; two that share their first block with the 30-token one (prefix-cache hits)
    return counting + [rng.integers(0, vocab, 13).tolist(), counting[1][:16] + [7, 9], counting[1][:20]]


@pytest.fixture(scope="module")
def plain(model, prompts):
    return [c.tokens for c in Engine(model, **SETTINGS).generate(prompts, GREEDY)]


def _run(engine, prompts, params):
    """Step `engine` over `prompts` to the end: (each request's tokens,
    (request index, sequence so far, the engine's first draft) after each
    step for every decoding request)."""
    ids = [engine.add_request(p, p_) for p, p_ in zip(prompts, params if isinstance(params, list)
                                                      else [params] * len(prompts), strict=True)]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    drafts = []
    while engine.has_unfinished():
        for event in engine.step():
            tokens[event.request_id] += event.tokens
        for i, rid in enumerate(ids):
            req = engine.scheduler.get(rid)
            running = req is not None and req.status is RequestStatus.RUNNING
            proposal = engine._mtp_proposals.get(req.held_slot) if running else None
            if proposal:
                drafts.append((i, req.prompt + req.tokens, proposal[0]))
    return [tokens[i] for i in ids], drafts


def _check_drafts(model, prompts, outputs, drafts):
    """Every recorded first draft is the module's teacher-forced argmax at
    the sequence's last kept position (its token after the next)."""
    full = [p + o for p, o in zip(prompts, outputs, strict=True)]
    width = max(map(len, full))
    batch = np.zeros((len(full), width), np.int32)
    for i, seq in enumerate(full):
        batch[i, :len(seq)] = seq  # right-padded: causal, so the padding changes no earlier position
    predicted = np.argmax(np.asarray(model.mtp_logits(jnp.asarray(batch))), axis=-1)  # [B, T - 1]
    assert drafts
    for i, seq, draft in drafts:
        assert full[i][:len(seq)] == seq
        assert draft == predicted[i, len(seq) - 2], (i, len(seq))


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(draft_tokens=1),
    dict(draft_tokens=3),
    dict(draft_tokens=2, prefix_cache_bytes=1 << 22),
    dict(draft_tokens=2, batch_invariant=True, max_prefill_batch=2),
], ids=["one", "chained", "prefix-cache", "batch-invariant"])
def test_mtp_drafts_keep_the_plain_tokens_and_are_the_modules_predictions(model, prompts, plain, settings):
    engine = Engine(model, **SETTINGS, draft_method="mtp", **settings)
    out, drafts = _run(engine, prompts, GREEDY)
    assert out == plain
    if settings.get("prefix_cache_bytes"):  # again, the shared blocks (and the first run's prompts) now cached
        again, more = _run(engine, prompts[::-1], GREEDY)
        assert again[::-1] == plain and engine.stats.cached_tokens > 0
        _check_drafts(model, prompts[::-1], again, more)
    _check_drafts(model, prompts, out, drafts)
    s = engine.stats
    assert s.verify_calls > 0 and len(s.drafted_at) == settings["draft_tokens"]
    assert s.acceptance_at()[0] >= 0.7  # the trained module's first drafts are mostly taken


@pytest.mark.slow
def test_batch_invariant_mtp_drafting_is_bit_identical_alone_and_in_company(model, prompts):
    settings = dict(SETTINGS, draft_method="mtp", draft_tokens=2, batch_invariant=True, keep_logits=True,
                    prefix_cache_bytes=1 << 22)
    alone = Engine(model, **settings).generate([prompts[1]], GREEDY)[0]
    company = Engine(model, **settings).generate(prompts, GREEDY)[1]
    assert alone.tokens == company.tokens
    assert np.array_equal(np.asarray(alone.logits), np.asarray(company.logits))


@pytest.mark.slow
def test_constrained_requests_decode_and_keep_the_drafter_in_step(tmp_path):
    """A constrained request draws one token per decode call (the host
    masks each next one), and while it runs no request drafts: the module's
    cache follows those decode calls, so every draft before, during and
    after it is still the module's prediction, and every request gets the
    plain engine's tokens. An untrained module over a tokenizer's
    vocabulary: its drafts are mostly refused, which the cache survives too."""
    from gdnx.data.text import HFTokenizer
    from gdnx.serving.grammar import Grammars
    from gdnx.serving.params import Structured
    from tests.helpers.hf_models import BPE_VOCAB, write_bpe_tokenizer

    write_bpe_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    grammars = Grammars((tmp_path / "tokenizer.json").read_text(), BPE_VOCAB, eos_id=0)
    model = CausalLM(ModelConfig(**{**TINY_HYBRID, "vocab_size": BPE_VOCAB, "mtp_num_layers": 1}), seed=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, BPE_VOCAB, n).tolist() for n in (6, 20, 11)]
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=0.0, structured=Structured("choice", ("yes", "no"))),
              SamplingParams(max_tokens=16, temperature=0.0)]

    def engine(**kw):
        return Engine(model, **SETTINGS, tokenizer=tok, eos_token_ids=[0], grammars=grammars, **kw)
    want, _ = _run(engine(), prompts, params)
    drafting = engine(draft_method="mtp", draft_tokens=2)
    out, drafts = _run(drafting, prompts, params)
    assert out == want and tok.decode(out[1]).removesuffix(tok.decode([0])) in ("yes", "no")
    assert drafting.stats.decode_calls > 0 and drafting.stats.verify_calls > 0
    _check_drafts(model, prompts, out, drafts)


@pytest.mark.slow
def test_under_load_the_engine_decodes_plainly_and_drafts_again_for_new_requests(model, prompts, plain):
    """draft_rows=1: three requests decode together (4 rows) without a
    verify pass and without the module (no drafts for them from then on);
    a request alone afterwards drafts again, with the module's predictions."""
    engine = Engine(model, **{**SETTINGS, "draft_rows": 1}, draft_method="mtp", draft_tokens=2)
    out, drafts = _run(engine, prompts[:3], GREEDY)
    assert out == plain[:3] and engine.stats.verify_calls == 0 and engine.stats.decode_calls > 0
    alone, more = _run(engine, prompts[3:4], GREEDY)
    assert alone == plain[3:4] and engine.stats.verify_calls > 0
    _check_drafts(model, prompts[3:4], alone, more)


def test_mtp_drafting_is_refused_without_the_module_or_drafts():
    bare = CausalLM(ModelConfig(**TINY_HYBRID), seed=0)
    with pytest.raises(FieldError, match="draft_method: mtp: this model has no multi-token prediction module"):
        Engine(bare, **SETTINGS, draft_method="mtp", draft_tokens=1)
    with pytest.raises(FieldError, match="draft_tokens: the multi-token prediction drafter drafts at least one"):
        Engine(bare, **SETTINGS, draft_method="mtp")
    with pytest.raises(FieldError, match="draft_method: expected one of ngram, mtp, got 'eagle'"):
        Engine(bare, **SETTINGS, draft_method="eagle", draft_tokens=1)
