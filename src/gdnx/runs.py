"""A training run's directory as a model: its saved config and the
parameters of its newest intact checkpoint (for generate and export)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from flax import nnx

from gdnx.checkpoints.orbax import CONFIG_FILE, check_base, load_params
from gdnx.config.reading import build_config
from gdnx.config.schema import Config
from gdnx.models import CausalLM
from gdnx.models.adapters import adapter_spec
from gdnx.training.init_from import initial_params


class NotARun(ValueError):
    """A directory's config.json is not a gdnx run config."""


class LoadedRun(NamedTuple):
    model: CausalLM
    config: Config
    step: int
    notes: list[str]  # one line per damaged newer checkpoint, skipped


def load_run(path: Path, model_overrides: dict | None = None) -> LoadedRun:
    """The run in `path`, with model_overrides (ModelConfig fields that do
    not change shapes) applied to its config. NotARun naming the file when
    the config is not a gdnx run config. A LoRA run's model holds its
    base (model.init_from) and its adapters."""
    try:
        saved = json.loads((path / CONFIG_FILE).read_text())
        saved["model"] = {**saved["model"], **(model_overrides or {})}
    except (ValueError, KeyError, TypeError):
        raise NotARun(f"{path / CONFIG_FILE} is not a gdnx run config (corrupt?)") from None
    config = build_config(saved)
    check_base(path, config)
    spec = adapter_spec(config.train.lora)
    abstract = nnx.eval_shape(lambda: CausalLM(config.model, adapters=spec))
    if spec is None:
        graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        params, step, notes = load_params(path, abstract_params)
        return LoadedRun(nnx.merge(graphdef, params), config, step, notes)
    graphdef, adapters, base = nnx.split(abstract, nnx.LoRAParam, nnx.Param)  # type: ignore[misc]
    trained, step, notes = load_params(path, adapters)
    return LoadedRun(nnx.merge(graphdef, trained, initial_params(config.model, base, None)), config, step, notes)
