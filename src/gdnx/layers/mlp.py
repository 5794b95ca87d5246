"""Dense SwiGLU MLP, optionally bounded (Ling 3's: silu(gate) capped at a
limit, up clipped to [-limit, limit])."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.linear import linear
from gdnx.parallel.rules import HIDDEN, out_sharding


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None = None) -> jax.Array:
    """silu(gate) * up; with a limit, silu(gate) capped at it and up clipped to [-limit, limit]."""
    act = jax.nn.silu(gate)
    if limit is not None:
        act, up = jnp.minimum(act, limit), jnp.clip(up, -limit, limit)
    return act * up


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, dtype: DTypeLike, param_dtype: DTypeLike, init_std: float,
                 rngs: nnx.Rngs, limit: float | None = None):
        self.limit = limit
        self.gate_proj = linear(hidden, intermediate, dtype, param_dtype, init_std, rngs)
        self.up_proj = linear(hidden, intermediate, dtype, param_dtype, init_std, rngs)
        self.down_proj = linear(intermediate, hidden, dtype, param_dtype, init_std, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = swiglu(self.gate_proj(x), self.up_proj(x), self.limit)
        return self.down_proj(h, out_sharding=out_sharding(HIDDEN, x.shape))
