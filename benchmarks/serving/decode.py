"""Where the engine's decode step spends its time on this machine's CPU:
the peer benchmark's checkpoint (benchmarks/serving/server.py --peer: Qwen3.5,
width 256, 8 layers, float32), 32 slots of 256 tokens, 8 tokens per call,
its layers scanned (the default from 8 layers: one scan over the repeats of
3 Gated DeltaNet + 1 attention layer) and unrolled (scan_layers=False),
in one process. For each: the decode call's median time over --calls
calls, and a profile of 5 calls (jax.profiler) with XLA's kernels grouped
as matrix products (XNNPACK fusions and dots), data movement (slices,
updates, copies, transposes, broadcasts, selects, gathers and scatters of
the cache and state) and the rest. Prints markdown for docs/benchmarks.md.

    python -m benchmarks.serving.decode [--calls 20]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from server import peer_checkpoint  # noqa: E402

from gdnx.models import CausalLM  # noqa: E402
from gdnx.serving import Engine  # noqa: E402
from gdnx.serving.runner import DecodeBatch  # noqa: E402

from benchmarks.harness import machine

SLOTS, MAX_LENGTH, STEPS = 32, 256, 8
MOVES = ("dynamic-slice", "dynamic-update-slice", "copy", "transpose", "broadcast", "select", "gather", "scatter",
         "concatenate", "slice")


def kind(name: str) -> str | None:
    """A profiled kernel's kind, None for what is not a kernel (the executor's own spans)."""
    if name.startswith(("ThunkExecutor", "$", "Slinky", "PjitFunction", "while", "ParseArguments")):
        return None
    if name.startswith(("ynn_fusion", "dot")):
        return "matrix products"
    base = re.sub(r"\.\d+$", "", name)
    return "data movement" if any(m in base for m in MOVES) else "other"


def decode_call(model: CausalLM):
    """The engine's decode call of every slot, STEPS tokens (the first
    calls, which compile, made)."""
    engine = Engine(model, max_slots=SLOTS, max_length=MAX_LENGTH, decode_steps=STEPS)
    batch = DecodeBatch.idle(SLOTS, max_slots=SLOTS, steps=STEPS, vocab=model.config.vocab_size)
    batch = batch._replace(active=np.ones(SLOTS, bool))

    def call():
        jax.block_until_ready(engine.runner._decode(batch))

    for _ in range(3):
        call()
    return call


def median_seconds(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(directory: Path, scan: bool, calls: int) -> tuple[float, dict[str, float]]:
    call = decode_call(CausalLM.from_pretrained(directory, scan_layers=scan))
    seconds = median_seconds(call, calls)
    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace, create_perfetto_trace=True)
        for _ in range(5):
            call()
        jax.profiler.stop_trace()
        events = json.load(gzip.open(glob.glob(f"{trace}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    kinds: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (k := kind(e["name"])) is not None:
            kinds[k] += e["dur"] / 5 / 1e3   # ms of kernel time per call
    return seconds, dict(kinds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    print(f"decode profile, {machine()}, `python -m benchmarks.serving.decode --calls {args.calls}`\n")
    with tempfile.TemporaryDirectory() as tmp:
        peer_checkpoint(Path(tmp))
        rows = {scan: measure(Path(tmp), scan, args.calls) for scan in (True, False)}
    print("| layers | decode call (8 tokens x 32 rows) | tokens/s | matrix products | data movement | other |")
    print("|---|---:|---:|---:|---:|---:|")
    for scan, (t, k) in rows.items():
        print(f"| {'scanned' if scan else 'unrolled'} | {t * 1e3:.1f} ms | {SLOTS * STEPS / t:,.0f} | "
              f"{k.get('matrix products', 0):.1f} ms | {k.get('data movement', 0):.1f} ms | {k.get('other', 0):.1f} ms |")
    print(f"\nunrolled / scanned: {rows[True][0] / rows[False][0]:.2f}x the decode tokens/s; kernel times are summed "
          "over XLA's threads (they overlap the call's wall time)")


if __name__ == "__main__":
    main()
