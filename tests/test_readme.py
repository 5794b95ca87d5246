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

from gdnx.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _section_commands(title: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"## {re.escape(title)}\n.*?```bash\n(.*?)```", text, re.S)
    assert block, f"README: no bash block under '## {title}'"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def test_the_fine_tuning_section_runs_as_written(tmp_path, monkeypatch, capsys):
    """In this process (gdnx.cli.main, as the `gdnx` command runs it): the
    two runs' programs are compiled once for the commands that share them."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    # the demo's run (make demo), a few steps of it
    assert main(["train", "tiny", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
                 "train.checkpoint_every=4"]) == 0
    commands = _section_commands("Fine-tune a published checkpoint")
    assert len(commands) >= 6 and all(c[0] == "gdnx" for c in commands)
    for command in commands:
        capsys.readouterr()
        assert main(command[1:]) == 0, (command, capsys.readouterr().err[-2000:])
    assert json.loads((tmp_path / "hf/sft/config.json").read_text())["model_type"] == "qwen3_next"
    assert (tmp_path / "hf/sft-merged/model.safetensors").is_file()
    assert json.loads((tmp_path / "hf/sft-adapter/adapter_config.json").read_text())["peft_type"] == "LORA"
    assert capsys.readouterr().out.strip(), "generate printed nothing"


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
