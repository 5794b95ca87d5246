"""Input checks shared by the ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike


def float_dtype(value: DTypeLike | str) -> np.dtype:
    """value (a dtype or its name) as a floating dtype; ValueError otherwise."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise ValueError(f"unknown dtype {value!r}; expected a floating dtype such as 'float32' or "
                         f"'bfloat16'") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"expected a floating dtype such as 'float32' or 'bfloat16', got {value!r}")
    return dtype


def concrete(x: object) -> np.ndarray | None:
    """x as numpy when its value is known at trace time, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_cu_seqlens(cu: jax.Array, batch: int, length: int) -> None:
    if not hasattr(cu, "shape") or not hasattr(cu, "dtype"):
        raise TypeError(f"cu_seqlens: expected an int32 array [N + 1], got {type(cu).__name__}")
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"cu_seqlens: expected an integer array, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape [N + 1] with N >= 1, got {tuple(cu.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B={batch}")
    vals = concrete(cu)
    if vals is None:
        return  # traced: the values cannot be checked here
    if vals[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got {vals[0]}")
    if np.any(np.diff(vals) < 0):
        raise ValueError(f"cu_seqlens: must be non-decreasing, got {vals.tolist()}")
    if vals[-1] != length:
        raise ValueError(f"cu_seqlens: must end at T={length}, got {vals[-1]}")
