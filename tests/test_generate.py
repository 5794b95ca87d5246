"""Sampling rules of `gdnx.generate`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from types import SimpleNamespace

from gdnx.config import load_config
from gdnx.generate import generate, prefill_bytes, sample


def test_greedy_is_argmax():
    logits = jnp.asarray([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    np.testing.assert_array_equal(sample(logits, jax.random.key(0)), [1, 0])


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two only
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(1), 400)
    draws = np.asarray([int(sample(logits, k, temperature=1.0, top_p=0.7)[0]) for k in keys[:200]])
    assert set(draws) == {0, 1}
    draws = np.asarray([int(sample(logits, k, temperature=1.0, top_p=1.0)[0]) for k in keys])
    assert set(draws) == {0, 1, 2, 3}
    # the top token always survives, however small top_p is
    assert {int(sample(logits, k, temperature=1.0, top_p=1e-6)[0]) for k in keys[:20]} == {0}


def test_temperature_sharpens():
    logits = jnp.asarray([[1.0, 0.0]])
    keys = jax.random.split(jax.random.key(2), 300)
    hot = np.mean([int(sample(logits, k, temperature=2.0)[0]) for k in keys])
    cold = np.mean([int(sample(logits, k, temperature=0.2)[0]) for k in keys])
    assert cold < 0.05 < hot


@pytest.mark.parametrize("kw,match", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                      ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_arguments(kw, match):
    args = {"max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=match):
        generate(None, jnp.zeros((1, 3), jnp.int32), args.pop("max_new_tokens"), **args)


def test_the_prompt_pass_of_an_attention_model_grows_with_prompt_times_cache():
    """A hybrid's attention layer holds float32 scores and probabilities
    [heads, T, S] over the prompt: a 100k-token prompt on a 16-head model is
    over 100 GB, which the check before generating refuses; a GDN-only model
    holds none."""
    hybrid = load_config("base").model  # Qwen3-Next-80B: full attention every 4th layer, 16 heads
    gdn_only = load_config("tiny").model
    long = prefill_bytes(SimpleNamespace(config=hybrid), 100_000, 100_032)
    assert long > 100 * 2 ** 30
    assert prefill_bytes(SimpleNamespace(config=hybrid), 1_000, 1_032) < long / 5_000
    assert prefill_bytes(SimpleNamespace(config=gdn_only), 100_000, 100_032) < 2 ** 30
