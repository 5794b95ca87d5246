"""Qwen4-Exp's hashed n-gram embeddings: per layer that has them, each
token's 2..n-grams (the token and the ones before it within its document,
end-of-sequence tokens resetting the context) hashed into `heads_per_ngram`
tables per n-gram size, each table a prime number of rows, their rows
concatenated.

The ids are computed on the host (`NGramHash`, numpy int64 with the
wrapping multiplication and XOR transformers' torch code does on int64):
no 64-bit arithmetic on the device, which TPUs lack and JAX runs 32-bit by
default. The device gets int32 row ids into one concatenated table
(`NGramEmbedding`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _primes_after(start: int, count: int) -> list[int]:
    """The first `count` primes greater than `start`."""
    out: list[int] = []
    n = start
    while len(out) < count:
        n += 1
        if _is_prime(n):
            out.append(n)
    return out


class NGramHash(NamedTuple):
    """One layer's hashing (what its tables are, on the host)."""
    ngram_size: int
    heads_per_ngram: int
    multipliers: tuple[int, ...]   # one odd int64 per position in the n-gram
    sizes: tuple[int, ...]         # rows per table (primes), [(ngram_size - 1) * heads_per_ngram]
    offsets: tuple[int, ...]       # each table's first row in the concatenated table
    rows: int                      # the concatenated table's rows, padded to a multiple
    eos: int

    @classmethod
    def build(cls, *, vocab_size: int, ngram_size: int, heads_per_ngram: int, vocab_base: int, layer_index: int,
              seed: int, divisible_by: int, eos: int) -> NGramHash:
        """layer_index: the layer's place among the layers that have tables
        (its tables' primes follow the previous layers')."""
        if ngram_size < 2 or heads_per_ngram < 1:
            raise ValueError(f"ngram_size, heads_per_ngram: expected >= 2 and >= 1, got {ngram_size}, "
                             f"{heads_per_ngram}")
        heads = (ngram_size - 1) * heads_per_ngram
        sizes = _primes_after(vocab_base - 1, (layer_index + 1) * heads)[layer_index * heads:]
        offsets = tuple(int(x) for x in np.cumsum([0, *sizes[:-1]]))
        half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
        base = seed + _LAYER_PRIME * layer_index
        multipliers = tuple(2 * (_splitmix64((base + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half) + 1
                            for i in range(ngram_size))
        rows = math.ceil(sum(sizes) / divisible_by) * divisible_by
        if rows >= 2 ** 31:
            raise ValueError(f"ngram tables: {rows} rows do not fit int32 row ids")
        return cls(ngram_size, heads_per_ngram, multipliers, tuple(sizes), offsets, rows, eos)

    def ids(self, tokens: np.ndarray, context: np.ndarray | None = None) -> np.ndarray:
        """int32 [B, T, heads] row ids of tokens [B, T], continuing after
        `context` [B, ngram_size - 1] (the row's previous tokens; None: a
        sequence's start, as end-of-sequence tokens)."""
        tokens = np.asarray(tokens, np.int64)
        b, t = tokens.shape
        n = self.ngram_size
        if context is None:
            context = np.full((b, n - 1), self.eos, np.int64)
        history = np.concatenate([np.asarray(context, np.int64), tokens], axis=1)
        positions = np.arange(history.shape[1])
        # each position's document start: just after the last end-of-sequence token before it
        eos_at = np.where(history == self.eos, positions, -1)
        last = np.maximum.accumulate(eos_at, axis=1)
        start = np.concatenate([np.full((b, 1), -1), last[:, :-1]], axis=1) + 1
        within = positions[None] - start
        with np.errstate(over="ignore"):  # int64 products wrap, as transformers' torch int64 does
            mixed = None
            blocks = []
            for k in range(n):
                source = np.clip(positions - k, 0, None)
                shifted = np.where((within >= k) & (positions[None] - k >= 0), history[:, source], self.eos)
                term = shifted * np.int64(self.multipliers[k])  # each < 2^63
                mixed = term if mixed is None else mixed ^ term
                if k == 0:
                    continue
                heads = slice((k - 1) * self.heads_per_ngram, k * self.heads_per_ngram)
                sizes = np.asarray(self.sizes[heads], np.int64)
                blocks.append(np.remainder(mixed[..., None], sizes) + np.asarray(self.offsets[heads], np.int64))
        return np.concatenate(blocks, axis=-1)[:, -t:].astype(np.int32)


class NGramEmbedding(nnx.Module):
    """The concatenated tables [rows, head_dim]: row ids [B, T, heads] ->
    [B, T, heads * head_dim]."""

    def __init__(self, rows: int, head_dim: int, *, init_std: float, param_dtype: DTypeLike, rngs: nnx.Rngs):
        self.table = nnx.Param(nnx.initializers.normal(init_std)(rngs.params(), (rows, head_dim), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        out = jnp.take(self.table[...], ids, axis=0)
        return out.reshape(*ids.shape[:-1], -1)
