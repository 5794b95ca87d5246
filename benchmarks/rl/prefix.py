"""RL rollouts of long prompts on CPU: the rollout engine's prefix cache on
(train.rl.prefix_cache_mb=1024) against off (0), in one run.

    .venv/bin/python -m benchmarks.rl.prefix [--steps 8] [--prompt-tokens 1000] [--out FILE]

The tiny model (bytes) on sums that follow a shared preamble of about
--prompt-tokens bytes, 4 prompts x 8 completions of 8 tokens per step:
with the cache, a prompt's first completion prefills it and the other 7
take its whole blocks from the cache. For each setting, the median over
the steps after the first two (their compiles) of the rollout's time and
the step's, and the prompt tokens taken from the cache per rollout, and whether the
rewards drawn were the same step by step.
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
NEW_TOKENS = 8


def prompts(path: pathlib.Path, length: int) -> None:
    """Sums after one preamble of about `length` bytes."""
    preamble = ("Add the two numbers and write the sum in digits. " * (length // 50 + 1))[:length]
    lines = (json.loads(x) for x in (ROOT / "examples/rl/arithmetic.jsonl").read_text().splitlines())
    path.write_text("".join(json.dumps({"prompt": preamble + e["prompt"], "answer": e["answer"]}) + "\n"
                            for e in lines))


def run(cache_mb: int, steps: int, length: int, root: pathlib.Path) -> dict:
    from gdnx.config import load_config
    from gdnx.training import train

    out = root / f"cache-{cache_mb}"
    train(load_config("tiny", [
        "data.source=rl", f"data.path={root / 'prompts.jsonl'}", f"data.seq_len={length + 16}",
        "train.batch_size=32", "train.rl.group_size=8", f"train.rl.max_new_tokens={NEW_TOKENS}",
        REWARD_FIELD, f"train.rl.prefix_cache_mb={cache_mb}", f"train.steps={steps}",
        "train.warmup_steps=0", "train.eval_every=0", "train.target_accuracy=null", "train.log_every=1",
        "train.learning_rate=1e-3", f"train.out_dir={out}"]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][2:]
    return {"rollout": statistics.median(r["rl/time_rollout_s"] for r in rows),
            "step": statistics.median(sum(r[f"rl/time_{k}_s"] for k in ("rollout", "score", "update")) for r in rows),
            "cached": statistics.median(r["rl/cached_prompt_tokens"] for r in rows),
            "reward": [r["rl/reward_mean"] for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--out")
    args = parser.parse_args()
    table = Table(f"RL rollouts, tiny model, prompts of about {args.prompt_tokens} tokens, 4 prompts x 8 completions "
                  f"of {NEW_TOKENS} tokens per step, median of steps 3-{args.steps}; {machine()}",
                  ["prefix cache", "rollout s", "step s", "prompt tokens from the cache", "rollout vs off",
                   "rewards step by step as off"])
    with run_root() as root:
        prompts(root / "prompts.jsonl", args.prompt_tokens)
        off = run(0, args.steps, args.prompt_tokens, root)
        on = run(1024, args.steps, args.prompt_tokens, root)
        for name, r in (("off (0)", off), ("on (1024 MiB)", on)):
            table.row(name, f"{r['rollout']:.3f}", f"{r['step']:.3f}", f"{r['cached']:.0f}",
                      f"{r['rollout'] / off['rollout']:.2f}x", "yes" if r["reward"] == off["reward"] else "no")
    write(args.out, table)


if __name__ == "__main__":
    main()
