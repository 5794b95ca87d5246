"""The trainer's replay of the engine's computation against the engine
itself: the log-probabilities of sampled completions equal the sampler's
bit for bit (batch-invariant engine; float32) on Qwen3-Next (MoE),
Kimi Linear (KDA, latent attention, MoE) and OLMo Hybrid shaped tiny
models, with prompts of one to three prefill blocks in prefill calls of
two rows (a prompt's first token's reduction has the call's shape),
completions cut short by end-of-sequence, and slots left empty."""

import jax
import numpy as np
import pytest

from gdnx.config import ModelConfig
from gdnx.models import CausalLM
from gdnx.rl.replay import ReplayShapes, replay_batch, replay_logprobs
from gdnx.serving import Engine, SamplingParams
from tests.helpers.configs import KIMI, MOE, TINY_HYBRID

FAMILIES = {"qwen3_next": {**TINY_HYBRID, **MOE}, "kimi_linear": {**TINY_HYBRID, **KIMI, **MOE},
            "olmo_hybrid": {**TINY_HYBRID, "family": "olmo_hybrid"}}
SLOTS, NEW, LENGTHS = 4, 5, (5, 20, 3)  # the fourth slot stays empty


def _sampled(model):
    engine = Engine(model, max_slots=SLOTS, max_length=48, block_size=16, decode_steps=4, max_logprobs=1,
                    batch_invariant=True, max_prefill_batch=2, eos_token_ids=[3])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, model.config.vocab_size, n).tolist() for n in LENGTHS]
    done = engine.generate(prompts, [SamplingParams(max_tokens=NEW, seed=i, logprobs=0) for i in range(3)])
    shapes = ReplayShapes(SLOTS, engine.config.prefill_rows, engine.shapes.block_size, engine.shapes.capacity)
    return prompts, done, shapes


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replay_is_the_samplers_log_probabilities_bit_for_bit(family):
    model = CausalLM(ModelConfig(**FAMILIES[family]), seed=3)
    prompts, done, shapes = _sampled(model)
    got = np.asarray(jax.jit(lambda m, b: replay_logprobs(m, b, shapes))(
        model, replay_batch(prompts, [c.tokens for c in done], shapes, NEW)))
    for i, c in enumerate(done):
        np.testing.assert_array_equal(got[i, :len(c.tokens)], np.asarray([lp for lp, _ in c.logprobs], np.float32))


@pytest.mark.slow
def test_replay_bit_for_bit_with_prefill_calls_narrower_than_the_slots():
    """16 slots, prefill calls of 8 rows, the tiny model's 256 tokens: a
    prompt's first token's log-probability is computed on its prefill
    call's rows, whose shape the reduction's rounding follows."""
    from gdnx.config import load_config

    model = CausalLM(load_config("tiny", []).model, seed=0)
    engine = Engine(model, max_slots=16, max_length=40, max_logprobs=1, batch_invariant=True, max_prefill_batch=8,
                    eos_token_ids=[0])
    prompts = [list(f"{a}+{a * 7 % 100}=".encode()) for a in range(16)]
    done = engine.generate(prompts, [SamplingParams(max_tokens=6, seed=i, logprobs=0) for i in range(16)])
    shapes = ReplayShapes(16, 8, engine.shapes.block_size, engine.shapes.capacity)
    got = np.asarray(jax.jit(lambda m, b: replay_logprobs(m, b, shapes))(
        model, replay_batch(prompts, [c.tokens for c in done], shapes, 6)))
    for i, c in enumerate(done):
        np.testing.assert_array_equal(got[i, :len(c.tokens)], np.asarray([lp for lp, _ in c.logprobs], np.float32))
