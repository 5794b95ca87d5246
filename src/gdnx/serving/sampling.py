"""Sampling on the device, one row per engine slot, every parameter an
array (one compiled program serves every mix of requests): the logit
adjustments, the draw, log-probabilities, and speculative acceptance.

Each row's randomness comes from its own key folded with the index of the
token it draws, so a request's tokens never depend on the other rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.serving.params import SamplingParams

# stop_token_ids a request may give (the rows of SlotParams.stop_ids)
MAX_STOP_IDS = 8


Arrays = jax.Array | np.ndarray  # device arrays, or host arrays on their way in


class SlotParams(NamedTuple):
    """SamplingParams as arrays, one row per slot."""
    temperature: Arrays    # float32 [S]
    top_k: Arrays          # int32 [S], 0: all
    top_p: Arrays          # float32 [S]
    min_p: Arrays          # float32 [S]
    repetition: Arrays     # float32 [S]
    presence: Arrays       # float32 [S]
    frequency: Arrays      # float32 [S]
    min_tokens: Arrays     # int32 [S]
    stop_ids: Arrays       # int32 [S, MAX_STOP_IDS], -1 where unused
    logprobs: Arrays       # bool [S]: the request asks for log-probabilities
    key: Arrays            # uint32 [S, 2]: the request's threefry key data

    @classmethod
    def rows(cls, params: list[SamplingParams], seeds: list[int]) -> "SlotParams":
        """Host arrays for these requests (seeds resolved)."""
        stop = np.full((len(params), MAX_STOP_IDS), -1, np.int32)
        for i, p in enumerate(params):
            stop[i, :len(p.stop_token_ids)] = p.stop_token_ids
        key = np.asarray([[(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF] for s in seeds], np.uint32).reshape(-1, 2)

        def col(name, dtype):
            return np.asarray([getattr(p, name) for p in params], dtype)

        return cls(col("temperature", np.float32), col("top_k", np.int32), col("top_p", np.float32),
                   col("min_p", np.float32), col("repetition_penalty", np.float32),
                   col("presence_penalty", np.float32), col("frequency_penalty", np.float32),
                   col("min_tokens", np.int32), stop,
                   np.asarray([p.logprobs is not None for p in params], bool), key)


def quiet(p: SlotParams, active: jax.Array) -> SlotParams:
    """Rows that are not decoding (free slots, prompts being prefilled) as
    greedy rows asking for nothing, so they never switch on the costlier
    paths below."""
    def keep(x, neutral):
        return jnp.where(active, jnp.asarray(x), neutral)
    return p._replace(temperature=keep(p.temperature, 0.0), repetition=keep(p.repetition, 1.0),
                      presence=keep(p.presence, 0.0), frequency=keep(p.frequency, 0.0),
                      min_tokens=keep(p.min_tokens, 0), logprobs=keep(p.logprobs, False))


def _repeat(p: SlotParams, n: int) -> SlotParams:
    """Each row's parameters n times in a row (for [S * n] flattened positions)."""
    return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), n, axis=0), p)


def token_keys(p: SlotParams, index: jax.Array) -> jax.Array:
    """Each row's key for its token number `index` [S]."""
    keys = jax.random.wrap_key_data(jnp.asarray(p.key), impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, index.astype(jnp.uint32))


def adjust_positions(logits: jax.Array, p: SlotParams, counts: jax.Array, seen: jax.Array, generated: jax.Array,
                     eos_ids: tuple[int, ...]) -> jax.Array:
    """adjust at each of K + 1 positions: logits and counts [S, K + 1, V]
    (counts including the drafts before each position), generated [S]
    (position j is token generated + j)."""
    s, k1, vocab = logits.shape
    flat = adjust(logits.reshape(s * k1, vocab), _repeat(p, k1), counts.reshape(s * k1, vocab),
                  jnp.repeat(seen, k1, axis=0), (generated[:, None] + jnp.arange(k1)).reshape(-1), eos_ids)
    return flat.reshape(s, k1, vocab)


def adjust(logits: jax.Array, p: SlotParams, counts: jax.Array, seen: jax.Array, generated: jax.Array,
           eos_ids: tuple[int, ...]) -> jax.Array:
    """The penalties and the min_tokens mask on float32 logits [S, V];
    counts [S, V] of the generated tokens, seen [S, V] the prompt's tokens,
    generated [S] how many tokens each row has drawn."""
    # each adjustment runs only when some row asks for it (greedy rows with no penalty cost nothing)
    def penalize(logits):
        occurred = counts > 0
        r = p.repetition[:, None]
        logits = jnp.where(seen | occurred, jnp.where(logits > 0, logits / r, logits * r), logits)
        return logits - p.presence[:, None] * occurred - p.frequency[:, None] * counts

    def hold_back(logits):
        ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
        banned = (ids[None, :, None] == p.stop_ids[:, None, :]).any(-1)
        if eos_ids:
            banned = banned | jnp.isin(ids, jnp.asarray(eos_ids, jnp.int32))[None]
        return jnp.where((generated < p.min_tokens)[:, None] & banned, -jnp.inf, logits)

    penalized = jnp.any((p.repetition != 1) | (p.presence != 0) | (p.frequency != 0))
    logits = jax.lax.cond(penalized, penalize, lambda x: x, logits)
    return jax.lax.cond(jnp.any(generated < p.min_tokens), hold_back, lambda x: x, logits)


def allow(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Logits [S, V] with the tokens a row's bitmask (int32 [S, ceil(V / 32)],
    bit j of word i: token 32 i + j) does not allow set to -inf."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    words = jnp.take(bitmask, ids // 32, axis=1).astype(jnp.uint32)
    bits = jax.lax.shift_right_logical(words, (ids % 32).astype(jnp.uint32)[None]) & 1
    return jnp.where(bits == 1, logits, -jnp.inf)


def truncated(z: jax.Array, top_k: Arrays, top_p: Arrays, min_p: Arrays) -> jax.Array:
    """Logits [S, V] (already divided by the temperature) cut by each row's
    top_k (0: off), top_p and min_p (0: off), -inf outside: the tokens a
    row may draw. The one place these filters are written (the engine's
    draws and gdnx.generate's)."""
    vocab = z.shape[-1]
    ranked = -jnp.sort(-z, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)
    ranked = jnp.where(jnp.arange(vocab)[None] < k[:, None], ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    # keep a token while the mass before it is below top_p (the top token always stays)
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(before < top_p[:, None], ranked, jnp.inf), axis=-1, keepdims=True)
    top = ranked[:, :1]
    floor = top + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    keep = (z >= kth) & (z >= cutoff) & ((min_p[:, None] == 0) | (z >= floor))
    return jnp.where(keep, z, -jnp.inf)


def filtered(logits: jax.Array, p: SlotParams) -> jax.Array:
    """Adjusted logits [S, V] divided by the temperature and `truncated` by
    the rows' top_k, top_p and min_p: the distribution a row draws from.
    Rows at temperature 0 are left at temperature 1 (they take the argmax)."""
    t = jnp.where(p.temperature > 0, p.temperature, 1.0)[:, None]
    return truncated(logits / t, p.top_k, p.top_p, p.min_p)


def draw(logits: jax.Array, p: SlotParams, keys: jax.Array) -> jax.Array:
    """Next tokens int32 [S] from adjusted logits [S, V]: the argmax at
    temperature 0, else a draw from `filtered`."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        sampled = jax.vmap(jax.random.categorical)(keys, filtered(logits, p)).astype(jnp.int32)
        return jnp.where(p.temperature > 0, sampled, greedy)

    # the sort behind top-k / top-p runs only when some row samples
    return jax.lax.cond(jnp.any(p.temperature > 0), sample, lambda _: greedy, None)


class TokenLogprobs(NamedTuple):
    chosen: jax.Array   # float32 [S]
    top_ids: jax.Array  # int32 [S, N]
    top: jax.Array      # float32 [S, N]


def logprobs(logits: jax.Array, tokens: jax.Array, n: int, wanted: Arrays) -> TokenLogprobs:
    """Log-probabilities of the adjusted logits [S, V]: the drawn tokens' and
    the top n; computed when some row is `wanted` ([S]), else zeros."""
    def compute(_):
        lp = jax.nn.log_softmax(logits, axis=-1)
        top, ids = jax.lax.top_k(lp, max(n, 1))
        chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        return TokenLogprobs(chosen, ids.astype(jnp.int32)[:, :n], top[:, :n])

    def skip(_):
        s = logits.shape[0]
        return TokenLogprobs(jnp.zeros(s, jnp.float32), jnp.zeros((s, n), jnp.int32), jnp.zeros((s, n), jnp.float32))

    return jax.lax.cond(jnp.any(jnp.asarray(wanted)) & (n > 0), compute, skip, None)


class Verdict(NamedTuple):
    accepted: jax.Array  # int32 [S]: drafts accepted
    next: jax.Array      # int32 [S]: the token after them (a correction, or the bonus token)


def accept(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, p: SlotParams,
           generated: jax.Array) -> Verdict:
    """Speculative acceptance of drafts [S, K] (the first num_drafts [S] of
    each row are real) against adjusted logits [S, K + 1, V] (position j:
    after the row's last token and drafts < j). A deterministic drafter
    proposes each token with probability 1, so draft j is kept with
    probability p_j(draft) and, at the first refusal, the next token is drawn
    from p_j without the draft: the target distribution exactly (rejection
    sampling). At temperature 0, p_j is the argmax: drafts equal to it are
    kept, and the next token is the argmax."""
    s, k1, vocab = logits.shape
    k = k1 - 1
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    real = jnp.arange(k)[None] < num_drafts[:, None]

    def kept(ok):
        return jnp.sum(jnp.cumprod((ok & real).astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    def greedy(_):
        accepted = kept(drafts == argmax[:, :k])
        return accepted, jnp.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]

    def sample(_):
        index = generated[:, None] + jnp.arange(k1, dtype=jnp.int32)[None]          # each position's token number
        keys = jax.vmap(lambda j: token_keys(p, j), in_axes=1, out_axes=1)(index)    # [S, K + 1]
        coin_keys, draw_keys = (jax.vmap(jax.vmap(lambda key, i=i: jax.random.split(key)[i]))(keys)
                                for i in (0, 1))
        z = filtered(logits.reshape(s * k1, vocab), _repeat(p, k1)).reshape(s, k1, vocab)
        probs = jax.nn.softmax(z, axis=-1)
        p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]  # [S, K]
        coins = jax.vmap(jax.vmap(jax.random.uniform))(coin_keys[:, :k])
        accepted = kept(jnp.where((p.temperature == 0)[:, None], drafts == argmax[:, :k], coins < p_draft))
        at = jnp.take_along_axis(z, accepted[:, None, None], axis=1)[:, 0]          # [S, V]
        refused = jnp.take_along_axis(drafts, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0] if k else accepted
        rejected = accepted < num_drafts
        at = jnp.where(rejected[:, None] & (jnp.arange(vocab)[None] == refused[:, None]), -jnp.inf, at)
        # after a refusal the draw takes its own key; the token after every draft (or with none) is drawn
        # with the key and distribution a plain decode step uses, so a request draws the same tokens whether
        # a step is a verify pass (another slot has drafts) or a decode step
        data = jnp.where(rejected[:, None, None], jax.random.key_data(draw_keys), jax.random.key_data(keys))
        key_at = jnp.take_along_axis(data, accepted[:, None, None], axis=1)[:, 0]
        sampled = jax.vmap(jax.random.categorical)(jax.random.wrap_key_data(key_at, impl="threefry2x32"), at)
        greedy_next = jnp.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]
        return accepted, jnp.where(p.temperature > 0, sampled.astype(jnp.int32), greedy_next)

    # the filtering sort and the draws run only when some row samples
    accepted, nxt = jax.lax.cond(jnp.any(jnp.asarray(p.temperature) > 0), sample, greedy, None)
    return Verdict(accepted, nxt)
