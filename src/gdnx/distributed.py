"""Several processes, one run: starting JAX's distributed runtime, stop
signals every process agrees on, waiting for the first process, and the
supervisor that turns a lost process into one line.

The coordinator address, the number of processes and this process's id come
from the command line, else from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
and JAX_PROCESS_ID, else from JAX's cluster detection (Cloud TPU, SLURM,
Open MPI, Kubernetes). On CPU the processes' collectives run over gloo.

When a process of the run dies, JAX's runtime ends the others from native
code (a fatal log and abort) once the heartbeat timeout passes, or at once
when the coordinator itself is gone; Python cannot catch that. So `gdnx
train`, `gdnx generate` and `gdnx serve` with --distributed run the work in a child
process whose native output goes through the supervisor: it passes that
output on (less gloo's line per collective group and the runtime's
accounts of a lost process), and replaces the runtime's fatal
report with one line and exit status PEER_LOST_STATUS.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

import jax
import numpy as np

from gdnx.errors import FieldError
from gdnx.signals import handled

HEARTBEAT_TIMEOUT_S = 100  # JAX's default: how long a silent process is taken for alive
JOIN_TIMEOUT_S = 300       # JAX's default: how long the processes of a run may take to join
JOIN_NOTE_S = 5            # a line this often while they join
JOIN_MARGIN_S = 10         # past --join-timeout, the runtime's own deadline (gdnx stops first, in one line)
REFUSED_WAIT_S = 10        # how long a process that refused waits for the others to refuse too
PREEMPTED_STATUS = 75  # stopped by SIGTERM / SIGINT with a checkpoint (sysexits' EX_TEMPFAIL: run it again)
PEER_LOST_STATUS = 4   # another process of the run died; rerunning resumes from the last intact checkpoint
SUPERVISED = "GDNX_SUPERVISED"  # set in the child: the fd the supervisor reads native output from
_FATAL_MARK = b"Terminating process because the JAX distributed service detected fatal errors"
# gloo's line per new collective group, from several threads at once (so also in pieces)
_GLOO_CHATTER = re.compile(rb"\[Gloo\] Rank|connected peer ranks|^\s*\d*\s*$")
# a native log record's first line: severity, date, time, thread, file:line]
_NATIVE_LOG = re.compile(rb"^[IWEF]\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\]")
_PR_SET_PDEATHSIG = 1
# native log records passed over: the runtime's accounts of a lost process (the one line says it)
_QUIET_SOURCES = (b"coordination_service", b"preemption_sync_manager")
# a supervised child's closing line, sent through the supervisor's pipe: it prints one line, the runtime's
# account of the failure where that came first through the same pipe, else this
_EXIT_MARK = b"\x00gdnx-exit\x00"
# a supervised child has said its own closing line and ends with the status after the mark: the runtime's account
# of another process leaving meanwhile (it ended its run on seeing this one go) is not a second line
_SAID_MARK = b"\x00gdnx-said\x00"
_to_supervisor = False  # set in a supervised child once its native output goes to the supervisor
_started = False  # this process started the distributed runtime (initialize)


class PeerLost(RuntimeError):
    """Another process of the run stopped answering."""


class BarrierTimeout(RuntimeError):
    """Not every process of the run reached a barrier within its time (one
    may still be working, or was never started)."""


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands in a run of several: what
    jax.distributed.initialize needs; None leaves a value to cluster detection."""
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S
    join_timeout_s: int = JOIN_TIMEOUT_S


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


def process_group(coordinator: str | None, num_processes: int | None, process_id: int | None,
                  heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S, join_timeout_s: int = JOIN_TIMEOUT_S,
                  env: Mapping[str, str] = os.environ) -> ProcessGroup:
    """Options first, then the environment; checks what is given."""
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = num_processes if num_processes is not None else _env_int(env, "JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int(env, "JAX_PROCESS_ID")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator: expected HOST:PORT, got {coordinator!r}")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes: expected a positive integer, got {num_processes}")
    if process_id is not None and (process_id < 0 or (num_processes is not None and process_id >= num_processes)):
        raise ValueError(f"--process-id: expected 0 <= id < --num-processes ({num_processes}), got {process_id}")
    if heartbeat_timeout_s < 1:
        raise ValueError(f"--heartbeat-timeout: expected a positive number of seconds, got {heartbeat_timeout_s}")
    if join_timeout_s < 1:
        raise ValueError(f"--join-timeout: expected a positive number of seconds, got {join_timeout_s}")
    return ProcessGroup(coordinator, num_processes, process_id, heartbeat_timeout_s, join_timeout_s)


def _check_port_free(coordinator: str) -> None:
    """Process 0 serves the coordinator's port: one in use there would end
    the runtime's start in a crash of native code, so it is refused first.
    The runtime listens on every interface of the port (IPv6 and IPv4)."""
    port = int(coordinator.rpartition(":")[2])
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT is no obstacle
            try:
                probe.bind((address, port))
            except OSError as e:
                raise ValueError(f"--coordinator: port {port} is in use on this host ({e.strerror}); process 0 "
                                 "serves the coordinator there: choose a free port") from None
        return


def initialize(group: ProcessGroup, command: str = "run") -> None:
    """Start JAX's distributed runtime; before anything else touches JAX's
    devices. While the processes join, a line every few seconds says so; a
    process whose run has not gathered within group.join_timeout_s stops
    with one line and PEER_LOST_STATUS (before the runtime's own deadline,
    which ends the process in native code). A process that stops answering
    for group.heartbeat_timeout_s ends the others' runs."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if group.coordinator is not None and group.process_id == 0:
        _check_port_free(group.coordinator)
    joined = threading.Event()

    def say_waiting() -> None:
        start = time.monotonic()
        where = f" at {group.coordinator}" if group.coordinator else ""
        while not joined.wait(min(JOIN_NOTE_S, max(0.0, start + group.join_timeout_s - time.monotonic()))):
            waited = time.monotonic() - start
            if waited >= group.join_timeout_s:
                exit_run(command, f"not every process joined the run{where} within --join-timeout "
                                  f"({group.join_timeout_s} s); start every process with the same --coordinator "
                                  "and --num-processes, each with its own --process-id (a process whose id another "
                                  "already holds cannot join)")
            print(f"gdnx: waiting for the {group.num_processes or 'other'} processes of the run to join{where} "
                  f"({waited:.0f} s of {group.join_timeout_s})", file=sys.stderr, flush=True)

    threading.Thread(target=say_waiting, name="gdnx-join", daemon=True).start()
    try:
        jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id,
                                   heartbeat_timeout_seconds=group.heartbeat_timeout_s,
                                   initialization_timeout=group.join_timeout_s + JOIN_MARGIN_S)
    except (ValueError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--distributed: the distributed runtime did not start ({first[:200]}); give --coordinator "
                         "HOST:PORT --num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS, "
                         "JAX_NUM_PROCESSES, JAX_PROCESS_ID), or run where a cluster (Cloud TPU, SLURM, Open MPI) "
                         "is detected") from None
    finally:
        joined.set()
    global _started
    _started = True


def started() -> bool:
    """This process joined a run of several (initialize returned); unlike
    is_distributed, it starts no JAX backend to tell."""
    return _started


def runtime_client() -> Any:
    """The distributed runtime's client (its key-value store and barriers)."""
    from jax._src import distributed as state

    client = state.global_state.client
    if client is None:
        raise RuntimeError("the distributed runtime is not started (gdnx.distributed.initialize)")
    return client


def runtime_failure(e: BaseException) -> tuple[str, bool]:
    """A runtime call's error: its first line, and whether it is a deadline
    passing (else the process on the other side is gone)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return text, "DEADLINE_EXCEEDED" in text or "timed out" in text.lower()


def agree(name: str, record: Mapping[str, Any], timeout_s: int = 300) -> None:
    """Every process of the run gives `record` (JSON values); raises
    FieldError naming the first key whose value differs between this
    process and another (both see it: each compares with every other).
    Over the runtime's key-value store, not a device collective."""
    if not is_distributed():
        return
    client = runtime_client()
    me = jax.process_index()
    client.key_value_set(f"gdnx:{name}:{me}", json.dumps(dict(record), sort_keys=True, default=str))
    mine = json.loads(json.dumps(dict(record), sort_keys=True, default=str))
    for other in range(jax.process_count()):
        if other == me:
            continue
        theirs = json.loads(client.blocking_key_value_get(f"gdnx:{name}:{other}", timeout_s * 1000))
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                raise FieldError(key, f"{mine.get(key)!r} in process {me}, {theirs.get(key)!r} in process {other}: "
                                 "every process of a run must be started with the same config and data")


def is_distributed() -> bool:
    return jax.process_count() > 1


def fetch(tree: Any) -> Any:
    """A program's outputs as host arrays. On a mesh over several
    processes each reads a replicated output from its own devices and
    gathers a split one: every process makes the same call (SPMD)."""
    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return jax.device_get(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_shards[0].data)
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(get, tree)


_PEER_FAILURE = re.compile(r"Gloo \w+ failed|Connection (reset|closed|refused)|Socket closed|heartbeat|UNAVAILABLE")


def peer_failure(e: BaseException) -> str | None:
    """What an error says when another process of the run is gone (its
    sockets closed under a gloo collective, its heartbeats stopped, the
    coordinator gone while this process set up its devices), else None.
    Asks no JAX backend (it may be what failed)."""
    if not isinstance(e, (RuntimeError, PeerLost)) or not started():
        return None
    text = str(e).strip()
    if not isinstance(e, PeerLost) and not _PEER_FAILURE.search(text):
        return None
    return text.splitlines()[0][:200] if text else type(e).__name__


def peer_lost(what: str) -> str:
    """How gdnx says another process of the run stopped (`what`: how it was seen)."""
    return f"another process of the run stopped ({what})"


def exit_peer_lost(command: str, what: str) -> NoReturn:
    """Another process of the run stopped: one line, PEER_LOST_STATUS."""
    resume = " to resume from the last intact checkpoint" if command == "train" else ""
    exit_run(command, f"{peer_lost(what)}; start every process again{resume}")


def exit_run(command: str, message: str) -> NoReturn:
    """One line and PEER_LOST_STATUS, at once: the runtime's shutdown at
    exit would wait for the missing process until the heartbeat timeout and
    then abort with a fatal report. In a supervised child the line goes to
    the supervisor, behind any fatal report already sent, so that one line
    is printed whichever of the two noticed the failure first."""
    line = f"gdnx {command}: error: {message}"
    sys.stdout.flush()
    if _to_supervisor:
        os.write(2, _EXIT_MARK + line.encode(errors="replace") + b"\n")
    else:
        print(line, file=sys.stderr, flush=True)
    os._exit(PEER_LOST_STATUS)


def exit_said(status: int) -> NoReturn:
    """End with `status`, this process's one line already said (a mistake
    of its own). In a run of several processes the others may have made the
    same mistake (a config they disagree on: each sees it): they meet at a
    barrier and shut the runtime down together, each with its own line.
    Where they do not come within REFUSED_WAIT_S (a mistake of this process
    alone, as a port in use), it ends at once: the runtime's shutdown would
    wait for the others, which wait for this one; gone, it ends their runs
    (one line each)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _to_supervisor:
        os.write(2, _SAID_MARK + str(status).encode() + b"\n")
    try:
        runtime_client().wait_at_barrier("gdnx:refused", timeout_in_ms=REFUSED_WAIT_S * 1000)
        jax.distributed.shutdown()
    except Exception:  # the others did not come (or are gone): out at once
        pass
    os._exit(status)


def wait_for_first(name: str, timeout_s: int) -> None:
    """Every process waits here until all have arrived (process 0 after its
    work); a barrier of the distributed runtime, not a device collective, so
    it may wait long (a corpus being prepared)."""
    if not is_distributed():
        return
    try:
        runtime_client().wait_at_barrier(f"gdnx:{name}", timeout_in_ms=timeout_s * 1000)
    except Exception as e:  # the runtime's own error type
        text, deadline = runtime_failure(e)
        if deadline:
            raise BarrierTimeout(f"not every process reached {name!r} within {timeout_s} s ({text}); start every "
                                 "process of the run, or give the slow one more time") from None
        raise PeerLost(f"while waiting for every process at {name!r}: {text}") from None


class StopSignals:
    """SIGTERM (a scheduler's preemption notice) and SIGINT ask the run to
    stop after a step; `reached()` is True after the same step on every
    process: each step the processes share whether any of them got a signal
    (one small all-gather; the step already waits for its metrics). A second
    SIGINT interrupts at once. `signal` is the signal any process got, as of
    the last `reached()`."""

    def __init__(self) -> None:
        self.signal: int | None = None
        # this process's own, set by the handler alone: a signal that lands while
        # the processes share theirs is then shared at the next step, not lost
        self._received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers belong to the main thread; an embedding program keeps its own
        for signum in (signal.SIGINT, signal.SIGTERM):
            # this replaces JAX's own SIGTERM notifier too: the agreement below is gdnx's
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._received is not None:
            raise KeyboardInterrupt
        self._received = signum
        print(f"{signal.Signals(signum).name} received: stopping after this step with a checkpoint "
              "(SIGINT again interrupts at once)", file=sys.stderr, flush=True)

    def reached(self) -> bool:
        if is_distributed():
            from jax.experimental import multihost_utils

            got = multihost_utils.process_allgather(np.asarray(self._received or 0, np.int32))
            self.signal = int(np.max(got)) or None
        else:
            self.signal = self._received
        return self.signal is not None

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _die_with_parent() -> None:
    """In the child, before exec: die when the supervisor dies (Linux), so
    that killing `gdnx train` never leaves its worker running."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def supervise(argv: list[str], command: str) -> int:
    """Run `gdnx <argv>` as a child and wait for it; SIGINT and SIGTERM are
    passed on. Returns the child's exit status (128 + N for signal N), or
    PEER_LOST_STATUS, with one line, when JAX's runtime ended it because
    another process was lost."""
    read_end, write_end = os.pipe()
    env = {**os.environ, SUPERVISED: str(write_end)}
    child = subprocess.Popen([sys.executable, "-m", "gdnx", *argv], env=env,
                             pass_fds=(write_end,), start_new_session=True, preexec_fn=_die_with_parent)
    os.close(write_end)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)
    fatal: list[str] = []
    closing: list[str] = []  # the child's own closing line (exit_run)
    said: int | None = None  # the child said its closing line itself and ends with this status (exit_said)
    with handled(forward):
        with os.fdopen(read_end, "rb") as native:
            quiet = False  # inside a record of _QUIET_SOURCES (a record spans lines)
            for line in native:
                if line.startswith(_EXIT_MARK):
                    closing.append(line[len(_EXIT_MARK):].decode(errors="replace").rstrip("\n"))
                    continue
                if line.startswith(_SAID_MARK):
                    said = int(line[len(_SAID_MARK):].strip() or 1)
                    continue
                if fatal or _FATAL_MARK in line:
                    fatal.append(line.decode(errors="replace"))
                    continue
                if record := _NATIVE_LOG.match(line):
                    quiet = record.group(1).startswith(_QUIET_SOURCES)
                if not quiet and not _GLOO_CHATTER.search(line):
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()
        status = child.wait()
    if said is not None:
        return said
    if fatal:
        # the status follows "absl::Status:" and may run on to the next line (the lost tasks' ids)
        reason = " ".join(x.strip() for x in [fatal[0].split("absl::Status:", 1)[-1], *fatal[1:2]] if x.strip())
        if twice := re.search(r"(\d+) unexpectedly tried to connect with a different incarnation", reason):
            exit_run(command, f"a second process started with --process-id {twice.group(1)} tried to join the run; "
                              "give each process its own --process-id (0 .. N-1) and start the run again")
        exit_peer_lost(command, reason[:200])
    if closing:
        print(closing[0], file=sys.stderr, flush=True)
    return status if status >= 0 else 128 - status


def native_output_to_supervisor() -> None:
    """In a supervised child: what native code writes to fd 1 and 2 goes
    to the supervisor (which passes it on to stderr); Python's sys.stdout
    and sys.stderr keep the terminal, so output, progress and messages are
    unchanged."""
    global _to_supervisor
    fd = os.environ.pop(SUPERVISED, None)
    if fd is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    terminal_out, terminal_err = os.dup(1), os.dup(2)
    os.dup2(int(fd), 1)
    os.dup2(int(fd), 2)
    os.close(int(fd))
    sys.stdout = os.fdopen(terminal_out, "w", buffering=1, errors="backslashreplace")
    sys.stderr = os.fdopen(terminal_err, "w", buffering=1, errors="backslashreplace")
    _to_supervisor = True
