"""Dense SwiGLU MLP, optionally bounded: up clipped to [-limit, limit] and
silu(gate) capped at the limit (Ling 3's) or the gate clamped at it before
the activation (clamp_gate: GLM-5-Next's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.linear import linear
from gdnx.parallel.rules import HIDDEN, out_sharding


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None = None, clamp_gate: bool = False) -> jax.Array:
    """silu(gate) * up; with a limit, up clipped to [-limit, limit] and
    silu(gate) capped at it, or (clamp_gate) the gate capped at it first."""
    if limit is None:
        return jax.nn.silu(gate) * up
    up = jnp.clip(up, -limit, limit)
    if clamp_gate:
        return jax.nn.silu(jnp.minimum(gate, limit)) * up
    return jnp.minimum(jax.nn.silu(gate), limit) * up


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, dtype: DTypeLike, param_dtype: DTypeLike, init_std: float,
                 rngs: nnx.Rngs, limit: float | None = None, clamp_gate: bool = False):
        self.limit, self.clamp_gate = limit, clamp_gate
        self.gate_proj = linear(hidden, intermediate, dtype, param_dtype, init_std, rngs)
        self.up_proj = linear(hidden, intermediate, dtype, param_dtype, init_std, rngs)
        self.down_proj = linear(intermediate, hidden, dtype, param_dtype, init_std, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = swiglu(self.gate_proj(x), self.up_proj(x), self.limit, self.clamp_gate)
        return self.down_proj(h, out_sharding=out_sharding(HIDDEN, x.shape))
