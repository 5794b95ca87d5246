"""Test-wide fixtures. x64 is scoped to the tests that need float64
(tests/ops/conftest.py)."""

import pytest

from tests.helpers.processes import Processes


@pytest.fixture
def processes():
    """The test's subprocesses (tests.helpers.processes), stopped when it ends."""
    with Processes() as procs:
        yield procs


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """Tiny Hugging Face checkpoints, each built once per test process
    (tests.helpers.hf_models.HFCheckpoints)."""
    from tests.helpers.hf_models import HFCheckpoints

    return HFCheckpoints(tmp_path_factory.mktemp("hf_checkpoints"))


@pytest.fixture
def rl_prompts(tmp_path, monkeypatch):
    """A tiny RL run's prompts.jsonl, its reward module importable
    (tests.helpers.rl)."""
    from tests.helpers.rl import write_prompts

    return write_prompts(tmp_path, monkeypatch)
