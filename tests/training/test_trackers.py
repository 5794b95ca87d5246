"""The trackers of a run: TensorBoard event files hold every metric of
metrics.jsonl at the same step (train and eval apart) and the config; a
run resumed from an earlier checkpoint than its last logged step shows
each step once; W&B (offline) continues the same run id; a missing
package is one line naming the pip extra."""

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from gdnx.config import load_config
from gdnx.config.reading import ConfigError
from gdnx.training import train
from tests.helpers.configs import SMALL_RUN

TRACKED = SMALL_RUN + ["train.steps=6", "train.checkpoint_every=3", "train.trackers=[jsonl, tensorboard, wandb]",
                   "train.wandb.mode=offline", "train.wandb.project=gdnx-test", "train.keep_checkpoints=3"]


def _records(path: Path):
    """The records of a TFRecord file: length, its CRC, the data, its CRC."""
    data = path.read_bytes()
    at = 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        yield data[at + 12:at + 12 + n]
        at += 12 + n + 4


def _tensorboard(logdir: Path) -> tuple[dict[tuple[str, int], float], list[str]]:
    """{(tag, step): value} as TensorBoard shows it (a SessionLog START at
    step s hides the events of steps >= s written before it), and the text
    summaries' tags."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[tuple[str, int], float] = {}
    texts = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for raw in _records(path):
            event = Event.FromString(raw)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                scalars = {k: v for k, v in scalars.items() if k[1] < event.step}
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars[(value.tag, event.step)] = value.simple_value
                else:
                    texts.append(value.tag)
    return scalars, texts


def _jsonl(out: Path) -> dict[tuple[str, int], float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {(f"{r['split']}/{k}", r["step"]): v for r in rows for k, v in r.items() if k not in ("step", "split")}


@pytest.mark.slow
def test_tensorboard_and_wandb_follow_metrics_jsonl_across_a_resume(tmp_path):
    out = tmp_path / "run"
    train(load_config("tiny", TRACKED + [f"train.out_dir={out}"]))
    first = _jsonl(out)
    scalars, texts = _tensorboard(out / "tensorboard")
    assert set(scalars) == set(first) and {s for _, s in first} == {2, 4, 6}
    for key, value in first.items():
        assert scalars[key] == pytest.approx(value, rel=1e-6), key
    assert {t for t in texts if t.startswith("config")}, texts
    # the run stopped after logging step 6 but before its step-6 checkpoint: it resumes from step 3
    shutil.rmtree(out / "checkpoints" / "6")
    train(load_config("tiny", TRACKED + [f"train.out_dir={out}"]))
    again = _jsonl(out)
    scalars, _ = _tensorboard(out / "tensorboard")
    assert set(scalars) == set(again) == set(first)       # each step once
    for key, value in again.items():
        assert scalars[key] == pytest.approx(value, rel=1e-6), key
    runs = sorted((out / "wandb").glob("offline-run-*"))
    run_id = (out / "wandb_run_id").read_text().strip()
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs


def test_a_missing_tracker_package_names_the_pip_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    cfg = load_config("tiny", SMALL_RUN + ["train.steps=4", "train.trackers=[tensorboard]",
                                           f"train.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"train.trackers: tensorboard needs the tensorboardX package "
                                          r"\(pip install 'gdnx\[tracking\]'\)"):
        train(cfg)


def test_trackers_are_named_from_a_fixed_list():
    with pytest.raises(ConfigError, match="train.trackers"):
        load_config("tiny", ["train.trackers=[mlflow]"])
