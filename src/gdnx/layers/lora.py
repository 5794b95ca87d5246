"""LoRA adapters: a projection x W becomes x W + scale * dropout(x) A B,
with A [in, rank] and B [rank, out] (B starts at zero, so an adapted model
starts as its base), scale = alpha / rank, as PEFT defines them. Adapters
are nnx.LoRAParam variables beside the frozen base weights: training takes
gradients and optimizer state for them alone.

Routed experts (their weights feed grouped matmuls) get A [E, in, rank]
and B [E, rank, out] added into the weights, W_e + scale * A_e B_e, before
the matmuls: the same function, without the input dropout.

Dropout needs a key, given for the training step by `dropout_key`; each
adapter folds in a number derived from its module path (the same in every
process and every model built with that layout), a scanned stack folds in
the repeat and gradient accumulation the micro-batch (`fold_dropout`), so
every layer of every micro-batch draws its own mask. Without a key
(evaluation, generation) there is none.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx import quantization
from gdnx.parallel.rules import out_sharding

P = jax.sharding.PartitionSpec

# an AdapterSpec's target for the routed experts; the others name projections
EXPERTS = "experts"

_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("gdnx_lora_dropout_key", default=None)


class AdapterSpec(NamedTuple):
    rank: int
    alpha: float
    dropout: float
    targets: frozenset[str]
    mtp: bool = False   # the multi-token prediction module's layers adapted too

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@contextlib.contextmanager
def dropout_key(key: jax.Array | None) -> Iterator[None]:
    """Adapters draw their dropout masks from `key` inside this context."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


@contextlib.contextmanager
def fold_dropout(index: jax.Array | int) -> Iterator[None]:
    """Fold `index` into the dropout key inside this context (a scanned
    stack's repeat, an accumulated step's micro-batch)."""
    key = _KEY.get()
    with dropout_key(None if key is None else jax.random.fold_in(key, index)):
        yield


def adapted_weight(path: tuple) -> tuple:
    """The path of the weight an adapter's parameter (path ending in
    lora_a or lora_b) adapts: <projection>/lora/* -> <projection>/kernel,
    <experts weight>_lora/* -> <experts weight>."""
    *head, owner, _ = path
    if owner == "lora":
        return (*head, "kernel")
    return (*head, str(owner).removesuffix("_lora"))


def _a_init(key: jax.Array, shape: tuple[int, ...], dtype: DTypeLike) -> jax.Array:
    """PEFT's default for A: Kaiming uniform with a = sqrt(5), i.e. uniform
    within 1 / sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(shape[-2])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRA(nnx.Module):
    """The adapter of one projection [in, out]."""

    def __init__(self, d_in: int, d_out: int, spec: AdapterSpec, *, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 path: str, experts: int | None = None):
        """path: the adapted module's path in the model; its dropout masks
        are keyed by it."""
        lead = () if experts is None else (experts,)
        self.lora_a = nnx.LoRAParam(_a_init(rngs.params(), (*lead, d_in, spec.rank), param_dtype))
        self.lora_b = nnx.LoRAParam(jnp.zeros((*lead, spec.rank, d_out), param_dtype))
        self.scale, self.rate = spec.scale, spec.dropout
        self.number = zlib.crc32(path.encode())

    def __call__(self, x: jax.Array, out: P | None = None) -> jax.Array:
        """scale * dropout(x) A B for x [B, T, in]; `out`: the result's
        out_sharding (an Explicit mesh)."""
        key = _KEY.get()
        if self.rate and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.number), 1.0 - self.rate, x.shape)
            x = jnp.where(keep, x / (1.0 - self.rate), 0).astype(x.dtype)
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        place = out_sharding(("batch", "length", None), (*x.shape[:-1], a.shape[-1]))
        low = jnp.einsum("...i,ir->...r", x, a, out_sharding=place)
        return self.scale * jnp.einsum("...r,ro->...o", low, b, out_sharding=out)

    def merged(self, w: jax.Array) -> jax.Array:
        """w + scale * A B (the experts' weights, [E, in, out])."""
        delta = jnp.einsum("...ir,...ro->...io", self.lora_a[...].astype(jnp.float32),
                           self.lora_b[...].astype(jnp.float32))
        return (w.astype(jnp.float32) + self.scale * delta).astype(w.dtype)


class Linear(nnx.Linear):
    """nnx.Linear with an optional LoRA adapter (`lora`, set by add_adapters)
    and optionally quantized weights (`quantize`: int8 / float8 values in
    `kernel`, block factors in `kernel_scale`; gdnx.quantization)."""

    lora: LoRA | None = None
    kernel_scale: nnx.Param | None = None
    block: tuple[int, int] | None = None
    activations: str = "none"

    def quantize(self, kind: str, block: tuple[int, int], activations: str = "none") -> None:
        """Hold the kernel quantized (its values replaced in place);
        activations=fp8: products with the input in float8 per token group
        where the blocks tile the kernel (gdnx.quantization.fp8_product)."""
        values, scale = quantization.quantize(self.kernel[...], kind, block)
        self.kernel = nnx.Param(values)
        self.kernel_scale = nnx.Param(scale)
        self.block = block
        self.activations = quantization.activations_for(activations, values.shape, block)

    def __call__(self, x: jax.Array, *, out_sharding: P | None = None) -> jax.Array:  # type: ignore[override]
        if self.kernel_scale is None:
            y = super().__call__(x, out_sharding=out_sharding)
        elif self.activations == "fp8":
            assert self.block is not None
            x = x.astype(self.dtype or x.dtype)
            y = quantization.fp8_product(x, self.kernel[...], self.kernel_scale[...], self.block).astype(x.dtype)
            if self.bias is not None:
                y = y + self.bias[...].astype(y.dtype)
        else:
            x = x.astype(self.dtype or x.dtype)
            y = jnp.einsum("...i,io->...o", x, self._dequantized(x.dtype), precision=self.precision,
                           out_sharding=out_sharding)
            if self.bias is not None:
                y = y + self.bias[...].astype(y.dtype)
        if self.lora is None:
            return y
        return y + self.lora(x, out_sharding).astype(y.dtype)

    def _dequantized(self, dtype: DTypeLike) -> jax.Array:
        assert self.kernel_scale is not None and self.block is not None
        return quantization.dequantize(self.kernel[...], self.kernel_scale[...], self.block, dtype)

    def weight(self) -> jax.Array:
        """The kernel [in, out] (dequantized) with the adapter merged in (no
        dropout): for a caller that multiplies by the weight itself."""
        w = self.kernel[...] if self.kernel_scale is None else self._dequantized(self.dtype or jnp.float32)
        return w if self.lora is None else self.lora.merged(w)
