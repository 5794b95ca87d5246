"""`gdnx serve` in a subprocess, and what the serving tests share."""

from __future__ import annotations

import re
import subprocess
import threading
import time

import httpx
import openai

from tests.helpers.processes import cpu_env, gdnx, stop

# a JSON schema small enough for a tiny model's constrained output
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


KEY = "test-key"


START_S = 240                                  # a server's start: import, load, compile (cold cache, 2 cores)


class Server:
    """`gdnx serve` in a subprocess; its URL read from its stderr. command:
    a whole command line in place of the tiny model's (run in `cwd`)."""

    def __init__(self, checkpoint, *flags: str, env: dict | None = None, command: list[str] | None = None,
                 cwd=None):
        cmd = command or gdnx("serve", "--checkpoint", str(checkpoint), "--port", "0", "--served-model-name", "tiny",
                              *flags, "model.gdn_chunk_size=16")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=cpu_env(**(env or {})), cwd=cwd)
        self.lines: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                if (m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)) and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(START_S)
        if self.url is None:
            self.stop()
            raise AssertionError("gdnx serve did not start:\n" + "".join(self.lines))
        deadline = time.monotonic() + 60
        while True:  # listening once the lifespan has started the engine
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.1)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {k: float(v) for k, v in re.findall(r"^(gdnx_\w+) (\S+)$", text, re.M)}

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (the server drains), then SIGKILL past `timeout`; its status."""
        return stop(self.proc, timeout)
