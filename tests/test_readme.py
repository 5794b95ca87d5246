"""The README's fine-tuning section, run as written (with the demo's run
made small first): every command exits 0 and writes what it says; and its
reinforcement-learning command, shortened to a few steps."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _section_commands(title: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"## {re.escape(title)}\n.*?```bash\n(.*?)```", text, re.S)
    assert block, f"README: no bash block under '## {title}'"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def test_the_fine_tuning_section_runs_as_written(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    gdnx = [sys.executable, "-m", "gdnx"]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    # the demo's run (make demo), a few steps of it
    subprocess.run([*gdnx, "train", "tiny", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
                    "train.checkpoint_every=4"], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    commands = _section_commands("Fine-tune a published checkpoint")
    assert len(commands) >= 6 and all(c[0] == "gdnx" for c in commands)
    for command in commands:
        done = subprocess.run([*gdnx, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (command, done.stderr[-2000:])
    assert json.loads((tmp_path / "hf/sft/config.json").read_text())["model_type"] == "qwen3_next"
    assert (tmp_path / "hf/sft-merged/model.safetensors").is_file()
    assert json.loads((tmp_path / "hf/sft-adapter/adapter_config.json").read_text())["peft_type"] == "LORA"
    assert done.stdout.strip(), "generate printed nothing"


def test_the_rl_section_runs_as_written_shortened(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (command,) = _section_commands("Learn from rewards")
    assignments = dict(c.split("=", 1) for c in command if c.split("=", 1)[0].isupper())
    args = [c for c in command if c.split("=", 1)[0] not in assignments]
    assert args[:2] == ["gdnx", "train"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **assignments}
    done = subprocess.run([sys.executable, "-m", "gdnx", *args[1:], "train.steps=2", "train.eval_every=2",
                           "train.warmup_steps=0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "runs/rl/metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in rows] == ["train", "eval"] and "rl/reward_mean" in rows[0]
