"""Training checkpoints with orbax: parameters and optimizer state by step,
written atomically (orbax finalises a step directory only when complete),
plus the run's config so a resume can refuse another config's checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from gdnx.checkpoints.files import atomic_write_text
from gdnx.config.schema import Config

CONFIG_FILE = "config.json"
# what a resumed run must share with the run that wrote the checkpoints
IDENTITY = ("model", "data")


def check_compatible(out_dir: Path, config: Config) -> None:
    saved_file = out_dir / CONFIG_FILE
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text())
    now = json.loads(config.model_dump_json())
    diffs = [f"{section}.{k}: {saved[section].get(k)!r} there, {v!r} here"
             for section in IDENTITY for k, v in now[section].items() if saved.get(section, {}).get(k) != v]
    if saved.get("train", {}).get("seed") != config.train.seed:
        diffs.append(f"train.seed: {saved['train'].get('seed')!r} there, {config.train.seed!r} here")
    if diffs:
        raise ValueError(f"train.out_dir {out_dir} holds checkpoints of another config ({'; '.join(diffs[:4])}); "
                          "use another train.out_dir or the same config")


class Checkpoints:
    def __init__(self, out_dir: Path, config: Config):
        self.dir = out_dir / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.dir.resolve(), options=ocp.CheckpointManagerOptions(
                max_to_keep=config.train.keep_checkpoints, create=True, enable_async_checkpointing=False))
        atomic_write_text(out_dir / CONFIG_FILE, config.model_dump_json(indent=2))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any) -> None:
        self.manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                        opt_state=ocp.args.StandardSave(opt_state)))
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_params: Any, abstract_opt_state: Any) -> tuple[Any, Any]:
        tree = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params), opt_state=ocp.args.StandardRestore(abstract_opt_state)))
        return tree["params"], tree["opt_state"]

    def close(self) -> None:
        self.manager.close()


def load_params(checkpoint_dir: Path, abstract_params: Any) -> Any:
    """Parameters of the latest step under a train.out_dir (for generate)."""
    manager = ocp.CheckpointManager((checkpoint_dir / "checkpoints").resolve())
    step = manager.latest_step()
    if step is None:
        raise FileNotFoundError(f"{checkpoint_dir}: no checkpoints under checkpoints/")
    tree = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
    manager.close()
    return tree["params"], step
