"""Batches from prepared token shards (gdnx.data.prepare), on the host.

Each row packs whole documents: it starts at a random piece of the corpus
(a document, or a T-token piece of a longer one: a split document's later
pieces are rows' first segments of their own) and runs on through the
documents that follow, each ending with its end-of-document token. Its
`segments` number the documents in the row, so the model restarts its
state, conv window, attention and positions at each; a target in another
document than its input (after an end-of-document token) is not scored.

Row r of step s depends only on (seed, s, r): a resumed run reads exactly
what an uninterrupted one would, and each process of a multi-host run
reads only the rows of its slice of the global batch. The shards are
memory-mapped; a background thread keeps the next batches ready.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np


class HostBatch(NamedTuple):
    """numpy [rows, T] arrays; rows = this process's share of the batch."""
    inputs: np.ndarray     # int32
    targets: np.ndarray    # int32
    mask: np.ndarray       # bool: positions scored (target in the input's document; SFT: a response's)
    segments: np.ndarray   # int32: document number within the row
    target_bytes: np.ndarray  # int32: UTF-8 bytes of each target token (bits per byte)


class Row(NamedTuple):
    """One row of a batch, T + 1 positions (inputs and targets)."""
    tokens: np.ndarray    # int32
    segments: np.ndarray  # int32: document number within the row
    valid: np.ndarray     # bool: a token of the data, not padding
    scored: np.ndarray    # bool: counts in the loss as a target (all of text; SFT: the responses)


class TokenShards:
    """One split of a prepared directory, memory-mapped."""

    def __init__(self, directory: Path, split: str):
        self.directory, self.split = directory, split
        meta_file = directory / "meta.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"data.path: {directory} has no meta.json; run `gdnx prepare` on your text "
                                    "first")
        try:
            meta = json.loads(meta_file.read_text())
            dtype, info = np.dtype(meta["dtype"]), meta["splits"][split]
            self.vocab_size = int(meta["vocab_size"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"data.path: {meta_file} is not a gdnx prepare manifest") from None
        path = directory / f"{split}.tokens"
        # numpy cannot map an empty file: an empty split is an empty array
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
        self.ends = np.fromfile(directory / f"{split}.docs", dtype=np.int64)
        if self.tokens.shape[0] != info["tokens"] or self.ends.shape[0] != info["documents"]:
            raise ValueError(f"data.path: {directory}/{split}.tokens or .docs does not match meta.json "
                             "(truncated?); run `gdnx prepare` again")
        self.token_bytes = np.load(directory / "token_bytes.npy")
        # SFT shards (gdnx.data.sft) mark the tokens the loss counts
        scored = directory / f"{split}.scored"
        self.scored: np.ndarray | None = None
        if scored.is_file():
            size = scored.stat().st_size
            self.scored = np.memmap(scored, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
            if self.scored.shape[0] != self.tokens.shape[0]:
                raise ValueError(f"data.path: {scored} does not match {split}.tokens (truncated?); prepare again")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class PackedRows:
    """Rows of `length` tokens (+1 for the targets) packing whole documents."""

    def __init__(self, shards: TokenShards, length: int):
        self.shards, self.length = shards, length
        starts = np.concatenate([[0], shards.ends[:-1]])
        sizes = shards.ends - starts
        pieces = -(-sizes // length)  # a document longer than a row is cut into row-long pieces
        self.piece_starts = np.repeat(starts, pieces) + _ranks(pieces) * length
        if len(shards) < 2:
            raise ValueError(f"data.path: the {shards.split} split of {shards.directory} holds {len(shards)} "
                             "tokens; give more documents (or, for the validation split, raise data.val_fraction)")

    def row(self, seed: int, step: int, index: int) -> Row:
        """Row `index` of step `step`."""
        rng = np.random.default_rng([seed, step, index])
        start = int(self.piece_starts[rng.integers(len(self.piece_starts))])
        stop = min(start + self.length + 1, len(self.shards))
        tokens = np.zeros(self.length + 1, np.int32)
        tokens[:stop - start] = self.shards.tokens[start:stop]
        positions = np.arange(start, start + self.length + 1)
        # documents ending before each position; a row-long piece starts a segment of its own
        segments = np.searchsorted(self.shards.ends, positions, side="right")
        segments = (segments - segments[0]).astype(np.int32)
        valid = positions < stop
        return Row(tokens, segments, valid, valid)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., n - 1 for each n in counts, concatenated."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total) - offsets


class Rows(Protocol):
    shards: TokenShards

    def row(self, seed: int, step: int, index: int) -> Row: ...


def host_batch(rows: Rows, seed: int, step: int, row_ids: range) -> HostBatch:
    got = [rows.row(seed, step, r) for r in row_ids]
    tokens, segments, valid, scored = (np.stack(x) for x in zip(*got))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = (segments[:, 1:] == segments[:, :-1]) & valid[:, 1:] & scored[:, 1:]
    return HostBatch(inputs, targets, mask, segments[:, :-1], rows.shards.token_bytes[targets].astype(np.int32))


class Prefetcher:
    """host_batch(step) for steps start, start + 1, ... made `depth` ahead on a thread."""

    def __init__(self, make: Callable[[int], HostBatch], start: int, depth: int = 2):
        self.make, self.next_step = make, start
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, args=(start,), daemon=True, name="gdnx-prefetch")
        self.thread.start()

    def _produce(self, step: int) -> None:
        while not self.stop.is_set():
            item: tuple[int, HostBatch | None, Exception | None]
            try:
                item = (step, self.make(step), None)
            except Exception as e:  # handed to the consumer, which raises it
                item = (step, None, e)
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1

    def get(self, step: int) -> HostBatch:
        if step != self.next_step:
            raise ValueError(f"prefetcher: asked for step {step}, next is {self.next_step}")
        got, batch, error = self.queue.get()
        if error is not None:
            raise error
        assert got == step
        self.next_step += 1
        return batch

    def close(self) -> None:
        """Stop the thread and wait for it (a batch being made is finished first)."""
        self.stop.set()
        self.thread.join()
