"""The RL objectives against a plain NumPy transcription of their papers'
formulas (GRPO, Dr. GRPO, DAPO, GSPO), float64 vs float32: relative 1e-5
(the float32 sums of a few dozen terms)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.config.schema import RL_CLIPS
from gdnx.rl.objective import EPS, Scored, advantages, policy_loss

ROWS, T, G = 6, 7, 3


def _batch(seed=0, kept_groups=(True, True)):
    rng = np.random.default_rng(seed)
    mask = np.zeros((ROWS, T), bool)
    for i in range(ROWS):
        start = rng.integers(0, 3)
        mask[i, start:start + rng.integers(1, T - start + 1)] = True
    rewards = rng.integers(0, 2, ROWS).astype(np.float32)
    adv = rng.normal(size=ROWS).astype(np.float32)
    kept = np.repeat(np.asarray(kept_groups), G)
    old = rng.normal(-2, 0.5, (ROWS, T)).astype(np.float32)
    sampler = (old + rng.normal(0, 0.3, (ROWS, T))).astype(np.float32)
    reference = (old + rng.normal(0, 0.2, (ROWS, T))).astype(np.float32)
    wide = lambda x: np.broadcast_to(x[:, None], (ROWS, T)).copy()  # noqa: E731
    batch = Scored(mask, sampler, old, reference, wide(adv), wide(kept))
    logp = (old + rng.normal(0, 0.2, (ROWS, T))).astype(np.float32)
    return batch, logp, rewards


def _reference(logp, b, loss, clip, cap, kl_coef, max_new):
    """The objective written out per completion, in float64 loops."""
    low, high = clip
    terms, kls, lengths = [], [], []
    for i in range(ROWS):
        if not b.kept[i, 0]:
            continue
        idx = np.flatnonzero(b.mask[i])
        lp, old = logp[i, idx].astype(np.float64), b.old[i, idx].astype(np.float64)
        a = float(b.advantages[i, 0])
        w = np.exp(old - b.sampler[i, idx])
        if loss == "gspo":
            s = np.exp(np.mean(lp - old))
            ratio = np.full(len(idx), s)
            w = np.full(len(idx), np.exp(np.mean(np.log(w))))
        else:
            ratio = np.exp(lp - old)
        if cap is not None:
            w = np.minimum(w, cap)
        obj = np.minimum(ratio * a, np.clip(ratio, 1 - low, 1 + high) * a) * w
        d = b.reference[i, idx] - lp
        terms.append(obj)
        kls.append(np.exp(d) - d - 1)
        lengths.append(len(idx))
    kept_rows = len(terms)
    if loss in ("grpo", "gspo"):
        agg = lambda xs: sum(x.mean() for x in xs) / kept_rows  # noqa: E731
    elif loss == "dr_grpo":
        agg = lambda xs: sum(x.sum() for x in xs) / (ROWS * max_new)  # noqa: E731
    else:
        agg = lambda xs: sum(x.sum() for x in xs) / sum(lengths)  # noqa: E731
    return -agg(terms) + kl_coef * agg(kls)


def _totals(b):
    return (jnp.float32(max(b.kept[:, 0].sum(), 1)), jnp.float32(max((b.mask & b.kept).sum(), 1)))


@pytest.mark.parametrize("loss,cap,kl,kept", [("grpo", 2.0, 0.0, (True, True)), ("dr_grpo", None, 0.1, (True, True)),
                                              ("dapo", 1.5, 0.0, (True, False)), ("gspo", 2.0, 0.05, (True, True))])
def test_policy_loss_matches_the_formulas(loss, cap, kl, kept):
    b, logp, _ = _batch(kept_groups=kept)
    clip = RL_CLIPS[loss] if loss != "gspo" else (0.05, 0.05)  # a GSPO range that some sequences leave
    rows, tokens = _totals(b)
    got, metrics = policy_loss(jnp.asarray(logp), b, loss=loss, clip=clip, importance_cap=cap, kl_coef=kl,
                               max_new_tokens=T, rows=rows, tokens=tokens)
    want = _reference(logp, b, loss, clip, cap, kl, T)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    assert ("rl/kl" in metrics) == bool(kl)
    assert 0.0 < float(metrics["rl/clip_fraction"]) < 1.0  # the ranges above clip some tokens and not others


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_micro_batches_add_up_to_the_batch(loss):
    """Halves of the rows, each divided by the whole batch's totals, sum to
    the whole batch's loss and gradient (gradient accumulation)."""
    b, logp, _ = _batch(seed=1)
    rows, tokens = _totals(b)

    def f(lp, batch):
        return policy_loss(lp, batch, loss=loss, clip=RL_CLIPS[loss], importance_cap=2.0, kl_coef=0.1,
                           max_new_tokens=T, rows=rows, tokens=tokens)[0]

    whole, grad = jax.value_and_grad(f)(jnp.asarray(logp), b)
    halves = [jax.value_and_grad(f)(jnp.asarray(logp[s]), Scored(*(x[s] for x in b)))
              for s in (slice(0, 3), slice(3, 6))]
    np.testing.assert_allclose(float(whole), sum(float(v) for v, _ in halves), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), np.concatenate([np.asarray(g) for _, g in halves]), rtol=1e-5,
                               atol=1e-7)


def test_on_policy_gradient_is_advantage_over_length():
    """On a rollout's first update (logp = old, sampler = old): GRPO's
    gradient at each counted token is -A / |o_i| / rows, zero elsewhere."""
    b, _, _ = _batch(seed=2)
    b = b._replace(sampler=b.old)
    rows, tokens = _totals(b)
    grad = jax.grad(lambda lp: policy_loss(lp, b, loss="grpo", clip=(0.2, 0.2), importance_cap=2.0, kl_coef=0.0,
                                           max_new_tokens=T, rows=rows, tokens=tokens)[0])(jnp.asarray(b.old))
    want = np.where(b.mask, -b.advantages / b.mask.sum(axis=1, keepdims=True) / ROWS, 0.0)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6, atol=1e-8)


def test_advantages_per_group():
    rewards = np.asarray([1, 0, 0, 2, 2, 2], np.float32)
    adv, kept = advantages(rewards, 3, "grpo")
    first = rewards[:3] - rewards[:3].mean()
    np.testing.assert_allclose(adv[:3], first / (rewards[:3].std() + EPS), rtol=1e-6)
    np.testing.assert_array_equal(adv[3:], 0.0)
    assert kept.all()
    adv, _ = advantages(rewards, 3, "dr_grpo")
    np.testing.assert_allclose(adv[:3], first, rtol=1e-6)
    _, kept = advantages(rewards, 3, "dapo")  # dynamic sampling: a group of equal rewards teaches nothing
    np.testing.assert_array_equal(kept, [True] * 3 + [False] * 3)
