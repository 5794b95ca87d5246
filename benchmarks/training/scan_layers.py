"""Compile time and step time of the train step, layers scanned or unrolled.

    python -m benchmarks.training.scan_layers [--depths 4 16 48] [--steps 10]

The tiny model's width (64) with the Qwen3-Next pattern (3 GDN layers, then
one attention layer) at each depth, MQAR batches (16 x 128), on this
machine's CPU. Set-up is building the Trainer (parameters, optimizer);
compile is lowering and compiling one train step; the step time is the
median of --steps steps after it. Everything runs in one process, after one
untimed compile (the first pays XLA's start-up), so the ratios are the
comparison. Prints markdown rows
for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.harness import machine


def measure(depth: int, scan: bool, steps: int) -> tuple[float, float, float]:
    from gdnx.config import load_config
    from gdnx.training import Trainer

    cfg = load_config("tiny", [f"model.num_hidden_layers={depth}", "model.layer_types=null",
                               "model.full_attention_interval=4", f"model.scan_layers={str(scan).lower()}",
                               "train.eval_every=0", "train.out_dir=/tmp/gdnx-scan-bench"])
    assert cfg.model.scanned == scan
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    params, opt = trainer.params, trainer.init_opt_state(trainer.params)
    jax.block_until_ready(opt)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = trainer.step_fn.lower(params, opt, jnp.int32(0), None).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        params, opt, metrics = compiled(params, opt, jnp.int32(s), None)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return setup, compile_s, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 48])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(machine())
    measure(args.depths[0], True, 1)  # untimed: the process's first compile also pays XLA's own start-up
    print("| layers | mode | set-up (s) | compile (s) | step (ms, median) |")
    print("|---:|---|---:|---:|---:|")
    for depth in args.depths:
        for scan in (False, True):
            setup, compile_s, step = measure(depth, scan, args.steps)
            print(f"| {depth} | {'scanned' if scan else 'unrolled'} | {setup:.1f} | {compile_s:.1f} | "
                  f"{1e3 * step:.0f} |", flush=True)


if __name__ == "__main__":
    main()
