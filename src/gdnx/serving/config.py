"""The serving engine's settings, in one place: `EngineConfig`.

One frozen record with one set of defaults, read by the Engine, by the
`gdnx serve` / `gdnx generate` / `gdnx plan --serve` flags (their defaults
are these) and by the serving plan. It checks itself on construction (a
FieldError names the field), and with a model config it fixes every shape
the engine's programs see (`EngineShapes`): the prefix-cache block, the
prefill length buckets, the decode batch sizes and each slot's capacity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from gdnx.errors import FieldError


class EngineShapes(NamedTuple):
    block_size: int                 # tokens per prefix-cache block
    padded_length: int              # max_length rounded up to a block: the longest prefill bucket
    capacity: int                   # tokens each slot's cache holds
    buckets: tuple[int, ...]        # prefill lengths
    decode_rows: tuple[int, ...]    # decode batch sizes (the first slots)
    prefill_batches: tuple[int, ...]  # prompts per prefill call

    def prefill_batch(self, n: int) -> int:
        """The prefill batch that holds n prompts (the rest of its rows padding)."""
        return next(b for b in self.prefill_batches if b >= n)

    def bucket(self, n: int) -> int:
        """The prefill length that holds n tokens."""
        return next(b for b in self.buckets if b >= n)

    def history_every(self, length: int, prefix_cache: bool) -> int | None:
        """The prefill's state snapshots for a prefix cache: every block of a
        bucket of whole blocks (a shorter bucket holds no block to keep)."""
        return self.block_size if prefix_cache and length % self.block_size == 0 else None


def doubling(block: int, limit: int, smallest: int | None = None) -> tuple[int, ...]:
    """Doubling from `smallest` while under `block`, then from `block`, up to `limit`."""
    out, n = [], block if smallest is None else smallest
    while n < min(block, limit):
        out.append(n)
        n *= 2
    n = block
    while n < limit:
        out.append(n)
        n *= 2
    return (*out, limit)


def quadrupling(limit: int) -> tuple[int, ...]:
    """1, 4, 16, ... while under `limit`, then `limit`: batch sizes whose
    count grows as log4 of the largest (each a program to compile), a batch
    padded to the next size at most 4x its rows."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 4
    return (*out, limit)


DEFAULT_PREFILL_BATCH = 8
DRAFT_METHODS = ("ngram", "mtp")

_MINIMA = {"max_slots": 1, "max_length": 2, "prefix_cache_bytes": 0, "decode_steps": 1, "max_logprobs": 0,
           "draft_tokens": 0}
# Slots size the engine's per-slot host arrays and device caches before any
# request comes: a bound refuses a typo before it allocates (2**16 slots of
# one token's state each are already far past any chip's batch).
MAX_SLOTS = 2 ** 16


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """An engine's settings (docs/serving.md has the full story).

    max_slots: requests decoded together (the decode batch).
    max_length: prompt + generated tokens per request (the cache per slot).
    prefix_cache_bytes: host memory for the prefix cache (0: off).
    block_size: tokens per prefix-cache block, a multiple of the model's
      gdn_chunk_size (None: 4 chunks). Prefill buckets double from the
      chunk size up to a block, then from the block up to max_length.
    decode_steps: tokens per slot per host round trip of the decode loop.
    max_prefill_batch: prompts of one bucket prefilled together, at most
      (batches of 1, 4, 16, ... and it; None: max_slots, at most
      DEFAULT_PREFILL_BATCH: each batch size is a program per length bucket
      to compile, and 8 prompts of a bucket already fill a prefill call).
    max_logprobs: the most top-N log-probabilities a request may ask for.
    draft_tokens: draft tokens per verify pass (0: none; an engine given
      its own drafter takes that one's).
    draft_method: who drafts them: "ngram" (prompt lookup) or "mtp" (the
      model's multi-token prediction module, its first layer chained
      draft_tokens times).
    draft_rows: drafts are verified while the decode batch (the first
      slots up to the highest in use, rounded up to a decode batch size)
      holds at most this many rows; past it the engine decodes plainly.
      None: 1 on CPU, where a verify pass over more rows costs more than
      the tokens it gains (docs/benchmarks.md), every slot elsewhere.
    batch_invariant: a request's tokens and logits are bit-identical
      whatever else runs (every program keeps one shape; see Engine).
    keep_logits: also return every generated token's logits.
    seed: the generator of the seeds of requests that give none.
    """

    max_slots: int = 8
    max_length: int = 4096
    prefix_cache_bytes: int = 0
    block_size: int | None = None
    decode_steps: int = 8
    max_prefill_batch: int | None = None
    max_logprobs: int = 20
    draft_tokens: int = 0
    draft_method: str = "ngram"
    draft_rows: int | None = None
    batch_invariant: bool = False
    keep_logits: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in _MINIMA.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise FieldError(name, f"expected an integer >= {low}, got {value!r}")
        if self.max_slots > MAX_SLOTS:
            raise FieldError("max_slots", f"expected at most {MAX_SLOTS:,} requests decoded together, "
                                          f"got {self.max_slots:,}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or isinstance(self.block_size, bool)
                                            or self.block_size < 1):
            raise FieldError("block_size", f"expected None or an integer >= 1, got {self.block_size!r}")
        rows = self.max_prefill_batch
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool)
                                 or not 1 <= rows <= self.max_slots):
            raise FieldError("max_prefill_batch", f"expected an integer in [1, max_slots={self.max_slots}], "
                             f"got {rows!r}")
        if self.draft_method not in DRAFT_METHODS:
            raise FieldError("draft_method", f"expected one of {', '.join(DRAFT_METHODS)}, got {self.draft_method!r}")
        if self.draft_method == "mtp" and self.draft_tokens < 1:
            raise FieldError("draft_tokens", "the multi-token prediction drafter drafts at least one token per pass, "
                             f"got {self.draft_tokens}")
        if self.draft_rows is not None and (not isinstance(self.draft_rows, int) or isinstance(self.draft_rows, bool)
                                            or self.draft_rows < 1):
            raise FieldError("draft_rows", f"expected None or an integer >= 1, got {self.draft_rows!r}")
        for name in ("batch_invariant", "keep_logits"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"expected a bool, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise FieldError("seed", f"expected an integer, got {self.seed!r}")

    @property
    def prefill_rows(self) -> int:
        """Prompts per prefill call, at most."""
        if self.max_prefill_batch is None:
            return min(self.max_slots, DEFAULT_PREFILL_BATCH)
        return self.max_prefill_batch

    def drafting_rows(self, platform: str) -> int:
        """The most decode rows at which drafts are verified, on `platform`
        (jax's backend name: cpu, gpu, tpu): draft_rows or its default."""
        if self.draft_rows is not None:
            return self.draft_rows
        return 1 if platform == "cpu" else self.max_slots

    def shapes(self, model_config: Any, draft: int | None = None) -> EngineShapes:
        """The shapes these settings fix for a model (draft: the drafter's
        tokens per pass; None: draft_tokens). A block that is not a multiple
        of the model's chunk is refused naming block_size."""
        chunk = model_config.gdn_chunk_size
        block = 4 * chunk if self.block_size is None else self.block_size
        if block % chunk:
            raise FieldError("block_size", f"expected a multiple of the model's gdn_chunk_size {chunk}, got {block}")
        draft = self.draft_tokens if draft is None else draft
        padded = -(-self.max_length // block) * block
        # the chunk size doubling up to a block, then the block doubling up to max_length rounded up to a block
        # (a short prompt is not padded to a whole block), none past the first that holds max_length
        every = doubling(block, padded, chunk)
        buckets = tuple(b for i, b in enumerate(every) if i == 0 or every[i - 1] < self.max_length)
        decode_rows: tuple[int, ...]
        batches: tuple[int, ...]
        if self.batch_invariant:  # one shape per program
            decode_rows, batches = (self.max_slots,), (self.prefill_rows,)
        else:  # the first 1, 4, 16, ... slots, as few as hold every running request; prompts likewise
            decode_rows, batches = quadrupling(self.max_slots), quadrupling(self.prefill_rows)
        # the cache holds a padded prompt's last bucket and a verify pass's drafts past max_length
        return EngineShapes(block, padded, padded + draft + 1, buckets, decode_rows, batches)
