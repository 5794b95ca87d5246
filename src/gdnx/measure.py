"""Small measuring helpers shared by the demo and the benchmark scripts."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from numpy.typing import ArrayLike


def median_ms(fn: Callable, args: Sequence, repeats: int = 5) -> float:
    """Median wall time of fn(*args) in milliseconds, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def relative_error(x: ArrayLike, ref: ArrayLike, floor: float = 1e-300) -> float:
    """||x - ref|| / max(||ref||, floor), in float64.

    The floor makes a tensor that is ~0 (a gradient through decays of
    exp(-30) and less is ~1e-14) judged by its absolute error instead."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(float(np.linalg.norm(ref)), floor))


def compiled_peak_bytes(jitted: Any, args: Sequence) -> int:
    """Arguments + outputs + temporaries of the compiled program (XLA's buffer
    assignment: static, so not noisy)."""
    m = jitted.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def stored_bytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes an array of `shape` and `dtype` takes on a device: int4 packed
    two to a byte, as XLA stores it (numpy's and jax's nbytes count a byte)."""
    return -(-int(np.prod(shape, dtype=np.int64)) * jax.dtypes.itemsize_bits(dtype) // 8)
