"""What happens around each train step, as hooks of the loop: the
non-finite guard, metrics to the trackers and the progress bar,
evaluation, the target accuracy (early stop), preemption, checkpoints.

The loop runs the step and then calls every hook's `after_step` in order;
a hook that ends the run sets `LoopState.stop` (a note to finish with, or
an exception the loop raises), which the checkpoint hook reads, so the
run ends with a checkpoint at that step. `start` runs once before the
first step (after a resume). Each hook holds its own counters and is
testable alone with a LoopState of its own. `gdnx.training.train(config,
hooks=[...])` adds a caller's own (a Hook subclass).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jax

from gdnx.config.schema import Config
from gdnx.progress import Reporter
from gdnx.training.trackers import METRICS_FILE, Tracker


class NonFiniteStop(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient."""


class Preempted(RuntimeError):
    """SIGTERM or SIGINT stopped the run, with a checkpoint at the step reached."""


class Evaluator(Protocol):
    def evaluate(self, params: Any) -> dict[str, float]: ...


class Saver(Protocol):
    dir: Path

    def save(self, step: int, params: Any, opt_state: Any) -> None: ...

    def latest_step(self) -> int | None: ...


class Signals(Protocol):
    signal: int | None

    def reached(self) -> bool: ...


class Bar(Protocol):
    def update(self, step: int, metrics: dict) -> None: ...


@dataclasses.dataclass
class LoopState:
    """What the hooks read and write: the run's state after each step."""
    config: Config
    out: Path
    trainer: Evaluator
    checkpoints: Saver
    signals: Signals
    report: Reporter
    bar: Bar
    trackers: list[Tracker]     # empty on every process but the one that logs
    start: int                  # the step the run resumed from (0: a new run)
    step: int
    params: Any
    opt_state: Any
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    evaluated: bool = False     # an evaluation ran after this step
    stop: str | BaseException | None = None   # set by a hook that ends the run

    @property
    def done(self) -> bool:
        """The run's last step is done."""
        return self.step >= self.config.train.steps

    def log(self, split: str, metrics: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log(self.step, split, metrics)


class Hook:
    """A part of the loop: `start` once, `after_step` after every step."""

    def start(self, loop: LoopState) -> None:
        pass

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        pass


class NonFiniteGuard(Hook):
    """Stops the run once `limit` steps in a row were skipped (a non-finite
    loss or gradient: the step left the parameters as they were)."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        if not float(metrics["skipped"]):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        loop.report.note(f"step {loop.step}: the loss or gradient is not finite; parameters not updated")
        if self.in_a_row >= self.limit:
            last = loop.checkpoints.latest_step()
            where = f"step {last} in {loop.checkpoints.dir}" if last else "none"
            raise NonFiniteStop(f"stopped at step {loop.step}: {self.in_a_row} steps in a row had a non-finite "
                                f"loss or gradient norm (train.nonfinite_steps_limit); the last good checkpoint is "
                                f"{where}. Lower train.learning_rate or raise train.warmup_steps")


class LogMetrics(Hook):
    """Every `every` steps (and the last): the step's metrics and tokens/s
    to the trackers and the progress bar."""

    def __init__(self, every: int, tokens_per_step: int):
        self.every, self.tokens_per_step = every, tokens_per_step
        self._t0, self._since = time.perf_counter(), 0

    def start(self, loop: LoopState) -> None:
        self._t0, self._since = time.perf_counter(), loop.step

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        if loop.step % self.every and not loop.done:
            return
        logged = {k: float(v) for k, v in metrics.items()}
        elapsed = time.perf_counter() - self._t0
        logged["tokens_per_s"] = self.tokens_per_step * (loop.step - self._since) / max(elapsed, 1e-9)
        self._t0, self._since = time.perf_counter(), loop.step
        loop.log("train", logged)
        loop.bar.update(loop.step, logged)


class Evaluate(Hook):
    """Every `every` steps (and the last): held-out metrics to the trackers
    and the console. A fine-tuning run (model.init_from) also evaluates the
    loaded model at step 0, what it starts from."""

    def __init__(self, every: int):
        self.every = every

    def _run(self, loop: LoopState) -> None:
        loop.last_eval = loop.trainer.evaluate(loop.params)
        loop.evaluated = True
        loop.log("eval", loop.last_eval)
        loop.report.eval(loop.step, loop.last_eval)

    def start(self, loop: LoopState) -> None:
        if not loop.start and loop.config.model.init_from is not None:
            self._run(loop)

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        loop.evaluated = False
        if loop.step % self.every == 0 or loop.done:
            self._run(loop)


class TargetAccuracy(Hook):
    """Ends the run once an evaluation reaches `target` answer accuracy; a
    resumed run already there does nothing."""

    def __init__(self, target: float):
        self.target = target

    def start(self, loop: LoopState) -> None:
        if not loop.start:
            return
        loop.last_eval = loop.trainer.evaluate(loop.params)  # a run that reached its target is not extended
        if loop.last_eval["accuracy"] >= self.target:
            loop.stop = (f"already at {100 * loop.last_eval['accuracy']:.2f}% answer accuracy (target "
                         f"{100 * self.target:.0f}%); nothing to do. Raise train.target_accuracy or use another "
                         "train.out_dir to train further.")

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        if loop.evaluated and loop.last_eval["accuracy"] >= self.target and loop.stop is None:
            loop.stop = (f"reached {100 * loop.last_eval['accuracy']:.2f}% answer accuracy "
                         f"(target {100 * self.target:.0f}%) at step {loop.step}")


class Preemption(Hook):
    """SIGTERM or SIGINT on any process ends the run after the same step on
    every process (the signals are shared each step), with a checkpoint."""

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        if loop.signals.reached() and not loop.done:  # a collective: every process, every step
            why = signal.Signals(loop.signals.signal or signal.SIGTERM).name
            steps = loop.config.train.steps
            loop.stop = Preempted(f"stopped by {why} at step {loop.step} of {steps}, with a checkpoint in "
                                  f"{loop.checkpoints.dir}; run the same command again to resume")


class Checkpoint(Hook):
    """Every `every` steps, at the last, and wherever the run ends early:
    a checkpoint, and the metrics plot redrawn (by the process that logs)."""

    def __init__(self, every: int):
        self.every = every

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        if loop.step % self.every == 0 or loop.done or loop.stop is not None:
            loop.checkpoints.save(loop.step, loop.params, loop.opt_state)
            if loop.trackers:
                loop.report.plot(loop.out, loop.out / METRICS_FILE)


def default_hooks(config: Config, extra: Sequence[Hook] = ()) -> list[Hook]:
    """The hooks of `gdnx train`, in the order they run after a step; a
    caller's `extra` hooks run after the built-in ones and before
    preemption and the checkpoint (so one that sets LoopState.stop ends the
    run with a checkpoint)."""
    t = config.train
    hooks: list[Hook] = [NonFiniteGuard(t.nonfinite_steps_limit),
                         LogMetrics(t.log_every, t.batch_size * config.data.seq_len)]
    if t.eval_every:
        hooks.append(Evaluate(t.eval_every))
    if t.target_accuracy is not None:
        hooks.append(TargetAccuracy(t.target_accuracy))
    return [*hooks, *extra, Preemption(), Checkpoint(t.checkpoint_every)]


__all__ = ["Checkpoint", "Evaluate", "Hook", "LogMetrics", "LoopState", "NonFiniteGuard", "NonFiniteStop",
           "Preempted", "Preemption", "TargetAccuracy", "default_hooks"]
