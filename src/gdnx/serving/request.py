"""One engine request and the states it passes through.

    WAITING --admit--> PREFILLING --prompt through--> RUNNING --stop--> FINISHED
       |                   |                            |
       +-------------------+------------+---------------+--> ABORTED (its client left)
                                        +------------------> FAILED (a step it ran in raised)

A request's state is its `status`, changed only by `Request.transition`,
which refuses any other move (a finished, aborted or failed request never
moves again). A request holds a slot exactly while it is PREFILLING or
RUNNING.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gdnx.serving.output import Output
from gdnx.serving.output import Completion
from gdnx.serving.params import FinishReason, SamplingParams


_log = logging.getLogger(__name__)

Logprobs = tuple[float, dict[int, float]]   # a token's logprob and the top-N's


class Taken(NamedTuple):
    """What a request kept of the tokens a step gave it."""
    tokens: list[int]               # up to its stop condition, or up to and with the one that failed it
    reason: FinishReason | None     # the stop condition met, if one was
    error: str | None               # why it fails, if it does
    field: str | None = None        # the request field whose constraint could not be honoured, when that is why


class RequestStatus(enum.Enum):
    WAITING = "waiting"         # queued for a slot
    PREFILLING = "prefilling"   # holds a slot; its prompt is not yet through
    RUNNING = "running"         # decoding
    FINISHED = "finished"       # reached its stop condition (Request.finish_reason says which)
    ABORTED = "aborted"         # dropped on request (a client that left)
    FAILED = "failed"           # a step it took part in raised

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)

    @property
    def holds_slot(self) -> bool:
        return self in (RequestStatus.PREFILLING, RequestStatus.RUNNING)


_END = {RequestStatus.ABORTED, RequestStatus.FAILED}
_MOVES: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.WAITING: {RequestStatus.PREFILLING, *_END},
    RequestStatus.PREFILLING: {RequestStatus.RUNNING, *_END},
    RequestStatus.RUNNING: {RequestStatus.FINISHED, *_END},
    RequestStatus.FINISHED: set(), RequestStatus.ABORTED: set(), RequestStatus.FAILED: set(),
}


class TransitionError(RuntimeError):
    """A move between request states that the engine never makes (a bug)."""


@dataclasses.dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    output: Output
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None          # while PREFILLING or RUNNING
    cached: int = 0                  # prompt tokens restored from the prefix cache
    progress: int = 0                # prompt tokens prefilled (or restored) so far
    logprobs: list[Logprobs] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Logprobs] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None         # why it FAILED
    error_field: str | None = None   # the field whose constraint it could not honour, when that is why
    unmeetable: str | None = None    # why its constraint and min_tokens leave no token to draw (it fails so)
    completion: Completion | None = None  # set when FINISHED
    matcher: Any = None              # its constraint's gdnx.serving.grammar.Matcher, if it has one

    @property
    def tokens(self) -> list[int]:
        return self.output.tokens

    @property
    def held_slot(self) -> int:
        """Its slot, which only a PREFILLING or RUNNING request holds."""
        if self.slot is None:
            raise TransitionError(f"request {self.id} is {self.status.value} and holds no slot")
        return self.slot

    def take(self, new: Sequence[int], logprobs: Sequence[Logprobs] | None, logits: Any) -> Taken:
        """Take a step's new tokens (with their logprobs and logits where
        the request keeps them) one at a time: its constraint consumes each,
        its output detokenizes it and checks the stop conditions. Stops at
        the first stop condition, or at a token that fails the request (the
        constraint refuses a token its mask allowed: the server's fault; the
        grammar engine failed past its limits: the client's constraint, named
        in `Taken.field`; the tokenizer raises on its tokens). Moves no state: the
        caller finishes or fails the request."""
        kept: list[int] = []
        for j, tok in enumerate(new):
            if self.matcher is not None:
                refused = self.matcher.consume(tok)
                if refused is not None:
                    failed = self.matcher.error()  # the engine failed (a limit passed), not a refused token
                    s = self.params.structured
                    where = f"{s.field}, {s.kind}" if s is not None else "constraint"
                    first = (refused.strip().splitlines() or ["refused"])[0][:200]
                    _log.error("request %d: the output constraint (%s) %s:\n%s", self.id, where,
                               "failed" if failed is not None else f"refused token {tok}", refused)
                    if failed is not None:  # past the engine's limits: the client's constraint, not the server
                        return Taken(kept, None, f"the output constraint ({where}) could not be honoured: the "
                                                 f"grammar engine failed ({first}); simplify it",
                                     s.field if s is not None else None)
                    return Taken(kept, None, f"the output constraint ({where}) refused token {tok}: {first}")
            kept.append(tok)
            if logprobs is not None:
                self.logprobs.append(logprobs[j])
            if logits is not None:
                self.logits.append(np.asarray(logits[j]))
            try:
                reason = self.output.add(tok)
            except Exception as e:  # the tokenizer's failure on this request's tokens
                return Taken(kept, None, f"detokenizing failed: {type(e).__name__}: {e}")
            if reason is not None:
                return Taken(kept, reason, None)
        return Taken(kept, None, None)

    def transition(self, to: RequestStatus, *, slot: int | None = None, reason: FinishReason | None = None,
                   error: str | None = None) -> None:
        """Move to `to`: PREFILLING takes the slot given, FINISHED its
        reason, FAILED its error; leaving the slot-holding states drops the
        slot. Raises TransitionError for a move the state graph lacks."""
        if to not in _MOVES[self.status]:
            raise TransitionError(f"request {self.id}: {self.status.value} -> {to.value} is not a move a request "
                                  "makes")
        if to is RequestStatus.PREFILLING:
            if slot is None:
                raise TransitionError(f"request {self.id}: admitted without a slot")
            self.slot = slot
        if to is RequestStatus.FINISHED:
            if reason is None:
                raise TransitionError(f"request {self.id}: finished without a reason")
            self.finish_reason = reason
            self.completion = Completion(list(self.tokens), reason, len(self.prompt), self.cached,
                                         self.output.final_text(),
                                         self.logprobs if self.params.logprobs is not None else None,
                                         np.stack(self.logits) if self.logits else None,
                                         self.prompt_logprobs if self.params.prompt_logprobs is not None else None)
        if to is RequestStatus.FAILED:
            self.error = error
        if not to.holds_slot:
            self.slot = None
        self.status = to
