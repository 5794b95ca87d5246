"""gdnx serve's start-up on this machine's CPU: memory maps per compiled
program under XLA:CPU's flags (each in a process of its own: XLA reads its
flags once), and the time to serving of a first and a second start with
the persistent compilation cache, on a tiny Qwen3.5 checkpoint (written
here, random weights, a word-level tokenizer). Prints markdown for
docs/benchmarks.md.

    python -m benchmarks.serving.startup [--max-slots 8] [--max-length 4096] [--skip-maps | --skip-starts] [--peer]

--peer: benchmarks/serving/server.py's peer checkpoint (8 layers of
width 256, a byte-level BPE tokenizer) instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import machine

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"defaults": "", "fusion emitters off": "--xla_cpu_use_fusion_emitters=false",
            "optimisation level 0": "--xla_backend_optimization_level=0",
            "both": "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0",
            "fusion emitters off, level 1 (gdnx serve)":
                "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"}
# one process per variant: the engine's programs warmed up, the maps they added counted
MEASURE = """
import sys, time
from pathlib import Path
from gdnx.inference import build_engine, load
from gdnx.serving import EngineConfig

def maps(): return sum(1 for _ in open("/proc/self/maps"))
found = load(Path(sys.argv[1]), [], "serve")
engine = build_engine(found, EngineConfig(max_slots=int(sys.argv[2]), max_length=int(sys.argv[3])))
m0, t0 = maps(), time.perf_counter()
ran = engine.warm_up(prefill=True)
print(ran, (maps() - m0) / ran, time.perf_counter() - t0)
"""


def checkpoint(where: Path, peer: bool = False) -> Path:
    path = where / "model"
    if peer:
        from benchmarks.serving.server import peer_checkpoint

        peer_checkpoint(path)
        return path
    from tests.helpers.hf_models import random_hf_model, write_chat_tokenizer

    random_hf_model("qwen3_5").save_pretrained(path)
    write_chat_tokenizer(path)
    return path


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "JAX_PLATFORMS": "cpu", **extra}


def start(path: Path, cache: Path, slots: int, length: int) -> tuple[float, str]:
    """Seconds from launch to the serving line, and the line saying how many programs ran."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gdnx", "serve", "--checkpoint", str(path), "--port", "0",
                             "--max-slots", str(slots), "--max-length", str(length), "--compile-cache", str(cache)],
                            stderr=subprocess.PIPE, text=True, env=clean_env())
    ready = ""
    assert proc.stderr is not None
    for line in proc.stderr:
        if "programs ready" in line or "error" in line:
            ready = line.strip()
        if "serving" in line or "error" in line:
            break
    took = time.perf_counter() - t0
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    return took, ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-slots", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--maps-length", type=int, default=512, help="max_length of the maps measurement")
    parser.add_argument("--skip-maps", action="store_true", help="only the two starts")
    parser.add_argument("--skip-starts", action="store_true", help="only the memory maps")
    parser.add_argument("--peer", action="store_true", help="benchmarks/serving/server.py's peer checkpoint instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp), args.peer)
        print(f"gdnx serve: start-up, {machine()}\n")
        if not args.skip_maps:
            print(f"Memory maps per program, {args.max_slots} slots x {args.maps_length} tokens, `engine.warm_up()`:\n")
            print("| XLA_FLAGS | programs | maps per program | warm-up s |\n|---|---:|---:|---:|")
            for name, flags in VARIANTS.items():
                out = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(args.max_slots),
                                      str(args.maps_length)], capture_output=True, text=True,
                                     env=clean_env(XLA_FLAGS=flags), check=True).stdout.split()
                print(f"| {name} | {out[0]} | {float(out[1]):,.0f} | {float(out[2]):.1f} |", flush=True)
        if args.skip_starts:
            return
        print(f"\n`gdnx serve` ({args.max_slots} slots x {args.max_length} tokens, `--warm-up all`), a fresh "
              "compile cache:\n")
        print("| start | to serving, s | |\n|---|---:|---|")
        cache = Path(tmp) / "compiled"
        for run in ("first", "second"):
            took, ready = start(path, cache, args.max_slots, args.max_length)
            print(f"| {run} | {took:.1f} | {ready} |", flush=True)


if __name__ == "__main__":
    main()
