"""Subprocesses a test starts: each bounded in time and stopped when the
test (or the fixture holding them) ends, passed or failed.

    with Processes() as procs:
        run = procs.start([sys.executable, "-m", "gdnx", ...], stdout=subprocess.PIPE)
        ...
    # every process still running got SIGTERM, then SIGKILL after `grace` seconds

The `processes` fixture (tests/conftest.py) gives a test one registry.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

# a gdnx command of a few steps takes well under a minute on 2 cores; past this a test fails instead of hanging
LIMIT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gdnx(*args: str) -> list[str]:
    """The gdnx command line as a test runs it."""
    return [sys.executable, "-m", "gdnx", *args]


def cpu_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a CPU subprocess (with `devices` virtual devices)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **extra}
    if devices is not None:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return env


class Processes:
    """A registry of started subprocesses, all stopped on close."""

    def __init__(self, grace: float = 10.0):
        self.grace = grace
        self.started: list[subprocess.Popen] = []

    def start(self, args: Sequence[str], **popen: Any) -> subprocess.Popen:
        """subprocess.Popen(args, **popen), stopped on close; env defaults to cpu_env()."""
        popen.setdefault("env", cpu_env())
        proc = subprocess.Popen(list(args), **popen)
        self.started.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen, timeout: float = LIMIT_S) -> int:
        """Its exit status; past `timeout` it is killed and the test fails."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{' '.join(map(str, proc.args))[:200]} ran past {timeout} s") from None

    def close(self) -> None:
        for proc in self.started:
            stop(proc, self.grace)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
