"""Each hook of the training loop alone, on a LoopState of fakes, called
at the steps its registration makes it due (as the loop calls it)."""

import dataclasses
import signal
from pathlib import Path

import pytest

from gdnx.config import load_config
from gdnx.progress import Reporter
from gdnx.training.hooks import (Checkpoint, Evaluate, LogMetrics, LoopState, NonFiniteGuard, NonFiniteStop,
                                 Preempted, Preemption, Registered, Run, TargetAccuracy, default_hooks)


class Fakes:
    def __init__(self, accuracy=0.5, signal_at=None):
        self.saved, self.logged, self.bar, self.accuracy, self.signal_at = [], [], [], accuracy, signal_at
        self.dir, self.signal, self.step = Path("ckpt"), None, 0

    # trainer
    def evaluate(self, params):
        return {"loss": 1.0, "accuracy": self.accuracy, "first_query_accuracy": self.accuracy}

    # checkpoints
    def save(self, step, params, opt_state):
        self.saved.append(step)

    def latest_step(self):
        return self.saved[-1] if self.saved else None

    # signals
    def reached(self):
        if self.signal_at is not None and self.step >= self.signal_at:
            self.signal = signal.SIGTERM
        return self.signal is not None

    # bar
    def update(self, step, metrics):
        self.bar.append(step)

    # tracker
    def log(self, step, split, metrics):
        self.logged.append((step, split))

    def close(self):
        pass


def _loop(fakes, steps=8, start=0, tracked=True, **train):
    """tracked=False: the LoopState of a process that does not log (no plot to redraw)."""
    overrides = [f"train.steps={steps}", "train.warmup_steps=1"] + [f"train.{k}={v}" for k, v in train.items()]
    config = load_config("tiny", overrides)
    trackers = [fakes] if tracked else []
    run = Run(config, Path("out"), fakes, fakes, fakes, Reporter(quiet=True), fakes, trackers, start)
    return LoopState(run, start, None, None)


def _run(loop, hooks, skipped=lambda step: False):
    """hooks: Registered, or a bare Hook (every step)."""
    fakes = loop.run.trainer
    hooks = [h if isinstance(h, Registered) else Registered(h) for h in hooks]
    for h in hooks:
        h.hook.start(loop)
    while loop.stop is None and not loop.done:
        loop.step += 1
        fakes.step = loop.step
        for h in hooks:
            if h.due(loop):
                h.hook.after_step(loop, {"loss": 1.0, "skipped": float(skipped(loop.step))})
    return loop


def test_non_finite_guard_stops_after_its_limit_in_a_row_only():
    loop = _loop(Fakes())
    with pytest.raises(NonFiniteStop, match="3 steps in a row"):
        _run(loop, [NonFiniteGuard(3)], skipped=lambda s: s >= 4)
    assert loop.step == 6
    loop = _loop(Fakes())
    _run(loop, [NonFiniteGuard(3)], skipped=lambda s: s % 3 == 0)  # never 3 in a row
    assert loop.step == 8


def test_metrics_and_evaluations_at_their_cadence_and_the_last_step():
    fakes = Fakes()
    _run(_loop(fakes, steps=7), [Registered(LogMetrics(10), 3), Registered(Evaluate(), 4)])
    assert fakes.logged == [(3, "train"), (4, "eval"), (6, "train"), (7, "train"), (7, "eval")]
    assert fakes.bar == [3, 6, 7]


def test_checkpoints_at_their_cadence_the_end_and_an_early_stop():
    fakes = Fakes(accuracy=1.0)
    evaluate = Evaluate()
    loop = _run(_loop(fakes, steps=20, tracked=False),
                [Registered(evaluate, 5), TargetAccuracy(evaluate, 0.9), Registered(Checkpoint(), 3)])
    assert loop.step == 5 and fakes.saved == [3, 5] and "reached 100.00%" in loop.stop


def test_preemption_after_the_same_step_with_a_checkpoint_there():
    fakes = Fakes(signal_at=5)
    loop = _run(_loop(fakes, tracked=False), [Preemption(), Registered(Checkpoint(), 4)])
    assert isinstance(loop.stop, Preempted) and "SIGTERM at step 5 of 8" in str(loop.stop)
    assert fakes.saved == [4, 5]
    fakes = Fakes(signal_at=8)  # on the last step: a finished run, not a preempted one
    loop = _run(_loop(fakes, tracked=False), [Preemption(), Registered(Checkpoint(), 4)])
    assert loop.stop is None and fakes.saved == [4, 8]


def test_preemption_in_rl_waits_for_the_rollouts_last_update():
    """With three updates a rollout, a signal after step 4 stops after step
    6: a checkpoint at 4 or 5 would resume by drawing rollout 2 again on
    updated weights, not the completions the run drew."""
    from gdnx.config.schema import RLConfig

    fakes = Fakes(signal_at=4)
    loop = _loop(fakes, steps=12, tracked=False)
    config = loop.run.config
    rl = config.model_copy(update={"train": config.train.model_copy(update={"rl": RLConfig(updates_per_rollout=3)})})
    loop = LoopState(dataclasses.replace(loop.run, config=rl), 0, None, None)
    loop = _run(loop, [Preemption(), Registered(Checkpoint(), 3)])
    assert isinstance(loop.stop, Preempted) and "SIGTERM at step 6 of 12" in str(loop.stop)
    assert fakes.saved == [3, 6]


def test_a_resumed_run_at_its_target_does_nothing():
    fakes = Fakes(accuracy=0.995)
    loop = _run(_loop(fakes, start=4, tracked=False), [TargetAccuracy(Evaluate(), 0.99), Registered(Checkpoint(), 2)])
    assert loop.step == 4 and fakes.saved == [] and "nothing to do" in loop.stop


def test_default_hooks_follow_the_config():
    hooks = lambda **t: default_hooks(load_config("tiny", [  # noqa: E731
        "train.steps=8", "train.warmup_steps=1", "train.log_every=3", "train.checkpoint_every=5",
        *(f"train.{k}={v}" for k, v in t.items())]))
    names = lambda **t: [(type(r.hook).__name__, r.every) for r in hooks(**t)]  # noqa: E731
    plain = [("NonFiniteGuard", 1), ("LogMetrics", 3)]
    end = [("Preemption", 1), ("Checkpoint", 5)]
    assert names(eval_every=0, target_accuracy="null") == plain + end
    assert names(eval_every=2, target_accuracy=0.9) == plain + [("Evaluate", 2), ("TargetAccuracy", 1)] + end
    # no evaluations, so no target accuracy to check (it read an evaluation that never ran)
    assert names(eval_every=0, target_accuracy=0.9) == plain + end
    evaluate, target = (r.hook for r in hooks(eval_every=2, target_accuracy=0.9)[2:4])
    assert target.evaluate is evaluate  # the result it reads, given explicitly
    with pytest.raises(ValueError, match="every: expected a positive integer, got 0"):
        Registered(Evaluate(), 0)


def test_a_callers_hook_ends_a_real_run_with_a_checkpoint(tmp_path):
    from gdnx.training import Hook, train
    from tests.helpers.configs import SMALL_RUN

    class StopAt(Hook):
        def after_step(self, loop, metrics):
            if loop.step == 3:
                loop.stop = "enough"

    result = train(load_config("tiny", SMALL_RUN + ["train.steps=8", "train.checkpoint_every=5",
                                                    f"train.out_dir={tmp_path}"]), hooks=[StopAt()])
    assert result["step"] == 3
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [3]
