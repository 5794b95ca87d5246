"""Batches by step number: batch s depends only on (seed, s), so a resumed
run sees exactly the data an uninterrupted one would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gdnx.config.schema import DataConfig
from gdnx.data.mqar import mqar_batch
from gdnx.data.text import Tokenizer, make_tokenizer, token_stream


class Batch(NamedTuple):
    inputs: jax.Array   # int32 [B, T]
    targets: jax.Array  # int32 [B, T]
    mask: jax.Array     # bool [B, T]: positions that count in loss and accuracy
    first: jax.Array    # bool [B, T]: MQAR first queries (all of mask for text)


def make_source(data_cfg: DataConfig, batch_size: int, vocab_size: int,
                ) -> tuple[Callable[[int], Callable[[jax.Array], Batch]], Tokenizer | None]:
    """(batches, tokenizer): batches(seed) -> batch_fn(step) -> Batch, jit-able
    in step. The data (a tokenized file) is prepared once for every seed;
    the tokenizer is None for MQAR."""
    if data_cfg.source == "mqar":
        def mqar_batches(seed):
            base = jax.random.fold_in(jax.random.key(seed), 0x5EED)

            def batch_fn(step):
                return Batch(*mqar_batch(jax.random.fold_in(base, step), batch_size, data_cfg.seq_len,
                                         data_cfg.num_pairs, data_cfg.num_keys, data_cfg.num_values))
            return batch_fn
        return mqar_batches, None
    tokenizer = make_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"model.vocab_size: the tokenizer has {tokenizer.vocab_size} tokens, "
                          f"the model {vocab_size}")
    assert data_cfg.path is not None  # DataConfig requires it for text sources
    stream = jnp.asarray(token_stream(Path(data_cfg.path), tokenizer))
    span = data_cfg.seq_len + 1
    if stream.shape[0] < span:
        raise ValueError(f"data.path: {data_cfg.path} has {stream.shape[0]} tokens, fewer than "
                          f"data.seq_len + 1 = {span}")

    def batches(seed):
        base = jax.random.fold_in(jax.random.key(seed), 0x5EED)

        def batch_fn(step):
            starts = jax.random.randint(jax.random.fold_in(base, step), (batch_size,), 0,
                                        stream.shape[0] - span + 1)
            rows = jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (span,)))(starts)
            ones = jnp.ones((batch_size, data_cfg.seq_len), bool)
            return Batch(rows[:, :-1], rows[:, 1:], ones, ones)
        return batch_fn
    return batches, tokenizer
