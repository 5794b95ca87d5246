"""Where a run's metrics go: metrics.jsonl (always), TensorBoard event files
and Weights & Biases (`train.trackers`). One process of a run logs.

Every tracker gets the same records: (step, split, metrics), split "train"
or "eval". A resumed run continues the same log: metrics.jsonl keeps the
lines up to the checkpoint's step; TensorBoard purges the events after it
(its purge_step), so no step shows twice; W&B continues the run whose id
the first start stored in the out_dir (W&B keeps a step once: a step
logged before an interruption and after the checkpoint stays as first
logged).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any, Protocol

from gdnx.config.reading import ConfigError
from gdnx.config.schema import Config
from gdnx.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


class Tracker(Protocol):
    def log(self, step: int, split: str, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _finite(record: dict) -> dict:
    """A non-finite number becomes null (JSON has no NaN)."""
    return {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}


def json_line(record: dict) -> str:
    """One metrics line."""
    return json.dumps(_finite(record), allow_nan=False) + "\n"


def _step_of(line: str) -> int | None:
    """The step of a metrics line; None for a damaged one (a full disk can
    cut the last line short)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def rewrite_metrics(path: Path, upto: int) -> int:
    """Keep the lines of steps <= upto: a resumed run continues the log.
    Returns how many damaged lines were dropped."""
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text(errors="replace").splitlines() if line]
    steps = [_step_of(line) for line in lines]
    keep = [line for line, s in zip(lines, steps) if s is not None and s <= upto]
    atomic_write_text(path, "".join(line + "\n" for line in keep))
    return steps.count(None)


class JsonlTracker:
    """metrics.jsonl, one line per record, flushed as it comes (the log is
    what a user, or a scheduler's hook, watches)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a")

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        self._file.write(json_line({"step": step, "split": split, **metrics}))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def dotted(config: Config) -> dict[str, Any]:
    """The config's fields as {"section.field": JSON value}."""
    def walk(tree: dict, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(walk(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    return walk(config.model_dump(mode="json"), "")


class TensorBoardTracker:
    """Event files under <out_dir>/tensorboard: a scalar `split/metric` per
    record, the config as hyperparameters (text, flattened)."""

    def __init__(self, out: Path, config: Config, start: int):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("train.trackers: tensorboard needs the tensorboardX package "
                              "(pip install 'gdnx[tracking]')") from None
        # purge_step: events a stopped run logged after the checkpoint it resumes from are hidden
        self._writer = SummaryWriter(str(out / TENSORBOARD_DIR), purge_step=start + 1 if start else None,
                                     filename_suffix=f".from{start}")
        if not start:
            flat = dotted(config)
            self._writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(flat.items())), 0)

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        for name, value in _finite(metrics).items():
            if value is not None:
                self._writer.add_scalar(f"{split}/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run (train.wandb: project, name, mode), the
    config as its config; a resumed run continues the same run id."""

    def __init__(self, out: Path, config: Config, start: int):
        try:
            import wandb
        except ImportError:
            raise ConfigError("train.trackers: wandb needs the wandb package (pip install 'gdnx[tracking]')") from None
        settings = config.train.wandb
        id_file = out / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        atomic_write_text(id_file, run_id + "\n")
        try:
            self._run = wandb.init(project=settings.project, name=settings.name, mode=settings.mode, dir=str(out),
                                   id=run_id, resume="allow", config=config.model_dump(mode="json"))
        except wandb.errors.Error as e:  # credentials refused, the server out of reach: one line
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"train.trackers: wandb could not start its run ({first}); check `wandb login`, or "
                              "set train.wandb.mode=offline") from None
        self.id = run_id

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        self._run.log({f"{split}/{k}": v for k, v in _finite(metrics).items() if v is not None}, step=step)

    def close(self) -> None:
        self._run.finish()


def check_trackers(config: Config) -> None:
    """Refuse, before the run writes anything, a tracker that cannot start:
    its package missing, or W&B online with no credentials (WANDB_API_KEY,
    or what `wandb login` writes to ~/.netrc for the W&B host)."""
    import importlib.util
    import netrc
    import os
    from urllib.parse import urlparse

    names = config.train.trackers
    for name, package in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        if name in names and importlib.util.find_spec(package) is None:
            raise ConfigError(f"train.trackers: {name} needs the {package} package (pip install 'gdnx[tracking]')")
    if "wandb" not in names or config.train.wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        found = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    if not found or not found[2]:
        raise ConfigError(f"train.wandb.mode: online needs W&B credentials for {host} (none in WANDB_API_KEY or "
                          "~/.netrc): run `wandb login`, set WANDB_API_KEY, or set train.wandb.mode=offline")


def make_trackers(config: Config, out: Path, start: int) -> list[Tracker]:
    """The trackers of train.trackers (metrics.jsonl first, always); the
    file log rewritten to the resumed step."""
    trackers: list[Tracker] = [JsonlTracker(out / METRICS_FILE)]
    try:
        for name in config.train.trackers:
            if name == "tensorboard":
                trackers.append(TensorBoardTracker(out, config, start))
            elif name == "wandb":
                trackers.append(WandbTracker(out, config, start))
    except BaseException:
        for t in trackers:
            t.close()
        raise
    return trackers
