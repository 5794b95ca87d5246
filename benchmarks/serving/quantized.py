"""Quantized weights on this machine's CPU: the engine's decode call and
the parameters' bytes, unquantized (bfloat16 parameters) and held as int8 or
fp8 (model.quantize, blocks of 128 x 128), on the peer benchmark's
checkpoint (benchmarks/serving/server.py --peer: Qwen3.5, width 256, 8 layers),
32 slots of 256 tokens, 8 tokens a call; the three in one process,
medians of --calls calls. Prints markdown for docs/benchmarks.md.

    python -m benchmarks.serving.quantized [--calls 20]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
from flax import nnx

from benchmarks.serving.decode import SLOTS, STEPS, decode_call, median_seconds
from benchmarks.serving.server import peer_checkpoint

from gdnx.models import CausalLM  # noqa: E402

from benchmarks.harness import machine


def measure(directory: Path, quantize: str, calls: int) -> tuple[float, int]:
    model = CausalLM.from_pretrained(directory, quantize=quantize, dtype="bfloat16", param_dtype="bfloat16")
    size = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return median_seconds(decode_call(model), calls), size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    print(f"quantized decode, {machine()}, `python -m benchmarks.serving.quantized --calls {args.calls}`\n")
    with tempfile.TemporaryDirectory() as tmp:
        peer_checkpoint(Path(tmp))
        rows = {q: measure(Path(tmp), q, args.calls) for q in ("none", "int8", "fp8")}
    print("| weights | parameters | decode call (8 tokens x 32 rows) | tokens/s | / bf16 |")
    print("|---|---:|---:|---:|---:|")
    for q, (t, size) in rows.items():
        print(f"| {'bfloat16' if q == 'none' else q} | {size / 2**20:.2f} MiB | {t * 1e3:.1f} ms | "
              f"{SLOTS * STEPS / t:,.0f} | {rows['none'][0] / t:.2f}x |")


if __name__ == "__main__":
    main()
