"""`gdnx serve` under load on this machine's CPU: requests/s and output
tokens/s at 1, 8 and 32 concurrent streaming clients, time to first token
and inter-token latency (median, p99) as the clients see them, and the
server's overhead against the engine called directly on the same work.

    python -m benchmarks.serving.server [--repeats 3]
    python -m benchmarks.serving.server --peer transformers [--repeats 1]

Model: the serving benchmark's (Qwen3-Next pattern, width 256, 8 layers,
4,096-token vocabulary, float32, random weights), written as a Hugging
Face directory with a word-level tokenizer (one word per token) and served
by a `gdnx serve` subprocess on 127.0.0.1 with 32 slots and the prefix
cache off (prompts are distinct). Each client sends its requests one after
another: 64 random words, 64 tokens out, greedy, ignore_eos. The clients
(httpx, one asyncio loop) share the 2 cores with the server. Each
concurrency first runs two untimed rounds (they compile its prefill shapes);
throughput is the median of --repeats rounds, latencies are pooled over
them. Prints markdown for docs/benchmarks.md.

--peer transformers: `gdnx serve` and `transformers serve` side by side on
one Hugging Face checkpoint, a Qwen3.5 model of a few million parameters
(width 256, 8 layers: 6 Gated DeltaNet, 2 attention) with a byte-level BPE
tokenizer of 4,096 entries, random weights, no end-of-sequence token (so
every request runs to max_tokens in both), float32 on CPU. The same
requests go to each server in turn (the other stopped): completions of
64-token prompts, 64 tokens out, greedy, streamed with usage, at 1, 8 and
32 concurrent clients. Output tokens/s from the usage; TTFT to the first
chunk of the choice; inter-token latency as each request's mean gap
between its first and last chunks over its tokens after the first. transformers serve runs its default path (its continuous batching
refuses GDN layers: "Invalid layer type: linear_attention"); gdnx serve
runs 32 slots with every program compiled before it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.serving.engine import MODEL  # the engine benchmark's model

from gdnx.config import ModelConfig  # noqa: E402
from gdnx.models import CausalLM  # noqa: E402
from gdnx.serving import Engine, SamplingParams  # noqa: E402

from benchmarks.harness import machine

PROMPT, NEW, SLOTS, MAX_LENGTH = 64, 64, 32, 256
# requests per client in one round: at least 8 requests a round
PER_CLIENT = {1: 8, 8: 2, 32: 1}


def checkpoint(directory: Path) -> None:
    """The model as a Hugging Face directory, with a word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    CausalLM(ModelConfig(**MODEL), rngs=__import__("flax").nnx.Rngs(0)).save_pretrained(directory)
    tok = Tokenizer(WordLevel(vocab={f"w{i}": i for i in range(MODEL["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def prompts(n: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(1, MODEL["vocab_size"], (n, PROMPT)).tolist()


class Server:
    def __init__(self, directory: Path):
        cmd = [sys.executable, "-m", "gdnx", "serve", "--checkpoint", str(directory), "--port", "0",
               "--served-model-name", "bench", "--max-slots", str(SLOTS), "--max-length", str(MAX_LENGTH),
               "--prefix-cache-mb", "0"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if m := re.search(r"at (http://[\d.]+:\d+)/v1", line):
                self.url = m.group(1)
                break
        else:
            raise SystemExit("gdnx serve did not start")
        while True:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


async def one_request(client: httpx.AsyncClient, url: str, ids: list[int], ttft: list, itl: list) -> int:
    body = {"model": "bench", "prompt": " ".join(f"w{i}" for i in ids), "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    last, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            n = len(json.loads(line[6:])["choices"][0]["text"].split())
            if not n:
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - start)
                n -= 1
            else:  # the tokens of one chunk came together: each at their mean gap
                itl.extend([(now - last) / n] * n)
            tokens += n + (last is None)
            last = now
    assert tokens == NEW, tokens
    return tokens


async def round_(url: str, clients: int, seed: int, ttft: list, itl: list) -> tuple[float, int, int]:
    """(seconds, requests, tokens) of one round: each client sends its requests in turn."""
    work = prompts(clients * PER_CLIENT[clients], seed)

    async def client_loop(client: httpx.AsyncClient, mine: list[list[int]]) -> int:
        return sum([await one_request(client, url, ids, ttft, itl) for ids in mine])

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(client_loop(client, work[c::clients]) for c in range(clients)))
        return time.perf_counter() - start, len(work), sum(counts)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


def engine_direct(clients: int, repeats: int) -> float:
    """Output tokens/s of the same rounds through Engine (same settings) in
    this process: requests of one round queued at once (the server's 32
    clients), or one after another (its 1 client)."""
    model = CausalLM(ModelConfig(**MODEL), rngs=__import__("flax").nnx.Rngs(0))
    engine = Engine(model, max_slots=SLOTS, max_length=MAX_LENGTH)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    rates = []
    for seed in range(repeats + 1):
        work = prompts(clients * PER_CLIENT[clients], 1000 + seed)
        start = time.perf_counter()
        if clients == 1:
            n = sum(len(engine.generate([ids], params)[0].tokens) for ids in work)
        else:  # every client's request at once
            n = sum(len(c.tokens) for c in engine.generate(work, params))
        if seed:  # the first round compiles
            rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


PEER_VOCAB, PEER_NEW, PEER_PROMPT = 4096, 64, 64


def peer_checkpoint(directory: Path) -> list[str]:
    """The peer benchmark's checkpoint (module docstring); returns prompts' texts to draw from."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(3000)]
    text = [" ".join(rng.choice(words, 40)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=PEER_VOCAB, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
                               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                               linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                               linear_value_head_dim=32, max_position_embeddings=1024, eos_token_id=None,
                               bos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    Qwen3_5ForCausalLM(config).eval().save_pretrained(directory)
    return [tok.decode(tok.encode(t).ids[:PEER_PROMPT]) for t in text[-200:]]


class PeerServer:
    """gdnx serve or transformers serve on a free port, ready when /health answers."""

    def __init__(self, which: str, directory: Path):
        with __import__("socket").socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if which == "gdnx":
            cmd = [sys.executable, "-m", "gdnx", "serve", "--checkpoint", str(directory), "--port", str(port),
                   "--served-model-name", str(directory), "--max-slots", str(SLOTS), "--max-length", str(MAX_LENGTH),
                   "--prefix-cache-mb", "0"]
        else:
            cmd = [str(Path(sys.executable).parent / "transformers"), "serve", str(directory), "--port", str(port),
                   "--device", "cpu", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url, self.model = f"http://127.0.0.1:{port}", str(directory)
        start = time.monotonic()
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() - start > 900:
                raise SystemExit(f"{which} serve did not start")
            time.sleep(0.5)
        self.start_s = time.monotonic() - start

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def peer_request(client: httpx.AsyncClient, server: PeerServer, prompt: str, ttft: list, itl: list) -> int:
    body = {"model": server.model, "prompt": prompt, "max_tokens": PEER_NEW, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):  # a server may hold back text (an incomplete character): any chunk counts
                last = time.perf_counter()
                first = first or last
    assert tokens == PEER_NEW and first is not None and last is not None, tokens
    ttft.append(first - start)
    itl.append((last - first) / (tokens - 1))
    return tokens


async def peer_round(server: PeerServer, prompts: list[str], clients: int, ttft: list, itl: list) -> float:
    """Output tokens/s of one round: each client sends its share of the prompts in turn."""
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        start = time.perf_counter()

        async def loop(mine: list[str]) -> int:
            return sum([await peer_request(client, server, p, ttft, itl) for p in mine])
        counts = await asyncio.gather(*(loop(prompts[c::clients]) for c in range(clients)))
        return sum(counts) / (time.perf_counter() - start)


def peer_main(repeats: int) -> None:
    print(f"gdnx serve against transformers serve, {machine()}, "
          f"`python -m benchmarks.serving.server --peer transformers "
          f"--repeats {repeats}`\n")
    results: dict[str, dict[int, tuple[float, list, list]]] = {}
    starts = {}
    with tempfile.TemporaryDirectory() as tmp:
        texts = peer_checkpoint(Path(tmp))
        for which in ("gdnx", "transformers"):
            server = PeerServer(which, Path(tmp))
            starts[which] = server.start_s
            results[which] = {}
            try:
                for clients in (1, 8, 32):
                    work = [texts[i % len(texts)] for i in range(clients * PER_CLIENT[clients])]
                    asyncio.run(peer_round(server, work, clients, [], []))  # untimed: first use
                    ttft: list[float] = []
                    itl: list[float] = []
                    rates = [asyncio.run(peer_round(server, work, clients, ttft, itl)) for _ in range(repeats)]
                    results[which][clients] = (statistics.median(rates), ttft, itl)
                    print(which, clients, f"{results[which][clients][0]:.1f} tokens/s", file=sys.stderr, flush=True)
            finally:
                server.stop()
    print(f"Start-up to /health answering: gdnx serve {starts['gdnx']:.1f} s (every program compiled), "
          f"transformers serve {starts['transformers']:.1f} s.\n")
    rows = ["| clients | gdnx tokens/s | transformers tokens/s | gdnx / transformers | TTFT median gdnx / "
            "transformers (ms) | ITL median gdnx / transformers (ms) |", "|---|---|---|---|---|---|"]
    for clients in (1, 8, 32):
        g, t = results["gdnx"][clients], results["transformers"][clients]
        rows.append(f"| {clients} | {g[0]:,.0f} | {t[0]:,.0f} | {g[0] / t[0]:.2f}x | {pct(g[1], 50):.0f} / "
                    f"{pct(t[1], 50):.0f} | {pct(g[2], 50):.1f} / {pct(t[2], 50):.1f} |")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", choices=("transformers",), default=None,
                    help="against another server on one checkpoint (module docstring)")
    args = ap.parse_args()
    if args.peer is not None:
        peer_main(args.repeats)
        return
    print(f"gdnx serve, {machine()}, "
          f"`python -m benchmarks.serving.server --repeats {args.repeats}`\n")
    rows = ["| clients | requests/s | output tokens/s | TTFT median / p99 (ms) | ITL median / p99 (ms) |",
            "|---|---|---|---|---|"]
    served: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(Path(tmp))
        server = Server(Path(tmp))
        try:
            for clients in (1, 8, 32):
                for seed in (998, 999):  # compile this concurrency's prefill shapes (arrivals vary)
                    asyncio.run(round_(server.url, clients, seed, [], []))
                ttft: list[float] = []
                itl: list[float] = []
                rounds = [asyncio.run(round_(server.url, clients, 1001 + r, ttft, itl)) for r in range(args.repeats)]
                rps = statistics.median(n / s for s, n, _ in rounds)
                tps = statistics.median(t / s for s, _, t in rounds)
                served[clients] = tps
                rows.append(f"| {clients} | {rps:.2f} | {tps:,.0f} | {pct(ttft, 50):.0f} / {pct(ttft, 99):.0f} | "
                            f"{pct(itl, 50):.1f} / {pct(itl, 99):.1f} |")
                print(rows[-1], file=sys.stderr, flush=True)
        finally:
            server.stop()
    print("\n".join(rows), "\n")
    rows = ["| clients | server output tokens/s | engine direct tokens/s | server / engine |", "|---|---|---|---|"]
    for clients in (1, 32):
        direct = engine_direct(clients, args.repeats)
        rows.append(f"| {clients} | {served[clients]:,.0f} | {direct:,.0f} | {served[clients] / direct:.2f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
