"""What happens around each train step, as hooks of the loop: the
non-finite guard, metrics to the trackers and the progress bar,
evaluation, the target accuracy (early stop), preemption, checkpoints.

A hook is registered with its cadence (`Registered(hook, every=N)`): the
loop runs the step, then calls, in order, the `after_step` of every hook
due at that step: every N-th step and the run's last (its final step, or
the step at which an earlier hook ended it). The loop applies the cadence,
once, for all hooks. A hook that ends the run sets `LoopState.stop` (a note
to finish with, or an exception the loop raises), so the hooks after it,
the checkpoint among them, see the run's last step. `start` runs once
before the first step (after a resume). A hook that needs another's result
holds that hook and asks it (TargetAccuracy reads its Evaluate's result at
the step). The loop's state is its resources (`Run`, fixed for the run)
and the step's state (`LoopState`). Each hook is testable alone with a
LoopState of its own. `gdnx.training.train(config, hooks=[...])` adds a
caller's own (Hook subclasses, every step, or Registered).
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


@dataclasses.dataclass(frozen=True)
class Run:
    """The run's resources: fixed from its first step to its last."""
    config: Config
    out: Path
    trainer: Evaluator
    checkpoints: Saver
    signals: Signals
    report: Reporter
    bar: Bar
    trackers: list[Tracker]     # empty on every process but the one that logs
    start: int                  # the step the run resumed from (0: a new run)


@dataclasses.dataclass
class LoopState:
    """What the hooks read and write: the run's resources and its state
    after each step."""
    run: Run
    step: int
    params: Any
    opt_state: Any
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)  # the latest evaluation's metrics
    stop: str | BaseException | None = None   # set by a hook that ends the run

    @property
    def done(self) -> bool:
        """The run's last step is done."""
        return self.step >= self.run.config.train.steps

    def log(self, split: str, metrics: dict[str, float]) -> None:
        for tracker in self.run.trackers:
            tracker.log(self.step, split, metrics)


class Hook:
    """A part of the loop: `start` once, `after_step` at the steps its
    registration makes it due."""

    def start(self, loop: LoopState) -> None:
        pass

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Registered:
    """A hook and its cadence: due after every `every`-th step and after the
    run's last step (its final one, or the one a hook before it ended it at)."""
    hook: Hook
    every: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every: expected a positive integer, got {self.every!r}")

    def due(self, loop: LoopState) -> bool:
        return loop.step % self.every == 0 or loop.done or loop.stop is not None


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
        loop.run.report.note(f"step {loop.step}: the loss or gradient is not finite; parameters not updated")
        if self.in_a_row >= self.limit:
            last = loop.run.checkpoints.latest_step()
            where = f"step {last} in {loop.run.checkpoints.dir}" if last else "none"
            raise NonFiniteStop(f"stopped at step {loop.step}: {self.in_a_row} steps in a row had a non-finite "
                                f"loss or gradient norm (train.nonfinite_steps_limit); the last good checkpoint is "
                                f"{where}. Lower train.learning_rate or raise train.warmup_steps")


class LogMetrics(Hook):
    """The step's metrics and tokens/s (since the last time it logged) to
    the trackers and the progress bar."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self._t0, self._since = time.perf_counter(), 0

    def start(self, loop: LoopState) -> None:
        self._t0, self._since = time.perf_counter(), loop.step

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        logged = {k: float(v) for k, v in metrics.items()}
        elapsed = time.perf_counter() - self._t0
        logged["tokens_per_s"] = self.tokens_per_step * (loop.step - self._since) / max(elapsed, 1e-9)
        self._t0, self._since = time.perf_counter(), loop.step
        loop.log("train", logged)
        loop.run.bar.update(loop.step, logged)


class Evaluate(Hook):
    """Held-out metrics to the trackers and the console. A fine-tuning run
    (model.init_from) also evaluates the loaded model at step 0, what it
    starts from. `result_at(step)`: the metrics of the evaluation after that
    step, if one ran."""

    def __init__(self) -> None:
        self._latest: tuple[int, dict[str, float]] | None = None

    def _run(self, loop: LoopState) -> None:
        loop.last_eval = loop.run.trainer.evaluate(loop.params)
        self._latest = (loop.step, loop.last_eval)
        loop.log("eval", loop.last_eval)
        loop.run.report.eval(loop.step, loop.last_eval)

    def result_at(self, step: int) -> dict[str, float] | None:
        return self._latest[1] if self._latest is not None and self._latest[0] == step else None

    def start(self, loop: LoopState) -> None:
        if not loop.run.start and loop.run.config.model.init_from is not None:
            self._run(loop)

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        self._run(loop)


class TargetAccuracy(Hook):
    """Ends the run once its Evaluate's result reaches `target` answer
    accuracy; a resumed run already there does nothing."""

    def __init__(self, evaluate: Evaluate, target: float):
        self.evaluate, self.target = evaluate, target

    def start(self, loop: LoopState) -> None:
        if not loop.run.start:
            return
        loop.last_eval = loop.run.trainer.evaluate(loop.params)  # a run that reached its target is not extended
        if loop.last_eval["accuracy"] >= self.target:
            loop.stop = (f"already at {100 * loop.last_eval['accuracy']:.2f}% answer accuracy (target "
                         f"{100 * self.target:.0f}%); nothing to do. Raise train.target_accuracy or use another "
                         "train.out_dir to train further.")

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        result = self.evaluate.result_at(loop.step)
        if result is not None and result["accuracy"] >= self.target and loop.stop is None:
            loop.stop = (f"reached {100 * result['accuracy']:.2f}% answer accuracy "
                         f"(target {100 * self.target:.0f}%) at step {loop.step}")


class Preemption(Hook):
    """SIGTERM or SIGINT on any process ends the run after the same step on
    every process (the signals are shared each step), with a checkpoint. In
    RL with several updates a rollout, after the rollout's last update: a
    checkpoint between two updates of one rollout would resume by drawing
    that rollout again on the updated weights, not what the run drew."""

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        reached = loop.run.signals.reached()  # a collective: every process, every step
        rl = loop.run.config.train.rl
        if rl is not None and loop.step % rl.updates_per_rollout:
            return
        if reached and not loop.done:
            why = signal.Signals(loop.run.signals.signal or signal.SIGTERM).name
            steps = loop.run.config.train.steps
            loop.stop = Preempted(f"stopped by {why} at step {loop.step} of {steps}, with a checkpoint in "
                                  f"{loop.run.checkpoints.dir}; run the same command again to resume")


class Checkpoint(Hook):
    """A checkpoint, and the metrics plot redrawn (by the process that
    logs); registered every train.checkpoint_every steps, so also at the
    last step and wherever the run ends early."""

    def after_step(self, loop: LoopState, metrics: dict[str, jax.Array]) -> None:
        loop.run.checkpoints.save(loop.step, loop.params, loop.opt_state)
        if loop.run.trackers:
            loop.run.report.plot(loop.run.out, loop.run.out / METRICS_FILE)


def default_hooks(config: Config, extra: Sequence[Hook | Registered] = ()) -> list[Registered]:
    """The hooks of `gdnx train` with their cadences, in the order they run
    after a step; a caller's `extra` hooks (a bare Hook: every step) run
    after the built-in ones and before preemption and the checkpoint (so one
    that sets LoopState.stop ends the run with a checkpoint). The target
    accuracy reads the evaluations: with train.eval_every=0 (none) it has
    none to read, and the run takes all its steps."""
    t = config.train
    hooks = [Registered(NonFiniteGuard(t.nonfinite_steps_limit)),
             Registered(LogMetrics(t.batch_size * config.data.seq_len), t.log_every)]
    if t.eval_every:
        evaluate = Evaluate()
        hooks.append(Registered(evaluate, t.eval_every))
        if t.target_accuracy is not None:
            hooks.append(Registered(TargetAccuracy(evaluate, t.target_accuracy)))
    hooks += [h if isinstance(h, Registered) else Registered(h) for h in extra]
    return [*hooks, Registered(Preemption()), Registered(Checkpoint(), t.checkpoint_every)]


__all__ = ["Checkpoint", "Evaluate", "Hook", "LogMetrics", "LoopState", "NonFiniteGuard", "NonFiniteStop",
           "Preempted", "Preemption", "Registered", "Run", "TargetAccuracy", "default_hooks"]
