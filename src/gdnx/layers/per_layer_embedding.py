"""Qwen4-Exp's per-layer embedding (PLE): a layer's hashed n-gram
embedding of each token (gdnx.layers.ngram_embedding) written into every
hyper-connection stream, gated by the stream.

Per token: a key per stream and one value from the n-gram embedding; the
gate per stream is the signed square root of the normed key's dot with
the normed stream (over sqrt(H)), through a sigmoid, times the value; the
gated values plus a causal depthwise convolution of their normed copy
(kernel `conv_kernel`, dilation `ngram_size`, SiLU) are what the layer
adds to the streams. Generation carries the convolution's last
(conv_kernel - 1) * dilation inputs and the tokens the next call's
n-grams reach back to, in the layer's DeltaRuleState (ple_conv,
ple_context).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.linear import linear
from gdnx.layers.ngram_embedding import NGramEmbedding
from gdnx.layers.norms import GroupedRMSNorm
from gdnx.parallel.rules import constrain


def states_at(x: jax.Array, ends: jax.Array, size: int) -> jax.Array:
    """x [B, L, ...] -> [B, N, size, ...]: per row, x[e:e + size] for each
    of its ends [B, N] (a state `size` long after token e of a call, x
    holding the incoming state's `size` entries first)."""
    index = ends[..., None] + jnp.arange(size, dtype=ends.dtype)  # [B, N, size]
    index = index.reshape(*index.shape, *(1,) * (x.ndim - 2))
    return jnp.take_along_axis(x[:, None], index, axis=2)


class PerLayerEmbedding(nnx.Module):
    def __init__(self, hidden_size: int, streams: int, *, rows: int, heads: int, embed_dim: int, conv_kernel: int,
                 dilation: int, eps: float, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike,
                 rngs: nnx.Rngs):
        if embed_dim % heads:
            raise ValueError(f"embed_dim: expected a multiple of the n-gram heads {heads}, got {embed_dim}")
        self.hidden_size, self.streams, self.conv_kernel, self.dilation = hidden_size, streams, conv_kernel, dilation
        width = streams * hidden_size
        self.embedding = NGramEmbedding(rows, embed_dim // heads, init_std=init_std, param_dtype=param_dtype,
                                        rngs=rngs)
        self.key_proj = linear(embed_dim, width, dtype, param_dtype, init_std, rngs)
        self.value_proj = linear(embed_dim, hidden_size, dtype, param_dtype, init_std, rngs)
        self.norm_key = GroupedRMSNorm(width, hidden_size, eps=eps, param_dtype=param_dtype)
        self.norm_query = GroupedRMSNorm(width, hidden_size, eps=eps, param_dtype=param_dtype)
        self.norm_conv = GroupedRMSNorm(width, hidden_size, eps=eps, param_dtype=param_dtype)
        # depthwise: one kernel per feature, [conv_kernel, width]
        self.conv_weight = nnx.Param(nnx.initializers.normal(init_std)(rngs.params(), (conv_kernel, width),
                                                                       param_dtype))

    @property
    def state_length(self) -> int:
        """Inputs of the convolution generation carries."""
        return (self.conv_kernel - 1) * self.dilation

    def __call__(self, streams: jax.Array, ids: jax.Array, state: jax.Array | None = None,
                 segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """streams [B, T, N*H], the n-gram row ids [B, T, heads] and the
        convolution's last inputs [B, state_length, N*H] (None: a sequence's
        start) -> (what the layer adds to the streams [B, T, N*H], the
        convolution's inputs after the state [B, state_length + T, N*H]:
        the state after token e is [e, e + state_length) of it,
        `states_at`). segments [B, T] (without a state): packed documents,
        the convolution kept within each."""
        b, t, width = streams.shape
        split = (b, t, self.streams, self.hidden_size)
        embedded = self.embedding(ids)
        key = self.norm_key(self.key_proj(embedded)).reshape(split)
        value = self.value_proj(embedded)
        query = self.norm_query(streams).reshape(split)
        gate = jnp.sum(key * query, axis=-1, keepdims=True) / math.sqrt(self.hidden_size)
        gate = jnp.sqrt(jnp.maximum(jnp.abs(gate), 1e-6)) * jnp.sign(gate)
        gated = (jax.nn.sigmoid(gate) * value[..., None, :]).reshape(b, t, width)
        normed = self.norm_conv(gated)
        # the convolution reaches back across the sequence: its input whole along it (under context parallelism,
        # gathered), its output split again
        normed = constrain(normed, ("batch", None, None))
        if segments is not None:
            segments = constrain(segments, ("batch", None))
        pad = ((0, 0), (self.state_length, 0), (0, 0))
        # [B, state + T, width]; a sequence's start pads with zeros (no concatenation with an unsharded operand,
        # which an Explicit mesh refuses)
        window = jnp.pad(normed, pad) if state is None else jnp.concatenate([state.astype(normed.dtype), normed], 1)
        w = self.conv_weight[...].astype(normed.dtype)
        taps = []
        for k in range(self.conv_kernel):
            tap = window[:, k * self.dilation:k * self.dilation + t]
            back = self.state_length - k * self.dilation  # tokens between the tap and the output
            if segments is not None and back:
                earlier = jnp.pad(segments, ((0, 0), (back, 0)), constant_values=-1)[:, :t]  # -1: before the row
                tap = jnp.where((earlier == segments)[..., None], tap, 0)
            taps.append(tap * w[k])
        conv = constrain(sum(taps[1:], taps[0]), ("batch", "length", None))
        return gated + jax.nn.silu(conv), window
