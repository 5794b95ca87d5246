"""Draft proposers for speculative decoding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to `num_tokens` next tokens for a request from its tokens
    so far (prompt and generated). The engine verifies them in one forward
    pass; a drafter that proposes nothing costs a plain step."""

    num_tokens: int

    def propose(self, tokens: Sequence[int]) -> list[int]: ...


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence
    of the request's last n tokens (n from max_ngram down to min_ngram),
    up to num_tokens. Wins where the output repeats its context (code edits,
    quoting, extraction)."""

    def __init__(self, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        for name, value in (("num_tokens", num_tokens), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram: expected <= max_ngram={max_ngram}, got {min_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def propose(self, tokens: Sequence[int]) -> list[int]:
        tokens = list(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + self.num_tokens]
        return []
