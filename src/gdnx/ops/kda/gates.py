"""KDA's gate functions: a layer's raw gate input f [..., H, K] to the log
decay g <= 0 per key channel that `chunk_kda` takes.

    kimi:     g = -exp(A_log) * softplus(f + dt_bias)              (Kimi Linear)
    bounded:  g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))  (Ling 3's
              kda_safe_gate, GLM-5-Next's linear_lower_bound; lower_bound < 0)

A_log holds one value per head, dt_bias one per head and channel (H * K);
both are read in float32 whatever f's dtype, as the reference models keep
them. Gradients are JAX's own (softplus and sigmoid in their stable forms).
The op applies the gate itself when given `A_log` (see `chunk_kda`), inside
the jitted call, so the decay is computed in the pass that lays g out.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


@dataclasses.dataclass(frozen=True)
class GateParams:
    """A gate function's parameters, as the op takes them."""

    A_log: jax.Array
    dt_bias: jax.Array | None = None
    lower_bound: float | None = None


def check_gate(shape: tuple[int, ...], A_log: jax.Array, dt_bias: jax.Array | None,
               lower_bound: float | None) -> GateParams:
    """The gate's parameters for a raw gate input of `shape` [..., H, K],
    checked: a ValueError or TypeError names the argument."""
    heads, channels = shape[-2], shape[-1]
    for name, x, want, size in (("A_log", A_log, "H", heads), ("dt_bias", dt_bias, "H * K", heads * channels)):
        if x is None and name == "dt_bias":
            continue
        if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected an array of {want} = {size} values, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
        if math.prod(x.shape) != size:
            raise ValueError(f"{name}: expected {want} = {size} values (any shape, such as [{size}]), "
                             f"got shape {tuple(x.shape)}")
    if lower_bound is not None:
        if not isinstance(lower_bound, numbers.Real) or isinstance(lower_bound, bool):
            raise TypeError(f"lower_bound: expected a Python float or None, got {type(lower_bound).__name__}")
        if not lower_bound < 0:
            raise ValueError(f"lower_bound: expected a negative float (the most decay per step), got {lower_bound}")
        lower_bound = float(lower_bound)
    return GateParams(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)


def kda_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array | None = None, *, lower_bound: float | None = None,
             dtype: DTypeLike = jnp.float32) -> jax.Array:
    """Log decay [..., H, K] in `dtype` from the raw gate input f [..., H, K]:
    Kimi's -exp(A_log) softplus(f + dt_bias), or with `lower_bound` the
    bounded lower_bound * sigmoid(exp(A_log) (f + dt_bias))."""
    params = check_gate(tuple(f.shape), A_log, dt_bias, lower_bound)
    heads, channels = f.shape[-2], f.shape[-1]
    x = f.astype(dtype)
    if params.dt_bias is not None:
        x = x + params.dt_bias.astype(dtype).reshape(heads, channels)
    rate = jnp.exp(params.A_log.astype(dtype).reshape(heads, 1))
    if params.lower_bound is None:
        return -rate * jax.nn.softplus(x)
    return params.lower_bound * jax.nn.sigmoid(rate * x)
