"""Supervised fine-tuning data: .jsonl examples, tokenized once into
memory-mapped shards with a per-token mask of the tokens the loss counts.

An example is {"messages": [{"role": ..., "content": ...}, ...]}, rendered
with the tokenizer's chat template as transformers renders it
(gdnx.data.chat; the loss counts the assistant turns' tokens), or
{"prompt": ..., "completion": ...} (the loss counts the completion's tokens
and the end-of-document token after it). The shards are those of `gdnx
prepare` (gdnx.data.prepare: `<split>.tokens`, `<split>.docs`, the same
validation split) plus `<split>.scored`, one byte per token. Rows hold
whole examples: packed (the longest example left, then the shortest ones
while they fit; the rest of the row padding) or one per row; an example longer than a row is dropped
or truncated (data.sft_overlong), and counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gdnx.data.chat import ChatTemplate
from gdnx.data.prepare import SPLITS, Encoder, fingerprint_of, in_val, input_files, prepared, token_bytes
from gdnx.data.tokens import Row, TokenShards
from gdnx.files import atomic_write_text

FORMAT = 1


def jsonl_objects(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a .jsonl file;
    ValueError naming the file and line of one that is not a JSON object."""
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise ValueError(f"{path} line {n}: not a JSON object (UTF-8)") from None
            if not isinstance(example, dict):
                raise ValueError(f"{path} line {n}: expected a JSON object, got {type(example).__name__}")
            yield n, example


def _messages(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be an object with a string \"role\" and \"content\"")
    if not any(m["role"] == "assistant" for m in value):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")
    return value


class ExampleEncoder:
    """An example -> (token ids, whether each counts in the loss)."""

    def __init__(self, tokenizer: str | None, eos_token: str | None):
        self.encoder = Encoder(tokenizer, eos_token)
        self.tokenizer = tokenizer
        self._template: ChatTemplate | None = None

    def _chat(self, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
        if self.encoder.hf is None or self.tokenizer is None:
            raise ValueError(f"{where}: \"messages\" are rendered with a chat template, which raw bytes have "
                             "none of; set data.tokenizer to a tokenizer.json beside its chat template")
        if self._template is None:
            self._template = ChatTemplate(Path(self.tokenizer).parent)
        try:
            text, spans = self._template.assistant_spans(messages)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        encoding = self.encoder.hf.tok.encode(text, add_special_tokens=False)
        scored = [any(a <= start < b for a, b in spans) for start, _ in encoding.offsets]
        return list(encoding.ids), scored

    def _text(self, text: str, special: bool) -> list[int]:
        if self.encoder.hf is None:
            return list(text.encode("utf-8"))
        return list(self.encoder.hf.tok.encode(text, add_special_tokens=special).ids)

    def encode(self, example: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        if "messages" in example:
            ids, scored = self._chat(_messages(example["messages"], where), where)
        elif isinstance(example.get("prompt"), str) and isinstance(example.get("completion"), str):
            prompt = self._text(example["prompt"], special=True)
            completion = self._text(example["completion"], special=False) + [self.encoder.eos]
            ids, scored = prompt + completion, [False] * len(prompt) + [True] * len(completion)
        else:
            raise ValueError(f"{where}: expected {{\"messages\": [...]}} or string \"prompt\" and \"completion\" "
                             f"fields, got the keys {sorted(example)}")
        return np.asarray(ids, np.int64), np.asarray(scored, np.uint8)


def prepare_sft(paths: list[Path], out: Path, *, tokenizer: str | None = None, eos_token: str | None = None,
                val_fraction: float = 0.05, progress: Callable[[int, int], None] | None = None,
                keep: bool = False) -> dict[str, Any]:
    """Tokenize the examples of `paths` (.jsonl files or directories of them)
    into shards under `out`; returns meta.json's content. A rerun on the
    same inputs does nothing; keep: shards already there must be of these
    inputs (ValueError if they changed)."""
    files = [f for f in input_files(paths) if f.suffix == ".jsonl"]
    if not files:
        raise ValueError(f"{', '.join(map(str, paths))}: no .jsonl files (SFT examples are JSON lines)")
    encoder = ExampleEncoder(tokenizer, eos_token)
    fingerprint = {**fingerprint_of(files, tokenizer, encoder.encoder.eos, val_fraction), "sft": FORMAT}
    if (ready := prepared(out, fingerprint, "scored", paths, keep)) is not None:
        return ready
    meta_file = out / "meta.json"
    dtype = np.dtype(np.uint16 if encoder.encoder.vocab_size <= 2 ** 16 else np.uint32)
    total, done, index = sum(f.stat().st_size for f in files), 0, 0
    counts = {s: [0, 0, 0] for s in SPLITS}  # tokens, examples, scored tokens
    names = ("tokens", "docs", "scored")
    handles = {s: [(out / f"{s}.{k}.tmp").open("wb") for k in names] for s in SPLITS}
    try:
        for path in files:
            for n, example in jsonl_objects(path):
                ids, scored = encoder.encode(example, f"{path} line {n}")
                split = "val" if in_val(index, val_fraction) else "train"
                index += 1
                tokens, docs, marks = handles[split]
                tokens.write(ids.astype(dtype).tobytes())
                marks.write(scored.tobytes())
                counts[split][0] += len(ids)
                counts[split][1] += 1
                counts[split][2] += int(scored.sum())
                docs.write(np.asarray([counts[split][0]], np.int64).tobytes())
            done += path.stat().st_size
            if progress:
                progress(done, total)
    finally:
        for files_of_split in handles.values():
            for handle in files_of_split:
                handle.close()
    for s in SPLITS:
        for k in names:
            os.replace(out / f"{s}.{k}.tmp", out / f"{s}.{k}")
    np.save(out / "token_bytes.npy", token_bytes(encoder.encoder))
    meta = {"fingerprint": fingerprint, "vocab_size": encoder.encoder.vocab_size, "dtype": dtype.name,
            "splits": {s: {"tokens": counts[s][0], "documents": counts[s][1], "scored_tokens": counts[s][2]}
                       for s in SPLITS}}
    atomic_write_text(meta_file, json.dumps(meta, indent=1))
    return meta


class Fit(NamedTuple):
    """How the examples of a split fit rows."""
    rows: int
    dropped: int    # longer than a row (data.sft_overlong=drop)
    truncated: int  # longer than a row, cut to it (data.sft_overlong=truncate)
    padding: float  # fraction of the rows' tokens that are padding
    unscored: int = 0  # cut to a row with no scored target left (data.sft_overlong=truncate): dropped


def _bins(examples: np.ndarray, sizes: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples packed into rows of `row` tokens: the longest left, then the
    shortest left while they fit (when the next shortest does not, none of
    the rest does). Returns the examples in row order and each row's bounds
    into them."""
    by_size = np.argsort(-sizes, kind="stable")
    low, high = 0, len(by_size) - 1
    order, bounds = [], [0]
    while low <= high:
        filled = int(sizes[by_size[low]])
        order.append(int(examples[by_size[low]]))
        low += 1
        while low <= high and filled + int(sizes[by_size[high]]) <= row:
            filled += int(sizes[by_size[high]])
            order.append(int(examples[by_size[high]]))
            high -= 1
        bounds.append(len(order))
    return np.asarray(order, np.int64), np.asarray(bounds, np.int64)


class ExampleRows:
    """Rows of `length` tokens (+1 for the targets) of whole examples:
    packed (the longest example, then the shortest while they fit) or one
    per row."""

    def __init__(self, shards: TokenShards, length: int, *, packing: bool = True, overlong: str = "drop"):
        if shards.scored is None:
            raise ValueError(f"data.path: {shards.directory} holds text, not SFT examples (no "
                             f"{shards.split}.scored); use data.source=tokens for it")
        self.shards, self.length = shards, length
        self.scored = shards.scored
        row = length + 1
        self.starts = np.concatenate([[0], shards.ends[:-1]]).astype(np.int64)
        sizes = shards.ends - self.starts
        long = sizes > row
        unscored = 0
        if overlong == "truncate":
            self.sizes, keep = np.minimum(sizes, row), np.ones(len(sizes), bool)
            for k in np.flatnonzero(long):  # a cut that leaves no scored target trains on nothing: dropped
                if not self.scored[self.starts[k] + 1:self.starts[k] + row].any():
                    keep[k] = False
                    unscored += 1
        else:
            self.sizes, keep = sizes, ~long
        kept = np.flatnonzero(keep)
        # the examples in row order, and each row's bounds into them
        self.order: np.ndarray = kept
        self.bounds: np.ndarray = np.arange(len(kept) + 1, dtype=np.int64)
        if packing:
            self.order, self.bounds = _bins(kept, self.sizes[kept], row)
        self.rows = len(self.bounds) - 1
        used = int(self.sizes[kept].sum())
        self.fit = Fit(self.rows, int(long.sum()) if overlong == "drop" else 0,
                       int(long.sum()) - unscored if overlong == "truncate" else 0,
                       1.0 - used / max(self.rows * row, 1), unscored)
        if self.rows == 0 and overlong == "truncate":
            raise ValueError(f"data.seq_len: cut to {length} + 1 tokens, none of the {len(sizes)} examples of the "
                             f"{shards.split} split keeps a scored (response) token (data.sft_overlong=truncate); "
                             "raise data.seq_len")
        if self.rows == 0:
            raise ValueError(f"data.seq_len: every one of the {len(sizes)} examples of the {shards.split} split is "
                             f"longer than {length} + 1 tokens (data.sft_overlong=drop); raise data.seq_len or "
                             "set data.sft_overlong=truncate")
        if not any(self.scored[self.starts[k] + 1:self.starts[k] + self.sizes[k]].any() for k in kept):
            raise ValueError(f"data.path: no example of the {shards.split} split has a scored (response) token: "
                             "nothing to train on")

    def row(self, seed: int, step: int, index: int) -> Row:
        rng = np.random.default_rng([seed, step, index])
        b = int(rng.integers(self.rows))
        tokens = np.zeros(self.length + 1, np.int32)
        segments = np.zeros(self.length + 1, np.int32)
        scored = np.zeros(self.length + 1, bool)
        at = 0
        for seg, k in enumerate(self.order[self.bounds[b]:self.bounds[b + 1]]):
            start, size = int(self.starts[k]), int(self.sizes[k])
            tokens[at:at + size] = self.shards.tokens[start:start + size]
            scored[at:at + size] = self.scored[start:start + size] != 0
            segments[at:at + size] = seg
            at += size
        segments[at:] = segments[at - 1] + 1  # padding: a segment of its own
        valid = np.arange(self.length + 1) < at
        return Row(tokens, segments, valid, scored)
