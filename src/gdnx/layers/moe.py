"""Sparse MoE with a sigmoid-gated shared expert (Qwen3-Next, Qwen3.5).

Routing: softmax over experts in float32, top-k, optionally renormalised
(norm_topk_prob). Experts run as grouped matmuls (jax.lax.ragged_dot) over
the token copies sorted by expert, so the work is tokens * k, not tokens *
num_experts. The layer also returns what the load-balancing loss needs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.linear import linear
from gdnx.layers.lora import LoRA
from gdnx.layers.mlp import MLP
from gdnx.parallel.moe import run_experts


class RouterStats(NamedTuple):
    """Per layer: top-k assignments per expert, summed router probabilities
    per expert, and the number of tokens (Switch Transformer's f and P)."""
    counts: jax.Array
    prob_sums: jax.Array
    tokens: jax.Array


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> jax.Array:
    """num_experts * sum_e f_e P_e with f and P pooled over all MoE layers
    (as Hugging Face's Qwen3-Next computes it); 0 without MoE layers."""
    if not stats:
        return jnp.zeros((), jnp.float32)
    tokens = sum(s.tokens for s in stats)
    f = sum(s.counts for s in stats) / tokens
    p = sum(s.prob_sums for s in stats) / tokens
    return num_experts * jnp.sum(f * p)


EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


class SparseMoE(nnx.Module):
    """Top-k routed SwiGLU experts plus a gated shared expert."""

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, expert_size: int, shared_expert_size: int,
                 norm_topk_prob: bool, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs):
        h, i, e, std = hidden_size, expert_size, num_experts, init_std
        self.num_experts, self.top_k, self.norm_topk_prob = e, top_k, norm_topk_prob
        self.dtype = dtype
        self.gate = linear(h, e, dtype, param_dtype, std, rngs)
        init = nnx.initializers.normal(std)
        self.experts_gate = nnx.Param(init(rngs.params(), (e, h, i), param_dtype))
        self.experts_up = nnx.Param(init(rngs.params(), (e, h, i), param_dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (e, i, h), param_dtype))
        self.shared_expert = MLP(h, shared_expert_size, dtype=dtype, param_dtype=param_dtype,
                                 init_std=std, rngs=rngs)
        self.shared_expert_gate = linear(h, 1, dtype, param_dtype, std, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        """x [B, T, hidden] -> (y, RouterStats)."""
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
        top_p, top_i = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        routed, counts = run_experts(self._routed, x, top_p, top_i,
                                     *(self._weights(name) for name in EXPERT_WEIGHTS))
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        tokens = jnp.asarray(x.shape[0] * x.shape[1], jnp.float32)
        return routed + shared, RouterStats(counts, jnp.sum(probs, axis=(0, 1)), tokens)

    def _weights(self, name: str) -> jax.Array:
        """An experts' weight, with its LoRA adapter (<name>_lora) added in."""
        w = getattr(self, name)[...]
        adapter: LoRA | None = getattr(self, f"{name}_lora", None)
        return w if adapter is None else adapter.merged(w)

    def _routed(self, x, top_p, top_i, w_gate, w_up, w_down, width_axes, token_axes):
        """The routed experts on one shard's tokens (all of them without a
        mesh): token copies sorted by expert -> grouped matmuls -> weighted
        sum back per token. Returns (y, top-k counts per expert)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        flat_e = top_i.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)
        rows = order // self.top_k
        sizes = jnp.bincount(flat_e, length=self.num_experts).astype(jnp.int32)
        xs = x[rows]
        wd = lambda w: w.astype(x.dtype)  # noqa: E731
        act = jax.nn.silu(jax.lax.ragged_dot(xs, wd(w_gate), sizes)) * jax.lax.ragged_dot(xs, wd(w_up), sizes)
        ys = jax.lax.ragged_dot(act, wd(w_down), sizes)
        ys = ys * top_p.reshape(-1)[order][:, None].astype(ys.dtype)
        routed = jnp.zeros_like(x).at[rows].add(ys)
        if width_axes:  # each shard summed over its slice of the expert width
            routed = jax.lax.psum(routed, width_axes)
        counts = sizes.astype(jnp.float32)
        if token_axes:
            counts = jax.lax.psum(counts, token_axes)
        return routed.reshape(shape), counts
