"""Sparse MoE: routed SwiGLU experts plus a shared expert.

Two routers. softmax (Qwen3-Next, Qwen3.5, Lara 4 Mini): softmax over
experts in float32, top-k, optionally renormalised (norm_topk_prob).
sigmoid (Kimi Linear, Ling 3; DeepSeek-V3's): sigmoid scores in float32;
the choice adds a per-expert correction bias and keeps to the topk_group
best of n_group groups (a group scored by its best two experts); the chosen
experts' scores (renormalised with norm_topk_prob) times
routed_scaling_factor weight them. The shared expert is scaled by a sigmoid
gate (Qwen's) or added whole.
The correction bias takes no gradient (it only moves the choice). Experts
run as grouped matmuls (gdnx.ops.grouped_matmul) over the token copies
sorted by expert, so the work is tokens * k, not tokens * num_experts, and
no dense per-expert copy of the tokens is made. The layer also returns what
the load-balancing loss needs.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike
from qwix import QArray

from gdnx import quantization
from gdnx.layers.linear import linear
from gdnx.layers.lora import LoRA
from gdnx.layers.mlp import MLP, swiglu
from gdnx.ops.grouped_matmul import grouped_matmul, resolve, traced_platform
from gdnx.parallel.moe import RAGGED_PLATFORMS, Exchange, ShardAxes, holds_whole_blocks, run_experts, split_experts
from gdnx.scales import scale_name


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
# Tokens whose expert copies one pass holds: more (a long prefill, a large batch) run in passes of this many, so
# the routed experts' temporaries (k copies of each token, their activations) stay bounded by it, not by the batch
# x length.
CHUNK_TOKENS = 4096


class SparseMoE(nnx.Module):
    """Top-k routed SwiGLU experts plus a gated shared expert."""

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, expert_size: int, shared_expert_size: int,
                 norm_topk_prob: bool, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 router: Literal["softmax", "sigmoid"] = "softmax", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, limit: float | None = None, shared_limit: float | None = None,
                 shared_gate: bool = True, implementation: str | None = None, split: str = "auto",
                 clamp_gate: bool = False):
        """limit, shared_limit: bounds on the routed experts' and the shared
        expert's SwiGLU (gdnx.layers.mlp.swiglu, clamp_gate its kind); None:
        unbounded.
        shared_gate: the shared expert scaled by sigmoid(shared_expert_gate(x)).
        implementation: the grouped matmuls' (gdnx.ops.grouped_matmul; None:
        the platform's). split: how a tensor axis splits the experts
        (gdnx.parallel.moe.split_experts: auto, width or experts)."""
        self.implementation, self.split = implementation, split
        self.block: tuple[int, int] | None = None  # quantized weights' blocks (quantize)
        self.activations = "none"  # fp8: the experts' inputs in float8 per token group (quantize)
        h, i, e, std = hidden_size, expert_size, num_experts, init_std
        self.num_experts, self.top_k, self.norm_topk_prob = e, top_k, norm_topk_prob
        self.router, self.n_group, self.topk_group = router, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.limit, self.clamp_gate = limit, clamp_gate
        self.dtype = dtype
        self.gate = linear(h, e, dtype, param_dtype, std, rngs)
        self.e_score_correction_bias = (nnx.Param(jnp.zeros((e,), jnp.float32)) if router == "sigmoid" else None)
        init = nnx.initializers.normal(std)
        self.experts_gate = nnx.Param(init(rngs.params(), (e, h, i), param_dtype))
        self.experts_up = nnx.Param(init(rngs.params(), (e, h, i), param_dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (e, i, h), param_dtype))
        self.shared_expert = MLP(h, shared_expert_size, dtype=dtype, param_dtype=param_dtype,
                                 init_std=std, rngs=rngs, limit=shared_limit, clamp_gate=clamp_gate)
        self.shared_expert_gate = linear(h, 1, dtype, param_dtype, std, rngs) if shared_gate else None

    def _route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(the k weights [B, T, k], the k experts [B, T, k], each expert's
        probability [B, T, E] for the balancing loss)."""
        if self.router == "softmax":
            probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
            top_p, top_i = jax.lax.top_k(probs, self.top_k)
            if self.norm_topk_prob:
                top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
            return top_p, top_i, probs
        assert self.e_score_correction_bias is not None  # built with the sigmoid router
        # in float32 whatever the model's dtype (as the checkpoints' routers are kept)
        scores = jax.nn.sigmoid(jnp.einsum("...h,he->...e", x.astype(jnp.float32),
                                           self.gate.weight().astype(jnp.float32)))
        choice = scores + jax.lax.stop_gradient(self.e_score_correction_bias[...])
        if self.topk_group < self.n_group:
            grouped = choice.reshape(*choice.shape[:-1], self.n_group, -1)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)              # [B, T, n_group]
            _, kept = jax.lax.top_k(group_scores, self.topk_group)
            keep = jnp.any(kept[..., None] == jnp.arange(self.n_group), axis=-2)     # [B, T, n_group]
            choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)
        _, top_i = jax.lax.top_k(choice, self.top_k)
        top_p = jnp.take_along_axis(scores, top_i, axis=-1)
        if self.norm_topk_prob:
            top_p = top_p / (jnp.sum(top_p, axis=-1, keepdims=True) + 1e-20)
        return top_p * self.routed_scaling_factor, top_i, scores / jnp.sum(scores, axis=-1, keepdims=True)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        """x [B, T, hidden] -> (y, RouterStats)."""
        top_p, top_i, probs = self._route(x)
        kernels = resolve(self.implementation, traced_platform()) in ("triton", "mosaic")
        split = split_experts(self.split, self.num_experts, self.experts_gate.shape[-1])
        routed, counts = run_experts(self._routed, x, top_p, top_i,
                                     *(self._weights(name, split) for name in EXPERT_WEIGHTS), split=split,
                                     kernels=kernels)
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
        tokens = jnp.asarray(x.shape[0] * x.shape[1], jnp.float32)
        return routed + shared, RouterStats(counts, jnp.sum(probs, axis=(0, 1)), tokens)

    def quantize(self, kind: str, block: tuple[int, int], activations: str = "none") -> None:
        """Hold the routed experts' weights quantized (gdnx.quantization:
        values in place, block factors in <name>_scale); activations=fp8:
        their inputs in float8 per token group where the blocks tile all
        three matrices."""
        self.block = block
        shapes = [getattr(self, name).shape for name in EXPERT_WEIGHTS]
        self.activations = "fp8" if all(quantization.activations_for(activations, s, block) == "fp8"
                                         for s in shapes) else "none"
        for name in EXPERT_WEIGHTS:
            values, scale = quantization.quantize(getattr(self, name)[...], kind, block)
            setattr(self, name, nnx.Param(values))
            setattr(self, scale_name(name), nnx.Param(scale))

    def _weights(self, name: str, split: bool) -> jax.Array | QArray:
        """An experts' weight with its LoRA adapter (<name>_lora) added in.
        A quantized one without an adapter goes to the grouped matmuls as it
        is held (a qwix.QArray) where its blocks tile it and each shard holds
        whole matrices (gdnx.ops.grouped_matmul); otherwise dequantized."""
        w = getattr(self, name)[...]
        scale = getattr(self, scale_name(name), None)
        adapter: LoRA | None = getattr(self, f"{name}_lora", None)
        if scale is not None:
            assert self.block is not None  # set by quantize with the factors
            if adapter is None and quantization.tiles(w.shape, self.block) and holds_whole_blocks(w.shape, split):
                return QArray(w, scale[...], qtype=w.dtype)
            w = quantization.dequantize(w, scale[...], self.block, self.dtype)
        return w if adapter is None else adapter.merged(w)

    def _routed(self, x, top_p, top_i, w_gate, w_up, w_down, axes: ShardAxes):
        """The routed experts on one shard's tokens (all of them without a
        mesh) and its experts (all, or a share when the axes split them),
        in passes of at most CHUNK_TOKENS tokens (divided among the devices
        of a dispatch axis, whose all-to-all gathers each device's share of
        every pass). Returns (y, top-k counts per expert)."""
        shape = x.shape
        x, top_p, top_i = x.reshape(-1, shape[-1]), top_p.reshape(-1, self.top_k), top_i.reshape(-1, self.top_k)
        counts = jnp.bincount(top_i.reshape(-1), length=self.num_experts).astype(jnp.float32)
        weights = tuple(w if isinstance(w, QArray) else w.astype(x.dtype) for w in (w_gate, w_up, w_down))
        if axes.dispatch is None:
            run = functools.partial(self._held, axes=axes)
            tokens = CHUNK_TOKENS
        else:
            run = functools.partial(self._dispatched, axes=axes)
            tokens = max(1, CHUNK_TOKENS // jax.lax.axis_size(axes.dispatch))
        n = x.shape[0]
        if n <= tokens:
            routed = run(x, top_p, top_i, *weights)
        else:  # padding tokens weigh 0: they add nothing to any token
            chunks = -(-n // tokens)
            pad = lambda a: jnp.pad(a, ((0, chunks * tokens - n), (0, 0)))  # noqa: E731
            split = lambda a: pad(a).reshape(chunks, tokens, -1)  # noqa: E731
            routed = jax.lax.map(lambda c: run(*c, *weights), (split(x), split(top_p), split(top_i)))
            routed = routed.reshape(-1, shape[-1])[:n]
        if axes.sums:  # each shard's partial sums: its slice of the width, or its experts' copies
            routed = jax.lax.psum(routed, axes.sums)
        if axes.tokens:
            counts = jax.lax.psum(counts, axes.tokens)
        return routed.reshape(shape), counts

    def _dispatched(self, x, top_p, top_i, w_gate, w_up, w_down, axes: ShardAxes):
        """x [N, hidden]'s token copies sent to the devices of the dispatch
        axis that hold their experts (device d holds experts [d E/n, (d+1)
        E/n)), run there (_held), and their outputs brought back and
        weighted in. A device can receive N x min(k, E/n) copies from each
        (a token's k experts are distinct, so no more of its copies meet on
        one device): no copy is ever dropped."""
        assert axes.dispatch is not None
        n, k = jax.lax.axis_size(axes.dispatch), self.top_k
        per = self.num_experts // n
        flat = top_i.reshape(-1)
        order = jnp.argsort(flat // per, stable=True)
        dest = flat[order] // per                                     # the copies' devices, ascending
        exchange = Exchange.plan(dest, axes.dispatch, x.shape[0] * min(k, per),
                                 ragged=traced_platform() in RAGGED_PLATFORMS)
        rows = exchange.send(x[order // k])
        ids = exchange.send((flat[order] - dest * per).astype(jnp.int32), fill=-1)  # -1: no copy, no expert
        held = self._held(rows, jnp.ones((rows.shape[0], 1), x.dtype), ids[:, None], w_gate, w_up, w_down, axes)
        back = exchange.back(held, flat.shape[0])                     # each copy's output, in `order`
        back = back * top_p.reshape(-1)[order][:, None].astype(back.dtype)
        return jnp.zeros_like(x).at[order // k].add(back)

    def _held(self, x, top_p, top_i, w_gate, w_up, w_down, axes: ShardAxes):
        """x [N, hidden] through the experts this shard holds of the top_i
        (each counted from the first expert that reaches this device; when
        axes.experts split them further, this shard's share)."""
        if axes.experts:  # this shard's experts: [first, first + held); the others' copies are left to their shards
            top_i = top_i - jax.lax.axis_index(axes.experts) * w_gate.shape[0]
            # the tokens and weights, the same on every shard, marked as each shard's own: their gradients are
            # then summed over the shards (left implicit, the gather by expert took one shard's alone)
            x, top_p = (jax.lax.pcast(a, axes.experts, to="varying") for a in (x, top_p))
        return self._experts(x, top_p, top_i, w_gate, w_up, w_down)

    def _experts(self, x, top_p, top_i, w_gate, w_up, w_down):
        """x [N, hidden] through its tokens' top-k experts among the
        w_gate.shape[0] held (top_i counts from the first held; copies for
        experts outside them add nothing): token copies sorted by expert ->
        grouped matmuls -> weighted sum back per token."""
        held, k = w_gate.shape[0], top_i.shape[-1]
        flat_e = top_i.reshape(-1)
        mine = (flat_e >= 0) & (flat_e < held)
        key = jnp.where(mine, flat_e, held)  # the others sort last, past the groups' total: zero rows
        order = jnp.argsort(key, stable=True)
        rows = order // k
        sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
        xs = x[rows]
        gmm = functools.partial(grouped_matmul, group_sizes=sizes, implementation=self.implementation,
                                out_dtype=x.dtype)
        if self.activations == "fp8":  # the inputs in float8 per token group (gdnx.quantization)
            assert self.block is not None
            group = self.block[1]
            xq = quantization.quantize_tokens(xs, group)
            act = swiglu(gmm(xq, w_gate), gmm(xq, w_up), self.limit, self.clamp_gate)
            ys = gmm(quantization.quantize_tokens(act, group), w_down)
        else:
            act = swiglu(gmm(xs, w_gate), gmm(xs, w_up), self.limit, self.clamp_gate)
            ys = gmm(act, w_down)
        weight = jnp.where(mine, top_p.reshape(-1), 0)[order]
        ys = ys * weight[:, None].astype(ys.dtype)
        return jnp.zeros_like(x).at[rows].add(ys)
