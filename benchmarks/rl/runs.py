"""What the RL benchmark scripts share: the reward their runs import (the
share of a completion's characters that are digits)."""

from __future__ import annotations

import contextlib
import pathlib
import sys
import tempfile
from collections.abc import Iterator

REWARD = "def digits(completion, example):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"
# train.rl.reward for REWARD
REWARD_FIELD = "train.rl.reward=rl_bench_reward:digits"


@contextlib.contextmanager
def run_root() -> Iterator[pathlib.Path]:
    """A temporary directory for the runs, holding the reward's module
    (importable while it lasts)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "rl_bench_reward.py").write_text(REWARD)
        sys.path.insert(0, str(root))
        try:
            yield root
        finally:
            sys.path.remove(str(root))
