"""Gated RMSNorm: the normalisation on the delta rule's output in every GDN hybrid.

    y = x / sqrt(mean(x^2) + eps) * weight * act(z)

act silu (GDN) or sigmoid (KDA), over the last axis (the value head dim), computed in float32 and returned in
x's dtype. Plain JAX: autodiff of these few elementwise ops is already what a
hand-written backward would be.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp


_GATES = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


def gated_rmsnorm(x: jax.Array, z: jax.Array, weight: jax.Array, *, eps: float = 1e-6,
                  gate: Literal["silu", "sigmoid"] = "silu") -> jax.Array:
    """x, z [..., V] (z the gate), weight [V]; gate: the activation on z."""
    if gate not in _GATES:
        raise ValueError(f"gate: expected one of {', '.join(_GATES)}, got {gate!r}")
    for name, arr in (("x", x), ("z", z), ("weight", weight)):
        if not hasattr(arr, "shape") or not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating array")
    if z.shape != x.shape:
        raise ValueError(f"z: expected the shape of x {tuple(x.shape)}, got {tuple(z.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight: expected [{x.shape[-1]}], got {tuple(weight.shape)}")
    f32 = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(f32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(f32) * _GATES[gate](z.astype(f32))).astype(x.dtype)
