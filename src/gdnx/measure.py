"""Small measuring helpers shared by the demo and the benchmark scripts."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_ms(fn, args, repeats: int = 5) -> float:
    """Median wall time of fn(*args) in milliseconds, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def relative_error(x, ref) -> float:
    """||x - ref|| / ||ref||, in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def compiled_peak_bytes(jitted, args) -> int:
    """Arguments + outputs + temporaries of the compiled program (XLA's buffer
    assignment: static, so not noisy)."""
    m = jitted.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
