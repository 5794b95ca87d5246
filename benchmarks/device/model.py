"""Qwen3.5-0.8B (the bundled `qwen3.5-0.8b`: the smallest published
Qwen3.5, random weights) trained and served on one accelerator chip, in one
run, beside its attention-only twin (the same width and depth, every layer
gated attention).

    python -m benchmarks.device.model [--part train serve decode] [--steps 200] [--budget-s 560] [--out FILE]

Training: `gdnx train`'s own Trainer (its compiled step, optimizer and host
loader over token shards `gdnx prepare` wrote from the Python standard
library's sources, bytes as tokens), full training (bfloat16 parameters and
AdamW state, the multi-token prediction module trained beside the model),
one row of T tokens a step. Each row: the compiled step's bytes (XLA's
buffer assignment; a row that does not fit the chip is refused before it
runs), the mean step over --steps steps after three that compile and warm
up, tokens/s, and MFU (the model's FLOPs as `gdnx plan` counts them, over
the chip's bfloat16 peak).

Serving: the engine in process (the server's code above the engine is what
the CPU tests cover), 512-token prompts and 256 greedy new tokens each, all
requests submitted at once, at 1, 8, 32 and 128 concurrent requests: the
start-up (building the engine and compiling its programs), time to first
token and inter-token latency (medians over the requests), output tokens/s,
and a decode token's time against the chip's bandwidth limit (the weights
read once per decode step, divided over the tokens a step gives each
request). Then on/off pairs at 8 requests: the prefix cache (prompts that
share their first 384 tokens with an earlier request), and int8 weights.

Decode (`--part decode`): the engine's decode program alone at each decode
batch size of a 128-slot engine (the GDN layers' decode step as the TPU
kernel, then as the token recurrence) and an 8-slot one, the chip's time per
token to read the engine's inter-token latency against.

A part past --budget-s of the run says so in its table instead of running.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
import traceback

import jax
import numpy as np
from flax import nnx

from benchmarks.device.train import GIB, TRAIN_COLUMNS, train_rows
from benchmarks.harness import Table, machine, median_seconds, write
from gdnx.config import load_config
from gdnx.measure import stored_bytes
from gdnx.models import CausalLM
from gdnx.serving import Engine, SamplingParams, grammar
from gdnx.serving.runner import DecodeBatch

NAME = "qwen3.5-0.8b"
MODELS = {"GDN hybrid (as published)": [],
          "attention-only twin": ["model.layer_types=null", "model.full_attention_interval=1"]}
# HBM bandwidth per chip, bytes/s, by device kind (published), for the decode limit
BANDWIDTH = {"TPU v4": 1.2e12, "TPU v5 lite": 819e9, "TPU v5": 2.76e12, "TPU v6 lite": 1.64e12}


class Budget:
    """Seconds left of the run's budget: a part that would start past it is
    reported as not run."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def train_table(model: str, lengths: list[int], steps: int, budget: Budget, common: list[str]) -> Table:
    table = Table(f"{model} trained on one chip (full training, bfloat16 parameters and AdamW, batch 1; "
                  f"the mean of {steps} steps at 4,096 tokens, fewer at longer rows; "
                  f"{' '.join(common) or 'the config as bundled'}); "
                  f"{machine()}",
                  ["tokens a step", *TRAIN_COLUMNS[1:]], numeric=[True, False, True, True, True, True, True, True])
    return train_rows(table, model, {name: overrides + common for name, overrides in MODELS.items()}, lengths, steps,
                      budget.left)


def serve_wave(engine: Engine, prompts: list[list[int]], new: int) -> dict[str, float]:
    """Every prompt submitted at once: TTFT and inter-token latency medians
    over the requests (seconds), output tokens/s over the wave's wall time."""
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count: dict[int, int] = {}
    t0 = time.perf_counter()
    for rid, toks in engine.stream(prompts, greedy):
        now = time.perf_counter()
        first.setdefault(rid, now)
        last[rid] = now
        count[rid] = count.get(rid, 0) + len(toks)
    wall = time.perf_counter() - t0
    itl = [(last[r] - first[r]) / max(count[r] - 1, 1) for r in first]
    return {"ttft": statistics.median(first[r] - t0 for r in first), "itl": statistics.median(itl),
            "tokens_s": sum(count.values()) / wall, "wall": wall}


def serve_table(name: str, budget: Budget, quantize: bool) -> Table:
    rng = np.random.default_rng(0)
    table = Table(f"{name} served on one chip by the engine in process (random bfloat16 weights; 512-token "
                  f"prompts, 256 greedy new tokens each, all submitted at once; each wave run twice, the second "
                  f"timed); {machine()}",
                  ["case", "requests", "start-up to first token s", "TTFT ms", "inter-token ms", "output tokens/s",
                   "decode token / bandwidth limit"],
                  numeric=[False, True, True, True, True, True, True])
    bandwidth = BANDWIDTH.get(jax.devices()[0].device_kind)
    cases = [("plain", [], 128, (1, 8, 32, 128)), ("prefix cache", [], 8, (8,))]
    if quantize:
        cases.append(("int8 weights", ["model.quantize=int8"], 8, (8,)))
    vocab = load_config(name).model.vocab_size
    random = lambda n: rng.integers(0, vocab, n).tolist()
    for case, overrides, slots, waves in cases:
        if budget.left() < 90:
            table.row(case, "", "not run: the time budget", "", "", "", "")
            continue
        try:
            cfg = load_config(name, overrides).model
            t0 = time.perf_counter()
            model = CausalLM(cfg, seed=0)
            weights = weight_bytes(model)
            prefix = case == "prefix cache"
            engine = Engine(model, max_slots=slots, max_length=1024, block_size=128, decode_steps=8,
                            prefix_cache_bytes=(4 * GIB if prefix else 0))
            # what a server does before its first answer: the model, the engine, one request's first token
            engine.generate([random(512)], SamplingParams(max_tokens=1, temperature=0.0))
            startup = time.perf_counter() - t0
            shared = random(384)  # 3 of the cache's 128-token blocks
            for n in waves:
                if budget.left() < 30:
                    table.row(case, n, f"{startup:.0f}", "not run: the time budget", "", "", "")
                    continue
                for _ in range(2):  # the first wave compiles what its batch sizes need
                    prompts = [(shared if prefix else random(384)) + random(128) for _ in range(n)]
                    if prefix:  # an earlier request left the shared 384 tokens in the cache
                        engine.generate([shared + random(128)], SamplingParams(max_tokens=1, temperature=0.0))
                    r = serve_wave(engine, prompts, 256)
                limit = f"{r['itl'] / (weights / bandwidth):.1f}x" if bandwidth else "-"
                table.row(case, n, f"{startup:.0f}", f"{r['ttft'] * 1e3:,.0f}", f"{r['itl'] * 1e3:.2f}",
                          f"{r['tokens_s']:,.0f}", limit)
            del engine, model
        except Exception as e:  # noqa: BLE001  # one case that fails should not cost the rest
            traceback.print_exc()
            table.row(case, "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", "", "", "", "")
        gc.collect()
    if bandwidth:
        table.note(f"The bandwidth limit: the case's weights (what the model holds) read once per decode step at "
                   f"{bandwidth / 1e9:.0f} GB/s; 1.0x is a step that does nothing but read them.")
    return table


def weight_bytes(model: CausalLM) -> int:
    """The bytes the model's weights take on the chip (what a decode step reads at least)."""
    return sum(stored_bytes(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(model)))


# the decode step of the delta-rule layers: the TPU kernel in place in the stacked states (the default on a TPU),
# and the token recurrence on each layer's slice (gdn_implementation=xla), for the pair in one run
DECODE_STEPS = {"kernel": [], "recurrence": ["model.gdn_implementation=xla"]}


def decode_table(name: str, budget: Budget, repeats: int = 5) -> Table:
    """The decode program alone, timed from the host (a call of 8 tokens a
    row, every row of the batch decoding, fetched to the host as the engine
    fetches it), at each decode batch size of a 128-slot engine (with the
    delta-rule layers' decode step as the kernel and as the token
    recurrence) and of an 8-slot one: what the chip's step costs, to read
    the engine's inter-token latency against (the rest is the host's loop
    and the prefills between decode calls)."""
    table = Table(f"{name}: the engine's decode program by batch size (8 tokens a call, every row decoding, "
                  f"median of {repeats} calls); {machine()}",
                  ["engine slots", "GDN decode step", "rows", "call ms", "per token ms",
                   "per token / bandwidth limit"],
                  numeric=[True, False, True, True, True, True])
    bandwidth = BANDWIDTH.get(jax.devices()[0].device_kind)
    for slots, step in ((128, "kernel"), (128, "recurrence"), (8, "kernel")):
        if budget.left() < 60:
            table.row(slots, step, "", "not run: the time budget", "", "")
            continue
        cfg = load_config(name, DECODE_STEPS[step]).model
        model = CausalLM(cfg, seed=0)
        weights = weight_bytes(model)
        engine = Engine(model, max_slots=slots, max_length=1024, block_size=128, decode_steps=8)
        every = grammar.masks([None] * slots, cfg.vocab_size)
        for rows in engine.decode_rows:
            batch = DecodeBatch(np.arange(slots) < rows, every, rows, 8, 8)
            call = median_seconds(functools.partial(engine.runner.decode, batch), repeats)  # after one that compiles
            limit = f"{call / 8 / (weights / bandwidth):.1f}x" if bandwidth else "-"
            table.row(slots, step, rows, f"{call * 1e3:.2f}", f"{call / 8 * 1e3:.2f}", limit)
        del engine, model
        gc.collect()
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=NAME, help="a bundled config (a small one checks the script on a CPU)")
    ap.add_argument("--part", nargs="+", choices=["train", "serve", "decode"], default=["train", "serve"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--set", nargs="*", default=[], metavar="key=value",
                    help="config overrides for every trained model, e.g. model.remat_policy=full")
    ap.add_argument("--no-int8", action="store_true", help="leave out the int8-weights serving pair")
    ap.add_argument("--budget-s", type=float, default=560.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the train rows compile their step once for its memory and once to run it: the second is a cache hit
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="gdnx-jax-cache-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    budget = Budget(args.budget_s)
    tables = []
    if "train" in args.part:
        tables.append(train_table(args.model, args.lengths, args.steps, budget, args.set))
    if "serve" in args.part:
        tables.append(serve_table(args.model, budget, not args.no_int8))
    if "decode" in args.part:
        tables.append(decode_table(args.model, budget))
    write(args.out, *tables)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
