"""Reading what a training run saved."""

from pathlib import Path

import orbax.checkpoint as ocp


def saved_params(out: Path):
    """(latest step, params) of a run's orbax checkpoints under `out`."""
    manager = ocp.CheckpointManager(out.resolve() / "checkpoints")
    step = manager.latest_step()
    tree = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
    manager.close()
    return step, tree["params"]
