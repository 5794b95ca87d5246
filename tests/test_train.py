"""`gdnx train` end to end on a very small run: metrics, plot, checkpoints,
and resume after the process is killed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from gdnx.config import load_config
from gdnx.train import Trainer, train

SMALL = ["model.hidden_size=32", "model.intermediate_size=32", "data.seq_len=40", "data.num_pairs=4",
         "data.num_keys=16", "data.num_values=16", "model.vocab_size=32", "train.batch_size=4",
         "train.warmup_steps=2", "train.log_every=2", "train.eval_every=4", "train.target_accuracy=null"]


def _params(out: Path):
    manager = ocp.CheckpointManager(out.resolve() / "checkpoints")
    step = manager.latest_step()
    tree = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
    manager.close()
    return step, tree["params"]


def test_train_writes_metrics_plot_and_checkpoints(tmp_path):
    cfg = load_config("tiny", SMALL + ["train.steps=8", "train.checkpoint_every=4", f"train.out_dir={tmp_path}"])
    result = train(cfg)
    assert result["step"] == 8 and 0.0 <= result["accuracy"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4, 6, 8]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [4, 8]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]


def _cli(out: Path, steps: int):
    args = [sys.executable, "-m", "gdnx.cli", "train", "tiny", *SMALL, f"train.steps={steps}",
            "train.checkpoint_every=3", f"train.out_dir={out}"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path):
    """Kill the process once the step-3 checkpoint exists, start it again:
    the final parameters equal those of a run that was never stopped, and the
    metrics log has each step once."""
    straight = _cli(tmp_path / "straight", 9)
    killed = _cli(tmp_path / "killed", 9)
    ckpt = tmp_path / "killed" / "checkpoints" / "3"
    deadline = time.time() + 300
    while not ckpt.is_dir() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ckpt.is_dir(), killed.communicate()[0]
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    resumed = _cli(tmp_path / "killed", 9)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resumed from the checkpoint at step" in out
    assert straight.wait(timeout=600) == 0
    (s1, p1), (s2, p2) = _params(tmp_path / "straight"), _params(tmp_path / "killed")
    assert s1 == s2 == 9
    flat1, flat2 = (jax_leaves(p) for p in (p1, p2))
    for a, b in zip(flat1, flat2, strict=True):
        np.testing.assert_array_equal(a, b)
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 9


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


@pytest.mark.parametrize("implementation", ["pallas_tpu", "xla"])
def test_train_step_with_kernel_on_and_off(tmp_path, implementation):
    cfg = load_config("tiny", SMALL + ["train.steps=4", f"model.gdn_implementation={implementation}",
                                       "model.num_hidden_layers=1",
                                       "model.layer_types=[linear_attention]", f"train.out_dir={tmp_path}"])
    if implementation == "pallas_tpu":
        with pytest.warns(UserWarning, match="interpret mode"):
            result = train(cfg)
    else:
        result = train(cfg)
    assert result["step"] == 4 and np.isfinite(result["loss"])


def test_a_run_that_reached_its_target_is_not_extended(tmp_path, capsys, monkeypatch):
    overrides = SMALL + ["train.steps=20", f"train.out_dir={tmp_path}"]
    assert train(load_config("tiny", overrides + ["train.steps=4"]))["step"] == 4
    capsys.readouterr()
    # the evaluation of the restored parameters says the target is met
    monkeypatch.setattr(Trainer, "evaluate", lambda self, params: {"loss": 0.1, "accuracy": 0.995,
                                                                    "first_query_accuracy": 0.99})
    again = train(load_config("tiny", overrides + ["train.target_accuracy=0.99"]))
    assert again["step"] == 4 and "nothing to do" in capsys.readouterr().err
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [4]
