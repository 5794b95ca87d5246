"""The engine in its own thread, fed by an asyncio server: requests go in
through a thread-safe queue, each request's events come back on its own
asyncio queue. The thread steps the engine while any request is
unfinished and sleeps on the queue otherwise."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence

from gdnx.distributed import peer_failure, peer_lost
from gdnx.serving.engine import Engine, Event
from gdnx.serving.metrics import Metrics
from gdnx.serving.params import SamplingParams
from gdnx.serving.spmd import Leader

log = logging.getLogger("gdnx.serve")


class Overloaded(Exception):
    """More requests than the engine's slots and the queue limit hold."""


class TooLarge(Exception):
    """More requests in one HTTP request than the engine's slots and queue
    could ever hold: never admitted, so not worth retrying."""


class EngineError(Exception):
    """The engine failed while running a request (the request is dropped;
    the engine goes on with the others). `field`: the request field whose
    constraint could not be honoured, when that is why (the client's to
    change, not the server's failure)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class Handle:
    """One engine request as the server sees it: its events, in order, then
    the end (a Completion in the last event, or an EngineError)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: list[int], params: SamplingParams):
        self.prompt, self.params = prompt, params
        self.request_id: int | None = None      # set by the engine thread
        self.released = False                   # the server is done with it (AsyncEngine.release)
        self.submitted = time.perf_counter()
        self.last: float | None = None          # when its previous tokens came
        self._loop = loop
        self._queue: asyncio.Queue[Event | EngineError] = asyncio.Queue()

    def _put(self, item: Event | EngineError) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def events(self) -> AsyncIterator[Event]:
        """This request's events up to the one holding its Completion."""
        while True:
            item = await self._queue.get()
            if isinstance(item, EngineError):
                raise item
            yield item
            if item.completion is not None:
                return


@dataclasses.dataclass(frozen=True)
class _Add:
    handle: Handle


@dataclasses.dataclass(frozen=True)
class _Abort:
    handle: Handle


@dataclasses.dataclass(frozen=True)
class _EndAll:
    why: str


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


# what the server's threads ask of the engine's thread
_Command = _Add | _Abort | _EndAll | _Stop


class AsyncEngine:
    """engine: the Engine, or the Leader of one over several processes
    (used only from its own thread once started). max_queue: requests that
    may wait for a slot; past that, submit raises Overloaded at once.

    When another process of the run is gone (a step's collective fails, or
    the watcher of the processes' links calls `lose`), every request in
    flight ends with an EngineError saying so, the thread stops stepping and
    `lost` says how the loss was seen (the server then stops)."""

    def __init__(self, engine: Engine | Leader, metrics: Metrics, max_queue: int):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.lost: str | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._handles: dict[int, Handle] = {}     # by engine request id (engine thread only)
        self._in_flight = 0                        # submitted, not yet ended (the event loop's count)
        self._live: set[Handle] = set()            # the same requests (under the lock)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="gdnx-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Drop what is left and end the thread (left alone once the run is
        lost: it may wait in a collective that never ends)."""
        self._commands.put(_Stop())
        if self.lost is None:
            self._thread.join()

    def lose(self, what: str) -> None:
        """Another process of the run is gone: every request in flight ends
        with an EngineError saying so, new ones are refused (any thread may
        call it; the first call counts)."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = what
            live = list(self._live)
        for handle in live:
            self.metrics.failed.inc()
            handle._put(EngineError(f"{peer_lost(what)}; the server stops"))

    def check(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The engine's own check of a request (ValueError naming the field);
        it reads only the engine's settings, so any thread may call it."""
        return self.engine.check(prompt, params)

    def submit(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[Handle]:
        """Queue these engine requests (the choices of one HTTP request)
        together, or raise Overloaded for all of them (TooLarge when they
        could never all be held)."""
        capacity = self.engine.max_slots + self.max_queue
        if len(requests) > capacity:
            raise TooLarge(f"{len(requests)} prompts x choices exceed what the server ever holds at once "
                           f"({self.engine.max_slots} slots + a queue of {self.max_queue}); send fewer prompts or "
                           "a smaller n")
        with self._lock:
            if self.lost is not None:
                raise Overloaded(f"the server is stopping: {peer_lost(self.lost)}")
            if self._in_flight + len(requests) > capacity:
                self.metrics.rejected.inc()
                raise Overloaded(f"the server holds {self._in_flight} requests ({self.engine.max_slots} slots, a "
                                 f"queue of {self.max_queue}); retry later")
            self._in_flight += len(requests)
            loop = asyncio.get_running_loop()
            handles = [Handle(loop, prompt, params) for prompt, params in requests]
            self._live.update(handles)
        for h in handles:
            self._commands.put(_Add(h))
        return handles

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet released by the server."""
        with self._lock:
            return self._in_flight

    def release(self, handle: Handle, finished: bool) -> None:
        """The server is done with a request: unfinished, it is aborted (its
        slot is free at the engine's next step). A second release of the
        same request does nothing."""
        with self._lock:
            if handle.released:
                return
            handle.released = True
            self._in_flight -= 1
            self._live.discard(handle)
        if not finished:
            self._commands.put(_Abort(handle))

    def end_all(self, why: str) -> None:
        """End every request in flight with an EngineError (streams send it
        as an error event, then [DONE]); the engine keeps running."""
        self._commands.put(_EndAll(why))

    # ---- the engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                # idle: sleep until a command comes
                command = self._commands.get(timeout=None if not engine.has_unfinished() else 0)
            except queue.Empty:
                command = None
            while command is not None:
                if not self._apply(command):
                    return
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if engine.has_unfinished():
                self._step(decode=engine.step_decodes())
                if self.lost is not None:
                    return
            self._gauges()

    def _apply(self, command: _Command) -> bool:
        """Do what a command asks; False: the thread ends."""
        match command:
            case _Stop():
                for h in self._handles.values():
                    h._put(EngineError("the server is shutting down"))
                if isinstance(self.engine, Leader):
                    self.engine.stop()
                return False
            case _EndAll(why):
                for rid, h in list(self._handles.items()):
                    self.engine.abort(rid)
                    self.metrics.failed.inc()
                    h._put(EngineError(why))
                self._handles.clear()
            case _Add(handle):
                try:
                    handle.request_id = self.engine.add_request(handle.prompt, handle.params)
                except ValueError as e:  # checked before submit; a failure here is the engine's
                    handle._put(EngineError(str(e)))
                    return True
                self._handles[handle.request_id] = handle
                self.metrics.requests.inc()
                self.metrics.prompt_tokens.inc(len(handle.prompt))
            case _Abort(handle) if handle.request_id in self._handles:
                self.engine.abort(handle.request_id)
                del self._handles[handle.request_id]
                self.metrics.aborted.inc()
        return True

    def _step(self, decode: bool) -> None:
        stats = self.engine.stats
        cached, drafted, accepted = stats.cached_tokens, stats.drafted_tokens, stats.accepted_tokens
        try:
            events = self.engine.step(decode)
        except Exception as e:  # the engine's failure: fail the requests it was running, keep serving
            if (what := peer_failure(e)) is not None:  # the run cannot step again
                self.lose(what)
                return
            log.exception("the engine failed a step")
            dropped = self.engine.reset_running()
            if not dropped:  # it failed before running any: the waiting ones would fail again
                dropped = list(self._handles)
                for rid in dropped:
                    self.engine.abort(rid)
            for rid in dropped:
                handle = self._handles.pop(rid, None)
                if handle is not None:
                    self.metrics.failed.inc()
                    handle._put(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        m = self.metrics
        m.cached_tokens.inc(stats.cached_tokens - cached)
        m.drafted_tokens.inc(stats.drafted_tokens - drafted)
        m.accepted_tokens.inc(stats.accepted_tokens - accepted)
        for event in events:
            handle = self._handles.get(event.request_id)
            if handle is None:
                continue
            if event.tokens:
                m.generated_tokens.inc(len(event.tokens))
                if handle.last is None:  # its prefill's token
                    m.time_to_first_token.observe(now - handle.submitted)
                else:  # the tokens of one round trip arrive together: each counts their mean gap
                    gap = (now - handle.last) / len(event.tokens)
                    for _ in event.tokens:
                        m.inter_token_latency.observe(gap)
                handle.last = now
            if event.error is not None:  # this request's own failure: the others go on
                del self._handles[event.request_id]
                m.failed.inc()
                handle._put(EngineError(event.error, event.error_field))
                continue
            if event.completion is not None:
                del self._handles[event.request_id]
                m.finished.inc()
            handle._put(event)

    def _gauges(self) -> None:
        self.metrics.running.set(self.engine.running)
        self.metrics.queue_depth.set(self.engine.waiting)
