"""RMSNorm in two parametrisations: scale by w (w initialised to 1; OLMo
Hybrid) or by 1 + w (zero-centred, w initialised to 0; Qwen3-Next and
Qwen3.5), and LayerNorm (GLM-5-Next's sparse-attention indexer keys). All
normalise in float32 and cast back to x's dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * w."""

    offset = 0.0  # the scale is offset + w, w starting at 1 - offset

    def __init__(self, dim: int, *, eps: float, param_dtype: DTypeLike = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - self.offset, param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps)
        return (y * (self.offset + self.weight[...].astype(y.dtype))).astype(x.dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """y = x / rms(x) * (1 + w)."""

    offset = 1.0


class GroupedRMSNorm(ZeroCenteredRMSNorm):
    """Zero-centred RMSNorm over each group of `group` features of the last
    dim (Qwen4-Exp's hyper-connection streams: one group per stream), w over
    the whole dim."""

    def __init__(self, dim: int, group: int, *, eps: float, param_dtype: DTypeLike = jnp.float32):
        if dim % group:
            raise ValueError(f"group: expected a divisor of the width {dim}, got {group}")
        super().__init__(dim, eps=eps, param_dtype=param_dtype)
        self.group = group

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x.reshape(*x.shape[:-1], -1, self.group), self.eps).reshape(x.shape)
        return (y * (self.offset + self.weight[...].astype(y.dtype))).astype(x.dtype)


class LayerNorm(nnx.Module):
    """y = (x - mean(x)) / std(x) * w + b, w starting at 1 and b at 0."""

    def __init__(self, dim: int, *, eps: float, param_dtype: DTypeLike = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(y.dtype) + self.bias[...].astype(y.dtype)).astype(x.dtype)
