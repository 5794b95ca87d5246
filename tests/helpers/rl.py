"""The tiny RL runs the tests make: prompts, a reward with signal from the
first steps, and `gdnx train tiny` overrides for a run of seconds."""

import json
from pathlib import Path

# the share of the completion's bytes that are lowercase letters
REWARD = "def letters(completion, example):\n    return sum('a' <= c <= 'z' for c in completion) / 4\n"
RUN = ["model.hidden_size=32", "model.intermediate_size=32", "data.source=rl", "data.seq_len=16",
       "train.batch_size=4", "train.rl.group_size=2", "train.rl.max_new_tokens=4", "train.rl.reward=rl_letters:letters",
       "train.warmup_steps=0", "train.min_lr_ratio=1.0", "train.log_every=1", "train.target_accuracy=null",
       "train.learning_rate=0.01"]


def write_prompts(directory: Path, monkeypatch) -> Path:
    """prompts.jsonl ("say a:" ... with their answers) and the reward's
    module (rl_letters, importable for the test's duration)."""
    (directory / "rl_letters.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(directory))
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {c}:", "answer": c}) + "\n" for c in "abcdefghij"))
    return path
