"""A scanned cycle's cache entries, stacked over its repeats: each repeat's
entry read at its index and written back there, so that a decode step
updates the stacks in place in the scan's carry (gdnx.models.causal_lm).

Attention's caches (KVCache, LatentCache) and a delta-rule layer's recurrent
states stay stacked, marked with the repeat (KVStack, LatentStack,
StateStack): the layer writes into the stack itself. Everything else is
sliced out and written back.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax

from gdnx.layers.attention import KVCache, KVStack
from gdnx.layers.gated_deltanet import DeltaRuleState
from gdnx.layers.latent_attention import LatentCache, LatentStack
from gdnx.ops.delta_rule.decode_step import StateStack
from gdnx.parallel.rules import as_layout_of, as_repeat_of

# the caches attention writes into a scanned cycle's stack itself (given as KVStack / LatentStack)
_STACKS = (KVCache, LatentCache)


def entry_at(stacked: Any, index: jax.Array) -> Any:
    """Repeat `index`'s entry of a scanned cycle's stacked cache entry: an
    attention cache (KVCache, LatentCache) stays stacked, marked with the
    repeat (attention writes its few new positions into the stack itself),
    as does a delta-rule layer's recurrent state (a decode step updates it in
    place); the others are sliced out."""
    if isinstance(stacked, KVCache):
        return KVStack(stacked.k, stacked.v, index)
    if isinstance(stacked, LatentCache):
        return LatentStack(stacked.latent, stacked.rope, index)
    sliced = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False), stacked)
    if isinstance(stacked, DeltaRuleState):
        return sliced._replace(recurrent=StateStack(cast(jax.Array, stacked.recurrent), index))
    return sliced


def unstacked(entry: Any) -> Any:
    """A layer's returned entry as the stacked cache entry it updated."""
    if isinstance(entry, KVStack):
        return KVCache(entry.k, entry.v)
    if isinstance(entry, LatentStack):
        return LatentCache(entry.latent, entry.rope)
    if isinstance(entry, DeltaRuleState) and isinstance(entry.recurrent, StateStack):
        return entry._replace(recurrent=entry.recurrent.stack)
    return entry


def written(held: Any, kept: Any, index: jax.Array) -> Any:
    """A repeat's kept entry written into the stacked one at `index`, but
    for what the layer wrote into the stack itself (attention's positions,
    a delta-rule layer's recurrent state)."""
    if isinstance(kept, _STACKS):
        return kept
    write = functools.partial(_write_at, index=index)
    if isinstance(kept, DeltaRuleState):
        rest = {f: jax.tree.map(write, getattr(held, f), getattr(kept, f)) for f in kept._fields if f != "recurrent"}
        # on an Explicit mesh the op may hand the stack back in its own layout (heads split over tensor)
        stack = as_layout_of(cast(jax.Array, kept.recurrent), cast(jax.Array, held.recurrent))
        return kept._replace(recurrent=stack, **rest)
    return jax.tree.map(write, held, kept)


def _write_at(stack: jax.Array, x: jax.Array, index: jax.Array) -> jax.Array:
    """x written as repeat `index` of `stack`, in the stack's layout (on an
    Explicit mesh the layer may leave x in another)."""
    return jax.lax.dynamic_update_index_in_dim(stack, as_repeat_of(x, stack).astype(stack.dtype), index, 0)


def split_entry(new: Any, old: Any) -> tuple[Any, Any]:
    """A layer's new cache entry split into the fields its old entry has
    (carried through the scan) and those a call adds (a RingCache's fresh
    keys, a delta-rule state's history: stacked as the scan's outputs)."""
    added = [f for f in new._fields if getattr(old, f) is None]
    return (new._replace(**dict.fromkeys(added)),
            new._replace(**{f: None for f in new._fields if f not in added}))


def join_entry(kept: Any, extra: Any) -> Any:
    """split_entry's halves back into one entry."""
    return kept._replace(**{f: getattr(extra, f) for f in kept._fields if getattr(kept, f) is None})
