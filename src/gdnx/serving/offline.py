"""Running a list of requests to the end on an engine: the one loop behind
`Engine.generate`, `Engine.stream`, `gdnx generate --prompts-file` and
`gdnx eval`'s generation. A request that fails is reported where its result would have
been, never skipped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from gdnx.serving.output import Completion
from gdnx.serving.params import SamplingParams


class RequestFailed(RuntimeError):
    """A request failed in the engine (Event.error says why)."""


class Steps(Protocol):
    """What these loops need of an engine (gdnx.serving.Engine)."""

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> Iterable[Any]: ...


class Finished(NamedTuple):
    """One request's end: its `position` in the list given, the engine's request
    id, and its Completion or the error it failed with (exactly one set)."""
    position: int
    request_id: int
    completion: Completion | None
    error: str | None


def run_to_completion(engine: Steps, requests: Sequence[tuple[Sequence[int], SamplingParams]],
                      ) -> Iterator[Finished]:
    """Queue `requests` (prompt ids, params) on `engine` and step it until
    each has finished or failed, yielding each as it does (in the order they
    end). Requests queued before keep running; their events are not this
    loop's."""
    index_of = {engine.add_request(prompt, params): i for i, (prompt, params) in enumerate(requests)}
    while index_of:
        if not engine.has_unfinished():
            raise RuntimeError(f"the engine finished with {len(index_of)} of these requests unaccounted for "
                               f"(request ids {sorted(index_of)[:8]})")
        for event in engine.step():
            if event.request_id not in index_of or (event.error is None and event.completion is None):
                continue
            yield Finished(index_of.pop(event.request_id), event.request_id, event.completion, event.error)


def stream(engine: Steps, requests: Sequence[tuple[Sequence[int], SamplingParams]]) -> Iterator[tuple[int, list[int]]]:
    """Queue `requests` and run the engine (with anything already queued) to
    the end, yielding (request id, new tokens) as they come; a failure
    raises RequestFailed naming its request."""
    for prompt, params in requests:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        for event in engine.step():
            if event.error is not None:
                raise RequestFailed(f"request {event.request_id}: {event.error}")
            if event.tokens:
                yield event.request_id, event.tokens


def generate(engine: Steps, requests: Sequence[tuple[Sequence[int], SamplingParams]]) -> list[Completion]:
    """The completions of `requests`, in order; the first failure raises
    RequestFailed naming its request."""
    results: list[Completion | None] = [None] * len(requests)
    for done in run_to_completion(engine, requests):
        if done.error is not None:
            raise RequestFailed(f"request {done.request_id}: {done.error}")
        results[done.position] = done.completion
    assert all(c is not None for c in results)  # run_to_completion ends each request once
    return results  # type: ignore[return-value]
