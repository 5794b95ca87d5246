"""The device-side sampling rules, on small explicit logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.serving import SamplingParams
from gdnx.serving.sampling import SlotParams, accept, adjust, draw, filtered, token_keys


def _rows(n, **kw):
    return SlotParams.rows([SamplingParams(**kw)] * n, list(range(n)))


def test_penalties_follow_their_definitions():
    logits = jnp.asarray([[2.0, -1.0, 0.5, 3.0]])
    counts = jnp.asarray([[2, 0, 1, 0]], jnp.int32)
    seen = jnp.asarray([[False, True, False, False]])
    out = adjust(logits, _rows(1, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
                 counts, seen, jnp.zeros(1, jnp.int32), ())
    # token 0: generated twice: 2/2 - 0.5 - 0.5; token 1: in the prompt, negative: -1*2; token 2: once:
    # 0.5/2 - 0.5 - 0.25; token 3: untouched
    np.testing.assert_allclose(out[0], [0.0, -2.0, -0.5, 3.0], rtol=1e-6)


def test_min_tokens_masks_end_of_sequence_and_stop_ids_until_reached():
    logits = jnp.zeros((2, 5))
    p = _rows(2, min_tokens=2, stop_token_ids=[3])
    out = adjust(logits, p, jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 5), bool), jnp.asarray([1, 2]), (4,))
    assert np.isneginf(out[0, [3, 4]]).all() and np.isfinite(out[0, :3]).all()
    assert np.isfinite(out[1]).all()  # two tokens drawn: nothing masked


def test_filters_keep_what_their_definitions_keep():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 3))
    keep = lambda **kw: np.isfinite(filtered(logits[:1], _rows(1, temperature=1.0, **kw)))[0]  # noqa: E731
    assert keep(top_k=2).tolist() == [True, True, False, False]
    assert keep(top_p=0.7).tolist() == [True, True, False, False]
    assert keep(top_p=0.81).tolist() == [True, True, True, False]
    assert keep(min_p=0.5).tolist() == [True, True, False, False]   # p >= 0.25
    assert keep().tolist() == [True] * 4


def test_draws_follow_the_filtered_distribution_and_greedy_rows_take_the_argmax():
    n = 4000
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * n))
    p = SlotParams.rows([SamplingParams(temperature=1.0)] * (n - 1) + [SamplingParams(temperature=0.0)],
                        list(range(n)))
    tok = np.asarray(draw(logits, p, token_keys(p, jnp.zeros(n, jnp.int32))))
    freq = np.bincount(tok[:-1], minlength=4) / (n - 1)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)  # 4 sigma at n = 4000
    assert tok[-1] == 0


def test_a_row_draws_the_same_token_whatever_the_other_rows_are():
    logits = jax.random.normal(jax.random.key(0), (3, 50))
    p = _rows(3, temperature=0.9, seed=None)
    keys = token_keys(p, jnp.asarray([5, 6, 7]))
    full = draw(logits, p, keys)
    alone = draw(logits[1:2], SlotParams(*(x[1:2] for x in p)), keys[1:2])
    assert int(full[1]) == int(alone[0])


def _chi_square(counts, probs) -> float:
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


# chi-square with 3 degrees of freedom (4 tokens): exceeded with probability 1e-4
CHI2_3DOF_P1E4 = 21.1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_acceptance_preserves_the_target_distribution(temperature):
    """Rejection sampling of a deterministic drafter's tokens (random drafts,
    likely and unlikely ones) over 20000 rows with their own seeds: the first
    emitted token follows p0, and where the first draft was kept the second
    follows p1 (the logits here do not depend on the earlier tokens)."""
    n, vocab = 20000, 4
    p0 = np.asarray([0.4, 0.3, 0.2, 0.1])
    p1 = np.asarray([0.1, 0.6, 0.1, 0.2])
    # scaled by the temperature, which the sampler divides out: the target is p0, p1 at either
    logits = (jnp.log(jnp.asarray(np.stack([p0, p1, p0])))[None].repeat(n, 0) * temperature).astype(jnp.float32)
    params = SlotParams.rows([SamplingParams(temperature=temperature)] * n, list(range(n)))
    drafts = np.random.default_rng(0).integers(0, vocab, (n, 2)).astype(np.int32)
    verdict = jax.jit(accept)(logits, jnp.asarray(drafts), jnp.full(n, 2, jnp.int32), params,
                              jnp.zeros(n, jnp.int32))
    a, nxt = np.asarray(verdict.accepted), np.asarray(verdict.next)
    first = np.where(a >= 1, drafts[:, 0], nxt)
    assert _chi_square(np.bincount(first, minlength=vocab), p0) < CHI2_3DOF_P1E4
    kept = a >= 1
    second = np.where(a[kept] >= 2, drafts[kept, 1], nxt[kept])
    assert _chi_square(np.bincount(second, minlength=vocab), p1) < CHI2_3DOF_P1E4
    assert 0 < (a == 0).mean() < 1 and 0 < (a == 2).mean() < 1  # both ways were taken


def test_a_verify_pass_without_drafts_draws_what_a_decode_step_draws():
    """A request without drafts in a verify pass (another slot has some)
    draws its token with the decode step's key and distribution, so its
    seeded tokens do not depend on the other requests' drafts."""
    n, vocab, k = 64, 11, 2
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(n, vocab)) * 3, jnp.float32)
    params = SlotParams.rows([SamplingParams(temperature=0.9, top_k=6, top_p=0.95)] * n, list(range(n)))
    generated = jnp.arange(n, dtype=jnp.int32) % 7
    plain = draw(logits, params, token_keys(params, generated))
    verdict = accept(jnp.repeat(logits[:, None], k + 1, axis=1), jnp.zeros((n, k), jnp.int32),
                     jnp.zeros(n, jnp.int32), params, generated)
    assert (np.asarray(verdict.accepted) == 0).all()
    np.testing.assert_array_equal(np.asarray(verdict.next), np.asarray(plain))
    assert len(set(np.asarray(plain).tolist())) > 3  # draws, not one argmax
