"""The engine's compiled programs and the slot state they share.

Slots: every decode slot's generation cache (per-row lengths) and sampling
state. Programs (each jitted once per shape; the slot state is donated):
  prefill  [P, L] prompt tokens (right-padded in a length bucket) into P
           slots: the model over them, the first token drawn, and for the
           prefix cache the GDN states at block ends and the attention
           keys and values of the call;
  restore  a prefix-cache hit's states written into one slot;
  decode   up to `steps` tokens for every slot in one loop (one token
           when a row's output is constrained);
  verify   speculative: the last token and K drafts in one pass, the
           drafts accepted or refused, and each GDN layer's state after the
           last accepted token selected from the pass's per-token states.

With the multi-token prediction module as the drafter (Static.mtp_drafts),
the slots also hold the module's own keys and values (`MtpState`), and
every program that advances a row advances them too (but a decode over
more rows than draft only: its rows no longer draft): position t's entry
from the model's final hidden state at t and the token at t + 1, written
for the tokens the row keeps (prefill: its prompt; decode: each token
drawn; verify: the accepted drafts and the next token), so a refused draft
leaves nothing behind. Each program then returns the next K drafts of
every row: the module's greedy token from its last kept position, chained
K - 1 times through its own output (entries past the kept positions are
provisional: the next program writes over them).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gdnx.layers.attention import KVCache, RingCache
from gdnx.layers.gated_deltanet import DeltaRuleState
from gdnx.loss import position_scores
from gdnx.layers.latent_attention import LatentCache
from gdnx.models.cache import Cache, attention_entry, place_cache
from gdnx.parallel.rules import constrain
from gdnx.serving import sampling
from gdnx.serving.params import SamplingParams
from gdnx.serving.sampling import SlotParams, TokenLogprobs


class MtpState(NamedTuple):
    """The multi-token prediction drafter's state per slot."""
    cache: KVCache | LatentCache  # [S, capacity, ...]: the module's keys and values (latent attention's latents)
    # [S, H]: the final hidden state at the row's last prefilled position: a prefill that continues the row
    # (a prefix-cache hit, the next block of a prompt) writes that position's entry again from it, the token
    # after it being known only then
    hidden: jax.Array


class Slots(NamedTuple):
    cache: Cache            # per-row lengths [S]
    params: SlotParams      # [S] each
    counts: jax.Array       # int32 [S, V]: each row's generated tokens
    seen: jax.Array         # bool [S, V]: each row's prompt tokens
    generated: jax.Array    # int32 [S]: tokens drawn so far
    last: jax.Array         # int32 [S]: the last token drawn (the next input)
    mtp: MtpState | None    # the drafter's state, with multi-token prediction drafting


class Static(NamedTuple):
    """What every program of one engine fixes (bound by `compile`, not hashed)."""
    graphdef: Any
    config: Any                 # the model's ModelConfig
    row_axes: tuple[int, ...]   # per cache entry: the axis of its rows (1 in a scanned cycle's stack)
    eos_ids: tuple[int, ...]
    logprobs: int               # top-N computed per token
    keep_logits: bool
    mtp_drafts: int             # drafts per pass from the multi-token prediction module (0: it does not draft)
    draft_rows: int             # the most decode rows that draft: a decode over more skips the module


def _take(x, rows, axis):
    # rows past the last slot pad a fixed-size prefill batch: they read a slot and write nowhere
    return jnp.take(x, rows, axis=axis, mode="clip")


def _put(x, rows, y, axis):
    return x.at[(slice(None),) * axis + (rows,)].set(y.astype(x.dtype), mode="drop")


def _where_rows(mask, a, b, axis: int):
    """where(mask[row], a, b) for arrays whose rows lie on `axis`."""
    return jnp.where(mask.reshape((1,) * axis + mask.shape + (1,) * (a.ndim - axis - 1)), a, b)


def _keep_inactive(static: Static, new: Cache, old: Cache, active) -> Cache:
    """The new cache where a row is active; a row that is not (a prompt part
    way through a block-by-block prefill) keeps its GDN states and length.
    Its attention cache only gains an entry at its length, which its next
    prefill block overwrites."""
    def keep(axis, n, o):
        if not isinstance(n, DeltaRuleState):
            return n
        return jax.tree.map(lambda a, b: _where_rows(active, a, b, axis), n._replace(history=None), o)
    return Cache(_map_entries(keep, static, new.layers, old.layers), jnp.where(active, new.length, old.length))


def _map_entries(fn, static: Static, *entries):
    """fn(axis, *parts) over the cache entries (parts: their arrays, None kept)."""
    out = []
    for axis, parts in zip(static.row_axes, zip(*entries), strict=True):
        out.append(fn(axis, *parts))
    return tuple(out)


def strip_returned(entry: Any) -> Any:
    """The entry without what a call returned beside it (GDN states' history, a ring's fresh keys)."""
    if isinstance(entry, DeltaRuleState):
        return entry._replace(history=None)
    return entry._replace(fresh=None) if isinstance(entry, RingCache) else entry


def place(static: Static, slots: Slots) -> Slots:
    """The slot state placed on the ambient mesh (nothing without one): the
    cache as place_cache lays it out, the sampling state's rows over the
    batch axes. Every program ends with it, so the state each program
    donates to the next keeps one layout."""
    def rows(x):
        return constrain(x, ("batch",) + (None,) * (x.ndim - 1))
    mtp = slots.mtp
    if mtp is not None:  # its keys and values as an attention layer's
        mtp = MtpState(place_cache(Cache((mtp.cache,), slots.cache.length), static.config, (0,)).layers[0],
                       rows(mtp.hidden))
    rest = {f: jax.tree.map(rows, getattr(slots, f)) for f in Slots._fields if f not in ("cache", "mtp")}
    return Slots(cache=place_cache(slots.cache, static.config, static.row_axes), mtp=mtp, **rest)


def empty_slots(model: Any, max_slots: int, capacity: int, rollback: int = 0, mtp: bool = False) -> Slots:
    """mtp: with the multi-token prediction drafter's state."""
    cfg = model.config
    vocab, dtype = cfg.vocab_size, jnp.dtype(cfg.dtype)
    zeros = SlotParams.rows([SamplingParams(temperature=0.0)] * max_slots, [0] * max_slots)
    drafter = None
    if mtp:
        drafter = MtpState(attention_entry(cfg, max_slots, capacity), jnp.zeros((max_slots, cfg.hidden_size), dtype))
    return Slots(Cache.init(model, max_slots, capacity, per_row=True, rollback=rollback), zeros,
                 jnp.zeros((max_slots, vocab), jnp.int32), jnp.zeros((max_slots, vocab), bool),
                 jnp.zeros((max_slots,), jnp.int32), jnp.zeros((max_slots,), jnp.int32), drafter)


def _mtp_drafts(model: Any, cache: KVCache | LatentCache, out: jax.Array, position: jax.Array, k: int,
                ) -> tuple[jax.Array, KVCache | LatentCache]:
    """k greedy drafts per row [S, k] from the module's output out [S, H]
    at position [S] (its last kept entry), chaining: each next draft from
    the module at the next position over the previous output and draft
    (entries the next program writes over)."""
    drafts: list[jax.Array] = []
    for j in range(k):
        if j:
            chained, cache = model.mtp_extend(out[:, None], drafts[-1][:, None], cache, position + j)
            out = chained[:, 0]
        drafts.append(jnp.argmax(model.logits(out[:, None])[:, 0], axis=-1).astype(jnp.int32))
    return jnp.stack(drafts, axis=1), cache


def _row_window(x: jax.Array, starts: jax.Array, length: int) -> jax.Array:
    """Each row's [start, start + length) of x [rows, positions, ...]."""
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, length, axis=0))(x, starts)


class PrefillOut(NamedTuple):
    tokens: jax.Array                 # int32 [P]
    logprobs: TokenLogprobs
    logits: jax.Array | None          # float32 [P, V]
    # per cache entry: (conv, recurrent) [.., P, NB, ...] (and a per-layer embedding's (conv, context)), or an
    # attention cache's parts ((k, v) or (latent, rope), and an indexer's) [.., P, L, ...]
    # followed, with multi-token prediction drafting, by the drafter's keys and values (k, v) [P, L, ...] and
    # its final hidden states at block ends (hidden,) [P, NB, H]
    snapshot: tuple | None
    prompt: TokenLogprobs | None      # [P, L], [P, L, N]: each position's next prompt token and the top N
    drafts: jax.Array | None          # int32 [P, K]: each row's next drafts (multi-token prediction drafting)


def prefill(state: nnx.State, slots: Slots, rows: jax.Array, tokens: jax.Array, starts: jax.Array, lengths: jax.Array,
            params: SlotParams, seen: jax.Array, targets: jax.Array | None = None, allowed: jax.Array | None = None,
            follows: jax.Array | None = None, *, static: Static, history_every: int | None,
            ) -> tuple[Slots, PrefillOut]:
    """targets [P, L]: the prompt token after each position, when some row
    asks for its prompt's logprobs (the model's own, from this pass).
    allowed [P, W]: the tokens each row may draw first (a bitmask,
    sampling.allow), when some row's output is constrained. follows [P]:
    the prompt's token after the call's (-1 where the prompt ends in the
    call: the token drawn follows), for the multi-token prediction
    drafter."""
    model = nnx.merge(static.graphdef, state)
    p = tokens.shape[0]
    fresh = starts == 0

    def take(axis, entry):
        entry = jax.tree.map(lambda x: _take(x, rows, axis), entry)
        if isinstance(entry, DeltaRuleState):  # a row not restored from the prefix cache starts from zero states
            entry = jax.tree.map(lambda x: _where_rows(fresh, jnp.zeros_like(x), x, axis), entry)
        return entry

    cache = Cache(_map_entries(take, static, slots.cache.layers), starts)
    out = model.hidden_states(tokens, cache, lengths=lengths, history_every=history_every)
    last = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)
    logits = model.logits(last)[:, 0]
    zero = jnp.zeros((p,), jnp.int32)
    adj = sampling.adjust(logits, params, jnp.zeros_like(logits, jnp.int32), seen, zero, static.eos_ids)
    if allowed is not None:
        adj = sampling.allow(adj, allowed)
    tok = sampling.draw(adj, params, sampling.token_keys(params, zero))
    lp = sampling.logprobs(adj, tok, static.logprobs, params.logprobs)
    new = out.cache
    snapshot = None
    if history_every is not None:
        def snap(axis, entry):
            if isinstance(entry, DeltaRuleState):  # (conv, recurrent) and a per-layer embedding's states
                assert entry.history is not None
                return tuple(x for x in entry.history if x is not None)
            if isinstance(entry, RingCache):  # this call's own keys and values
                assert entry.fresh is not None
                return entry.fresh
            # this call's keys and values: [start, start + L) of each row
            def window(x):  # the length axis follows the rows' (after a scanned cycle's repeats)
                return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, tokens.shape[1], axis=axis),
                                in_axes=(axis, 0), out_axes=axis)(x, starts)
            return tuple(window(x) for x in entry if x is not None)  # a shared-index layer has no indexer's
        snapshot = _map_entries(snap, static, new.layers)

    def put(axis, entry, fresh_entry):
        return jax.tree.map(lambda x, y: _put(x, rows, y, axis), entry, strip_returned(fresh_entry))

    mtp, drafts = slots.mtp, None
    if static.mtp_drafts:
        assert mtp is not None and follows is not None
        held = jax.tree.map(lambda x: _take(x, rows, 0), mtp)
        # the module over the row's positions [start - 1, start + n) (a fresh row's [0, n)): the hidden states
        # at them, the last prefill's or restored one first, and each position's next token, the prompt's or
        # the one drawn
        length = tokens.shape[1]
        hidden = jnp.concatenate([held.hidden[:, None].astype(out.hidden.dtype), out.hidden], axis=1)
        following = jnp.where(follows >= 0, follows, tok)
        nexts = jnp.concatenate([tokens, jnp.zeros((p, 1), tokens.dtype)], axis=1)
        nexts = nexts.at[jnp.arange(p), lengths].set(following)
        shift = fresh.astype(jnp.int32)
        at = jnp.minimum(jnp.arange(length + 1)[None] + shift[:, None], length)
        hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)
        nexts = jnp.take_along_axis(nexts, at, axis=1)
        outs, drafted = model.mtp_extend(hidden, nexts, held.cache, jnp.where(fresh, 0, starts - 1))
        kept = jnp.take_along_axis(outs, (lengths - shift)[:, None, None], axis=1)[:, 0]
        drafts, drafted = _mtp_drafts(model, drafted, kept, starts + lengths - 1, static.mtp_drafts)
        if snapshot is not None:
            assert history_every is not None
            snapshot = (*snapshot, tuple(_row_window(x, starts, length) for x in drafted),
                        (out.hidden[:, history_every - 1::history_every],))
        mtp = jax.tree.map(lambda x, y: _put(x, rows, y, 0), mtp, MtpState(drafted, last[:, 0]))

    vocab = logits.shape[-1]
    slots = Slots(Cache(_map_entries(put, static, slots.cache.layers, new.layers), _put(slots.cache.length, rows,
                                                                                       new.length, 0)),
                  jax.tree.map(lambda x, y: _put(x, rows, y, 0), slots.params, params),
                  _put(slots.counts, rows, jax.nn.one_hot(tok, vocab, dtype=jnp.int32), 0),
                  _put(slots.seen, rows, seen, 0), _put(slots.generated, rows, zero + 1, 0), _put(slots.last, rows, tok, 0),
                  mtp)
    prompt = None
    if targets is not None:  # a block of positions at a time: never the whole [P, L, vocab]
        scores = position_scores(out.hidden, model.logits, targets, vocab=vocab, top=static.logprobs)
        prompt = TokenLogprobs(scores.chosen, scores.top_ids, scores.top)
    return slots, PrefillOut(tok, lp, logits if static.keep_logits else None, snapshot, prompt, drafts)


def restore(slots: Slots, row: jax.Array, layers: tuple, *, static: Static) -> Slots:
    """Write a prefix-cache hit's states into slot `row`: per cache entry
    (conv, recurrent) of a GDN or KDA layer (then a per-layer embedding's
    conv and context), the parts ((k, v), (latent,
    rope), and an indexed layer's indexer entries) [capacity, ...] of an
    attention layer (the hit's tokens first), each without the row axis; with multi-token prediction
    drafting, then the drafter's (k, v) [capacity, ...] and (hidden,) [H]
    at the hit's end."""
    def put(axis, entry, parts):
        # the entry's arrays, in order, past the ones a call adds (a ring's fresh keys, a state's history)
        fields = [f for f in entry._fields if getattr(entry, f) is not None]
        arrays = [getattr(entry, f).at[(slice(None),) * axis + (row,)].set(y.astype(getattr(entry, f).dtype))
                  for f, y in zip(fields, parts, strict=True)]
        return entry._replace(**dict(zip(fields, arrays)))
    main = len(static.row_axes)
    slots = slots._replace(cache=slots.cache._replace(
        layers=_map_entries(put, static, slots.cache.layers, layers[:main])))
    if static.mtp_drafts:
        assert slots.mtp is not None
        (k, v), (hidden,) = layers[main:]
        slots = slots._replace(mtp=MtpState(put(0, slots.mtp.cache, (k, v)),
                                            slots.mtp.hidden.at[row].set(hidden.astype(slots.mtp.hidden.dtype))))
    return slots


class Step(NamedTuple):
    tokens: jax.Array            # int32 [S, n]
    logprobs: TokenLogprobs      # [S, n], [S, n, N]
    logits: jax.Array | None     # float32 [S, n, V]
    drafts: jax.Array | None = None  # int32 [S, K]: each row's next drafts (multi-token prediction drafting)



def _over_rows(static: Static, fn, *slot_states: Slots) -> Slots:
    """fn(axis, *arrays) over the arrays of slot states of one structure,
    axis being their row axis."""
    def entries(axis, *es):
        return jax.tree.map(lambda *xs: fn(axis, *xs), *es)
    layers = _map_entries(entries, static, *(s.cache.layers for s in slot_states))
    rest = {name: jax.tree.map(lambda *xs: fn(0, *xs), *(getattr(s, name) for s in slot_states))
            for name in Slots._fields if name != "cache"}
    return Slots(cache=Cache(layers, fn(0, *(s.cache.length for s in slot_states))), **rest)


def decode(state: nnx.State, slots: Slots, active: jax.Array, allowed: jax.Array, draws: jax.Array, *,
           static: Static, steps: int, rows: int | None = None) -> tuple[Slots, Step]:
    """Up to `steps` tokens per slot: `draws` (an int32 scalar in [1,
    steps]) of them this call, so plain and constrained calls share one
    program per decode batch size. active [S]: the rows decoding (the
    others' states are kept). rows: only the first `rows` slots decode (the
    others are idle), so a step costs what the batch holds rather than
    every slot. allowed [S, W]: the tokens each row may draw (a bitmask,
    sampling.allow; every token for an unconstrained row); a constrained
    row's mask comes from the host after its last token, so a call with a
    constrained row draws one. Step's columns past `draws` are zeros."""
    if rows is not None and rows < slots.last.shape[0]:
        part = _over_rows(static, lambda axis, x: jax.lax.slice_in_dim(x, 0, rows, axis=axis), slots)
        part, step = decode(state, part, active[:rows], allowed[:rows], draws, static=static, steps=steps)
        return _over_rows(static, lambda axis, x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis),
                          slots, part), step
    model = nnx.merge(static.graphdef, state)
    index = jnp.arange(slots.last.shape[0])

    params = sampling.quiet(slots.params, active)
    # the module keeps up only where the engine drafts: under load, decode costs what it costs without it
    drafting = static.mtp_drafts > 0 and slots.last.shape[0] <= static.draft_rows

    # A row that is not active (a prompt part way through a block-by-block prefill) decodes as padding: its
    # GDN states pass through unchanged (gate and beta 0) and its length stays. Selecting the old states
    # after the step instead kept both copies of every slot's states alive, and copied them, each token.
    real = active.astype(jnp.int32)

    def one(slots: Slots, drafter_out: jax.Array) -> tuple[Slots, jax.Array, tuple]:
        out = model.hidden_states(slots.last[:, None], slots.cache, lengths=real)
        logits = model.logits(out.hidden)[:, 0]
        adj = sampling.allow(sampling.adjust(logits, params, slots.counts, slots.seen, slots.generated,
                                             static.eos_ids), allowed)
        tok = sampling.draw(adj, params, sampling.token_keys(params, slots.generated))
        lp = sampling.logprobs(adj, tok, static.logprobs, params.logprobs)
        mtp = slots.mtp
        if drafting:  # the drafter's entry at the input's position, from its hidden state and the draw
            assert mtp is not None
            outs, drafted = model.mtp_extend(out.hidden, tok[:, None], mtp.cache, slots.cache.length)
            mtp, drafter_out = mtp._replace(cache=drafted), outs[:, 0]
        slots = slots._replace(cache=out.cache, counts=slots.counts.at[index, tok].add(1),
                               generated=slots.generated + 1, last=tok, mtp=mtp)
        return slots, drafter_out, (tok, lp, logits.astype(jnp.float32) if static.keep_logits else None)

    # a while loop (not a scan) so that the call stops after `draws` tokens; each token's outputs go into
    # [steps, ...] buffers in place
    s, n, vocab = slots.last.shape[0], static.logprobs, static.config.vocab_size
    buffers = (jnp.zeros((steps, s), jnp.int32),
               TokenLogprobs(jnp.zeros((steps, s), jnp.float32), jnp.zeros((steps, s, n), jnp.int32),
                             jnp.zeros((steps, s, n), jnp.float32)),
               jnp.zeros((steps, s, vocab), jnp.float32) if static.keep_logits else None)

    def body(carry):
        i, slots, drafter_out, buffers = carry
        slots, drafter_out, got = one(slots, drafter_out)
        buffers = jax.tree.map(lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x, i, 0), buffers, got)
        return i + 1, slots, drafter_out, buffers

    # the drafter's output at each row's last kept position ([S, 0] without drafting)
    width = static.config.hidden_size if drafting else 0
    drafter_out = jnp.zeros((s, width), jnp.dtype(static.config.dtype))
    _, slots, drafter_out, (tok, lp, logits) = jax.lax.while_loop(
        lambda c: c[0] < jnp.minimum(draws, steps), body, (jnp.int32(0), slots, drafter_out, buffers))
    drafts = None
    if drafting:
        assert slots.mtp is not None
        drafts, drafted = _mtp_drafts(model, slots.mtp.cache, drafter_out, slots.cache.length - 1,
                                      static.mtp_drafts)
        slots = slots._replace(mtp=slots.mtp._replace(cache=drafted))
    swap = functools.partial(jnp.swapaxes, axis1=0, axis2=1)
    return slots, Step(swap(tok), jax.tree.map(swap, lp), None if logits is None else swap(logits), drafts)


class Verified(NamedTuple):
    step: Step          # [S, K + 1]: the accepted drafts, then the next token (the rest is padding)
    accepted: jax.Array  # int32 [S]


def verify(state: nnx.State, slots: Slots, active: jax.Array, drafts: jax.Array, num_drafts: jax.Array, *,
           static: Static, rows: int | None = None) -> tuple[Slots, Verified]:
    """The last token and drafts [S, K] (the first num_drafts [S] of each
    row real) in one pass, over the first `rows` slots (the others idle,
    as decode's)."""
    if rows is not None and rows < slots.last.shape[0]:
        part = _over_rows(static, lambda axis, x: jax.lax.slice_in_dim(x, 0, rows, axis=axis), slots)
        part, out = verify(state, part, active[:rows], drafts[:rows], num_drafts[:rows], static=static)
        return _over_rows(static, lambda axis, x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis),
                          slots, part), out
    model = nnx.merge(static.graphdef, state)
    s, k = drafts.shape
    tokens = jnp.concatenate([slots.last[:, None], drafts], axis=1)
    out = model.hidden_states(tokens, slots.cache, history_every=1)
    logits = model.logits(out.hidden)                                          # [S, K + 1, V]
    vocab = logits.shape[-1]
    real = (jnp.arange(k)[None] < num_drafts[:, None])[..., None]
    drafted = jax.nn.one_hot(drafts, vocab, dtype=jnp.int32) * real           # [S, K, V]
    before = jnp.concatenate([jnp.zeros((s, 1, vocab), jnp.int32), jnp.cumsum(drafted, axis=1)], axis=1)
    position = jnp.arange(k + 1, dtype=jnp.int32)

    params = sampling.quiet(slots.params, active)

    adj = sampling.adjust_positions(logits, params, slots.counts[:, None] + before, slots.seen, slots.generated,
                                    static.eos_ids)
    verdict = sampling.accept(adj, drafts, num_drafts, params, slots.generated)
    a = verdict.accepted
    emitted = jnp.where(position[None] < a[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                        verdict.next[:, None])                                  # [S, K + 1]
    flat = sampling.logprobs(adj.reshape(s * (k + 1), vocab), emitted.reshape(-1), static.logprobs,
                             jnp.repeat(jnp.asarray(params.logprobs), k + 1))
    lp = jax.tree.map(lambda x: x.reshape(s, k + 1, *x.shape[1:]), flat)

    def select(axis, entry):
        if not isinstance(entry, DeltaRuleState):
            return strip_returned(entry)
        assert entry.history is not None
        pick = jax.vmap(lambda h, i: h[:, i] if axis else h[i], in_axes=(axis, 0), out_axes=axis)
        return DeltaRuleState(*(None if h is None else pick(h, a) for h in entry.history[:2]), None,
                              *(None if h is None else pick(h, a) for h in entry.history[2:]))

    cache = _keep_inactive(static, Cache(_map_entries(select, static, out.cache.layers), slots.cache.length + a + 1),
                           slots.cache, active)
    mtp, next_drafts = slots.mtp, None
    if static.mtp_drafts:  # the drafter's entries at the pass's positions: those past the kept ones are overwritten
        assert mtp is not None
        outs, mtp_cache = model.mtp_extend(out.hidden, emitted, mtp.cache, slots.cache.length)
        kept_out = jnp.take_along_axis(outs, a[:, None, None], axis=1)[:, 0]
        next_drafts, mtp_cache = _mtp_drafts(model, mtp_cache, kept_out, slots.cache.length + a, static.mtp_drafts)
        mtp = mtp._replace(cache=mtp_cache)
    kept = (position[None] <= a[:, None])[..., None]
    counts = slots.counts + jnp.sum(jax.nn.one_hot(emitted, vocab, dtype=jnp.int32) * kept, axis=1)
    slots = slots._replace(cache=cache, counts=counts, generated=slots.generated + a + 1, last=verdict.next, mtp=mtp)
    return slots, Verified(Step(emitted, lp, logits if static.keep_logits else None, next_drafts), a)


class Programs(NamedTuple):
    prefill: Any
    restore: Any
    decode: Any
    verify: Any


def compile_programs(static: Static) -> Programs:
    """The programs of one engine, jitted with its settings bound (the slot
    state donated: every program updates it in place)."""
    def jit(fn, *static_names):
        bound = functools.partial(fn, static=static)

        def placed(*args, **kwargs):
            out = bound(*args, **kwargs)
            return place(static, out) if isinstance(out, Slots) else (place(static, out[0]), out[1])
        placed.__name__ = fn.__name__
        placed.__signature__ = inspect.signature(bound)  # jit reads the argument names
        return jax.jit(placed, static_argnames=static_names, donate_argnames=("slots",))
    return Programs(jit(prefill, "history_every"), jit(restore), jit(decode, "steps", "rows"), jit(verify, "rows"))
