"""The serving engine on a mesh: the weights placed as training places
them, each slot's state split with its layer's heads and the slots over the
data axes. With the prefix cache and speculation on, its greedy tokens
equal the plain one-device engine's (no prefix cache, no drafts), logprobs
within 1e-5 (float32: the same operations, partitioned, and a verify pass's
logits where drafts were taken); and its batch-invariant mode gives a request the
same bits whatever shares the engine with it, on a fixed mesh."""

import functools

import jax
import numpy as np
import pytest

from gdnx.config.reading import load_config
from gdnx.models import CausalLM
from gdnx.serving import Engine, SamplingParams
from tests.parallel.helpers import mesh
from tests.parallel.helpers import FAMILIES, MODEL

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
SETTINGS = dict(max_slots=4, max_length=64, block_size=16, decode_steps=4, draft_rows=4)
CACHED = dict(prefix_cache_bytes=1 << 24)


# the tiny model with a multi-token prediction module (the engine drafts with it)
_MTP = {"qwen3_next_mtp": ["model.mtp_num_layers=1"]}


@functools.cache
def _model(family: str) -> CausalLM:
    return CausalLM(load_config("tiny", MODEL + FAMILIES.get(family, []) + _MTP.get(family, [])).model, seed=0)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, 16).tolist()  # a block the later prompts share: prefix-cache hits
    # two prefill buckets (16, 32), each at both batch sizes over the two calls below
    return [rng.integers(0, vocab, n).tolist() for n in (5, 21)] + [shared + rng.integers(0, vocab, n).tolist()
                                                                    for n in (3, 12, 14)]


class _Repeat:
    """Drafts the request's last two tokens again: every step is a verify
    pass, whose drafts are sometimes taken and mostly refused (rollback)."""
    num_tokens = 2

    def propose(self, tokens):
        return list(tokens[-2:])


def _run(model, **kw):
    drafter = {} if "draft_method" in kw else {"speculative": _Repeat()}
    engine = Engine(model, **SETTINGS, **CACHED, **drafter, **kw)
    prompts = _prompts(model.config.vocab_size)
    first = engine.generate(prompts, PARAMS)
    again = engine.generate(prompts[::-1], PARAMS)[::-1]  # the shared block now cached, the batch reordered
    return first, again, engine


# every tensor size once, tensor x data, both shard modes; every family (Qwen3.5 with
# value-head groups of 3; Kimi's and Ling's KDA states and latents, Lara's ring, OLMo's dense MLPs,
# GLM-5-Next's index caches, Qwen4-Exp's index caches and PLE states with the n-gram tables split);
# qwen3_next_mtp drafts with its multi-token prediction module (its keys and values split with its
# heads, the slots over data; its layer routes, as the model's last does)
@pytest.mark.slow
@pytest.mark.parametrize("family, mode, axes", [
    ("qwen3_next", "auto", dict(data=1, tensor=2, fsdp=4)),
    ("qwen3_next_mtp", "explicit", dict(data=2, tensor=4)),
    ("kimi_linear", "auto", dict(data=1, tensor=8)),
    ("lara_mini", "auto", dict(data=2, fsdp=1, tensor=4)),
    ("bailing_hybrid", "explicit", dict(data=4, tensor=2)),
    ("olmo_hybrid", "auto", dict(data=2, tensor=4)),
    ("qwen3_5_gva3", "auto", dict(data=1, fsdp=2, tensor=4)),
    ("glm5_next", "explicit", dict(data=2, fsdp=2, tensor=2)),
    ("qwen4_exp", "auto", dict(data=2, fsdp=2, tensor=2)),
])
def test_the_sharded_engine_gives_the_one_device_tokens(family, mode, axes):
    model = _model(family)
    ref = Engine(model, **SETTINGS).generate(_prompts(model.config.vocab_size), PARAMS)
    drafter = dict(draft_method="mtp", draft_tokens=2) if family.endswith("_mtp") else {}
    first, again, engine = _run(model, mesh=mesh(mode, **axes), **drafter)
    assert engine.stats.cached_tokens > 0 and engine.stats.verify_calls > 0
    if drafter:
        assert not engine.runner.slots.mtp.cache.k.sharding.is_fully_replicated
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(engine.runner.state))
    for a, b, r in zip(first, again, ref, strict=True):
        assert a.tokens == b.tokens == r.tokens
        for got in (a, b):
            lp = np.asarray([x for x, _ in got.logprobs])
            want = np.asarray([x for x, _ in r.logprobs])
            np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_batch_invariance_on_a_mesh():
    """batch_invariant on a tensor x data mesh: a request's logits are
    bit-identical alone, beside others and from a cached prefix."""
    model = _model("qwen3_next")
    m = mesh("auto", data=2, tensor=4)
    prompts = _prompts(model.config.vocab_size)
    engine = Engine(model, **SETTINGS, **CACHED, batch_invariant=True, keep_logits=True, mesh=m)
    together = engine.generate(prompts, PARAMS)
    alone = [engine.generate([p], PARAMS)[0] for p in prompts[::-1]][::-1]
    for a, b in zip(together, alone, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))
    placed = jax.tree.leaves(engine.runner.slots.cache)
    assert any(not x.sharding.is_fully_replicated for x in placed)


def test_a_mesh_the_engine_cannot_use_is_named():
    model = _model("qwen3_next")
    with pytest.raises(ValueError, match="mesh: the engine splits heads and slots, not sequences: expected "
                                         "context=1, got context=2"):
        Engine(model, mesh=mesh("auto", data=1, context=2, tensor=4))
    with pytest.raises(ValueError, match="mesh: expected a jax.sharding.Mesh"):
        Engine(model, mesh="tensor=8")

