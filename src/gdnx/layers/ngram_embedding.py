"""Qwen4-Exp's hashed n-gram embeddings: per layer that has them, each
token's 2..n-grams (the token and the ones before it within its document,
end-of-sequence tokens resetting the context) hashed into `heads_per_ngram`
tables per n-gram size, each table a prime number of rows, their rows
concatenated.

transformers hashes in int64 (wrapping products, XOR, a remainder by
each table's prime). TPUs have no 64-bit integers and JAX runs 32-bit by
default, so gdnx computes the same ids two ways, neither with 64-bit
arithmetic on the device: `NGramHash.ids` on the host (numpy int64, the
reference), and `NGramHash.device_ids` inside the model's program from
the token ids, each 64-bit value as two uint32 halves (products from
16-bit limbs, the remainder by Horner steps that stay below 2^32). The
model hashes on the device so that everything that runs it (training
steps, generation, serving) needs only the tokens; the ids are int32 rows
of one concatenated table (`NGramEmbedding`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from gdnx.parallel.rules import out_sharding

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


def _primes_after(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes greater than `start` (a layer's tables
    follow the earlier layers': the longer list extends the shorter)."""
    # the longest list already found that this one extends
    known = max((v for (s, c), v in _found.items() if s == start and c <= count), key=len, default=())
    out: list[int] = list(known)
    n = known[-1] if known else start
    while len(out) < count:
        n += 1
        if _is_prime(n):
            out.append(n)
    _found[(start, count)] = tuple(out)
    return tuple(out)


_found: dict[tuple[int, int], tuple[int, ...]] = {}


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


    def device_ids(self, tokens: jax.Array, context: jax.Array | None = None,
                   segments: jax.Array | None = None) -> jax.Array:
        """As `ids`, traced: int32 [B, T, heads] from int32 tokens [B, T]
        (non-negative) after `context` [B, ngram_size - 1]; segments [B, T]:
        packed documents, each starting its n-grams afresh as after an
        end-of-sequence token."""
        t, n = tokens.shape[1], self.ngram_size
        tokens = tokens.astype(jnp.int32)
        # a sequence's start: positions before it read as end-of-sequence (no concatenation, which an Explicit
        # mesh refuses between a sharded and an unsharded operand)
        history = tokens if context is None else jnp.concatenate([context.astype(jnp.int32), tokens], axis=1)
        positions = jnp.arange(history.shape[1], dtype=jnp.int32)
        eos_at = jnp.where(history == self.eos, positions, -1)
        # each position's document start: just after the last end-of-sequence token before it
        start = _shift_right(jax.lax.cummax(eos_at, axis=1), -1) + 1
        if segments is not None:  # (without context) a packed document's first token starts afresh
            seg = segments.astype(jnp.int32)
            first = seg != _shift_right(seg, -1)
            start = jnp.maximum(start, jax.lax.cummax(jnp.where(first, positions, 0), axis=1))
        within = positions[None] - start
        hi = lo = jnp.zeros(history.shape, jnp.uint32)
        blocks = []
        for k in range(n):
            shifted = jnp.where(within >= k, _shift_right(history, self.eos, k), self.eos).astype(jnp.uint32)
            m = self.multipliers[k]
            t_hi, t_lo = _mul_wide(shifted, np.uint32(m & 0xFFFFFFFF))
            t_hi = t_hi + shifted * np.uint32(m >> 32)
            hi, lo = hi ^ t_hi, lo ^ t_lo
            if k == 0:
                continue
            heads = slice((k - 1) * self.heads_per_ngram, k * self.heads_per_ngram)
            primes = np.asarray(self.sizes[heads], np.int64)
            rem = _remainder_signed64(hi[..., None], lo[..., None], primes)
            blocks.append(rem + jnp.asarray(self.offsets[heads], jnp.int32))
        return jnp.concatenate(blocks, axis=-1)[:, -t:]


def _shift_right(x: jax.Array, fill: int, by: int = 1) -> jax.Array:
    """x [B, T] moved `by` positions along T, `fill` in front."""
    if by == 0:
        return x
    return jnp.pad(x, ((0, 0), (by, 0)), constant_values=fill)[:, :x.shape[1]]


def ngram_hash(cfg: Any, layer: int) -> NGramHash:
    """The n-gram hashing of layer `layer`'s per-layer embedding, from a
    model config (gdnx.config.ModelConfig: `layer` one of its ple_layers,
    whose tables' primes follow the earlier PLE layers')."""
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    if eos is None:
        raise ValueError("model.eos_token_id: the n-gram context restarts after end-of-sequence; set its id")
    return NGramHash.build(vocab_size=cfg.vocab_size, ngram_size=cfg.ngram_size, heads_per_ngram=cfg.heads_per_ngram,
                           vocab_base=cfg.ngram_vocab_base, layer_index=sorted(cfg.ple_layers).index(layer),
                           seed=cfg.ngram_seed, divisible_by=cfg.ngram_rows_multiple, eos=eos)


def _mul_wide(a: jax.Array, b: np.uint32) -> tuple[jax.Array, jax.Array]:
    """The 64-bit product of uint32 a and b as (high, low) uint32 halves."""
    mask = np.uint32(0xFFFF)
    a0, a1 = a & mask, a >> 16
    b0, b1 = np.uint32(b & 0xFFFF), np.uint32(b >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & mask) + (p10 & mask)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), (p00 & mask) | (mid << 16)


def _mulmod(x: jax.Array, y: np.ndarray, primes: np.ndarray) -> jax.Array:
    """x * y mod p (x uint32 < p, y host constants < p, per prime p < 2^31),
    by Horner steps over y's bits `w` at a time with p * 2^w <= 2^32 so that
    nothing exceeds 32 bits."""
    bits = int(primes.max()).bit_length()
    w = 32 - bits
    p = jnp.asarray(primes, jnp.uint32)
    acc = jnp.zeros_like(x)
    for shift in range(-(-bits // w) * w - w, -1, -w):
        chunk = jnp.asarray((y >> shift) & ((1 << w) - 1), jnp.uint32)
        acc = ((acc << w) % p + (x * chunk) % p) % p
    return acc


def _remainder_signed64(hi: jax.Array, lo: jax.Array, primes: np.ndarray) -> jax.Array:
    """int32 (v mod p) for the int64 v whose bits are (hi, lo), taken as
    torch.remainder takes it (non-negative, v signed), per prime p."""
    p = jnp.asarray(primes, jnp.uint32)
    two32 = np.asarray([(1 << 32) % int(q) for q in primes], np.int64)
    unsigned = (_mulmod(hi % p, two32, primes) + lo % p) % p
    # a negative v is its unsigned bits minus 2^64
    two64 = jnp.asarray([(1 << 64) % int(q) for q in primes], jnp.uint32)
    signed = jnp.where(hi >> 31 == 1, (unsigned + p - two64) % p, unsigned)
    return signed.astype(jnp.int32)


class NGramEmbedding(nnx.Module):
    """The concatenated tables [rows, head_dim]: row ids [B, T, heads] ->
    [B, T, heads * head_dim]."""

    def __init__(self, rows: int, head_dim: int, *, init_std: float, param_dtype: DTypeLike, rngs: nnx.Rngs):
        self.table = nnx.Param(nnx.initializers.normal(init_std)(rngs.params(), (rows, head_dim), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        table = self.table[...]
        # on a mesh the rows stay where they are (split over it): each device gathers the rows it holds and the
        # mesh sums them; an Explicit mesh wants the result's placement stated
        place = out_sharding(("batch", None, None, None), (*ids.shape, table.shape[-1]))
        out = jnp.take(table, ids, axis=0) if place is None else table.at[ids].get(out_sharding=place)
        return out.reshape(*ids.shape[:-1], -1)
