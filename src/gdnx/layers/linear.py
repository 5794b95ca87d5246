"""The one dense layer every block uses: no bias unless asked, normal(std)
init as in Hugging Face's Qwen3-Next, kernel [in, out]; a LoRA adapter can
be added to it (gdnx.layers.lora)."""

from __future__ import annotations

from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.lora import Linear


def linear(d_in: int, d_out: int, dtype: DTypeLike, param_dtype: DTypeLike, init_std: float, rngs: nnx.Rngs, *,
           bias: bool = False) -> Linear:
    return Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=nnx.initializers.normal(init_std), rngs=rngs)
