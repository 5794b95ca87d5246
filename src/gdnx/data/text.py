"""A local text (.txt) or JSONL ({"text": ...} per line) file as a token
stream: bytes by default, or a Hugging Face tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np



def read_documents(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no such file {path}")
    if path.suffix == ".jsonl":
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"data.path: {path}: not UTF-8 text (byte {e.start}); a .jsonl file is UTF-8") from None
        docs = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"data.path: {path} line {n}: expected a JSON object with a \"text\" field") from None
            if not isinstance(text, str):
                raise ValueError(f"data.path: {path} line {n}: \"text\" is a {type(text).__name__}, expected a "
                                 "string")
            docs.append(text)
        return docs
    return [path.read_text(encoding="utf-8", errors="replace")]


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("data.tokenizer: reading tokenizer.json needs the `tokenizers` package "
                             "(pip install tokenizers)") from None
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.tokenizer: no such file {path}")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own Exception on a bad file
            raise ValueError(f"data.tokenizer: {path} is not a readable tokenizer.json "
                             f"({str(e).splitlines()[0][:120]})") from None
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


Tokenizer = ByteTokenizer | HFTokenizer


def make_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)


def token_stream(path: Path, tokenizer: Tokenizer) -> np.ndarray:
    """All documents' tokens, one stream (documents separated by a newline)."""
    ids: list[int] = []
    for doc in read_documents(path):
        ids.extend(tokenizer.encode(doc + "\n"))
    return np.asarray(ids, np.int32)
