"""Tokenizers: raw bytes by default, or a Hugging Face tokenizer.json."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


# byte tokenization: NUL ends a document (text does not contain it)
BYTES_EOS = 0


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes' text; the end of document is left out, as a
        tokenizer.json's decode leaves out its special tokens."""
        return bytes(i for i in map(int, ids) if 0 <= i < 256 and i != BYTES_EOS).decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        """The id of a named token (bytes have no named tokens: None)."""
        return None


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
        self._kept: dict[int, str] = {}   # special tokens decoded as their text

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it): a long text encoded in one thread
        # does not stop the others (a server's event loop)
        return self.tok.encode_batch([text])[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        """The ids' text; special tokens are left out, but for those kept."""
        ids = [int(i) for i in ids]
        if not self._kept or not any(i in self._kept for i in ids):
            return self.tok.decode(ids)
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._kept:
                out += [self.tok.decode(run), self._kept[i]]
                run = []
            else:
                run.append(i)
        return "".join([*out, self.tok.decode(run)])

    def keep(self, texts: Sequence[str]) -> frozenset[str]:
        """Decode those of these texts that are special tokens of the
        tokenizer as their text, where decode leaves other special tokens
        out: the tags a server's parser reads (a tool-call format's).
        Returns the texts that are special tokens."""
        special = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        for text in texts:
            if text in special:
                self._kept[special[text]] = text
        return frozenset(t for t in texts if t in special)

    def token_id(self, text: str) -> int | None:
        """The id of a token by its text (a special token's name), or None."""
        return self.tok.token_to_id(text)


Tokenizer = ByteTokenizer | HFTokenizer


def make_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)
