"""The prefix cache: model states at block ends, keyed by the tokens before.

A block is `block_size` tokens; block i of a prompt is keyed by a digest
chain over blocks 0..i (BLAKE2b, 128 bits: collision-resistant, so a
client cannot craft a prompt whose key names another prefix's states, as
it could with Python's unkeyed hash of integers), so an entry stands for
its whole prefix. An entry
holds what continuing after the block needs: each GDN layer's conv and
recurrent state at the block's end, and each attention layer's keys and
values for the block's tokens. Entries live in host memory, least recently
used evicted first once their bytes pass the budget.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

Key = bytes


@dataclasses.dataclass
class Block:
    tokens: tuple[int, ...]
    # per cache entry of the model: (conv, recurrent) of a GDN or KDA layer, (k, v) or (latent, rope)
    # of an attention layer
    layers: list[tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers)


class PrefixCache:
    def __init__(self, capacity_bytes: int, block_size: int):
        self.capacity = capacity_bytes
        self.block_size = block_size
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
