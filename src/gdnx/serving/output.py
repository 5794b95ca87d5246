"""A request's output as its tokens come: the incremental detokenizer, the
stop conditions, and the text that is safe to stream.

Detokenizing only the new tokens: each step decodes a short window (the
tokens since the last emitted text, after a few tokens before them for
context) instead of the whole output, so a request costs O(tokens), not
O(tokens^2). The context window is what keeps the joins right: a
SentencePiece tokenizer drops a leading space at the start of a decode, and
a byte-level one splits a character across tokens (the text waits, held
back, until the character is complete).

Stop strings are searched only in the text the new tokens added plus the
stop string's length minus one characters before it, and only once
min_tokens tokens are generated: a stop string that was complete before
then is part of the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gdnx.serving.params import FinishReason, SamplingParams

Decode = Callable[[Sequence[int]], str]

# tokens an unfinished character may span before its text is taken as it is (a UTF-8 character is at most
# four bytes; a model can also emit bytes that never form one)
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Text of a growing token list, decoding only a window at each step."""

    def __init__(self, decode: Decode):
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = 0   # the window's context starts here
        self._read = 0     # tokens before this have their text emitted

    def add(self, ids: Sequence[int]) -> str:
        """Append tokens; returns the text they complete ("" while a
        character is incomplete)."""
        self.ids.extend(ids)
        return self._advance(force=False)

    def flush(self) -> str:
        """The text of every token not yet emitted, complete or not."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self.decode(self.ids[self._prefix:self._read])
        text = self.decode(self.ids[self._prefix:])
        complete = not text.endswith("\ufffd") or len(self.ids) - self._read >= _MAX_PENDING
        if not (force or (len(text) > len(before) and complete)):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):] if text.startswith(before) else text


TokenLogprob = tuple[float, dict[int, float]]


@dataclasses.dataclass
class Completion:
    """One request's result. tokens: the generated ids (a stop token
    included, text after a stop string not); finish_reason "stop" (end of
    sequence, a stop token or string) or "length" (max_tokens, or the
    engine's max_length); text: the detokenized tokens, cut before a stop
    string (with a tokenizer); logprobs: per token, (its logprob, the top-N
    as {id: logprob}) when asked; prompt_logprobs: the same for each prompt
    token after the first (the model's own, unadjusted) when asked; logits
    [n, vocab] float32 when the engine keeps them (keep_logits)."""

    tokens: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    logits: np.ndarray | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


def unpack_logprobs(chosen: Any, top_ids: Any, top: Any, n: int, count: int) -> list[TokenLogprob]:
    """One row's log-probabilities as a request keeps them, for its first
    `count` tokens: (the token's, its top n as {id: logprob}). chosen [T],
    top_ids and top [T, N] (a single token's: [] and [N]). A token a
    constraint or min_tokens ruled out has -inf: not a candidate, left out."""
    chosen, top_ids, top = (np.asarray(x) for x in (chosen, top_ids, top))
    if chosen.ndim == 0:
        chosen, top_ids, top = chosen[None], top_ids[None], top[None]
    return [(float(chosen[j]), {int(i): float(v) for i, v in zip(top_ids[j][:n], top[j][:n]) if v > -np.inf})
            for j in range(count)]


def find_stop(text: str, added: int, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string ends the text, searching only what
    the last `added` characters can have completed; None if none."""
    hits = []
    for s in stops:
        at = text.find(s, max(0, len(text) - added - len(s) + 1))
        if at >= 0:
            hits.append(at)
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of the text that may begin a stop string."""
    for k in range(min(max((len(s) for s in stops), default=1) - 1, len(text)), 0, -1):
        if any(s.startswith(text[len(text) - k:]) for s in stops):
            return k
    return 0


class Output:
    """One request's tokens and text, and its stop conditions.

    decode: the tokenizer's decode, or None (no text; stop strings need one).
    eos_ids: the end-of-sequence tokens (ignored under params.ignore_eos).
    """

    def __init__(self, params: SamplingParams, decode: Decode | None, eos_ids: Sequence[int]):
        self.params = params
        self.eos_ids = frozenset(() if params.ignore_eos else eos_ids) | frozenset(params.stop_token_ids)
        self.tokens: list[int] = []
        self._detok = None if decode is None else IncrementalDetokenizer(decode)
        self.text = ""                 # what the tokens decode to so far
        self._cut: int | None = None   # where a stop string ends the text
        self._sent = 0                 # characters handed out by new_text

    def add(self, token: int) -> FinishReason | None:
        """Append one token; returns why the request ends with it, if it does."""
        p = self.params
        self.tokens.append(token)
        added = ""
        if self._detok is not None:
            added = self._detok.add([token])
            self.text += added
        if token in self.eos_ids:
            return "stop"
        if p.stop and added and len(self.tokens) >= p.min_tokens:
            self._cut = find_stop(self.text, len(added), p.stop)
            if self._cut is not None:
                return "stop"
        if len(self.tokens) >= p.max_tokens:
            return "length"
        return None

    def final_text(self) -> str | None:
        """The whole text, cut before a stop string (None without a tokenizer)."""
        if self._detok is None:
            return None
        self.text += self._detok.flush()
        return self.text if self._cut is None else self.text[:self._cut]

    def new_text(self, finished: bool) -> str | None:
        """The text not yet handed out that is safe to show: while running,
        short of an incomplete character and of a tail that may begin a stop
        string; once finished, the rest of the final text."""
        if self._detok is None:
            return None
        if finished:
            end = len(self.final_text() or "")
        else:
            end = len(self.text) - held_back(self.text, self.params.stop)
        out = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out
