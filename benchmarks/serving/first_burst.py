"""The first burst of requests a fresh `gdnx serve` answers, against the
same burst sent again, with every program compiled before it listens
(--warm-up all) and with only the decode steps (--warm-up decode), and
the start-up each costs.

    python -m benchmarks.serving.first_burst

Model and checkpoint: benchmarks/serving/server.py's (width 256, 8 layers, word
tokenizer), 32 slots of 256 tokens, prefix cache off. A burst: 12
concurrent completions with prompts of 5 to 200 words (every prefill
bucket and several batch sizes), 16 tokens out, greedy. Prints markdown
for docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.serving.server import MAX_LENGTH, SLOTS, checkpoint

from benchmarks.harness import machine

LENGTHS = (5, 9, 20, 33, 47, 64, 90, 120, 150, 170, 190, 200)


def start(directory: Path, warm_up: str) -> tuple[subprocess.Popen, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gdnx", "serve", "--checkpoint", str(directory), "--port", "0",
                             "--served-model-name", "bench", "--max-slots", str(SLOTS), "--max-length",
                             str(MAX_LENGTH), "--prefix-cache-mb", "0", "--warm-up", warm_up],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"at (http://[\d.]+:\d+)/v1", line):
            url = m.group(1)
            break
    else:
        raise SystemExit("gdnx serve did not start")
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.TransportError:
            time.sleep(0.1)


async def burst(url: str, seed: int) -> float:
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
            "model": "bench", "prompt": " ".join(f"w{i}" for i in rng.integers(1, 4096, n)), "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}) for n in LENGTHS))
        return time.perf_counter() - t0


def main() -> None:
    print(f"first burst, {machine()}, `python -m benchmarks.serving.first_burst`\n")
    rows = ["| --warm-up | start-up to serving | first burst | the same burst again | first / again |",
            "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(Path(tmp))
        for mode in ("all", "decode"):
            proc, url, up = start(Path(tmp), mode)
            try:
                first = asyncio.run(burst(url, 0))
                again = float(np.median([asyncio.run(burst(url, 0)) for _ in range(3)]))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            rows.append(f"| {mode} | {up:.1f} s | {first:.2f} s | {again:.2f} s | {first / again:.2f}x |")
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
