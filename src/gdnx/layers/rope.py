"""Rotary position embedding: partial (the first rotary_dim features of each
head rotate, halves paired, as in Qwen3-Next; the rest pass through), or
on adjacent pairs (DeepSeek's layout, latent attention's rope part)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    return int(head_dim * partial_rotary_factor)


def rope_tables(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., T, dim] in float32 for int positions [..., T]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D]; cos, sin [B or 1, T, rotary_dim]."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on pairs of adjacent features (x0, x1), (x2, x3), ... (DeepSeek's
    layout), each pair turned by one frequency; the result holds the pairs'
    first members, then their second ones, as transformers returns it (q and
    k alike, so their products are those of the interleaved layout).
    x [B, T, H, D]; cos, sin [B or 1, T, D] as rope_tables gives them."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, :, None, :half].astype(x.dtype), sin[:, :, None, :half].astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
