"""The trainer's log-probabilities of drawn completions computed as the
serving engine computes them in batch-invariant mode: each prompt
prefilled one block at a time in calls of the engine's prefill rows, then
each completion token read back through one decode step over the engine's
slots, against caches of the engine's capacity. Every array a step sees
has the shape the engine's program gave it, so the float operations, and
their blocking, are the engine's: compiled on their own, the
log-probabilities are the sampler's, bit for bit. The trainer takes its
gradient from one pass over the rows instead (the same gradient to float
rounding, at a fraction of a scan of decode steps' backward).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.models.cache import Cache, row_axes
from gdnx.rl.objective import Array
from gdnx.serving.programs import strip_returned


class ReplayShapes(NamedTuple):
    """The engine's shapes the replay keeps (EngineShapes and its settings)."""
    slots: int         # decode rows (max_slots)
    prefill_rows: int  # prompts per prefill call
    block: int         # tokens per prefill call
    capacity: int      # each row's cache


class ReplayBatch(NamedTuple):
    """[slots] rows: prompts in blocks and the completions to score."""
    blocks: Array        # int32 [slots, K, block]: each prompt's blocks, right-padded
    block_lengths: Array  # int32 [slots, K]: real tokens per block (0: past the prompt)
    completions: Array   # int32 [slots, N]: the drawn tokens, padded


def replay_batch(prompts: list[list[int]], completions: list[list[int]], shapes: ReplayShapes,
                 max_new_tokens: int) -> ReplayBatch:
    """The host arrays of a replay (rows past the prompts given are padding)."""
    blocks_needed = max(-(-len(p) // shapes.block) for p in prompts)
    blocks = np.zeros((shapes.slots, blocks_needed, shapes.block), np.int32)
    lengths = np.zeros((shapes.slots, blocks_needed), np.int32)
    drawn = np.zeros((shapes.slots, max_new_tokens), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        for k in range(-(-len(p) // shapes.block)):
            part = p[k * shapes.block:(k + 1) * shapes.block]
            blocks[i, k, :len(part)] = part
            lengths[i, k] = len(part)
        drawn[i, :len(c)] = c
    return ReplayBatch(blocks, lengths, drawn)


def replay_logprobs(model, batch: ReplayBatch, shapes: ReplayShapes) -> jax.Array:
    """float32 [slots, N]: log-probability of each completion token (the
    first from the prompt's last prefill, the rest from decode steps)."""
    s, p = shapes.slots, shapes.prefill_rows
    blocks, block_lengths = jnp.asarray(batch.blocks), jnp.asarray(batch.block_lengths)
    axes = row_axes(model)  # each cache entry's axis of rows (a scanned cycle's: after its repeats)
    drawn = jnp.asarray(batch.completions)
    cache = Cache.init(model, s, shapes.capacity, per_row=True)
    # each completion's first token's log-probability, from its prompt's last prefill call: computed there, on
    # the call's rows (a reduction's rounding may follow its operand's shape)
    first = jnp.zeros((s,), jnp.float32)
    for k in range(blocks.shape[1]):  # one prefill call per block of each prompt, p rows at a time
        for g in range(0, s, p):
            n = min(p, s - g)
            lengths = _rows(block_lengths[:, k], 0, g, n, p)
            active = lengths > 0  # a row whose prompt ended runs as padding and keeps its states
            part = tuple(jax.tree.map(lambda x, a=a: _rows(x, a, g, n, p), entry)
                         for entry, a in zip(cache.layers, axes, strict=True))
            out = model.hidden_states(_rows(blocks[:, k], 0, g, n, p),
                                      Cache(part, _rows(cache.length, 0, g, n, p)), lengths=jnp.maximum(lengths, 1))
            last = jnp.take_along_axis(out.hidden, (jnp.maximum(lengths, 1) - 1)[:, None, None], axis=1)
            logits = model.logits(last)[:, 0]
            layers = []
            for full, old, new, a in zip(cache.layers, part, out.cache.layers, axes, strict=True):
                kept = jax.tree.map(lambda o, x, a=a: _where_rows(active, x, o, a), old, strip_returned(new))
                layers.append(jax.tree.map(
                    lambda f, x, a=a: jax.lax.dynamic_update_slice_in_dim(f, jax.lax.slice_in_dim(x, 0, n, axis=a),
                                                                          g, axis=a), full, kept))
            length = jnp.where(active, out.cache.length, _rows(cache.length, 0, g, n, p))
            cache = Cache(tuple(layers), jax.lax.dynamic_update_slice_in_dim(cache.length, length[:n], g, 0))
            chosen = jnp.where(active, _chosen(logits, _rows(drawn[:, 0], 0, g, n, p)), _rows(first, 0, g, n, p))
            first = jax.lax.dynamic_update_slice_in_dim(first, chosen[:n], g, 0)

    def step(cache, token_and_next):
        token, following = token_and_next
        out = model.hidden_states(token[:, None], cache)
        logits = model.logits(out.hidden)[:, 0]
        return out.cache, _chosen(logits, following)

    _, rest = jax.lax.scan(step, cache, (drawn[:, :-1].T, drawn[:, 1:].T))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def _chosen(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]


def _rows(x: jax.Array, axis: int, start: int, n: int, rows: int) -> jax.Array:
    """Rows [start, start + n) of x along `axis`, zero-padded to `rows`."""
    part = jax.lax.slice_in_dim(x, start, start + n, axis=axis)
    return jnp.pad(part, [(0, rows - n) if i == axis else (0, 0) for i in range(x.ndim)])


def _where_rows(active: jax.Array, new: jax.Array, old: jax.Array, axis: int) -> jax.Array:
    return jnp.where(active.reshape((1,) * axis + active.shape + (1,) * (new.ndim - axis - 1)), new, old)
