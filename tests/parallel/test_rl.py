"""RL on a 2 x 4 mesh (data x fsdp): bitwise mode's sampler/trainer gap
stays exactly 0, and the run draws and scores what the one-device run
does (the same rewards and completion lengths, step by step)."""

import json

import pytest

from gdnx.config import load_config
from gdnx.training import train
from gdnx.training.rl import RLTrainer
from tests.helpers.rl import RUN



def _train_rows(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


@pytest.mark.slow
def test_bitwise_rl_on_a_mesh_has_a_zero_gap_and_the_one_device_rollouts(tmp_path, rl_prompts):
    base = RUN + [f"data.path={rl_prompts}", "train.rl.bitwise=true", "train.steps=3", "train.eval_every=0",
                  "train.batch_size=8", "train.rl.group_size=4"]
    train(load_config("tiny", base + ["parallel.data=2", "parallel.fsdp=4", f"train.out_dir={tmp_path / 'mesh'}"]))
    RLTrainer(load_config("tiny", base + [f"train.out_dir={tmp_path / 'one'}"]), mesh=None).run()  # one device
    rows = {name: _train_rows(tmp_path / name) for name in ("mesh", "one")}
    assert [r["rl/logp_diff_max"] for r in rows["mesh"]] == [0.0, 0.0, 0.0]
    for a, b in zip(rows["mesh"], rows["one"], strict=True):
        assert a["rl/reward_mean"] == b["rl/reward_mean"]
        assert a["rl/completion_length_mean"] == b["rl/completion_length_mean"]
