"""Training: the step (gdnx.training.step) apart from the loop that runs it
(gdnx.training.loop), reinforcement learning's trainer (gdnx.training.rl),
and the trainer a config asks for (gdnx.training.build)."""

from gdnx.training.hooks import Hook, LoopState, NonFiniteStop, Preempted, Registered, Run
from gdnx.training.build import build_trainer, train
from gdnx.training.loop import Trainer
from gdnx.training.step import loss_and_metrics, make_optimizer, make_step_fn

__all__ = ["Hook", "LoopState", "NonFiniteStop", "Preempted", "Registered", "Run", "Trainer", "build_trainer", "loss_and_metrics",
           "make_optimizer", "make_step_fn", "train"]
