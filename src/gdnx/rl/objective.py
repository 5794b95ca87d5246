"""The policy-gradient objectives of train.rl.loss, on a batch of
completions laid out as rows (prompt + completion, padded), with their
rewards normalised within each prompt's group.

For completion i with tokens t (mask m), the trainer's log-probabilities
logp (differentiated), those of the weights that drew the batch, old
(equal to logp on a rollout's first update), and the sampler's own,
sampler:

  ratio r_t = exp(logp_t - old_t), A_i the group-normalised reward,
  token objective o_t = min(r_t A_i, clip(r_t, 1 - low, 1 + high) A_i),
  weighted by w_t = min(exp(old_t - sampler_t), cap) (truncated importance
  sampling: the sampler drew from its distribution, not the trainer's).

grpo:    -mean_i (sum_t w o m / |o_i|), A = (R - mean) / (std + eps)
dr_grpo: -sum_i sum_t w o m / (rows x max_new_tokens), A = R - mean
dapo:    -sum_i sum_t w o m / sum_i |o_i| over the groups whose rewards
         differ (dynamic sampling keeps those), clip-higher by default
gspo:    the sequence ratio s_i = exp(mean_t (logp - old)) in place of r_t
         (each token's gradient that of log s_i), -mean_i (w_i o_i), w_i
         the geometric mean of the sequence's weights, capped

plus kl_coef times the k3 estimate of KL to the reference,
exp(ref - logp) - (ref - logp) - 1, averaged as the loss averages.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-4  # added to a group's reward std (a group of equal rewards has advantage 0)
# an array of a batch: numpy on the host, then the same fields on the device
Array = jax.Array | np.ndarray


def advantages(rewards: np.ndarray, group_size: int, loss: str) -> tuple[np.ndarray, np.ndarray]:
    """(advantage per completion, whether its group counts) for rewards
    [rows] laid out a group after another. dr_grpo leaves out the std;
    dapo counts only the groups whose rewards differ."""
    r = rewards.reshape(-1, group_size).astype(np.float64)
    centred = r - r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, keepdims=True)
    adv = centred if loss == "dr_grpo" else centred / (std + EPS)
    kept = np.ones_like(r, bool) if loss != "dapo" else np.broadcast_to(std > 0, r.shape)
    return adv.reshape(-1).astype(np.float32), kept.reshape(-1).copy()


class Scored(NamedTuple):
    """A batch of completions' positions, [rows, P] each: mask, the
    positions that hold a completion token; the log-probabilities there of
    the sampler, of the weights that drew the batch (old) and of the
    reference (zeros without KL); the row's advantage and whether its
    group counts, along the whole row."""
    mask: Array
    sampler: Array
    old: Array
    reference: Array
    advantages: Array
    kept: Array


def policy_loss(logp: jax.Array, batch: Scored, *, loss: str, clip: tuple[float, float],
                importance_cap: float | None, kl_coef: float, max_new_tokens: int, rows: jax.Array,
                tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective for the trainer's log-probabilities logp [rows, P] and
    its metrics (clip fractions, KL, importance weights), each divided by
    the whole batch's counted rows and tokens (a micro-batch's add up)."""
    m = (batch.mask & batch.kept).astype(jnp.float32)
    lengths = jnp.maximum(m.sum(axis=1), 1.0)
    low, high = clip
    adv = batch.advantages
    log_weight = jax.lax.stop_gradient(batch.old - batch.sampler)
    if loss == "gspo":
        seq = ((logp - batch.old) * m).sum(axis=1, keepdims=True) / lengths[:, None]
        # each token's ratio has the sequence's value and its own token's gradient (GSPO-token, equal here)
        log_ratio = jax.lax.stop_gradient(seq) + logp - jax.lax.stop_gradient(logp)
        log_weight = jnp.broadcast_to((log_weight * m).sum(axis=1, keepdims=True) / lengths[:, None], m.shape)
    else:
        log_ratio = logp - batch.old
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - low, 1.0 + high)
    objective = jnp.minimum(ratio * adv, clipped * adv)
    weight = jnp.exp(log_weight) if importance_cap is None else jnp.minimum(jnp.exp(log_weight), importance_cap)
    weight = jax.lax.stop_gradient(weight)
    diff = batch.reference - logp
    k3 = jnp.exp(diff) - diff - 1.0  # >= 0, unbiased for KL(trainer || reference) on the trainer's draws

    def average(x):
        if loss in ("grpo", "gspo"):
            return ((x * m).sum(axis=1) / lengths).sum() / rows
        if loss == "dr_grpo":
            return (x * m).sum() / (rows * max_new_tokens)
        return (x * m).sum() / tokens  # dapo: over the tokens

    total = -average(weight * objective)
    metrics = {"rl/policy_loss": total}
    if kl_coef:  # the reference's log-probabilities are there
        metrics["rl/kl"] = average(k3)
        total = total + kl_coef * metrics["rl/kl"]
    metrics |= {
        "rl/clip_fraction": ((objective != ratio * adv) * m).sum() / tokens,
        "rl/ratio_mean": (ratio * m).sum() / tokens,
        "rl/importance_weight_mean": (weight * m).sum() / tokens,
        "rl/importance_capped_fraction": (jnp.zeros_like(m) if importance_cap is None else
                                          (jnp.exp(log_weight) > importance_cap) * m).sum() / tokens,
    }
    return total, metrics
