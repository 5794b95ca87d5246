"""Document boundaries in packed rows: segments [B, T] number each token's
document within its row (non-decreasing along T)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdnx.parallel.rules import constrain


def document_starts(segments: jax.Array) -> jax.Array:
    """bool [B, T]: the first token of each document (and of each row)."""
    whole = constrain(segments, ("batch", None))  # the shift needs the length axis on one device
    earlier = jnp.pad(whole, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
    return constrain(whole != earlier, ("batch", "length"))


def document_positions(segments: jax.Array) -> jax.Array:
    """Each token's position within its document: int32 [B, T]."""
    starts = constrain(document_starts(segments), ("batch", None))
    t = jnp.broadcast_to(jnp.arange(segments.shape[1], dtype=jnp.int32), segments.shape)
    return constrain(t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1), ("batch", "length"))
