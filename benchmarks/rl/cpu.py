"""RL's step time on CPU, the default mode against bitwise mode, in one run.

    .venv/bin/python -m benchmarks.rl.cpu [--steps 12] [--max-new-tokens 16 32] [--out FILE]

The tiny model (`gdnx train tiny`'s, bytes) on examples/rl/arithmetic.jsonl
with 4 prompts x 4 completions per step, one update per rollout: for each
completion length and each mode, the median over the steps after the first
two (their compiles) of the step's time and its rollout, scoring and update
parts, and the largest sampler/trainer log-probability gap of the run.
Prints a markdown table; `--out` also writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

from benchmarks.harness import Table, machine, write
from benchmarks.rl.runs import REWARD_FIELD, run_root

ROOT = pathlib.Path(__file__).resolve().parents[2]
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run(bitwise: bool, new: int, steps: int, root: pathlib.Path) -> dict:
    from gdnx.config import load_config
    from gdnx.training import train

    out = root / f"{'bitwise' if bitwise else 'default'}-{new}"
    train(load_config("tiny", [
        "data.source=rl", f"data.path={ROOT / 'examples/rl/arithmetic.jsonl'}", "data.seq_len=64",
        "train.batch_size=16", "train.rl.group_size=4", f"train.rl.max_new_tokens={new}",
        REWARD_FIELD, f"train.rl.bitwise={str(bitwise).lower()}", f"train.steps={steps}",
        "train.warmup_steps=0", "train.eval_every=0", "train.target_accuracy=null", "train.log_every=1",
        "train.learning_rate=1e-3", f"train.out_dir={out}"]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][2:]
    parts = {k: statistics.median(r[f"rl/time_{k}_s"] for r in rows) for k in ("rollout", "score", "update")}
    return {**parts, "step": statistics.median(sum(r[f"rl/time_{k}_s"] for k in ("rollout", "score", "update"))
                                               for r in rows),
            "gap": max(r["rl/logp_diff_max"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--out")
    args = parser.parse_args()
    table = Table(f"RL step time, tiny model, 16 completions per step, median of steps 3-{args.steps}; {machine()}",
                  ["completion tokens", "mode", "step s", "rollout s", "scoring s", "update s", "max logp gap",
                   "step vs default"])
    with run_root() as root:
        for new in args.max_new_tokens:
            base = run(False, new, args.steps, root)
            bit = run(True, new, args.steps, root)
            for name, r in (("default", base), ("bitwise", bit)):
                table.row(new, name, f"{r['step']:.3f}", f"{r['rollout']:.3f}", f"{r['score']:.3f}",
                          f"{r['update']:.3f}", f"{r['gap']:.2e}", f"{r['step'] / base['step']:.2f}x")
    write(args.out, table)


if __name__ == "__main__":
    main()
