"""Cross-entropy and per-position log-probabilities over a large
vocabulary in blocks of positions (the latter differentiable for
reinforcement learning: target_logprobs).

The logits of a [B, T] batch are B x T x vocab floats (1.3 GB in float32
at 16 x 512 x 151,936, several times that with the backward). Here the
final hidden states are cut into blocks along T; each block's logits are
made, reduced (to per-token sums for the loss: log-sum-exp, the target's
logit, the argmax hit; to each position's log-probabilities of its target
and its top N for scoring) and dropped, under jax.checkpoint for the loss,
so the backward remakes one block at a time too. Peak: about three blocks
of float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gdnx.parallel.rules import constrain

# bytes of float32 logits per block (the backward holds about three blocks).
# Each block's backward adds its share of the head's weight gradient into a
# [vocab, hidden] accumulator, a pass over the whole matrix per block, so
# few large blocks beat many small ones: on a TPU v5e at a 248,320 x 1,024
# head and 4,096 positions, forward + backward took 158 ms in blocks of 128
# positions (128 MiB), 75 ms in blocks of 512 (512 MiB), 66 ms in 1,024.
BLOCK_BYTES = 2 ** 29


class TokenSums(NamedTuple):
    """Sums over the counted positions of a batch."""
    nll: jax.Array          # negative log-likelihood
    hits: jax.Array         # argmax == target
    tokens: jax.Array       # positions counted (mask)
    first_hits: jax.Array   # hits at the `first` positions
    first_tokens: jax.Array


def block_length(batch: int, length: int, vocab: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Positions per block: a power of two whose [batch, block, vocab] float32
    logits fit block_bytes (at least 1), at most the padded length."""
    fit = max(1, block_bytes // (4 * batch * vocab))
    block = 1 << (fit.bit_length() - 1)
    return min(block, 1 << (length - 1).bit_length())


def blocked_cross_entropy(hidden: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], targets: jax.Array,
                          mask: jax.Array, first: jax.Array, *, vocab: int, block: int | None = None) -> TokenSums:
    """hidden [B, T, H] (final normed states), logits_fn: [B, t, H] -> float32
    [B, t, vocab], targets int [B, T], mask and first bool [B, T]."""
    b, t, _ = hidden.shape
    block = block or block_length(b, t, vocab)
    pad = -t % block
    # the length axis whole (context-parallel shards gather their hidden states)
    hidden = constrain(jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))), ("batch", None, "hidden"))
    side = [constrain(jnp.pad(x, ((0, 0), (0, pad))), ("batch", None))
            for x in (targets, mask.astype(jnp.float32), first.astype(jnp.float32))]

    @jax.checkpoint
    def one_block(start):
        h = jax.lax.dynamic_slice_in_dim(hidden, start, block, axis=1)
        tgt, m, f = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=1) for x in side)
        logits = logits_fn(h)
        lse = jax.nn.logsumexp(logits, axis=-1)
        # a one-hot product, not a gather: it needs no placement stated when
        # the vocabulary is split over tensor on an Explicit mesh
        picked = jnp.sum(logits * jax.nn.one_hot(tgt, vocab, dtype=logits.dtype), axis=-1)
        hit = (jnp.argmax(logits, axis=-1) == tgt).astype(jnp.float32)
        return jnp.stack([jnp.sum((lse - picked) * m), jnp.sum(hit * m), jnp.sum(m), jnp.sum(hit * f), jnp.sum(f)])

    def step(total, start):
        return total + one_block(start), None

    starts = jnp.arange(0, t + pad, block, dtype=jnp.int32)
    total, _ = jax.lax.scan(step, jnp.zeros((5,), jnp.float32), starts)
    return TokenSums(*total)


class PositionScores(NamedTuple):
    """Per position of a [B, T] batch."""
    chosen: jax.Array    # float32 [B, T]: log-probability of the target
    greedy: jax.Array    # bool [B, T]: the target is the argmax
    top_ids: jax.Array   # int32 [B, T, N]: the N most probable tokens
    top: jax.Array       # float32 [B, T, N]: their log-probabilities


def position_scores(hidden: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], targets: jax.Array, *,
                    vocab: int, top: int = 0, block: int | None = None) -> PositionScores:
    """Each position's log-probability of its target, whether the target is
    the argmax, and the top `top` tokens, a block of positions at a time
    (no [B, T, vocab] array is formed). hidden [B, T, H] (final normed
    states), logits_fn: [B, t, H] -> float32 [B, t, vocab], targets int [B, T]."""
    b, t, _ = hidden.shape
    block = block or block_length(b, t, vocab)
    pad = -t % block
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))

    def one_block(start):
        h = jax.lax.dynamic_slice_in_dim(hidden, start, block, axis=1)
        tgt = jax.lax.dynamic_slice_in_dim(targets, start, block, axis=1)
        logits = logits_fn(h)
        logp = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        vals, ids = jax.lax.top_k(logp, max(top, 1))
        return chosen, jnp.argmax(logits, axis=-1) == tgt, ids[..., :top].astype(jnp.int32), vals[..., :top]

    out = jax.lax.map(one_block, jnp.arange(0, t + pad, block, dtype=jnp.int32))  # [blocks, B, block, ...]
    return PositionScores(*(jnp.swapaxes(x, 0, 1).reshape(b, t + pad, *x.shape[3:])[:, :t] for x in out))


def target_logprobs(hidden: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], targets: jax.Array, *,
                    vocab: int, block: int | None = None) -> jax.Array:
    """float32 [B, T]: each position's log-probability of its target,
    differentiable, a block of positions at a time under jax.checkpoint
    (the backward remakes one block's logits at a time, as
    blocked_cross_entropy's). hidden [B, T, H] (final normed states),
    logits_fn: [B, t, H] -> float32 [B, t, vocab], targets int [B, T]."""
    b, t, _ = hidden.shape
    block = block or block_length(b, t, vocab)
    pad = -t % block
    hidden = constrain(jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))), ("batch", None, "hidden"))
    targets = constrain(jnp.pad(targets, ((0, 0), (0, pad))), ("batch", None))

    @jax.checkpoint
    def one_block(start):
        h = jax.lax.dynamic_slice_in_dim(hidden, start, block, axis=1)
        tgt = jax.lax.dynamic_slice_in_dim(targets, start, block, axis=1)
        logits = logits_fn(h)
        picked = jnp.sum(logits * jax.nn.one_hot(tgt, vocab, dtype=logits.dtype), axis=-1)
        return picked - jax.nn.logsumexp(logits, axis=-1)

    out = jax.lax.map(one_block, jnp.arange(0, t + pad, block, dtype=jnp.int32))  # [blocks, B, block]
    return jnp.swapaxes(out, 0, 1).reshape(b, t + pad)[:, :t]
