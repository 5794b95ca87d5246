"""A training run's directory as a model: its saved config and the
parameters of its newest intact checkpoint (for generate and export)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from flax import nnx

from gdnx.checkpoints.orbax import CONFIG_FILE, load_params
from gdnx.config.loading import build_config
from gdnx.config.schema import Config
from gdnx.models import CausalLM


class LoadedRun(NamedTuple):
    model: CausalLM
    config: Config
    step: int
    notes: list[str]  # one line per damaged newer checkpoint, skipped


def is_run(path: Path) -> bool:
    return (path / "checkpoints").is_dir() and (path / CONFIG_FILE).is_file()


def load_run(path: Path, model_overrides: dict | None = None) -> LoadedRun:
    """The run in `path`, with model_overrides (ModelConfig fields that do
    not change shapes) applied to its config. ValueError naming the file
    when the config is not a gdnx run config."""
    try:
        saved = json.loads((path / CONFIG_FILE).read_text())
        saved["model"] = {**saved["model"], **(model_overrides or {})}
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path / CONFIG_FILE} is not a gdnx run config (corrupt?)") from None
    config = build_config(saved)
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: CausalLM(config.model)), nnx.Param)
    params, step, notes = load_params(path, abstract_params)
    return LoadedRun(nnx.merge(graphdef, params), config, step, notes)
