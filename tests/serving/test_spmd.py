"""One engine over several processes. In process: a follower engine that
replays the leader's messages makes the same steps and gets the same
tokens (sampled, with seeds the leader drew, aborts and a failed step
included). As processes: `gdnx serve` on 2 processes x 4 CPU devices
answers with the one-device tokens and logprobs (prefix cache on, the
model's multi-token prediction module drafting), stops both processes on SIGTERM to process 0, and when a
process dies mid-request ends the requests in flight with an error naming
the loss and exits with status 4 in one line."""

import json
import re
import signal
import subprocess
import time

import httpx
import numpy as np
import pytest

from gdnx.config import ModelConfig
from gdnx.distributed import PEER_LOST_STATUS
from gdnx.models import CausalLM
from gdnx.serving import Engine, SamplingParams
from gdnx.serving.spmd import Leader, follow
from tests.helpers.configs import TINY_HYBRID
from tests.helpers.processes import LIMIT_S, cpu_env, free_port, gdnx
from tests.helpers.hf_models import VOCAB, words
from tests.helpers.mtp import mtp_checkpoint


class _Memory:
    """A Channel in one process."""

    def __init__(self):
        self.messages: dict[int, bytes] = {}

    def publish(self, n, message):
        self.messages[n] = message

    def receive(self, n, timeout_s):
        return self.messages.get(n)

    def drop(self, n):
        del self.messages[n]

    def has(self, n):
        return n in self.messages


class _Recording:
    """An engine whose steps' events are kept."""

    def __init__(self, engine):
        self.engine, self.events = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, decode=True):
        got = self.engine.step(decode)
        self.events += got
        return got


def _run(engine, rng):
    """Requests added between steps (sampled without seeds, one aborted), run to the end."""
    events = []
    sampled = SamplingParams(max_tokens=6, temperature=1.0, logprobs=1)
    for i, n in enumerate((5, 30, 12, 7)):
        engine.add_request(rng.integers(0, 61, n).tolist(), sampled)
        if i == 2:
            engine.abort(1)
        events += engine.step(decode=i % 2 == 0)
    while engine.has_unfinished():
        events += engine.step()
    return [(e.request_id, e.tokens, e.logprobs) for e in events]


def test_a_follower_replaying_the_leaders_messages_gets_the_same_tokens():
    model = CausalLM(ModelConfig(**TINY_HYBRID), seed=1)
    settings = dict(max_slots=2, max_length=64, block_size=16, decode_steps=2, prefix_cache_bytes=1 << 22)
    channel = _Memory()
    leader = Leader(Engine(model, **settings, seed=5), channel)
    led = _run(leader, np.random.default_rng(0))
    leader.reset_running("a step failed")  # replayed too: both engines drop the same requests
    leader.stop()
    follower = _Recording(Engine(model, **settings, seed=99))  # its own seed is never used: the leader's are
    follow(follower, channel)
    assert [(e.request_id, e.tokens, e.logprobs) for e in follower.events] == led
    assert {e[0] for e in led if e[1]} >= {0, 2, 3}


def test_a_follower_whose_engine_diverges_stops():
    model = CausalLM(ModelConfig(**TINY_HYBRID), seed=1)
    channel = _Memory()
    leader = Leader(Engine(model, max_slots=2, max_length=64, block_size=16), channel)
    leader.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    leader.step()
    follower = Engine(model, max_slots=2, max_length=64, block_size=16)
    follower.add_request([4], SamplingParams(max_tokens=1))  # one request more than the leader's: ids differ
    with pytest.raises(RuntimeError, match="the processes of the run diverged"):
        follow(follower, channel)


def test_a_follower_about_to_run_another_step_stops():
    """Each step carries the leader's scheduler digest: a follower whose
    engine scheduled otherwise (here: fewer slots, one request left
    waiting) stops at the next step, before running anything different."""
    model = CausalLM(ModelConfig(**TINY_HYBRID), seed=1)
    channel = _Memory()
    leader = Leader(Engine(model, max_slots=2, max_length=64, block_size=16), channel)
    for prompt in ([1, 2, 3], [4, 5]):
        leader.add_request(prompt, SamplingParams(max_tokens=4))
    leader.step()
    leader.step()
    follower = Engine(model, max_slots=1, max_length=64, block_size=16)
    with pytest.raises(RuntimeError, match=r"about to run another step than process 0's \(message 1\)"):
        follow(follower, channel)


def test_a_follower_past_the_replay_window_says_so():
    from gdnx.serving.spmd import KEEP

    model = CausalLM(ModelConfig(**TINY_HYBRID), seed=1)
    channel = _Memory()
    leader = Leader(Engine(model, max_slots=2, max_length=64, block_size=16), channel)
    for _ in range(KEEP + 1):  # steps of an idle engine: cheap, and each one message
        leader.step()
    with pytest.raises(RuntimeError, match=f"fell more than {KEEP} messages behind process 0 \\(message 0 is gone"):
        follow(Engine(model, max_slots=2, max_length=64, block_size=16), channel)


def test_a_step_that_fails_on_every_process_ends_alike():
    """The leader's step fails (the server then resets the running requests
    and goes on); the follower's same step fails too, is left to the
    leader's word, and the reset it replays leaves both engines alike: the
    same tokens after it."""
    model = CausalLM(ModelConfig(**TINY_HYBRID), seed=1)
    settings = dict(max_slots=2, max_length=64, block_size=16, decode_steps=2)

    def failing_once(engine):
        real, calls = engine.runner.decode, []

        def decode(batch):
            calls.append(batch)
            if len(calls) == 2:
                raise RuntimeError("injected")
            return real(batch)
        engine.runner.decode = decode
        return engine

    channel = _Memory()
    leader = Leader(failing_once(Engine(model, **settings)), channel)
    leader.add_request([1, 2, 3], SamplingParams(max_tokens=8))
    led = []
    with pytest.raises(RuntimeError, match="injected"):
        while leader.has_unfinished():
            led += leader.step()
    assert leader.reset_running("a step failed") == [0]
    leader.add_request([4, 5], SamplingParams(max_tokens=3))
    while leader.has_unfinished():
        led += leader.step()
    leader.stop()
    follower = _Recording(failing_once(Engine(model, **settings)))
    follow(follower, channel)
    assert [(e.request_id, e.tokens) for e in follower.events] == [(e.request_id, e.tokens) for e in led]
    assert any(e.request_id == 1 and e.completion is not None for e in led)


# --- gdnx serve as 2 processes x 4 CPU devices ---------------------------------------------------------------------

SERVE = ["--served-model-name", "m", "--warm-up", "decode", "--max-slots", "4", "--max-length", "128",
         "--prefix-cache-mb", "16", "--speculative", "mtp:2", "--draft-rows", "4",
         "--decode-steps", "2", "model.gdn_chunk_size=16", "parallel.data=2", "parallel.tensor=4"]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints, tmp_path_factory):
    """The tiny Qwen3-Next with a multi-token prediction module, which the
    servers draft with (the model without it: the reference's tokens)."""
    _, model = hf_checkpoints.hf_and_gdnx("qwen3_next", scale=5.0, tokenizer="words", gdn_chunk_size=16)
    path, _, _ = mtp_checkpoint(hf_checkpoints.path("qwen3_next", scale=5.0, tokenizer="words"),
                                tmp_path_factory.mktemp("mtp") / "checkpoint", np.random.default_rng(0))
    return path, model


class _Served:
    """`gdnx serve` as two processes of four CPU devices each; output in logs."""

    def __init__(self, processes, path, logs, extra=()):
        self.port, coordinator = free_port(), free_port()
        self.logs = [logs / f"serve.{i}.log" for i in range(2)]
        self.procs = []
        for i in range(2):
            with self.logs[i].open("wb") as f:
                self.procs.append(processes.start(
                    gdnx("serve", "--checkpoint", str(path), "--port", str(self.port), *SERVE, *extra,
                         "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id", str(i)),
                    stdout=f, stderr=subprocess.STDOUT, env=cpu_env(devices=4)))
        self.url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.monotonic() + LIMIT_S
        while True:
            assert all(p.poll() is None for p in self.procs), self.output()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.5)

    def output(self, i=0):
        return self.logs[i].read_text(errors="replace")

    def complete(self, prompt, **fields):
        r = httpx.post(f"{self.url}/completions", json={"model": "m", "prompt": words(prompt), "temperature": 0,
                                                          **fields}, timeout=LIMIT_S)
        assert r.status_code == 200, r.text
        return r.json()


def _tokens(text):
    return [int(w[1:]) for w in text.split()]


@pytest.mark.multiprocess
def test_two_processes_serve_the_one_device_tokens_and_stop_together(checkpoint, tmp_path, processes):
    from concurrent.futures import ThreadPoolExecutor

    path, model = checkpoint
    rng = np.random.default_rng(1)
    shared = rng.integers(1, VOCAB, 70).tolist()  # more than one block (4 chunks of 16): prefix-cache hits
    prompts = [shared + [3], rng.integers(1, VOCAB, 7).tolist(), shared + [9, 4]]
    one = Engine(model, max_slots=4, max_length=128)  # one device, no cache, no drafts
    want = one.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1))
    served = _Served(processes, path, tmp_path)
    with ThreadPoolExecutor(3) as pool:  # together: batched in one engine
        got = list(pool.map(lambda p: served.complete(p, max_tokens=6, logprobs=1), prompts))
    again = served.complete(prompts[2], max_tokens=6, logprobs=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    drafted = re.search(r"^gdnx_speculative_drafted_tokens_total (\S+)$",
                        httpx.get(f"http://127.0.0.1:{served.port}/metrics", timeout=LIMIT_S).text, re.M)
    assert drafted and float(drafted.group(1)) > 0  # the MTP module's drafts were verified
    for g, w in zip([*got, again], [*want, want[2]], strict=True):
        choice = g["choices"][0]
        assert _tokens(choice["text"]) == w.tokens
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], [x for x, _ in w.logprobs],
                                   rtol=1e-5, atol=1e-6)
    served.procs[0].send_signal(signal.SIGTERM)
    assert [processes.wait(p, 60) for p in served.procs] == [0, 0], served.output(0) + served.output(1)
    for i in range(2):
        assert served.output(i).rstrip().endswith("gdnx serve: stopped"), served.output(i)
    assert "follows process 0's steps" in served.output(1)


@pytest.mark.multiprocess
def test_a_process_lost_mid_request_ends_it_with_the_news_and_status_4(checkpoint, tmp_path, processes):
    path, _ = checkpoint
    served = _Served(processes, path, tmp_path, ["--decode-steps", "1"])
    stream = {"model": "m", "prompt": words([5, 6]), "max_tokens": 120, "ignore_eos": True, "stream": True}
    body = []
    with httpx.stream("POST", f"{served.url}/completions", json=stream, timeout=LIMIT_S) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert '"text"' in first
        served.procs[1].kill()  # its supervisor: the worker dies with it
        start = time.monotonic()
        body = [line for line in lines if line.startswith("data:")]
    assert body[-1] == "data: [DONE]"
    error = json.loads(body[-2][len("data:"):])["error"]
    assert re.match(r"another process of the run stopped \(process 1 closed its link", error["message"]), error
    assert processes.wait(served.procs[0], 60) == PEER_LOST_STATUS
    assert time.monotonic() - start < 30  # the link closed at once: no heartbeat timeout, no hang
    out = served.output(0)
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert errors == ["gdnx serve: error: another process of the run stopped (process 1 closed its link to this "
                      "one); start every process again"], out
    assert "Traceback" not in out and "[Gloo]" not in out


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


def _pair(processes, path, logs, port, extras):
    coordinator = free_port()
    out = []
    for i, extra in enumerate(extras):
        log = logs / f"pair.{i}.log"
        with log.open("wb") as f:
            processes.start(gdnx("serve", "--checkpoint", str(path), "--port", str(port), *SERVE, *extra,
                                 "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                                 "--process-id", str(i), "--join-timeout", "60"),
                            stdout=f, stderr=subprocess.STDOUT, env=cpu_env(devices=4))
        out.append(log)
    return processes.started[-2:], out


@pytest.mark.multiprocess
def test_a_taken_port_or_disagreeing_flags_end_every_process_in_one_line(checkpoint, tmp_path, processes):
    """Process 0's port taken: it says so in one line (status 2) and the
    other process, waiting on it, ends too in one line (it waited forever
    before). Processes started with different engine flags: each names the
    flag in one line, status 2 (a traceback before)."""
    import socket

    path, _ = checkpoint
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        procs, logs = _pair(processes, path, tmp_path, taken.getsockname()[1], [[], []])
        statuses = [processes.wait(p, LIMIT_S) for p in procs]
    text = [log.read_text(errors="replace") for log in logs]
    assert statuses[0] == 2 and statuses[1] in (2, PEER_LOST_STATUS), (statuses, text)
    assert len(_error_lines(text[0])) == 1 and "--port: cannot listen on 127.0.0.1" in text[0], text[0]
    assert len(_error_lines(text[1])) == 1 and "Traceback" not in text[1], text[1]
    procs, logs = _pair(processes, path, tmp_path, free_port(), [[], ["--max-slots", "2"]])
    assert [processes.wait(p, LIMIT_S) for p in procs] == [2, 2], [log.read_text() for log in logs]
    for i, log in enumerate(logs):
        lines = _error_lines(log.read_text(errors="replace"))
        assert len(lines) == 1 and "--max-slots: " in lines[0] and "in process" in lines[0], lines
