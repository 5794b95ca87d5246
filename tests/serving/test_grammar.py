"""Structured outputs on a random tiny model with a byte-level BPE
vocabulary, so that only the constraint makes an output valid: every
sampled output under a JSON schema parses and validates (jsonschema),
regex, choice and Lark outputs match, an output that cannot complete in
max_tokens ends with "length", an unconstrained request beside
constrained ones gets the tokens it gets alone, and a bad constraint is a
FieldError naming its field."""

import json
import re

import jsonschema
import numpy as np
import pytest

from gdnx.config import ModelConfig
from gdnx.data.text import HFTokenizer
from gdnx.models import CausalLM
from gdnx.serving import Engine, NgramDrafter, SamplingParams
from gdnx.serving.grammar import Grammars
from gdnx.serving.params import Structured
from gdnx.errors import FieldError
from tests.helpers.configs import TINY_HYBRID
from tests.helpers.hf_models import BPE_VOCAB, write_bpe_tokenizer
from tests.helpers.serving import SCHEMA

pytestmark = pytest.mark.xdist_group("grammar")

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(path)
    tok = HFTokenizer(str(path / "tokenizer.json"))
    model = CausalLM(ModelConfig(**{**TINY_HYBRID, "vocab_size": BPE_VOCAB}), seed=3)
    grammars = Grammars((path / "tokenizer.json").read_text(), BPE_VOCAB, eos_id=0)
    return model, tok, grammars


def _engine(setup, **kw):
    model, tok, grammars = setup
    return Engine(model, max_slots=4, max_length=96, block_size=16, decode_steps=4, tokenizer=tok,
                  eos_token_ids=[0], grammars=grammars, draft_rows=4, **kw)


def test_sampled_outputs_follow_each_kind_of_constraint(setup):
    engine = _engine(setup, speculative=NgramDrafter(2), prefix_cache_bytes=1 << 22)
    prompt = [5, 6, 7, 8]
    kinds = {
        "json": (Structured("json", json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        "regex": (Structured("regex", "[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        "choice": (Structured("choice", ("yes", "no", "maybe")), lambda t: t in ("yes", "no", "maybe")),
        "grammar": (Structured("grammar", 'start: "(" D ("+" D)* ")"\nD: /[0-9]/'),
                    lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t)),
    }
    for name, (structured, valid) in kinds.items():
        params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=structured, logprobs=1)
                  for s in range(6)]
        for c in engine.generate([prompt] * len(params), params):
            assert c.finish_reason == "stop", (name, c.text)
            assert valid(c.text), (name, c.text)
            assert c.tokens[-1] == 0  # the end of sequence, once the constraint was complete
            assert all(np.isfinite(lp) for lp, _ in c.logprobs)  # only allowed tokens were drawn


def test_an_unconstrained_request_is_unchanged_by_constrained_neighbours(setup):
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = _engine(setup).generate([[9, 10, 11]], plain)[0]
    json_params = SamplingParams(max_tokens=30, temperature=1.0, seed=1,
                                 structured=Structured("json", json.dumps(SCHEMA)))
    got = _engine(setup).generate([[1, 2], [9, 10, 11], [3]], [json_params, plain, json_params])
    assert got[1].tokens == alone.tokens
    assert alone.tokens != got[0].tokens


def test_an_output_that_cannot_complete_ends_with_length(setup):
    c = _engine(setup).generate([[4]], SamplingParams(max_tokens=3, temperature=0.0,
                                                      structured=Structured("json", json.dumps(SCHEMA))))[0]
    assert c.finish_reason == "length" and len(c.tokens) == 3 and c.text.startswith("{")


@pytest.mark.parametrize("structured,match", [
    (Structured("json", '{"type": "nonsense"}', field="response_format"), "response_format: not a valid json"),
    (Structured("regex", "(", field="structured_outputs.regex"),
     'structured_outputs.regex: not a valid regex constraint: at 1(8): invalid regex "(" (in regex): '
     "regex parse error: unclosed group"),  # the reason, not only the listing's opening line
    (Structured("grammar", "start: undefined_rule", field="structured_outputs.grammar"),
     "structured_outputs.grammar: not a valid"),
    # schemas that only refer to themselves: valid grammars that no output satisfies (an empty "stop" before)
    (Structured("json", '{"$ref": "#"}', field="response_format"), "response_format: not a valid json constraint: "
                                                                   "no output satisfies it"),
    (Structured("json", json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                    "$ref": "#/$defs/a"})), "structured: not a valid json constraint: no output"),
    (Structured("json", '{"anyOf": [{"$ref": "#"}]}'), "structured: not a valid json constraint: no output"),
    # constraints whose every output is infinite: valid to the grammar engine, each request ran to its token limit
    (Structured("json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
                field="response_format"),
     "response_format: not a valid json constraint: no output satisfies it: # refers back to itself"),
    (Structured("json", json.dumps({"type": "array", "items": {"$ref": "#"}, "minItems": 1})),
     "structured: not a valid json constraint: no output satisfies it"),
    (Structured("grammar", 'start: "a" start', field="structured_outputs.grammar"),
     "structured_outputs.grammar: not a valid grammar constraint: no output satisfies it: rule start derives no "
     "finite string"),
    # repetitions past the grammar engine's budget (its matchers failed mid-request: an empty "stop" before)
    (Structured("regex", "b{900000}", field="structured_outputs.regex"),
     "structured_outputs.regex: not a valid regex constraint: a repetition of 900000 passes"),
    (Structured("grammar", "start: /b{1000000000}/", field="structured_outputs.grammar"),
     "structured_outputs.grammar: not a valid grammar constraint: a repetition of 1000000000 passes"),
    (Structured("grammar", 'start: "b"~20000..900000', field="structured_outputs.grammar"),
     "structured_outputs.grammar: not a valid grammar constraint: a repetition of 900000 passes"),
    (Structured("json", json.dumps({"type": "object", "properties": {"s": {"type": "string",
                                                                             "pattern": "^b{200000}$"}}}),
                field="response_format"), "response_format: not a valid json constraint: a repetition of 200000"),
])
def test_a_bad_constraint_is_refused_naming_its_field(setup, structured, match):
    with pytest.raises(FieldError, match=re.escape(match)):
        _engine(setup).check([1], SamplingParams(structured=structured))


def test_a_grammar_engine_that_fails_mid_output_fails_its_request_naming_the_field(setup, monkeypatch):
    """Once the grammar engine is in error (a limit passed mid-output), its
    masks allow only the end of the output: the request fails there, with
    the constraint's field, and never finishes as a "stop"; the request
    beside it runs on."""
    from gdnx.serving.grammar import Matcher

    seen: list = []
    monkeypatch.setattr(Matcher, "error", lambda self: "lexer error: too many expressions constructed"
                        if seen.append(self) or len(seen) > 2 else None)
    engine = _engine(setup)
    structured = Structured("regex", "[0-9]{3}-[a-z]{2}", field="structured_outputs.regex")
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, structured=structured))
    b = engine.add_request([5, 6, 8], SamplingParams(max_tokens=8, temperature=0.0))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    failed = [e for e in events if e.request_id == a and e.error is not None]
    assert len(failed) == 1 and failed[0].error_field == "structured_outputs.regex", failed
    assert "could not be honoured: the grammar engine failed (lexer error: too many expressions" in failed[0].error
    assert not any(e.request_id == a and e.completion is not None for e in events)
    assert any(e.request_id == b and e.completion is not None for e in events)


def test_a_constraint_that_ends_before_min_tokens_fails_naming_min_tokens(setup):
    """A choice shorter than min_tokens: once the constraint allows only the
    end, min_tokens allows no end, and no token is left to draw: the
    request fails there naming min_tokens (every one of them; the request
    beside them runs on), never a token neither allows."""
    engine = _engine(setup)
    structured = Structured("choice", ("yes", "no"), field="structured_outputs.choice")
    constrained = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=12, min_tokens=10, temperature=1.0, seed=s,
                                                                structured=structured)) for s in range(2)]
    plain = engine.add_request([5, 6, 8], SamplingParams(max_tokens=6, temperature=0.0))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    for rid in constrained:
        failed = [e for e in events if e.request_id == rid and e.error is not None]
        assert len(failed) == 1 and failed[0].error_field == "min_tokens", failed
        assert "ends the output after" in failed[0].error and "fewer than min_tokens=10" in failed[0].error
        assert not any(e.request_id == rid and e.completion is not None for e in events)
    assert any(e.request_id == plain and e.completion is not None for e in events)


def test_large_constraints_still_compiling_hold_up_no_small_one(setup, monkeypatch):
    """Two huge schemas whose compiles run on past their refusal (held here)
    take the large constraints' lane alone: a small constraint sent after
    them compiles at once, and a third huge one waits its turn."""
    import threading
    import time

    from gdnx.serving import grammar

    _, _, shared = setup
    grammars = Grammars(shared._json, shared.vocab_size, shared.eos_id, compile_s=1.0)
    release, real = threading.Event(), Grammars._compile

    def held(self, s, tokenizer):
        if len(s.value) > grammar.LARGE_CONSTRAINT:
            release.wait(60)
        return real(self, s, tokenizer)

    monkeypatch.setattr(Grammars, "_compile", held)
    huge = [Structured("json", json.dumps({"type": "object", "properties": {
        f"p{i}_{n}": {"type": "string"} for i in range(1500)}}), field="response_format") for n in range(3)]
    assert all(len(h.value) > grammar.LARGE_CONSTRAINT for h in huge)
    try:
        for h in huge[:2]:
            with pytest.raises(FieldError, match="took longer than 1 s to compile"):
                grammars.grammar(h)
        t0 = time.perf_counter()
        grammars.grammar(Structured("regex", "[0-9]{3}", field="structured_outputs.regex"))
        assert time.perf_counter() - t0 < 1.0
        with pytest.raises(FieldError, match="took longer than 1 s to compile"):
            grammars.grammar(huge[2])
    finally:
        release.set()


def test_the_compiled_grammars_kept_are_bounded(setup, monkeypatch):
    """Clients choose the constraints: the cache keeps the most recently used few, not every one ever sent."""
    from gdnx.serving import grammar

    monkeypatch.setattr(grammar, "CACHED_GRAMMARS", 3)
    g = Grammars(setup[2]._json, BPE_VOCAB, eos_id=0)
    first, *rest = [Structured("regex", f"a{{{n}}}") for n in range(1, 6)]
    g.grammar(first)
    for s in rest[:2]:
        g.grammar(s)
    g.grammar(first)           # used again: kept
    for s in rest[2:]:
        g.grammar(s)
    assert list(g._cache) == [first, *rest[2:]]


def test_constraints_need_grammars_and_no_batch_invariance(setup):
    model, tok, grammars = setup
    s = SamplingParams(structured=Structured("choice", ("a", "b"), field="response_format"))
    with pytest.raises(FieldError, match="response_format: structured outputs need the engine's grammars"):
        Engine(model, max_slots=2, max_length=32, block_size=16).check([1], s)
    with pytest.raises(FieldError, match="not available in batch-invariant mode"):
        _engine(setup, batch_invariant=True).check([1], s)
    with pytest.raises(FieldError, match="structured: expected a non-empty list"):
        Structured("choice", ())


@pytest.mark.slow
def test_after_warm_up_no_request_compiles_a_program(setup):
    """warm_up runs every program a request can need; a burst of every kind
    of request afterwards lowers nothing new (JAX's lowering event counts
    each program it builds)."""
    import jax

    model, tok, grammars = setup
    engine = Engine(model, max_slots=4, max_length=96, block_size=16, decode_steps=4, tokenizer=tok,
                    eos_token_ids=[0], grammars=grammars, speculative=NgramDrafter(2), prefix_cache_bytes=1 << 22,
                    max_prefill_batch=3, keep_logits=False, max_logprobs=3, seed=11)
    ran = engine.warm_up()
    # decode at 1, 4 rows (constrained calls run the same programs); verify at 1 row (draft_rows' default on
    # CPU); prefill at buckets 16, 32, 64, 96
    # x batches 1, 3, and with prompt logprobs at batch 1 (such a prompt is prefilled alone); restore
    assert ran == 2 + 1 + 4 * 2 + 4 + 1
    lowered = []
    counting = [True]

    def listen(event, duration, **kw):
        if counting[0] and event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        rng = np.random.default_rng(0)
        shared = rng.integers(1, BPE_VOCAB, 40).tolist()
        prompts = [rng.integers(1, BPE_VOCAB, n).tolist() for n in (3, 20, 50, 90)] + [shared + [1], shared + [2]]
        params = [SamplingParams(max_tokens=5, temperature=0.0), SamplingParams(max_tokens=6, logprobs=2),
                  SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=1),
                  SamplingParams(max_tokens=5, structured=Structured("choice", ("yes", "no"))),
                  SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=4, temperature=0.0)]
        engine.generate(prompts, params)
        engine.generate(prompts[::-1], params[::-1])  # prefix-cache hits, other batches
        assert engine.stats.cached_tokens > 0
    finally:
        counting[0] = False
    assert lowered == [], f"{len(lowered)} programs compiled after warm_up"


def test_a_slow_compile_is_refused_in_its_time_and_a_tokenizer_it_cannot_read_names_the_field(setup, monkeypatch):
    """A constraint compiles on a thread of its own: past compile_s the
    caller gets a FieldError naming the field (the compile runs out in the
    background); a tokenizer.json the grammar engine cannot read (no
    decoder) refuses constraints by field, not with an internal error."""
    import threading

    from gdnx.serving import grammar

    release = threading.Event()
    real = grammar.Grammars._compile

    def slow(self, s, tokenizer):
        release.wait(60)
        return real(self, s, tokenizer)

    monkeypatch.setattr(grammar.Grammars, "_compile", slow)
    g = Grammars(setup[2]._json, BPE_VOCAB, eos_id=0, compile_s=0.2)
    try:
        with pytest.raises(FieldError, match=re.escape("response_format: not a valid regex constraint: it took "
                                                       "longer than 0.2 s to compile")):
            g.grammar(Structured("regex", "[a-z]+", field="response_format"))
    finally:  # the held compile's thread ends even when the check fails
        release.set()
    monkeypatch.setattr(grammar.Grammars, "_compile", real)
    spec = json.loads(setup[2]._json)
    spec["decoder"] = None
    g = Grammars(json.dumps(spec), BPE_VOCAB, eos_id=0)
    for _ in range(2):  # the reason is kept, not looked for again
        with pytest.raises(FieldError, match="tool_choice: structured outputs are not available for this "
                                             "checkpoint's tokenizer"):
            g.grammar(Structured("regex", "a", field="tool_choice"))
