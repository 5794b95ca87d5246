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
from typing import Any

import numpy as np

from gdnx.serving.output import Output
from gdnx.serving.output import Completion
from gdnx.serving.params import FinishReason, SamplingParams


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
    logprobs: list[tuple[float, dict[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[tuple[float, dict[int, float]]] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None         # why it FAILED
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
