"""What a request asks for: SamplingParams (and the FinishReason its output
ends with; the output itself is gdnx.serving.output's Completion)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal


from gdnx.errors import FieldError


def _int(name: str, value, low: int, high: float = math.inf) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= int(value) <= high:
        bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise FieldError(name, f"expected an integer {bound}, got {value!r}")


def _float(name: str, value, low: float, high: float, *, open_low: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (open_low and value == low):
        bound = f"in ({low}, {high}]" if open_low else f"in [{low}, {high}]"
        raise FieldError(name, f"expected a number {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Structured:
    """A constraint on a request's output, enforced token by token
    (gdnx.serving.grammar): a JSON schema (as JSON text; `{"type":
    "object"}` for any JSON object), a regular expression, one of a list of
    strings, or a Lark grammar. field: the request field it came from,
    which an error in it names."""
    kind: Literal["json", "regex", "choice", "grammar"]
    value: str | tuple[str, ...]
    field: str = "structured"

    def __post_init__(self):
        if self.kind not in ("json", "regex", "choice", "grammar"):
            raise FieldError(self.field, f"expected json, regex, choice or grammar, got {self.kind!r}")
        if self.kind == "choice":
            if isinstance(self.value, str) or not isinstance(self.value, (list, tuple)) or not self.value \
                    or not all(isinstance(c, str) and c for c in self.value):
                raise FieldError(self.field, "expected a non-empty list of non-empty strings")
            object.__setattr__(self, "value", tuple(self.value))
        elif not isinstance(self.value, str) or not self.value:
            raise FieldError(self.field, f"expected a non-empty string for {self.kind}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled; every field is checked on construction
    (FieldError naming the field).

    The logits are adjusted in this order: repetition_penalty (over the
    prompt and the generated tokens: a positive logit divided by it, a
    negative one multiplied), presence_penalty and frequency_penalty (over
    the generated tokens: minus presence if the token occurred, minus
    frequency times its count), end-of-sequence and stop_token_ids masked
    until min_tokens are generated. Then temperature 0 takes the argmax;
    otherwise the logits are divided by temperature and cut to the top_k
    tokens (0: all), to the smallest set whose probability reaches top_p,
    and to the tokens whose probability is at least min_p times the top
    one's, and a token is drawn. logprobs (top-N per generated token) are
    those of the adjusted logits before temperature. prompt_logprobs (top-N
    per prompt token after the first, from the prefill's own pass) are the
    model's, unadjusted; a request that asks for them is prefilled whole,
    without the prefix cache.

    seed: a request's draws depend only on it, its prompt and its own
    tokens, never on the other requests sharing the engine; None draws a
    seed from the engine's generator.

    structured: a Structured constraint; every token is drawn from those
    the constraint allows next (the disallowed ones' logits are -inf before
    any of the above: logprobs see them so). The output ends when the
    constraint is complete (the end-of-sequence token is then the one
    allowed), or at max_tokens ("length") if it cannot complete in time.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: Structured | None = None

    def __post_init__(self):
        # lists are accepted and kept as tuples (the params stay hashable)
        for name in ("stop_token_ids", "stop"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                if name == "stop" and isinstance(value, str):
                    value = (value,)
                else:
                    raise FieldError(name, f"expected a list, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _float("temperature", self.temperature, 0.0, 100.0)
        _int("top_k", self.top_k, 0)
        _float("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _float("min_p", self.min_p, 0.0, 1.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, open_low=True)
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _int("seed", self.seed, 0, 2 ** 63 - 1)
        for i, t in enumerate(self.stop_token_ids):
            _int(f"stop_token_ids[{i}]", t, 0)
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise FieldError(f"stop[{i}]", f"expected a non-empty string, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise FieldError("ignore_eos", f"expected a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, 20)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, 20)
        if self.structured is not None and not isinstance(self.structured, Structured):
            raise FieldError("structured", f"expected a Structured constraint, got {type(self.structured).__name__}")


FinishReason = Literal["stop", "length"]
