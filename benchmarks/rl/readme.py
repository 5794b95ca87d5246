"""The README's road from the demo to RL, run as written: `make demo`'s
run, the fine-tuning section's full-weight SFT and its export, then the
RL section's run (logging every step), each timed, and what the RL run
learned: the held-out prompts' greedy reward at each evaluation, and the
drawn completions' mean reward over its first and last ten steps.

    python -m benchmarks.rl.readme [--workdir /tmp/rl_readme]

About 7 minutes on 2 CPU cores (the demo's run takes half of it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def section(title: str) -> list[list[str]]:
    """The commands of the README's bash block under `## title`."""
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"## {re.escape(title)}\n.*?```bash\n(.*?)```", text, re.S)
    if block is None:
        raise SystemExit(f"README: no bash block under '## {title}'")
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def run(command: list[str], cwd: Path) -> float:
    """One README command (`VAR=value` assignments first), its wall seconds."""
    env = dict(os.environ)
    while "=" in command[0] and command[0].split("=", 1)[0].isupper():
        key, value = command.pop(0).split("=", 1)
        env[key] = value
    assert command[0] == "gdnx", command
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gdnx", *command[1:]], cwd=cwd, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary one)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rl_readme_"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "examples", work / "examples", dirs_exist_ok=True)
    sft = [c for c in section("Fine-tune a published checkpoint")
           if c[:2] == ["gdnx", "export"] and c[2] in ("runs/tiny", "runs/sft")
           or c[:2] == ["gdnx", "train"] and "train.out_dir=runs/sft" in c]
    rl = section("Learn from rewards")[0] + ["train.log_every=1"]
    timed = [("make demo (gdnx train)", ["gdnx", "train"])] + [(" ".join(c[:4]), c) for c in sft] + \
        [("the RL run", rl)]
    print("| step | command | wall s |\n|---|---|---|")
    for name, command in timed:
        print(f"| {name} | `{shlex.join(command)[:90]}`{'...' if len(shlex.join(command)) > 90 else ''} | "
              f"{run(list(command), work):.0f} |", flush=True)
    rows = [json.loads(x) for x in (work / "runs/rl/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "eval"]
    drawn = [r["rl/reward_mean"] for r in rows if r["split"] == "train"]
    print("\n| step | held-out greedy reward | held-out exact sums |\n|---|---|---|")
    for r in evals:
        print(f"| {r['step']} | {r['reward']:.3f} | {r['accuracy']:.3f} |")
    print(f"\ndrawn completions' mean reward: steps 1-10 {sum(drawn[:10]) / 10:.3f}, "
          f"steps {len(drawn) - 9}-{len(drawn)} {sum(drawn[-10:]) / 10:.3f}")
    gaps = [r["rl/logp_diff_max"] for r in rows if r["split"] == "train"]
    print(f"sampler/trainer gap (rl/logp_diff_max): at most {max(gaps):.2e}")


if __name__ == "__main__":
    main()
