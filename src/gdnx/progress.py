"""What `gdnx train` shows and writes besides checkpoints: a rich progress
bar (loss, answer accuracy, tokens/s), evaluation lines, and a PNG plot of
loss and accuracy from metrics.jsonl."""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gdnx.files import atomic_write

PLOT_FILE = "metrics.png"


class _Bar:
    def __init__(self, progress: Progress, task):
        self.progress, self.task = progress, task

    def update(self, step: int, metrics: dict) -> None:
        score = f"reward {metrics['rl/reward_mean']:.3f}" if "rl/reward_mean" in metrics else \
            f"acc {100 * metrics['accuracy']:5.1f}%"
        self.progress.update(self.task, completed=step, stats=(
            f"loss {metrics['loss']:.4f}  {score}  {metrics['tokens_per_s']:,.0f} tok/s"))


class Reporter:
    def __init__(self, console: Console | None = None, *, quiet: bool = False):
        self.console = console or Console(stderr=True, quiet=quiet)
        self.t_start = time.perf_counter()

    def note(self, text: str) -> None:
        self.console.print(text)

    @contextlib.contextmanager
    def progress(self, start: int, total: int):
        columns = [TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                   TimeElapsedColumn(), TimeRemainingColumn()]
        with Progress(*columns, console=self.console, transient=False) as progress:
            task = progress.add_task("train", total=total, completed=start, stats="compiling...")
            yield _Bar(progress, task)

    def eval(self, step: int, metrics: dict) -> None:
        """MQAR: answer and first-query accuracy; text: the validation split's
        loss, perplexity, bits per byte and next-token accuracy."""
        elapsed = time.perf_counter() - self.t_start
        acc = 100 * metrics["accuracy"]
        if "reward" in metrics:  # reinforcement learning: the held-out prompts' greedy completions
            self.console.print(f"step {step:>5}  eval reward {metrics['reward']:.4f}  full reward {acc:6.2f}% "
                               f"(held-out prompts, greedy)  {elapsed:4.0f} s", highlight=False, soft_wrap=True)
            return
        if "first_query_accuracy" in metrics:
            what = f"answers {acc:6.2f}%  first queries {100 * metrics['first_query_accuracy']:6.2f}%"
        else:
            what = (f"perplexity {metrics['perplexity']:.2f}  bits/byte {metrics['bits_per_byte']:.3f}  "
                    f"next token {acc:6.2f}%  (validation split)")
        self.console.print(f"step {step:>5}  eval loss {metrics['loss']:.4f}  {what}  {elapsed:4.0f} s",
                           highlight=False, soft_wrap=True)

    def plot(self, out: Path, metrics_file: Path) -> None:
        write_plot(metrics_file, out / PLOT_FILE)

    def finish(self, out: Path, step: int) -> None:
        self.console.print(f"done at step {step} in {time.perf_counter() - self.t_start:.0f} s; checkpoints, "
                           f"metrics.jsonl and {PLOT_FILE} in {out}")


def write_plot(metrics_file: Path, png: Path) -> None:
    # matplotlib warns (on stderr) about what a plot of a short or degenerate run holds, e.g. a loss of 0 on a
    # log axis; the plot is a convenience, and the run's messages are the CLI's own
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _plot(metrics_file, png)


def _plot(metrics_file: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    rl = any("rl/reward_mean" in r for r in rows)  # reinforcement learning: rewards, and a loss of either sign
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for split, style in (("train", "-"), ("eval", "o-")):
        pts = [r for r in rows if r["split"] == split]
        if not pts:
            continue
        steps = [r["step"] for r in pts]
        if "loss" in pts[0]:
            ax_loss.plot(steps, [r["loss"] for r in pts], style, label=split, markersize=3)
        if rl:
            key = "rl/reward_mean" if split == "train" else "reward"
            ax_acc.plot(steps, [r[key] for r in pts], style, label=f"{split} reward", markersize=3)
            continue
        ax_acc.plot(steps, [100 * r["accuracy"] for r in pts], style, label=f"{split} accuracy", markersize=3)
        if split == "eval" and "first_query_accuracy" in pts[0]:
            ax_acc.plot(steps, [100 * r["first_query_accuracy"] for r in pts], "s--", markersize=3,
                        label="eval first queries")
    ax_loss.set(xlabel="step", ylabel="loss", yscale="linear" if rl else "log", title="loss")
    if rl:
        ax_acc.set(xlabel="step", ylabel="mean reward", title="reward (train: drawn; eval: greedy, held out)")
    else:
        ax_acc.set(xlabel="step", ylabel="accuracy (%)", ylim=(0, 100),
                   title="accuracy (MQAR: answers; text: next token)")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    atomic_write(png, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
