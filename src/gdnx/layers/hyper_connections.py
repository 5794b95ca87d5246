"""Hyper-connections: the residual stream widened to N streams per token
([B, T, N, H]), a block (mixer or MLP) reading one mix of them and writing
its output back into each with a learned weight.

Two kinds, as transformers builds them:

- `ManifoldHyperConnection` (GLM-5-Next, mHC): from the RMS-normed
  flattened streams one projection gives, per token, the weights that
  collapse the streams into the block's input (pre: sigmoid + eps), that
  expand the block's output into each stream (post: 2 sigmoid), and the
  N x N matrix that mixes the residual streams (comb: softmax over each
  row, then Sinkhorn-Knopp normalisation of columns and rows, ending on the
  columns: they sum to 1 and the rows nearly, so that the streams' norm
  does not grow). Computed in float32. The model ends with the streams' mean (`stream_mean`).
- `GatedResidual` (Qwen4-Exp): the flattened streams normed per stream
  ((1 + w) RMSNorm), a low-rank sigmoid gate per feature, the gated
  streams' mean as the block's input, and 2 sigmoid injection weights per
  stream for the block's output (`inject`); without them
  (combine=False) it is the model's final collapse of the streams.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.linear import linear
from gdnx.layers.norms import GroupedRMSNorm


def expand_streams(x: jax.Array, streams: int) -> jax.Array:
    """The embeddings [B, T, H] as `streams` equal streams [B, T, N, H]."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], streams, x.shape[-1]))


def stream_mean(streams: jax.Array) -> jax.Array:
    """GLM-5-Next's final collapse: the streams' unweighted mean, [B, T, H]."""
    return jnp.mean(streams, axis=-2)


class ManifoldHyperConnection(nnx.Module):
    """GLM-5-Next's mHC around one block. Parameters as the checkpoint's
    (fn transposed to gdnx's [in, out]): fn [N*H, (2 + N) N], base
    [(2 + N) N] and scale [3] in float32."""

    def __init__(self, hidden_size: int, streams: int, *, sinkhorn_iters: int, eps: float, norm_eps: float,
                 init_std: float, param_dtype: DTypeLike, rngs: nnx.Rngs):
        if streams < 1 or sinkhorn_iters < 1:
            raise ValueError(f"streams, sinkhorn_iters: expected >= 1, got {streams}, {sinkhorn_iters}")
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = nnx.Param(nnx.initializers.normal(init_std)(rngs.params(), (streams * hidden_size, width),
                                                              param_dtype))
        self.base = nnx.Param(jnp.zeros((width,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))

    def __call__(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """streams [B, T, N, H] -> (post [B, T, N], comb [B, T, N, N], the
        block's input [B, T, H] in the streams' dtype)."""
        n = self.streams
        flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
        flat = flat * jax.lax.rsqrt(jnp.mean(jnp.square(flat), axis=-1, keepdims=True) + self.norm_eps)
        mixed = flat @ self.fn[...].astype(jnp.float32)
        pre_w, post_w, comb_w = mixed[..., :n], mixed[..., n:2 * n], mixed[..., 2 * n:]
        base = self.base[...]
        pre_b, post_b, comb_b = base[:n], base[n:2 * n], base[2 * n:].reshape(n, n)
        pre_s, post_s, comb_s = self.scale[0], self.scale[1], self.scale[2]
        pre = jax.nn.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * jax.nn.sigmoid(post_w * post_s + post_b)
        comb = jax.nn.softmax(comb_w.reshape(*comb_w.shape[:-1], n, n) * comb_s + comb_b, axis=-1) + self.eps
        # Sinkhorn-Knopp: columns, then rows and columns in turn
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + self.eps)
            comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        collapsed = jnp.sum(pre[..., None] * streams, axis=-2).astype(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def combine(post: jax.Array, comb: jax.Array, out: jax.Array, residual: jax.Array) -> jax.Array:
        """The new streams [B, T, N, H]: the block's output out [B, T, H]
        into each stream at its post weight, plus the residual streams
        mixed by comb (stream j gets sum_i comb[i, j] residual_i)."""
        dtype = residual.dtype
        mixed = jnp.einsum("...ij,...ih->...jh", comb.astype(dtype), residual)
        return post.astype(dtype)[..., None] * out[..., None, :] + mixed


class GatedResidual(nnx.Module):
    """Qwen4-Exp's gated residual around one block (combine=True) or the
    final collapse of the streams (combine=False). Streams flattened
    [B, T, N*H], as Qwen4-Exp carries them."""

    def __init__(self, hidden_size: int, streams: int, rank: int, *, combine: bool, eps: float, init_std: float,
                 dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs):
        if streams < 2:
            raise ValueError(f"streams: Qwen4-Exp's gated residual mixes at least 2 streams, got {streams}")
        self.hidden_size, self.streams = hidden_size, streams
        width = streams * hidden_size
        self.norm = GroupedRMSNorm(width, hidden_size, eps=eps, param_dtype=param_dtype)
        self.down = linear(width, rank, dtype, param_dtype, init_std, rngs)
        self.up = linear(rank, width, dtype, param_dtype, init_std, rngs)
        self.inject_weight = linear(width, streams, dtype, param_dtype, init_std, rngs) if combine else None

    def __call__(self, hyper: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """hyper [B, T, N*H] -> (the block's input [B, T, H], the injection
        weights [B, T, N]; None without combine)."""
        if hyper.shape[-1] != self.streams * self.hidden_size:
            raise ValueError(f"hyper: expected {self.streams * self.hidden_size} features (streams x hidden), got "
                             f"{hyper.shape[-1]}")
        normed = self.norm(hyper)
        gate = jax.nn.sigmoid(self.up(jax.nn.silu(self.down(normed) / self.streams)))
        split = (*hyper.shape[:-1], self.streams, self.hidden_size)
        mixed = jnp.mean(gate.reshape(split) * normed.reshape(split), axis=-2)
        if self.inject_weight is None:
            return mixed, None
        return mixed, 2 * jax.nn.sigmoid(self.inject_weight(normed) / self.streams)

    @staticmethod
    def inject(hyper: jax.Array, out: jax.Array, weights: jax.Array) -> jax.Array:
        """The new streams [B, T, N*H]: each stream plus the block's output
        out [B, T, H] at its injection weight."""
        added = out[..., None, :] * weights[..., None]
        return hyper + added.reshape(hyper.shape)
