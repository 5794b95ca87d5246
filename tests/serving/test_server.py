"""`gdnx serve` as a user runs it: a subprocess on a free port of
127.0.0.1 serving a tiny Qwen3.5 checkpoint with a chat template, driven
by the official openai client (and httpx for what the client hides: the
raw stream, status codes, error bodies). Greedy results are checked
against transformers (the model's own implementation) and against the same
prompt served alone; every server started is stopped by its test."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.hf_models import SPECIAL, ROLE_WORDS, VOCAB, word
from tests.helpers.serving import KEY, Server

# one worker runs this module: one server process for its tests
pytestmark = pytest.mark.xdist_group("server")

FIRST_WORD = len(SPECIAL) + len(ROLE_WORDS)   # ids below are special tokens and role words
MAX_BYTES = 2_000_000                          # the module server's --max-request-bytes
TIMEOUT_S = 5                                  # its --request-timeout


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints):
    return (hf_checkpoints.path("qwen3_5", scale=5.0, tokenizer="chat"),
            hf_checkpoints.hf("qwen3_5", scale=5.0, tokenizer="chat"))


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(checkpoint[0], "--max-slots", "4", "--max-length", "128", "--decode-steps", "4",
               "--prefix-cache-mb", "8", "--speculative", "2", "--draft-rows", "4", "--max-request-bytes", str(MAX_BYTES),
               "--request-timeout", str(TIMEOUT_S), env={"GDNX_API_KEY": KEY})
    yield s
    assert s.stop() == 0, "".join(s.lines)


def _prompt(seed: int, words: int) -> list[int]:
    return np.random.default_rng(seed).integers(FIRST_WORD, VOCAB, words).tolist()


def _text(ids) -> str:
    return " ".join(word(i) for i in ids)


def _decode(path, ids) -> str:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path / "tokenizer.json")).decode(ids)


GREEDY = dict(model="tiny", temperature=0.0, extra_body={"ignore_eos": True})


def test_completions_equal_transformers_greedy(server, checkpoint):
    hf = checkpoint[1]
    for seed, length in ((0, 9), (1, 70)):  # within one prefill block of 64 and past it
        ids = _prompt(seed, length)
        got = server.client().completions.create(prompt=_text(ids), max_tokens=8, **GREEDY)
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, length:]
        assert got.choices[0].text == _decode(checkpoint[0], want.tolist())
        assert got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (length, 8)


def test_echo_with_logprobs_scores_the_prompt_as_transformers(server, checkpoint):
    """lm-eval's local-completions request: token-id prompts in one batch,
    echo, logprobs 1, max_tokens 1 (or 0: the prompt alone). Each prompt
    token after the first gets transformers' log_softmax within 1e-5
    relative (float32) and its top-1; the first gets null; the text and
    tokens are the prompt's, then the generated one."""
    hf = checkpoint[1]
    prompts = [_prompt(5, 11), _prompt(6, 70)]  # within one prefill block of 64 and past it
    for max_tokens in (1, 0):
        r = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": max_tokens,
                                              "echo": True, "logprobs": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        for ids, choice in zip(prompts, r.json()["choices"], strict=True):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert choice["text"].startswith(_decode(checkpoint[0], ids))
            assert "".join(lp["tokens"]) == choice["text"]
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), dim=-1).numpy()
            want = ref[np.arange(len(ids) - 1), ids[1:]]
            np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, rtol=1e-5, atol=1e-5)
            for row, top in zip(ref, lp["top_logprobs"][1:len(ids)]):
                assert list(top.values()) == pytest.approx([row.max()], rel=1e-5, abs=1e-5)
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == 81 and usage["completion_tokens"] == 2 * max_tokens


def test_chat_renders_the_checkpoints_template(server, checkpoint):
    messages = [{"role": "system", "content": _text(_prompt(2, 3))}, {"role": "user", "content": _text(_prompt(3, 5))}]
    chat = server.client().chat.completions.create(messages=messages, max_tokens=6, **GREEDY)
    # transformers renders the same template: the chat equals a completion of its rendering
    tok = AutoTokenizer.from_pretrained(checkpoint[0])
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain = server.client().completions.create(prompt=rendered, max_tokens=6, **GREEDY)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)[
        "input_ids"])
    assert chat.object == "chat.completion" and chat.model == "tiny"


def test_streams_equal_the_whole_response(server):
    prompt = _text(_prompt(4, 12))
    whole = server.client().completions.create(prompt=prompt, max_tokens=10, **GREEDY)
    chunks = list(server.client().completions.create(prompt=prompt, max_tokens=10, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    messages = [{"role": "user", "content": prompt}]
    whole = server.client().chat.completions.create(messages=messages, max_tokens=7, **GREEDY)
    chunks = list(server.client().chat.completions.create(messages=messages, max_tokens=7, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks
    # the raw protocol: server-sent events ending in [DONE]
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": True}, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_strings_cut_the_text_streamed_or_not(server):
    prompt = _text(_prompt(5, 10))
    base = server.client().completions.create(prompt=prompt, max_tokens=10, **GREEDY).choices[0].text.split()
    # the fifth word, spaced (w9 is a prefix of w90): the text stops before its first occurrence
    stop = f" {base[4]} "
    want = " ".join(base[:base.index(base[4])])
    got = server.client().completions.create(prompt=prompt, max_tokens=10, stop=[stop, "never"], **GREEDY)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    chunks = list(server.client().completions.create(prompt=prompt, max_tokens=10, stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeds_and_n_choices(server):
    client = server.client()
    args = dict(model="tiny", prompt=_text(_prompt(6, 8)), max_tokens=12, temperature=1.0,
                extra_body={"ignore_eos": True})
    a, b, c = (client.completions.create(seed=s, **args).choices[0].text for s in (3, 3, 4))
    assert a == b != c
    many = client.completions.create(n=3, seed=3, **args)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    # choice i draws with seed + i: each equals that seed's request alone
    assert many.choices[0].text == a and many.choices[1].text == c
    assert many.choices[2].text == client.completions.create(seed=5, **args).choices[0].text
    assert many.usage.completion_tokens == 36 and many.usage.prompt_tokens == 8
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(n=2, seed=3, stream=True, **args):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: a, 1: c}


def test_logprobs(server):
    prompt = _text(_prompt(7, 8))
    got = server.client().completions.create(prompt=prompt, max_tokens=5, logprobs=3, **GREEDY).choices[0]
    lp = got.logprobs
    assert "".join(lp.tokens) == got.text and len(lp.token_logprobs) == 5
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert max(top.values()) == pytest.approx(chosen, abs=1e-6) and top[tok] == pytest.approx(chosen, abs=1e-6)
    assert lp.text_offset == np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    streamed = [c.choices[0].logprobs for c in server.client().completions.create(
        prompt=prompt, max_tokens=5, logprobs=3, stream=True, **GREEDY) if c.choices[0].logprobs]
    assert sum((x.tokens for x in streamed), []) == lp.tokens
    assert sum((x.text_offset for x in streamed), []) == lp.text_offset
    chat = server.client().chat.completions.create(messages=[{"role": "user", "content": prompt}], max_tokens=4,
                                                   logprobs=True, top_logprobs=2, **GREEDY).choices[0]
    content = chat.logprobs.content
    assert "".join(c.token for c in content) == chat.message.content and len(content) == 4
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
               for c in content)


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    before = server.metrics()
    # a prompt sent twice: its first block of 64 tokens comes back from the prefix cache
    prompt = _text(_prompt(8, 80))
    first, again = (server.client().completions.create(prompt=prompt, max_tokens=6, **GREEDY) for _ in range(2))
    assert again.usage.prompt_tokens_details.cached_tokens == 64 and again.choices[0].text == first.choices[0].text
    m = server.metrics()
    for name in ("gdnx_requests_total", "gdnx_prompt_tokens_total", "gdnx_generated_tokens_total",
                 "gdnx_queue_depth", "gdnx_running_slots", "gdnx_time_to_first_token_seconds_count",
                 "gdnx_inter_token_latency_seconds_count", "gdnx_prefix_cache_hit_rate",
                 "gdnx_speculative_acceptance"):
        assert name in m, name
    grew = {k: m[k] - before[k] for k in before}
    assert grew["gdnx_requests_total"] == grew["gdnx_requests_finished_total"] == 2
    assert grew["gdnx_prompt_tokens_total"] == 160 and grew["gdnx_generated_tokens_total"] == 12
    assert grew["gdnx_time_to_first_token_seconds_count"] == 2
    assert grew["gdnx_inter_token_latency_seconds_count"] == 10  # the tokens after each first one
    assert grew["gdnx_prefix_cache_hit_tokens_total"] == 64
    assert m["gdnx_prefix_cache_hit_rate"] == pytest.approx(
        m["gdnx_prefix_cache_hit_tokens_total"] / m["gdnx_prompt_tokens_total"])


def _post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("path,body,status,param,match", [
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "n": 0}, 400, "n", "n:"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "temp": 1}, 400, "temp", "unknown field"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt", "prompt: required"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "max_tokens": "8"}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "echo": True, "stream": True}, 400, "echo",
     "not with stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "max_tokens": 0}, 400, "max_tokens", "0 only with echo"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "best_of": 2}, 400, "best_of", "not supported"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 500]}, 400, "prompt", "token ids must be in"),
    ("/v1/completions", '{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(["w9"] * 130)}, 400, "prompt", "max_length=128"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "max_tokens": 200}, 400, "max_tokens", "max_length=128"),
    ("/v1/completions", {"model": "other", "prompt": "w9"}, 404, "model", "serves 'tiny'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "w9"}]}, 400, "messages",
     "unknown role robot"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w9"}], "top_logprobs": 2},
     400, "top_logprobs", "only with logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "top_k": 2 ** 31}, 400, "top_k", "vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": "w9", "seed": 2 ** 64}, 400, "seed", "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": [[5]] * 17, "n": 16, "max_tokens": 1}, 400, "n",
     "exceed what the server ever holds"),
    ("/v1/completions", '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None,
     "nested too deeply"),
])
def test_each_bad_request_names_its_field(server, path, body, status, param, match):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and match in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_api_key_is_required_on_v1_routes(server):
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "w9"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers={} if key is None else
                         {"Authorization": f"Bearer {key}"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(default_headers={"Authorization": "Bearer wrong"}).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics are open


async def _stream_text(client, prompt: str, max_tokens: int, cancel_after: int | None = None) -> str | None:
    stream = await client.completions.create(prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY)
    text, chunks = "", 0
    async for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            await stream.close()  # the client goes away mid-stream
            return None
    return text


def test_concurrent_streams_equal_each_prompt_alone_and_cancelled_ones_free_their_slots(server):
    prompts = [_text(_prompt(100 + i, 5 + 9 * i)) for i in range(8)]
    alone = [server.client().completions.create(prompt=p, max_tokens=12, **GREEDY).choices[0].text for p in prompts]

    async def load(cancel: bool) -> list:
        client = server.async_client()
        try:
            jobs = [_stream_text(client, prompts[i % 8], 60 if cancel and i % 3 == 0 else 12,
                                 cancel_after=2 if cancel and i % 3 == 0 else None) for i in range(33)]
            return await asyncio.wait_for(asyncio.gather(*jobs), 300)
        finally:
            await client.close()

    before = server.metrics()
    got = asyncio.run(load(cancel=False))  # 33 clients through 4 slots
    assert got == [alone[i % 8] for i in range(33)]
    got = asyncio.run(load(cancel=True))   # a third of them leave after their first chunks
    assert [g for i, g in enumerate(got) if i % 3] == [alone[i % 8] for i in range(33) if i % 3]
    deadline = time.monotonic() + 60
    while (m := server.metrics())["gdnx_running_slots"] or m["gdnx_queue_depth"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["gdnx_requests_aborted_total"] - before["gdnx_requests_aborted_total"] == 11
    assert m["gdnx_requests_finished_total"] - before["gdnx_requests_finished_total"] == 33 + 22
    assert m["gdnx_speculative_drafted_tokens_total"] > 0  # n-gram drafts were verified on the way
    # and the next requests are served
    assert server.client().completions.create(prompt=prompts[3], max_tokens=12, **GREEDY).choices[0].text == alone[3]


@pytest.mark.slow
def test_queue_limit_then_sigterm_lets_requests_in_flight_finish(checkpoint):
    """A client that gives up on a whole response frees its slot; then, with
    one slot and a queue of one, a third request is refused at once (503);
    SIGTERM then stops the listener while both requests finish."""
    # requests of thousands of tokens one per round trip: seconds, so the second waits while the third comes
    server = Server(checkpoint[0], "--warm-up", "decode", "--max-slots", "1", "--max-queue", "1",
                    "--max-length", "4096",
                    "--decode-steps", "1", "--grace", "60", "--batch-invariant", "--api-key", "flag-key",
                    env={"GDNX_API_KEY": ""})
    auth = {"Authorization": "Bearer flag-key"}
    try:
        body = {"model": "tiny", "prompt": "w9 w10 w11", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=1.0)
        deadline = time.monotonic() + 30
        while (m := server.metrics())["gdnx_running_slots"] or not m["gdnx_requests_aborted_total"]:
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert m["gdnx_requests_finished_total"] == 0
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        lengths = (3000, 10)  # the first holds the slot while the second waits and the third comes
        results: dict[int, list[str]] = {}
        first = [threading.Event(), threading.Event()]

        def stream(i: int) -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "max_tokens": lengths[i]},
                              headers=auth, timeout=120) as r:
                assert r.status_code == 200
                results[i] = []
                for line in r.iter_lines():
                    if line:
                        results[i].append(line)
                        first[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads[0].start()
        assert first[0].wait(60)
        threads[1].start()
        deadline = time.monotonic() + 30
        while server.metrics()["gdnx_queue_depth"] < 1:  # the second one waits for the slot
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        refused = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=60)
        assert refused.status_code == 503 and time.monotonic() - start < 5, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(120) == 0, "".join(server.lines)
        for t in threads:
            t.join(10)
        for i in range(2):  # both ran to max_tokens, then the finish, usage and [DONE]
            chunks = [json.loads(x[6:]) for x in results[i][:-1]]
            assert results[i][-1] == "data: [DONE]"
            assert chunks[-1]["usage"]["completion_tokens"] == lengths[i]
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        server.stop()


@pytest.mark.slow
def test_an_engine_error_fails_its_requests_with_500_and_the_server_goes_on(checkpoint):
    """In process (the failure is injected into the engine's step): the
    requests the failed step ran get 500 (a stream: an error event), and
    the next requests are served as before."""
    from fastapi.testclient import TestClient

    from gdnx.data.text import HFTokenizer
    from gdnx.models import CausalLM
    from gdnx.serving import Engine
    from gdnx.serving.async_engine import AsyncEngine
    from gdnx.serving.metrics import Metrics
    from gdnx.serving.server import Served, create_app

    path = checkpoint[0]
    engine = Engine(CausalLM.from_pretrained(path, gdn_chunk_size=16), max_slots=2, max_length=64, decode_steps=4,
                    tokenizer=HFTokenizer(str(path / "tokenizer.json")))
    served = Served(AsyncEngine(engine, Metrics(), max_queue=4), HFTokenizer(str(path / "tokenizer.json")), "tiny",
                    engine.max_length)
    body = {"model": "tiny", "prompt": _text(_prompt(9, 6)), "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    real, calls = engine.step, []

    def failing_step(decode=True):
        calls.append(decode)
        if decode and calls.count(True) == 2:  # the request is decoding by then
            raise RuntimeError("injected failure")
        return real(decode)

    with TestClient(create_app(served)) as client:
        want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        calls.clear()
        engine.step = failing_step
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "internal_server_error"
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        calls.clear()
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
        assert "injected failure" in events[-1]["error"]["message"]
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        assert served.engine.metrics.value("gdnx_requests_failed_total") == 2
        assert engine.running == 0
        engine.step = lambda decode=True: 1 / 0  # a failure before any request runs: the waiting ones fail
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
        engine.step = real
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == want


def _raw(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _head(length: int) -> bytes:
    """A completions request's headers, its body of `length` bytes to follow."""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {length}\r\n\r\n").encode()


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends until it closes the connection (within `seconds`)."""
    sock.settimeout(seconds)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_a_body_over_the_limit_is_413_and_health_answers_while_a_large_one_is_prepared(server):
    """413 past --max-request-bytes (known from Content-Length); a body just
    under it, tokenized off the event loop, does not hold up /health."""
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "w9 " * (MAX_BYTES // 3 + 10)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    big = {"model": "tiny", "prompt": "w9 " * ((MAX_BYTES - 100) // 3)}
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(_post(server, "/v1/completions", big)))
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.05)
    sender.join()
    assert answer[0].status_code == 400 and answer[0].json()["error"]["code"] == "context_length_exceeded"
    assert slowest < 1.0, slowest


@pytest.mark.slow
def test_idle_and_half_sent_connections_are_closed(server):
    """A connection that sends nothing, or part of its headers, is closed
    after --request-timeout seconds; a body sent in part gets 408."""
    with _raw(server) as idle, _raw(server) as headers, _raw(server) as body:
        start = time.monotonic()
        headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        body.sendall(_head(100) + b'{"model": ')
        assert _closed_within(idle, 3 * TIMEOUT_S) == b""
        assert _closed_within(headers, 3 * TIMEOUT_S) == b""
        assert b" 408 " in _closed_within(body, 3 * TIMEOUT_S).split(b"\r\n")[0]
        assert TIMEOUT_S - 1 < time.monotonic() - start < 3 * TIMEOUT_S
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_client_gone_before_its_first_token_frees_its_slot(server):
    """A streaming request whose client closes the connection at once (its
    prompt still being prefilled) is aborted: nothing stays running."""
    before = server.metrics()
    body = json.dumps({"model": "tiny", "prompt": _text(_prompt(41, 100)), "max_tokens": 20, "stream": True,
                       "ignore_eos": True}).encode()
    for _ in range(3):
        with _raw(server) as sock:
            sock.sendall(_head(len(body)) + body)
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        ended = m["gdnx_requests_aborted_total"] + m["gdnx_requests_finished_total"]
        if ended - before["gdnx_requests_aborted_total"] - before["gdnx_requests_finished_total"] >= 3 \
                and not m["gdnx_running_slots"] and not m["gdnx_queue_depth"]:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["gdnx_requests_aborted_total"] > before["gdnx_requests_aborted_total"]


@pytest.mark.slow
def test_sigterm_drains_then_ends_streams_with_an_error_and_done(checkpoint):
    """SIGTERM: /health says 503 while requests are in flight (the listener
    stays open), new requests get 503; after --grace seconds a stream still
    running ends with an error event and [DONE]; exit 0, no traceback. (The
    engine flags are the queue-limit test's: its compiled programs serve.)"""
    server = Server(checkpoint[0], "--warm-up", "decode", "--max-slots", "1", "--max-queue", "1",
                    "--max-length", "4096",
                    "--decode-steps", "1", "--grace", "1", "--batch-invariant", env={"GDNX_API_KEY": KEY})
    try:  # 4,000 tokens one per round trip: seconds, longer than the grace period
        body = {"model": "tiny", "prompt": "w9 w10", "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
                "stream": True}
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "shutting down"
        assert _post(server, "/v1/completions", {"model": "tiny", "prompt": "w9"}).status_code == 503
        assert server.proc.wait(60) == 0, "".join(server.lines)
        t.join(10)
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        assert "Traceback" not in "".join(server.lines), "".join(server.lines)
    finally:
        server.stop()
