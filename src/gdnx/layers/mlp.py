"""Dense SwiGLU MLP."""

from __future__ import annotations

import jax
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.linear import linear
from gdnx.parallel.rules import HIDDEN, out_sharding


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, dtype: DTypeLike, param_dtype: DTypeLike, init_std: float,
                 rngs: nnx.Rngs):
        self.gate_proj = linear(hidden, intermediate, dtype, param_dtype, init_std, rngs)
        self.up_proj = linear(hidden, intermediate, dtype, param_dtype, init_std, rngs)
        self.down_proj = linear(intermediate, hidden, dtype, param_dtype, init_std, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h, out_sharding=out_sharding(HIDDEN, x.shape))
