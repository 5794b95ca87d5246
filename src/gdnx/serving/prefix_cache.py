"""The prefix cache: model states at block ends, keyed by the tokens before.

A block is `block_size` tokens; block i of a prompt is keyed by a digest
chain over blocks 0..i (BLAKE2b, 128 bits: collision-resistant, so a
client cannot craft a prompt whose key names another prefix's states, as
it could with Python's unkeyed hash of integers), so an entry stands for
its whole prefix. An entry
holds what continuing after the block needs: each GDN layer's conv and
recurrent state at the block's end, and each attention layer's keys and
values for the block's tokens (with a multi-token prediction drafter, its
keys and values too, and the model's final hidden state at the block's
end). Entries live in host memory, least recently
used evicted first once their bytes pass the budget.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

Key = bytes


class CacheEntries(NamedTuple):
    """How the model's cache entries sit in the engine's slot state."""
    row_axes: tuple[int, ...]      # per entry: the axis of its rows (1 in a scanned cycle's stack)
    # per entry: arrays at a block's end (a GDN or KDA layer's (conv, recurrent)), else per token (attention's
    # (k, v) or (latent, rope))
    is_state: tuple[bool, ...]
    rings: tuple[int | None, ...]  # per entry: a sliding window's ring size (position p at slot p % ring), else None
    capacity: int                  # tokens a slot's cache holds


@dataclasses.dataclass
class Block:
    tokens: tuple[int, ...]
    # per cache entry: (conv, recurrent) of a GDN or KDA layer, (k, v) or (latent, rope) of an attention layer
    layers: list[tuple[np.ndarray, ...]]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for parts in self.layers for part in parts)


class PrefixCache:
    """Blocks of model states in host memory, and the arrays they become:
    a hit's states for a slot (`slot_layers`), a prefill's snapshots as
    blocks (`store`). entries: how the slot state holds each cache entry
    (None: keys and matching only)."""

    def __init__(self, capacity_bytes: int, block_size: int, entries: CacheEntries | None = None):
        self.capacity = capacity_bytes
        self.block_size = block_size
        self.entries = entries
        self._blocks: collections.OrderedDict[Key, Block] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.lookups = 0  # blocks found / blocks looked up

    def keys(self, tokens: Sequence[int], blocks: int) -> list[Key]:
        """The chain keys of the first `blocks` blocks of `tokens`."""
        keys: list[Key] = []
        parent = b""
        for i in range(blocks):
            block = np.asarray(tokens[i * self.block_size:(i + 1) * self.block_size], np.int64).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            keys.append(parent)
        return keys

    def match(self, tokens: Sequence[int], limit: int) -> list[Block]:
        """The cached blocks that start `tokens`, at most `limit`."""
        found = []
        for i, key in enumerate(self.keys(tokens, limit)):
            block = self._blocks.get(key)
            if block is None or block.tokens != tuple(tokens[i * self.block_size:(i + 1) * self.block_size]):
                break
            self._blocks.move_to_end(key)
            found.append(block)
        self.lookups += limit
        self.hits += len(found)
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0

    def put(self, key: Key, block: Block) -> None:
        if key in self._blocks or block.nbytes > self.capacity:
            return
        self._blocks[key] = block
        self.bytes += block.nbytes
        while self.bytes > self.capacity:
            _, old = self._blocks.popitem(last=False)
            self.bytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._blocks)

    def slot_layers(self, blocks: list[Block]) -> tuple:
        """The arrays a slot gets from hit blocks (the prompt's first ones):
        per cache entry, a GDN or KDA layer's (conv, recurrent) at the last
        block's end, an attention layer's two parts of every block at their
        positions (the slots of a ring), each without the row axis."""
        entries = self.entries
        assert entries is not None  # an engine's cache knows its entries
        start = len(blocks) * self.block_size
        layers = []
        for i, axis in enumerate(entries.row_axes):
            if entries.is_state[i]:
                layers.append(blocks[-1].layers[i])
                continue
            ring = entries.rings[i] if entries.rings else None

            def whole(j: int, part: np.ndarray) -> np.ndarray:
                shape = list(part.shape)
                shape[axis] = entries.capacity if ring is None else ring
                out = np.zeros(shape, part.dtype)
                seen = np.concatenate([blk.layers[i][j] for blk in blocks], axis=axis)
                if ring is None:
                    out[(slice(None),) * axis + (slice(0, start),)] = seen
                else:  # the last `ring` positions, position p at slot p % ring
                    kept = np.arange(max(0, start - ring), start)
                    out[(slice(None),) * axis + (kept % ring,)] = np.take(seen, kept, axis=axis)
                return out
            layers.append(tuple(whole(j, part) for j, part in enumerate(blocks[-1].layers[i])))
        return tuple(layers)

    def store(self, prompt: Sequence[int], row: int, start: int, length: int, snapshot: tuple) -> None:
        """Keep the blocks a prefill call completed for one prompt: its row
        `row` of the call's snapshot (per cache entry, the per-block states
        or the call's keys and values), which covered [start, start + length)."""
        assert self.entries is not None
        bs = self.block_size
        first, end = start // bs, (start + length) // bs
        keys = self.keys(prompt, end)
        for j in range(first, end):
            if keys[j] in self:
                continue
            local = j - first
            layers = []
            for e, axis in enumerate(self.entries.row_axes):
                pick = (slice(None),) * axis + (row,)
                if self.entries.is_state[e]:
                    at = (slice(None),) * axis + (local,)
                else:
                    at = (slice(None),) * axis + (slice(local * bs, (local + 1) * bs),)
                layers.append(tuple(np.array(part[pick][at]) for part in snapshot[e]))
            self.put(keys[j], Block(tuple(prompt[j * bs:(j + 1) * bs]), layers))
