"""`gdnx prepare`: text files to memory-mapped token shards.

Inputs are .txt files (one document each) and .jsonl files (one
{"text": ...} document per line), or directories of them. Each document
is tokenized (raw bytes, or a Hugging Face tokenizer.json), followed by the
end-of-document token, and appended to its split's shard: `<split>.tokens`
(uint16 when the vocabulary fits, else uint32) with `<split>.docs`, the
int64 end offset of every document. Every 1/val_fraction-th document, counted
across the sorted inputs, goes to the validation split: the split holds the
fraction exactly (to a document), does not depend on where the files lie,
and appending documents leaves earlier ones where they were. Reading is
streamed (memory does not grow with the corpus). `meta.json`, written last,
records the inputs (path, size, mtime), the tokenizer and the settings: a
rerun on the same inputs finds it and does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gdnx.files import atomic_write_text
from gdnx.data.text import BYTES_EOS, HFTokenizer

FORMAT = 2
SPLITS = ("train", "val")
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_TEXT_BLOCK = 1 << 20  # bytes of a .txt file read and tokenized at a time


def input_files(paths: list[Path]) -> list[Path]:
    """The .txt and .jsonl files named or under the directories named, sorted."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        elif path.is_file():
            if path.suffix not in (".txt", ".jsonl"):
                raise ValueError(f"{path}: expected a .txt or .jsonl file (or a directory of them)")
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    if not files:
        raise ValueError(f"{', '.join(map(str, paths))}: no .txt or .jsonl files")
    return files


def _documents(path: Path) -> Iterator[Iterator[bytes]]:
    """Each document of a file as UTF-8 byte blocks."""
    if path.suffix == ".txt":
        def blocks() -> Iterator[bytes]:
            with path.open("rb") as f:
                while block := f.read(_TEXT_BLOCK):
                    yield block
        yield blocks()
        return
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                decoded = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {n}: not UTF-8 text (byte {e.start}); a .jsonl file is UTF-8") from None
            try:
                text = json.loads(decoded)["text"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path} line {n}: expected a JSON object with a \"text\" field") from None
            if not isinstance(text, str):
                raise ValueError(f"{path} line {n}: \"text\" is a {type(text).__name__}, expected a string")
            yield iter((text.encode("utf-8", errors="surrogatepass"),))


def _cut(data: bytes) -> int:
    """Where to end the text tokenized now, the rest carried to the next
    block: after the last newline; where that would carry more than a block
    (text without newlines must not be held whole), after the last space,
    else at the last character boundary."""
    for mark in (b"\n", b" "):
        if (at := data.rfind(mark)) >= 0 and len(data) - at - 1 <= _TEXT_BLOCK:
            return at + 1
    at = len(data)
    while at > 0 and data[at - 1] & 0xC0 == 0x80:  # back over a character's continuation bytes
        at -= 1
    return at - 1 if at > 0 and data[at - 1] >= 0xC0 else at  # and its lead byte, if it is incomplete


class Encoder:
    """Bytes -> token ids: raw bytes, or a tokenizer.json on UTF-8 text."""

    def __init__(self, tokenizer: str | None, eos_token: str | None):
        if tokenizer is None:
            self.hf = None
            self.vocab_size, self.eos = 256, BYTES_EOS
            return
        self.hf = HFTokenizer(tokenizer)
        self.vocab_size = self.hf.vocab_size
        names = (eos_token,) if eos_token else _EOS_NAMES
        ids = [self.hf.tok.token_to_id(name) for name in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"{tokenizer} has none of {', '.join(names)}; name its end-of-document token "
                             "(gdnx prepare --eos-token, or data.eos_token)")
        self.eos = found[0]

    def encode(self, blocks: Iterator[bytes]) -> Iterator[np.ndarray]:
        carry = b""
        for block in blocks:
            if self.hf is None:
                yield np.frombuffer(block, np.uint8)
                continue
            data = carry + block
            cut = _cut(data) if len(block) == _TEXT_BLOCK else len(data)
            text, carry = data[:cut], data[cut:]
            if text:
                yield np.asarray(self.hf.encode(text.decode("utf-8", errors="replace")), np.int64)
        if carry:
            assert self.hf is not None
            yield np.asarray(self.hf.encode(carry.decode("utf-8", errors="replace")), np.int64)


def in_val(index: int, fraction: float) -> bool:
    """Whether document `index` (0-based, across all inputs) is held out: the
    held-out count steps by one each 1/fraction documents."""
    return int((index + 1) * fraction) > int(index * fraction)


def fingerprint_of(files: list[Path], tokenizer: str | None, eos: int, val_fraction: float) -> dict[str, Any]:
    tok = None
    if tokenizer is not None:
        tok = {"path": str(Path(tokenizer).resolve()),
               "sha256": hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()}
    return {"format": FORMAT, "tokenizer": tok, "eos": eos, "val_fraction": val_fraction,
            "inputs": [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
                       for f in files]}


def prepared(out: Path, fingerprint: dict[str, Any], last: str, paths: list[Path], keep: bool,
             ) -> dict[str, Any] | None:
    """meta.json's content (marked up_to_date) when `out` already holds the
    shards of this fingerprint (each split's `<split>.<last>` written);
    otherwise None, with `out` made ready to be rewritten. keep: shards of
    other inputs are an error (a run resumes on them), not rewritten."""
    meta_file = out / "meta.json"
    if meta_file.is_file():
        try:
            meta = json.loads(meta_file.read_text())
        except ValueError:
            meta = {}
        if meta.get("fingerprint") == fingerprint and all((out / f"{s}.{last}").is_file() for s in SPLITS):
            return {**meta, "up_to_date": True}
        if keep and meta:
            raise ValueError(f"data.path: {', '.join(map(str, paths))} changed since {out} was tokenized from it "
                             "(a file's size or time, the tokenizer or data.val_fraction); the run's checkpoints "
                             "were trained on the earlier data and its validation split: restore it, or use "
                             "another train.out_dir")
    out.mkdir(parents=True, exist_ok=True)
    meta_file.unlink(missing_ok=True)  # the shards are being rewritten
    return None


def prepare_corpus(paths: list[Path], out: Path, *, tokenizer: str | None = None, eos_token: str | None = None,
            val_fraction: float = 0.01, progress: Callable[[int, int], None] | None = None,
            keep: bool = False) -> dict[str, Any]:
    """Tokenize `paths` into shards under `out` (see the module doc); returns
    meta.json's content. progress(bytes done, bytes total) is called as it
    goes. keep: shards already there must be of these very inputs (a run
    resumes on them); ValueError if the inputs changed since."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction: expected a fraction in [0, 1), got {val_fraction}")
    files = input_files(paths)
    encoder = Encoder(tokenizer, eos_token)
    fingerprint = fingerprint_of(files, tokenizer, encoder.eos, val_fraction)
    if (ready := prepared(out, fingerprint, "tokens", paths, keep)) is not None:
        return ready
    meta_file = out / "meta.json"
    dtype = np.dtype(np.uint16 if encoder.vocab_size <= 2 ** 16 else np.uint32)
    total = sum(f.stat().st_size for f in files)
    done = 0
    counts = {s: [0, 0] for s in SPLITS}  # tokens, documents
    handles = {s: ((out / f"{s}.tokens.tmp").open("wb"), (out / f"{s}.docs.tmp").open("wb")) for s in SPLITS}
    index = 0
    try:
        for path in files:
            for blocks in _documents(path):
                split = "val" if in_val(index, val_fraction) else "train"
                index += 1
                tokens, docs = handles[split]
                for ids in encoder.encode(blocks):
                    tokens.write(ids.astype(dtype).tobytes())
                    counts[split][0] += len(ids)
                tokens.write(np.asarray([encoder.eos], dtype).tobytes())
                counts[split][0] += 1
                counts[split][1] += 1
                docs.write(np.asarray([counts[split][0]], np.int64).tobytes())
            done += path.stat().st_size
            if progress:
                progress(done, total)
    finally:
        for tokens, docs in handles.values():
            tokens.close()
            docs.close()
    for s in SPLITS:
        for kind in ("tokens", "docs"):
            os.replace(out / f"{s}.{kind}.tmp", out / f"{s}.{kind}")
    np.save(out / "token_bytes.npy", token_bytes(encoder))
    meta = {"fingerprint": fingerprint, "vocab_size": encoder.vocab_size, "dtype": dtype.name,
            "splits": {s: {"tokens": counts[s][0], "documents": counts[s][1]} for s in SPLITS}}
    atomic_write_text(meta_file, json.dumps(meta, indent=1))
    return meta


def token_bytes(encoder: Encoder) -> np.ndarray:
    """UTF-8 bytes each token stands for (0 for the end-of-document token):
    what bits per byte divides by."""
    if encoder.hf is None:
        out = np.ones(256, np.int32)
    else:
        out = np.asarray([len(encoder.hf.tok.decode([i], skip_special_tokens=False).encode("utf-8"))
                          for i in range(encoder.vocab_size)], np.int32)
    out[encoder.eos] = 0
    return out


def prepared_tokenizer(directory: Path) -> str | None:
    """The tokenizer.json a prepared directory was made with (None: raw bytes)."""
    try:
        tok = json.loads((directory / "meta.json").read_text())["fingerprint"]["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"data.path: {directory}/meta.json is missing or not a gdnx prepare manifest") from None
    return None if tok is None else tok["path"]
