"""The engine against the plain path: greedy tokens of `gdnx.generate`,
bit-identical logits in batch-invariant mode (whatever shares the batch,
the slot, a prefix-cache hit), speculative decoding's tokens, every
sampling parameter, requests added mid-run, and its errors.

One tiny hybrid (GDN, attention, GDN, attention; dense MLPs; the batch
invariance test also runs it with MoE MLPs, whose routing groups tokens
across rows) and few engine shapes: max_length 64 in blocks of 16
(prefill buckets 16, 32, 64)."""

import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.config import ModelConfig
from gdnx.generate import generate
from gdnx.measure import relative_error
from gdnx.models import CausalLM
from gdnx.serving import Engine, NgramDrafter, SamplingParams
from tests.helpers.configs import KIMI, LARA, MOE, TINY_HYBRID
from tests.helpers.tiers import fast_only

# one worker runs this module: its module fixtures (the plain path's tokens, compiled per prompt) run once
pytestmark = pytest.mark.xdist_group("engine")

TINY = TINY_HYBRID
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
LENGTHS = (5, 13, 30, 17, 40, 3)


def _engine(model, **kw):
    return Engine(model, **{"max_slots": 4, "max_length": 64, "block_size": 16, "decode_steps": 4, "max_logprobs": 5,
                            "draft_rows": 4, **kw})


@pytest.fixture(scope="module")
def model():
    return CausalLM(ModelConfig(**TINY), seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, TINY["vocab_size"], n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def plain(model, prompts):
    """gdnx.generate's greedy tokens, each prompt alone."""
    return [np.asarray(generate(model, jnp.asarray([p]), GREEDY.max_tokens))[0].tolist() for p in prompts]


def test_ragged_prompts_give_the_plain_greedy_tokens(model, prompts, plain):
    """Six prompts of 3-40 tokens through 4 slots (two wait for a free one),
    prefilled in buckets of 16, 32 and 64."""
    engine = _engine(model)
    out = engine.generate(prompts, GREEDY)
    assert [c.tokens for c in out] == plain
    assert all(c.finish_reason == "length" and c.prompt_tokens == len(p) for c, p in zip(out, prompts))
    names = {name for name, _ in engine.stats.programs}
    assert names == {"prefill", "decode"}
    assert {shape[1] for name, shape in engine.stats.programs if name == "prefill"} <= set(engine.buckets)
    # the decode batch is the first slots that hold every running request: one request alone decodes one row
    assert engine.decode_rows == (1, 4)
    assert {shape[0] for name, shape in engine.stats.programs if name == "decode"} <= {1, 4}
    alone = _engine(model)
    assert alone.generate(prompts[:1], GREEDY)[0].tokens == plain[0]
    assert {shape[0] for name, shape in alone.stats.programs if name == "decode"} == {1}


def test_prompts_shorter_than_a_block_prefill_in_chunk_buckets(model, prompts, plain):
    """Blocks of 32 on a model of 16-token chunks: buckets 16, 32, 64. A
    prompt of under 16 tokens prefills in the 16 bucket (no prefix-cache
    snapshot there), a longer one in whole blocks (snapshotted); a later
    prompt sharing a cached block prefills only its rest, in the 16 bucket:
    the plain greedy tokens throughout."""
    engine = _engine(model, block_size=32, prefix_cache_bytes=1 << 24)
    assert engine.buckets == (16, 32, 64)
    assert _engine(model, block_size=32, max_length=20).buckets == (16, 32)   # no prompt needs more
    out = engine.generate([prompts[0], prompts[4]], GREEDY)          # 5 and 40 tokens
    assert [c.tokens for c in out] == [plain[0], plain[4]]
    assert {shape for name, shape in engine.stats.programs if name == "prefill"} == {(1, 16), (1, 64)}
    hit = prompts[4][:32] + prompts[1][:6]
    again = engine.generate([hit], GREEDY)[0]
    assert again.cached_tokens == 32
    assert again.tokens == np.asarray(generate(model, jnp.asarray([hit]), GREEDY.max_tokens))[0].tolist()


def test_prefix_cache_gives_the_same_tokens_and_logits(model, prompts, plain):
    """Prompts sharing prefixes of 1-2 blocks with earlier ones: only the
    rest is prefilled; greedy tokens identical, logits within 1e-5 of the
    uncached engine's (float32; prefill shapes differ, so rounding may)."""
    shared = prompts[4][:32]
    family = [shared + p[:k] for p, k in zip(prompts, (3, 9, 1, 12, 5, 2))]
    cold = _engine(model, keep_logits=True).generate(family, GREEDY)
    engine = _engine(model, keep_logits=True, prefix_cache_bytes=1 << 24)
    engine.generate([shared + [7]], GREEDY)               # fills two blocks
    warm = engine.generate(family, GREEDY)
    assert [c.cached_tokens for c in warm] == [32] * 6
    assert engine.stats.cached_tokens == 6 * 32
    for c, w in zip(cold, warm):
        assert c.tokens == w.tokens
        np.testing.assert_allclose(w.logits, c.logits, rtol=0, atol=1e-5 * np.abs(c.logits).max())
    assert engine.prefix_cache is not None and 0 < engine.prefix_cache.bytes <= 1 << 24


def test_completions_of_one_prompt_share_its_prefill(model, prompts, plain):
    """Three requests of one 40-token prompt and one of another, submitted
    together: the first is prefilled, the two others wait for its two blocks
    to reach the prefix cache and prefill only the rest; the plain greedy
    tokens throughout."""
    engine = _engine(model, prefix_cache_bytes=1 << 24)
    out = engine.generate([prompts[4]] * 3 + [prompts[1]], GREEDY)
    assert [c.tokens for c in out] == [plain[4]] * 3 + [plain[1]]
    assert [c.cached_tokens for c in out] == [0, 32, 32, 0]


def test_set_weights_runs_on_the_new_weights_without_compiling_again(model, prompts, plain):
    """An engine handed another model's weights gives that model's greedy
    tokens, its prefix cache emptied (its states were the old weights'),
    and compiles no program anew; weights of another structure are refused."""
    from flax import nnx

    other = CausalLM(ModelConfig(**TINY), seed=2)
    engine = _engine(other, prefix_cache_bytes=1 << 24)
    engine.generate(prompts[:3], GREEDY)
    compiled = engine.runner.programs.decode._cache_size()
    engine.set_weights(nnx.state(model))
    assert engine.prefix_cache is not None and len(engine.prefix_cache) == 0
    assert [c.tokens for c in engine.generate(prompts[:3], GREEDY)] == plain[:3]
    assert engine.runner.programs.decode._cache_size() == compiled
    with pytest.raises(ValueError, match="weights: expected the model's state"):
        engine.set_weights({"embed": jnp.zeros(3)})


def test_prefix_cache_evicts_least_recently_used_within_its_bytes(model, prompts):
    engine = _engine(model, prefix_cache_bytes=1 << 24)
    engine.generate([prompts[4]], GREEDY)                  # 40 tokens: 2 full blocks
    per_block = engine.prefix_cache.bytes // 2
    small = _engine(model, prefix_cache_bytes=per_block * 3)
    small.generate([prompts[4], prompts[4][::-1]], GREEDY)  # 2 + 2 blocks: the oldest goes
    assert len(small.prefix_cache) == 3 and small.prefix_cache.bytes <= per_block * 3
    assert small.generate([prompts[4]], GREEDY)[0].cached_tokens == 0  # its first block was evicted


@pytest.mark.parametrize("dtype", fast_only(["float32", "bfloat16"], lambda d: d == "float32"))
def test_batch_invariance_bit_for_bit(prompts, dtype):
    """batch_invariant: one request's logits are bit-identical alone in
    slot 0, behind three others (another slot, other prefill partners), and
    after a prefix-cache hit of two blocks (MoE MLPs: experts see other
    rows' tokens)."""
    model = CausalLM(ModelConfig(**{**TINY, **MOE}, dtype=dtype), seed=1)
    target = prompts[4]                                     # 40 tokens
    engine = _engine(model, batch_invariant=True, keep_logits=True, prefix_cache_bytes=1 << 24,
                     max_prefill_batch=2)
    alone = engine.generate([target], GREEDY)[0]
    assert alone.cached_tokens == 0
    engine.prefix_cache.clear()
    crowded = engine.generate(prompts[:3] + [target] + prompts[5:], GREEDY)[3]
    cached = engine.generate([prompts[1], target], GREEDY)[1]
    assert cached.cached_tokens == 32
    assert alone.tokens == crowded.tokens == cached.tokens
    np.testing.assert_array_equal(alone.logits, crowded.logits)
    np.testing.assert_array_equal(alone.logits, cached.logits)


class _Oracle:
    """Drafts the plain continuation, every third proposal with a wrong token."""
    num_tokens = 3

    def __init__(self, prompts, plain):
        self.known = [(tuple(p), c) for p, c in zip(prompts, plain)]
        self.calls = 0

    def propose(self, tokens):
        self.calls += 1
        for prompt, cont in self.known:
            if tuple(tokens[:len(prompt)]) == prompt:
                draft = list(cont[len(tokens) - len(prompt):][:self.num_tokens])
                if self.calls % 3 == 0 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % TINY["vocab_size"]
                return draft
        return []


@pytest.mark.parametrize("invariant", [False, True])
def test_speculative_greedy_tokens_equal_plain_decoding(model, prompts, plain, invariant):
    engine = _engine(model, speculative=_Oracle(prompts, plain), batch_invariant=invariant)
    out = engine.generate(prompts, GREEDY)
    assert [c.tokens for c in out] == plain
    stats = engine.stats
    assert 0.3 < stats.acceptance < 1.0                      # right and wrong drafts both seen
    assert stats.verify_calls < stats.generated_tokens / 2   # more than two tokens per pass


def test_ngram_drafter_keeps_the_plain_tokens(model, plain, prompts):
    # the prompt ends as it began: the drafter proposes what followed the first time
    looped = [p + c + p for p, c in ((prompts[0], plain[0]), (prompts[5], plain[5]))]
    ref = [np.asarray(generate(model, jnp.asarray([p]), 8))[0].tolist() for p in looped]
    engine = _engine(model, speculative=NgramDrafter(num_tokens=4))
    assert [c.tokens for c in engine.generate(looped, GREEDY)] == ref
    assert engine.stats.drafted_tokens > 0


def test_seeded_sampling_does_not_depend_on_the_other_requests(model, prompts):
    p = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=1234)
    engine = _engine(model, batch_invariant=True)
    alone = engine.generate([prompts[1]], p)[0].tokens
    mixed = engine.generate([prompts[3], prompts[1], prompts[0]],
                            [SamplingParams(max_tokens=5, temperature=1.0), p, GREEDY])[1].tokens
    assert alone == mixed
    other = engine.generate([prompts[1]], SamplingParams(**{**p.__dict__, "seed": 99}))[0].tokens
    assert other != alone


def test_sampling_parameters_each_act(model, prompts, plain):
    engine = _engine(model, eos_token_ids=[plain[0][2]], keep_logits=True, tokenizer=_Digits())
    one = lambda **kw: engine.generate([prompts[0]], SamplingParams(**{"temperature": 0.0, **kw}))[0]  # noqa: E731
    # end of sequence: the greedy third token ends it, unless ignored or held back by min_tokens
    assert one(max_tokens=8).tokens == plain[0][:3] and one(max_tokens=8).finish_reason == "stop"
    assert one(max_tokens=8, ignore_eos=True).tokens == plain[0]
    assert len(one(max_tokens=8, min_tokens=5).tokens) >= 5
    assert one(max_tokens=8, ignore_eos=True, stop_token_ids=[plain[0][1]]).tokens == plain[0][:2]
    # a stop string ends the text before it (the tokens up to the one that completed it)
    stop = str(plain[0][4])
    got = one(max_tokens=8, ignore_eos=True, stop=[f" {stop} "])
    assert got.finish_reason == "stop" and f" {stop} " not in got.text
    # top_k=1 and a tiny top_p are greedy at any temperature
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert one(max_tokens=8, ignore_eos=True, temperature=1.5, seed=3, **kw).tokens == plain[0]
    # penalties: a strong repetition penalty avoids every token seen so far
    rep = one(max_tokens=8, ignore_eos=True, repetition_penalty=100.0).tokens
    assert all(t not in prompts[0] + rep[:i] for i, t in enumerate(rep))
    # logprobs: the drawn token's and the top 3, from the logits
    got = one(max_tokens=4, ignore_eos=True, logprobs=3, presence_penalty=0.5, frequency_penalty=0.5)
    for (chosen, top), logits, tok in zip(got.logprobs, got.logits, got.tokens):
        assert len(top) == 3 and max(top, key=top.get) == tok and abs(top[tok] - chosen) < 1e-6


class _Digits:
    def decode(self, ids):
        return "".join(f" {int(i)} " for i in ids)


def test_requests_added_while_others_run(model, prompts, plain):
    engine = _engine(model, max_slots=2)
    first = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    got: dict[int, list[int]] = {}
    events = engine.step() + engine.step()
    later = [engine.add_request(p, GREEDY) for p in prompts[2:4]]
    while not engine.can_admit:  # the later ones wait for a slot
        events += engine.step()
    admitted = engine.step(decode=False)  # a prefill only: the admitted requests' first tokens, nobody else's
    got_one = {e.request_id: len(e.tokens) for e in admitted if e.tokens}
    assert got_one and set(got_one) <= set(later) and set(got_one.values()) == {1}
    events += admitted
    while engine.has_unfinished():
        events += engine.step()
    for e in events:
        got.setdefault(e.request_id, []).extend(e.tokens)
    assert [got[i] for i in first + later] == plain[:4]


def test_streaming_yields_the_tokens_as_they_come(model, prompts, plain):
    engine = _engine(model)
    pieces: dict[int, list[int]] = {}
    for rid, toks in engine.stream(prompts[:3], GREEDY):
        pieces.setdefault(rid, []).extend(toks)
    assert list(pieces.values()) == plain[:3]


@pytest.mark.parametrize("prompt,params,match", [
    ([], GREEDY, "prompt: expected at least one token"),
    (list(range(60)) + [1, 2, 3, 4], GREEDY, "prompt: 64 tokens"),
    (list(range(60)), GREEDY, "max_tokens: the prompt's 60 tokens"),
    ([1, 99], GREEDY, r"prompt: token ids must be in \[0, 61\)"),
    ([1, 2], SamplingParams(logprobs=9), "logprobs"),
    ([1, 2], SamplingParams(stop=["x"]), "stop: stop strings"),
])
def test_a_bad_request_is_refused_and_the_engine_keeps_serving(model, prompts, plain, prompt, params, match):
    engine = _engine(model)
    ok = engine.add_request(prompts[0], GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    out = []
    while engine.has_unfinished():
        out += [e for e in engine.step() if e.completion is not None]
    assert [e.request_id for e in out] == [ok] and out[0].completion.tokens == plain[0]


def test_generate_names_the_bad_prompt_before_running_any(model, prompts):
    engine = _engine(model)
    with pytest.raises(ValueError, match=r"prompts\[1\]\.prompt: expected at least one token"):
        engine.generate([prompts[0], []], GREEDY)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kw,match", [({"block_size": 24}, "block_size"), ({"max_slots": 0}, "max_slots"),
                                      ({"max_prefill_batch": 9}, "max_prefill_batch"),
                                      ({"speculative": 3}, "speculative")])
def test_bad_engine_settings(model, kw, match):
    with pytest.raises(ValueError, match=match):
        _engine(model, **kw)


def test_a_hit_whose_rest_would_overflow_the_cache_is_recomputed(model, prompts):
    """max_length 64 (buckets 16, 32, 64): a 50-token prompt with its first
    block cached would prefill 34 tokens in the 64 bucket past the cache's
    end; the engine prefills it whole instead, with the plain tokens."""
    long = (prompts[4] + prompts[2])[:50]
    engine = _engine(model, prefix_cache_bytes=1 << 24)
    engine.generate([long[:17]], GREEDY)
    got = engine.generate([long], GREEDY)[0]
    assert got.cached_tokens == 0
    assert got.tokens == np.asarray(generate(model, jnp.asarray([long]), 8))[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["scanned", "kimi_linear", "lara_mini"])
def test_scanned_layers_with_prefix_cache_speculation_and_invariance(prompts, layout):
    """A scanned stack (a head layer, 2 repeats of a GDN + attention cycle
    whose cache entries hold the repeats first, a tail layer), Kimi Linear's (KDA states, latent
    attention's latents; MoE) and Lara 4 Mini's (a sliding window of 5
    tokens in a ring: hits restore it, rejected drafts wrap it): cached
    prefixes, drafts and the batch-invariant mode give the plain tokens, and
    a hit the miss's bits. A sliding window's hit attends over its restored
    ring, the miss over the prompt's own keys: the same keys in another
    order, so there the logits agree to float32 rounding (1e-6 relative),
    and its batch invariance is checked bit for bit without the prefix
    cache (the batch in another order)."""
    if layout == "scanned":  # a GDN layer (the head), 2 repeats of (GDN, attention), a GDN layer (the tail)
        model = CausalLM(ModelConfig(**{**TINY, "num_hidden_layers": 6, "layer_types": [
            "linear_attention", *["linear_attention", "full_attention"] * 2, "linear_attention"]}, scan_layers=True),
            seed=1)
        assert model.config.scanned and (len(model.head), len(model.cycle), len(model.tail)) == (1, 2, 1)
    else:
        model = CausalLM(ModelConfig(**{**TINY, **MOE, **(KIMI if layout == "kimi_linear" else LARA)}), seed=1)
    some = prompts[1:5]
    plain = [np.asarray(generate(model, jnp.asarray([p]), 8))[0].tolist() for p in some]
    engine = _engine(model, prefix_cache_bytes=1 << 24, speculative=_Oracle(some, plain), batch_invariant=True,
                     keep_logits=True)
    first = engine.generate(some, GREEDY)
    again = engine.generate(some[::-1], GREEDY)[::-1]
    assert [c.tokens for c in first] == [c.tokens for c in again] == plain
    assert [c.cached_tokens for c in again] == [0, 16, 16, 32]
    assert engine.stats.accepted_tokens > 0
    for a, b in zip(first, again):
        if layout == "lara_mini":
            assert relative_error(b.logits, a.logits) <= 1e-6
        else:
            np.testing.assert_array_equal(a.logits, b.logits)
    if layout == "lara_mini":
        alone = _engine(model, speculative=_Oracle(some, plain), batch_invariant=True,
                        keep_logits=True).generate(some[::-1], GREEDY)[::-1]
        for a, b in zip(first, alone):
            np.testing.assert_array_equal(a.logits, b.logits)


@pytest.mark.slow
def test_warm_up_compiles_every_decode_batch_and_changes_no_result(model, prompts, plain):
    engine = _engine(model, speculative=NgramDrafter(num_tokens=2))
    engine.warm_up()
    assert {(name, s) for name, s in engine.stats.programs if name in ("decode", "verify")} == {
        ("decode", (1, 4)), ("decode", (4, 4)), ("verify", (1, 2)), ("verify", (4, 2))}
    assert [c.tokens for c in engine.generate(prompts[:3], GREEDY)] == plain[:3]
    engine.add_request(prompts[0], GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="warm_up: requests are running"):
        engine.warm_up()


def test_abort_a_waiting_and_a_running_request_and_the_rest_run_on(model, prompts, plain):
    from gdnx.serving.request import RequestStatus

    engine = _engine(model)
    ids = [engine.add_request(p, GREEDY) for p in prompts]    # 4 slots: two wait
    engine.step()
    S = RequestStatus
    assert [engine.status(i) for i in ids] == [S.RUNNING] * 4 + [S.WAITING] * 2
    engine.abort(ids[1])
    engine.abort(ids[5])
    assert engine.status(ids[1]) is engine.status(ids[5]) is None
    assert engine.running == 3 and engine.waiting == 1
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    done = {}
    while engine.has_unfinished():
        for e in engine.step():
            tokens[e.request_id] += e.tokens
            if e.completion is not None:
                done[e.request_id] = e.completion.tokens
    assert sorted(done) == [ids[0], ids[2], ids[3], ids[4]]
    assert all(done[ids[i]] == plain[i] for i in (0, 2, 3, 4))
    engine.abort(ids[0])  # done: ignored


def test_a_failure_of_one_requests_host_work_fails_it_alone(model, prompts, plain):
    """Host work done for one request (the drafter on its context, the
    tokenizer on its tokens) that raises fails that request with an error
    event; the others' tokens are those of the plain path."""
    from gdnx.serving import RequestFailed

    class Faulty(_Oracle):
        def propose(self, tokens):
            if tuple(tokens[:len(prompts[2])]) == tuple(prompts[2]) and len(tokens) > len(prompts[2]) + 2:
                raise RuntimeError("injected drafter failure")
            return super().propose(tokens)

    class Tokenizer:
        def decode(self, ids):
            if 13 in ids:  # one request's token
                raise UnicodeDecodeError("utf-8", b"", 0, 1, "injected")
            return " ".join(map(str, ids))

    for engine, bad in ((_engine(model, speculative=Faulty(prompts, plain)), {2}),
                        (_engine(model, tokenizer=Tokenizer()), {i for i, c in enumerate(plain) if 13 in c})):
        assert bad and len(bad) < len(prompts)
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        done, failed = {}, {}
        while engine.has_unfinished():
            for e in engine.step():
                if e.error is not None:
                    failed[e.request_id] = e.error
                elif e.completion is not None:
                    done[e.request_id] = e.completion.tokens
        assert sorted(failed) == sorted(ids[i] for i in bad)
        assert all(done[ids[i]] == plain[i] for i in range(len(prompts)) if i not in bad)
        assert engine.running == 0
        with pytest.raises(RequestFailed, match="injected"):
            engine.generate([prompts[next(iter(bad))]], GREEDY)


def test_warm_up_stops_short_of_the_hosts_memory_map_limit(model, monkeypatch):
    """On CPU each compiled program maps its kernels' code; near vm.max_map_count warm_up stops with a clear
    error (XLA would abort mid-compile), before compiling anything more."""
    from gdnx.serving import runner

    monkeypatch.setattr(runner, "memory_maps", lambda: (60000, 65530))
    with pytest.raises(runner.TooManyPrograms, match="after 0 programs this process holds 60,000 of the "
                                                            "host's 65,530 memory maps"):
        _engine(model).warm_up()
    monkeypatch.setattr(runner, "memory_maps", lambda: None)   # not Linux: no check
    assert _engine(model).warm_up(prefill=False) == 2  # decode at 1 and 4 rows
