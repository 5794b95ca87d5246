"""One engine over several processes, SPMD: every process holds the same
Engine on its part of one mesh and runs the same steps, each step's
programs together (their collectives span the processes).

Process 0 (the leader) owns the requests: the server calls a Leader as it
would an Engine, and before each step the Leader publishes what changed
since the last one (requests added with their seeds, aborts) and the step
itself. The other processes (followers) apply each message to their own
engine in the same order, so their schedulers make the same choices
(admission, buckets, drafts: all deterministic in the requests and the
tokens, which every process reads back alike), and then step. A follower
checks that each request gets the id the leader's engine gave it: a
divergence stops the run rather than computing something else.

Messages travel over JAX's distributed runtime (its key-value store, served
by process 0's coordinator), not a device collective: a follower may wait
for hours while the server is idle. Each step carries a digest of what the
leader's scheduler is about to run; a follower whose own differs stops
rather than run something else. A step that fails on the follower is left
to the leader's word: the leader's same step fails alike and it sends
the reset that follows; a follower so far behind that a message it needs
has left the store (the last KEEP are kept) stops, saying so.

A lost process: each follower also holds a TCP connection to the leader
(Links), which the kernel closes when either process dies, so the other
side learns at once, even while it waits in a collective that will never
complete: the leader fails its requests in flight and stops, a follower
stops. A process that hangs with its connections open is found by the
runtime's heartbeat (--heartbeat-timeout), which ends the others.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import select
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from gdnx.distributed import PeerLost, peer_failure, runtime_client, runtime_failure
from gdnx.serving.engine import Engine, EngineStats, Event
from gdnx.serving.params import SamplingParams

log = logging.getLogger("gdnx.serve")

# a message stays in the store this many messages after its own: every step with work runs programs whose
# collectives make the followers keep pace, so none is ever this far behind
KEEP = 64
POLL_S = 2.0  # a follower's longest wait for the next message between checks of its own stop


@dataclasses.dataclass(frozen=True)
class Add:
    """A request the leader's engine took, with the id it gave it (and its seed in params)."""
    request_id: int
    prompt: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: int


@dataclasses.dataclass(frozen=True)
class Step:
    decode: bool
    digest: str     # the leader scheduler's digest before the step (Scheduler.digest)


@dataclasses.dataclass(frozen=True)
class Reset:
    error: str


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


Message = Add | Abort | Step | Reset | Stop


class Channel(Protocol):
    """Numbered messages from the leader to every follower."""

    def publish(self, n: int, message: bytes) -> None: ...

    def receive(self, n: int, timeout_s: float) -> bytes | None:
        """Message n, or None if it has not come within timeout_s."""
        ...

    def drop(self, n: int) -> None: ...

    def has(self, n: int) -> bool:
        """Whether message n is in the channel now (no wait)."""
        ...


class RuntimeChannel:
    """Messages in the distributed runtime's key-value store."""

    def __init__(self, name: str = "serve-steps"):
        self._client, self._prefix = runtime_client(), f"gdnx:{name}:"

    def publish(self, n: int, message: bytes) -> None:
        self._client.key_value_set_bytes(f"{self._prefix}{n}", message)

    def receive(self, n: int, timeout_s: float) -> bytes | None:
        try:
            return self._client.blocking_key_value_get_bytes(f"{self._prefix}{n}", int(timeout_s * 1000))
        except Exception as e:  # the runtime's own error type
            text, deadline = runtime_failure(e)
            if deadline:
                return None
            raise PeerLost(f"process 0 stopped answering ({text})") from None

    def drop(self, n: int) -> None:
        self._client.key_value_delete(f"{self._prefix}{n}")

    def has(self, n: int) -> bool:
        try:
            self._client.key_value_try_get_bytes(f"{self._prefix}{n}")
            return True
        except Exception:  # the runtime's NOT_FOUND (or the coordinator gone: the next receive says which)
            return False


def _listen() -> socket.socket:
    """A listening socket on a free port of every interface (IPv6 and IPv4 where the host has both)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


class Links:
    """One TCP connection from each follower to the leader; `on_lost(what)`
    is called once, from a thread of its own, when the other side of one
    closes (its process died) before close(). The leader listens on the
    coordinator's host, on a port it publishes in the runtime's store."""

    def __init__(self, on_lost: Callable[[str], None], timeout_s: float):
        import jax
        from jax._src import distributed as state

        self._on_lost, self._closed = on_lost, threading.Event()
        client, me = runtime_client(), jax.process_index()
        key = "gdnx:serve-link"
        if me == 0:
            with _listen() as server:
                client.key_value_set(key, str(server.getsockname()[1]))
                server.settimeout(timeout_s)
                self._peers: dict[socket.socket, int] = {}
                for _ in range(jax.process_count() - 1):
                    conn, _ = server.accept()
                    conn.settimeout(timeout_s)
                    self._peers[conn] = int(conn.recv(16).decode().strip())
                    conn.settimeout(None)
        else:
            port = int(client.blocking_key_value_get(key, int(timeout_s * 1000)))
            host = (state.global_state.coordinator_address or "").rpartition(":")[0].strip("[]")
            conn = socket.create_connection((host, port), timeout=timeout_s)
            conn.sendall(f"{me}\n".encode())
            conn.settimeout(None)
            self._peers = {conn: 0}
        threading.Thread(target=self._watch, name="gdnx-links", daemon=True).start()

    def _watch(self) -> None:
        peers = dict(self._peers)
        while peers and not self._closed.is_set():
            ready, _, _ = select.select(list(peers), [], [], 1.0)
            for conn in ready:
                try:
                    gone = not conn.recv(1)
                except OSError:
                    gone = True
                if gone and not self._closed.is_set():
                    self._on_lost(f"process {peers[conn]} closed its link to this one")
                    return

    def close(self) -> None:
        """A clean stop: the links may close from now on."""
        self._closed.set()


class Leader:
    """The leader's Engine, as the server drives it: what changes the
    requests or steps (add_request, abort, step, reset_running, stop) is
    done here and published for the followers; the rest reads the leader's
    engine. Nothing else of the engine is reachable through it."""

    def __init__(self, engine: Engine, channel: Channel):
        self.engine, self._channel = engine, channel
        self._pending: list[Message] = []
        self._sent = 0

    # what the server reads
    def check(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        return self.engine.check(prompt, params)

    @property
    def max_slots(self) -> int:
        return self.engine.max_slots

    @property
    def running(self) -> int:
        return self.engine.running

    @property
    def waiting(self) -> int:
        return self.engine.waiting

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step_decodes(self) -> bool:
        return self.engine.step_decodes()

    # what changes the run, published

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        params = SamplingParams() if params is None else params
        if params.seed is None:  # the leader draws it: the followers take the same
            params = dataclasses.replace(params, seed=self.engine.draw_seed())
        rid = self.engine.add_request(prompt, params)
        self._pending.append(Add(rid, list(prompt), params))
        return rid

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self._pending.append(Abort(request_id))

    def step(self, decode: bool = True) -> list[Event]:
        self._publish(Step(decode, self.engine.scheduler.digest()))
        return self.engine.step(decode)

    def reset_running(self, error: str = "the engine failed a step") -> list[int]:
        self._publish(Reset(error))
        return self.engine.reset_running(error)

    def stop(self) -> None:
        """Tell the followers to end (the server is stopping)."""
        self._publish(Stop())

    def _publish(self, last: Message) -> None:
        self._channel.publish(self._sent, pickle.dumps([*self._pending, last]))
        self._pending.clear()
        if self._sent >= KEEP:
            self._channel.drop(self._sent - KEEP)
        self._sent += 1


def follow(engine: Engine, channel: Channel) -> None:
    """Run the leader's messages on this process's engine until it says
    stop. Raises PeerLost when the leader is gone, RuntimeError when this
    engine diverges or falls out of the replay window."""
    n = 0
    while True:
        got = channel.receive(n, POLL_S)
        if got is None:
            if channel.has(n + KEEP):  # the leader dropped message n when it sent n + KEEP
                raise RuntimeError(f"this process fell more than {KEEP} messages behind process 0 (message {n} "
                                   "is gone): it cannot replay the run")
            continue
        message: Message
        for message in pickle.loads(got):
            match message:
                case Add(request_id, prompt, params):
                    mine = engine.add_request(prompt, params)
                    if mine != request_id:
                        raise RuntimeError(f"this process's engine gave request {request_id} the id {mine}: the "
                                           "processes of the run diverged (started with different settings or "
                                           "checkpoints?)")
                case Abort(request_id):
                    engine.abort(request_id)
                case Step(decode, digest):
                    if engine.scheduler.digest() != digest:
                        raise RuntimeError(f"this process's engine is about to run another step than process 0's "
                                           f"(message {n}): the processes of the run diverged")
                    try:
                        engine.step(decode)
                    except Exception as e:  # as the leader's: its same step fails alike and a Reset follows
                        if peer_failure(e) is not None:
                            raise
                        log.exception("this process failed a step; process 0's next message says how it ends")
                case Reset(error):
                    engine.reset_running(error)
                case Stop():
                    return
        n += 1
