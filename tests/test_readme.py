"""The README's road from the demo to serving, run as written but for the
runs' lengths: the demo's run (a few steps), every command of its
fine-tuning section, then its reinforcement-learning section from the
fine-tuned model (trained, exported, and served: a completion over HTTP
that stops at the run's end of document)."""

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from gdnx.cli import main
from gdnx.data.text import BYTES_EOS
from gdnx.inference import eos_ids, load
from tests.helpers.processes import gdnx
from tests.helpers.serving import Server

ROOT = Path(__file__).resolve().parents[1]
# the runs shortened: the commands' programs and files are what is checked, not what the runs learn
SHORT = ["train.steps=4", "train.eval_every=2", "train.warmup_steps=1"]


def _section_commands(title: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"## {re.escape(title)}\n.*?```bash\n(.*?)```", text, re.S)
    assert block, f"README: no bash block under '## {title}'"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def _run(command: list[str], capsys) -> None:
    """One README command in this process (gdnx.cli.main, as the `gdnx`
    command runs it: programs shared between commands), a training run
    shortened."""
    assert command[0] == "gdnx", command
    args = command[1:] + (SHORT if command[1] == "train" else [])
    capsys.readouterr()
    assert main(args) == 0, (command, capsys.readouterr().err[-2000:])


def _served_completion(command: list[str], cwd: Path) -> dict:
    """`gdnx serve` as written (but on a free port), asked for one greedy
    completion of a sum under the model name the README's curl gives."""
    port = command.index("--port")
    server = Server(None, command=gdnx(*command[1:port + 1], "0", *command[port + 2:]), cwd=cwd)
    try:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "rl", "prompt": "12+30=", "max_tokens": 6, "temperature": 0})
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
def test_the_readme_runs_from_the_demo_to_serving(tmp_path, monkeypatch, capsys):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    # the demo's run (make demo), a few steps of it
    assert main(["train", "tiny", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
                 "train.checkpoint_every=4"]) == 0
    commands = _section_commands("Fine-tune a published checkpoint")
    assert len(commands) >= 6
    for command in commands:
        _run(command, capsys)
    assert json.loads((tmp_path / "hf/sft/config.json").read_text())["model_type"] == "qwen3_next"
    assert (tmp_path / "hf/sft-merged/model.safetensors").is_file()
    assert json.loads((tmp_path / "hf/sft-adapter/adapter_config.json").read_text())["peft_type"] == "LORA"
    assert capsys.readouterr().out.strip(), "generate printed nothing"

    train, export, serve = _section_commands("Learn from rewards")
    assignments = dict(c.split("=", 1) for c in train if c.split("=", 1)[0].isupper())
    assert assignments == {"PYTHONPATH": "examples/rl"}
    monkeypatch.syspath_prepend(str(tmp_path / "examples/rl"))
    monkeypatch.delitem(sys.modules, "rewards", raising=False)
    _run([c for c in train if c.split("=", 1)[0] not in assignments], capsys)
    rows = [json.loads(x) for x in (tmp_path / "runs/rl/metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["split"] == "train"]
    assert trained and all(0 <= r["rl/reward_mean"] <= 1 for r in trained)  # rewards:close is within [0, 1]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [0, 2, 4]
    _run(export, capsys)
    assert json.loads((tmp_path / "hf/rl/config.json").read_text())["model_type"] == "qwen3_next"
    loaded = load(Path("runs/rl"), [], "serve")  # the run as serve reads it: raw bytes, NUL its end of document
    assert loaded.tokenizer.encode("12") == [49, 50] and eos_ids(loaded) == [BYTES_EOS]
    served = _served_completion(serve, tmp_path)
    choice = served["choices"][0]
    # raw bytes: NUL ends a document, and the served run stops there rather than writing it
    assert "\x00" not in choice["text"] and served["usage"]["prompt_tokens"] == len("12+30=")
    assert choice["finish_reason"] == "stop" or served["usage"]["completion_tokens"] == 6
