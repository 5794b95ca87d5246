"""The trainer a config asks for: `build_trainer` (the run's checks, then
a Trainer, or an RLTrainer for data.source=rl) and `train`."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from gdnx.config.schema import Config
from gdnx.training.hooks import Hook, Registered
from gdnx.training.loop import Trainer, check_run


def build_trainer(config: Config) -> Trainer:
    """Everything that can refuse a run, before anything is written (the
    out_dir, the mesh, the out_dir's earlier config, whether the model
    fits, the platform, the data), then its trainer. Raises ValueError (or
    OSError for a file) naming the field or path."""
    mesh = check_run(config)
    placed = mesh if mesh.size > 1 else None
    if config.train.rl is not None:
        from gdnx.training.rl import RLTrainer  # the engine and the verifiers load with RL only

        return RLTrainer(config, mesh=placed)
    return Trainer(config, mesh=placed)


def train(config: Config, *, console: Console | None = None, hooks: Sequence[Hook | Registered] = (),
          ) -> dict[str, float]:
    """Run (or resume) the training run in config.train.out_dir. Returns the
    last evaluation."""
    return build_trainer(config).run(console=console, hooks=hooks)
