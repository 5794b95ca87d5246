"""Multi-query associative recall (MQAR), generated on the fly.

A row is `k1 v1 k2 v2 ... kN vN` (N distinct keys, each with a random
value), then query pairs `k v` until the row is full, each query a random
key of the N whose answer is its value. Keys are tokens [0, num_keys),
values [num_keys, num_keys + num_values). The model is scored on the token
after each query key (the answer) only. A key can be queried more than once,
and a later answer can then be copied from an earlier query; `first` marks
each key's first query, whose answer only recall can give.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mqar_batch(key: jax.Array, batch: int, seq_len: int, num_pairs: int, num_keys: int, num_values: int,
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(inputs, targets, answer mask, first-query mask), each [batch, seq_len]."""
    if 2 * num_pairs + 2 > seq_len + 1:
        raise ValueError(f"seq_len: {num_pairs} pairs need seq_len >= {2 * num_pairs + 1}, got {seq_len}")
    num_queries = (seq_len + 1 - 2 * num_pairs) // 2
    k_keys, k_vals, k_q = jax.random.split(key, 3)
    keys = jax.vmap(lambda k: jax.random.permutation(k, num_keys)[:num_pairs])(jax.random.split(k_keys, batch))
    values = num_keys + jax.random.randint(k_vals, (batch, num_pairs), 0, num_values)
    which = jax.random.randint(k_q, (batch, num_queries), 0, num_pairs)
    q_keys = jnp.take_along_axis(keys, which, axis=1)
    q_vals = jnp.take_along_axis(values, which, axis=1)
    context = jnp.stack([keys, values], axis=-1).reshape(batch, -1)
    queries = jnp.stack([q_keys, q_vals], axis=-1).reshape(batch, -1)
    pad = seq_len + 1 - context.shape[1] - queries.shape[1]
    seq = jnp.concatenate([context, queries, jnp.zeros((batch, pad), keys.dtype)], axis=1).astype(jnp.int32)
    # the input position of each query key is where the answer is predicted
    answer = jnp.zeros((batch, seq_len + 1), bool).at[:, 2 * num_pairs:2 * num_pairs + 2 * num_queries:2].set(True)
    earlier = jnp.tril(which[:, :, None] == which[:, None, :], k=-1).any(-1)
    first = jnp.zeros((batch, seq_len + 1), bool).at[:, 2 * num_pairs:2 * num_pairs + 2 * num_queries:2].set(~earlier)
    return seq[:, :-1], seq[:, 1:], answer[:, :-1], first[:, :-1]
