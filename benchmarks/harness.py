"""What the benchmark scripts share: the machine line every table starts
with, medians of repeated calls, and markdown tables printed as their rows
come (so a run cut short keeps what it measured) and written to a file.

The scripts run from the repository root as modules, by area:

    python -m benchmarks.ops.cpu            the ops on this machine's CPU
    python -m benchmarks.device.ops         the ops on an accelerator (TPU or GPU)
    python -m benchmarks.serving.server     ...

docs/benchmarks.md gives each table with its command, machine and date.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def machine() -> str:
    """Today's date, the default JAX device (or this host's CPU and cores)
    and the JAX version: the line a table of numbers is read with."""
    import jax

    device = jax.devices()[0]
    where = (f"{platform.machine()} CPU, {os.cpu_count()} cores" if device.platform == "cpu"
             else f"{device.device_kind} ({device.platform})")
    return f"{datetime.date.today()}, {where}, jax {jax.__version__}"


def median_seconds(call: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of `call()` over `repeats` calls after `warmup`
    (a call that returns JAX arrays is waited for)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Table:
    """A markdown table: `title` (its command and what it measures) above
    the header, each row printed as it is added."""

    def __init__(self, title: str, columns: Sequence[str], *, numeric: Sequence[bool] | None = None):
        numeric = numeric if numeric is not None else [i > 0 for i in range(len(columns))]
        self.lines = [title, "", "| " + " | ".join(columns) + " |",
                      "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
        print("\n".join(self.lines), flush=True)

    def row(self, *cells: object) -> None:
        self.lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        print(self.lines[-1], flush=True)

    def note(self, text: str) -> None:
        """A line under the table (a ratio, what was not measured)."""
        self.lines += ["", text]
        print(f"\n{text}", flush=True)


def write(path: str | Path | None, *tables: Table | Sequence[str]) -> None:
    """The tables' markdown into `path` (nothing when None), one blank line
    apart."""
    if path is None:
        return
    blocks = ["\n".join(t.lines if isinstance(t, Table) else t) for t in tables]
    Path(path).write_text("\n\n".join(blocks) + "\n")
