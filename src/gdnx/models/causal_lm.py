"""The GDN hybrid decoder of every family gdnx builds (`ModelConfig.family`):
embeddings, a stack of decoder layers (Gated DeltaNet, with full attention
where layer_types says), each followed by a dense SwiGLU MLP or a sparse
MoE, a final norm and the LM head. Parameter names follow Hugging Face's so
the weight map stays plain.

The families differ in a few places, all here: OLMo Hybrid scales its norms
by w (Qwen by 1 + w), its attention normalises q and k across heads without
an output gate (NormedAttention) and may go without RoPE, its attention
layers normalise each block's output (post-norm), and its GDN layers may
take beta in [0, 2]. Qwen3.5 differs from Qwen3-Next only in how its
checkpoints store the GDN projections (gdnx.checkpoints.hf_names).
GLM-5-Next and Qwen4-Exp carry several residual streams per token
(hyper-connections); Qwen4-Exp ends with a gated mix of them, no final
norm, and adds hashed n-gram embeddings on some GDN layers.

A deep stack runs scanned (ModelConfig.scan_layers): its repeating cycle
of layers (Qwen3-Next: 3 GDN + 1 attention) under one lax.scan over
parameters stacked per position in the cycle (`cycle`), so the compiled
program does not grow with depth; the layers before the first cycle
(`head`: Kimi Linear's dense first layer) and after the last full one
(`tail`) run unrolled. gdnx.stacking owns the layout and maps it to
per-layer names.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx import quantization
from gdnx.config.schema import KDA_FAMILIES, ModelConfig
from gdnx.layers.attention import (GatedAttention, HeadNormedAttention, KVCache, KVStack, NormedAttention, RingCache,
                                   Rope)
from gdnx.layers.documents import document_positions
from gdnx.layers.gated_deltanet import DeltaRuleMixer, GatedDeltaNet, DeltaRuleState
from gdnx.layers.hyper_connections import GatedResidual, ManifoldHyperConnection, expand_streams, stream_mean
from gdnx.layers.kimi_delta_attention import KimiDeltaAttention
from gdnx.layers.latent_attention import LatentAttention, LatentCache, LatentStack
from gdnx.layers.linear import linear
from gdnx.layers.lora import AdapterSpec, Linear, fold_dropout
from gdnx.layers.mlp import MLP
from gdnx.layers.moe import RouterStats, SparseMoE, load_balancing_loss
from gdnx.layers.ngram_embedding import ngram_hash
from gdnx.layers.norms import RMSNorm, ZeroCenteredRMSNorm
from gdnx.layers.per_layer_embedding import PerLayerEmbedding, states_at
from gdnx.layers.rope import rope_tables, rotary_dim
from gdnx.layers.sparse_attention import (IndexedGatedAttention, IndexedKVCache, IndexedLatentAttention,
                                          IndexedLatentCache)
from gdnx.layers.sparse_index import Selection
from gdnx.layers.splash import Splash
from gdnx.models.adapters import add_adapters
from gdnx.models.cache import Cache
from gdnx.models.cycle_cache import entry_at, join_entry, split_entry, unstacked, written
from gdnx.ops import grouped_matmul
from gdnx.ops.delta_rule.options import KERNEL_PLATFORMS, RESIDUAL_NAMES, DeltaRuleOptions
from gdnx.parallel.params import shardings
from gdnx.parallel.rules import HIDDEN, constrain, current_mesh, out_sharding


class ModelOutput(NamedTuple):
    logits: jax.Array  # [B, T, vocab] float32
    cache: Cache | None
    aux_loss: jax.Array  # load-balancing loss (0 for dense models)


class HiddenOutput(NamedTuple):
    hidden: jax.Array  # [B, T, hidden]: the final (normed) hidden states
    cache: Cache | None
    aux_loss: jax.Array  # load-balancing loss (0 for dense models)


def _norm(cfg: ModelConfig) -> type[RMSNorm]:
    """The family's RMSNorm: scaled by w (OLMo Hybrid, Kimi Linear, Ling 3,
    Lara 4 Mini) or by 1 + w (Qwen)."""
    return RMSNorm if cfg.family in ("olmo_hybrid", "lara_mini", *KDA_FAMILIES) else ZeroCenteredRMSNorm


# OLMo Hybrid's gated norm on the GDN output has a fixed eps
OLMO_GATED_NORM_EPS = 1e-5
# latent attention's norms (on the query and key/value latents) have a fixed eps
LATENT_NORM_EPS = 1e-6
Mixer = GatedDeltaNet | KimiDeltaAttention | GatedAttention | NormedAttention | HeadNormedAttention | LatentAttention
LayerCache = (KVCache | KVStack | RingCache | LatentCache | LatentStack | DeltaRuleState | IndexedLatentCache
              | IndexedKVCache)


class HyperState(NamedTuple):
    """What each layer of a model with hyper-connection streams (glm5_next)
    passes to the next: the streams [B, T, N, H] and the sparse-attention
    selection of the last full-index layer (what a shared-index layer reads;
    before the first, an empty one)."""
    streams: jax.Array
    selection: Selection


class GatedStreams(NamedTuple):
    """What each layer of Qwen4-Exp passes to the next: the streams
    flattened [B, T, N*H] and the call's tokens [B, T] (the per-layer
    embeddings hash them)."""
    streams: jax.Array
    tokens: jax.Array


class DecoderLayer(nnx.Module):
    """Pre-norm, x + mixer(norm(x)) then x + mlp(norm(x)); post-norm (OLMo
    Hybrid's attention layers), x + norm(mixer(x)) then x + norm(mlp(x));
    with hyper-connection streams, each block between a
    ManifoldHyperConnection's read and write (GLM-5-Next) or a
    GatedResidual's (Qwen4-Exp, whose per-layer embeddings add to the
    streams first)."""

    def __init__(self, cfg: ModelConfig, index: int, *, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 full_attention: bool = False):
        # full_attention: a multi-token prediction layer (MultiTokenPredictor), beside the index-th's MLP kind;
        # its SwiGLU bounds are the lists' first (its own index 0 in transformers' module)
        self.layer_type = "full_attention" if full_attention else cfg.resolved_layer_types[index]
        bound_at = 0 if full_attention else index
        olmo, ling, glm = cfg.family == "olmo_hybrid", cfg.family == "bailing_hybrid", cfg.family == "glm5_next"
        qwen4 = cfg.family == "qwen4_exp"
        # the model reads the config; each layer gets the sizes it uses
        h = cfg.hidden_size
        kw: dict[str, Any] = dict(init_std=cfg.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = _norm(cfg)
        self.post_norm = olmo and self.layer_type == "full_attention"
        if self.post_norm:
            self.post_attention_layernorm = norm(h, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
            self.post_feedforward_layernorm = norm(h, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        elif not qwen4:  # Qwen4-Exp's gated residuals norm the streams instead
            self.input_layernorm = norm(h, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
            self.post_attention_layernorm = norm(h, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mixer: Mixer
        if self.layer_type == "linear_attention" and cfg.linear_kind == "kda":
            self.mixer = KimiDeltaAttention(
                h, num_heads=cfg.linear_num_key_heads, head_dim=cfg.linear_key_head_dim,
                conv_kernel_size=cfg.linear_conv_kernel_dim, op=delta_rule_options(cfg), norm_eps=cfg.rms_norm_eps,
                low_rank_gates=not ling, lower_bound=cfg.linear_gate_lower_bound, **kw)
        elif self.layer_type == "linear_attention":
            self.mixer = GatedDeltaNet(
                h, num_key_heads=cfg.linear_num_key_heads, num_value_heads=cfg.linear_num_value_heads,
                key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim,
                conv_kernel_size=cfg.linear_conv_kernel_dim, op=delta_rule_options(cfg),
                norm_eps=OLMO_GATED_NORM_EPS if olmo else cfg.rms_norm_eps,
                allow_neg_eigval=cfg.linear_allow_neg_eigval, output_gate=cfg.linear_output_gate, **kw)
        elif cfg.attention_kind == "head_normed":
            window = cfg.sliding_window if self.layer_type == "sliding_attention" else None
            self.mixer = HeadNormedAttention(h, num_heads=cfg.num_attention_heads,
                                             num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                             bias=cfg.attention_bias, norm_eps=cfg.rms_norm_eps, window=window,
                                             kernel=attention_kernel(cfg), **kw)
        elif cfg.attention_kind == "latent" and glm:
            assert cfg.q_lora_rank is not None  # the config requires it
            self.mixer = IndexedLatentAttention(
                h, num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, bias=cfg.attention_bias, norm_eps=cfg.rms_norm_eps, absorb=cfg.mla_absorb,
                index_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, block=cfg.index_kpool,
                budget=cfg.index_topk, tail=cfg.index_kpool_always_select_tail,
                shared=cfg.shared_index_layers[index], **kw)
        elif cfg.attention_kind == "latent":
            self.mixer = LatentAttention(
                h, num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, bias=cfg.attention_bias, norm_eps=LATENT_NORM_EPS,
                absorb=cfg.mla_absorb, head_gate=ling, **kw)
        elif qwen4:
            self.mixer = IndexedGatedAttention(
                h, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                bias=cfg.attention_bias, norm_eps=cfg.rms_norm_eps, index_heads=cfg.index_n_heads,
                index_head_dim=cfg.index_head_dim, block=cfg.index_kpool, budget=cfg.index_topk,
                theta=cfg.rope_theta or 0.0, rotary_dim=_rotary_dim(cfg), **kw)
        else:
            attention = NormedAttention if olmo else GatedAttention
            self.mixer = attention(h, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.head_dim, bias=cfg.attention_bias, norm_eps=cfg.rms_norm_eps,
                                   kernel=attention_kernel(cfg), **kw)
        self.mlp: SparseMoE | MLP
        if cfg.is_moe_layer(index):
            self.mlp = SparseMoE(h, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                                 expert_size=cfg.moe_intermediate_size,
                                 shared_expert_size=cfg.shared_expert_intermediate_size,
                                 norm_topk_prob=cfg.norm_topk_prob, router=cfg.router_kind, n_group=cfg.n_group,
                                 topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                                 limit=cfg.swiglu_limit if glm else _limit(cfg.swiglu_limits, bound_at),
                                 shared_limit=cfg.swiglu_limit if glm else _limit(cfg.swiglu_limits_shared, bound_at),
                                 shared_gate=cfg.shared_expert_gated,
                                 implementation=None if cfg.moe_implementation == "auto" else cfg.moe_implementation,
                                 split=cfg.moe_split, clamp_gate=glm,
                                 **kw)
        else:
            self.mlp = MLP(h, cfg.intermediate_size, limit=cfg.swiglu_limit, clamp_gate=glm, **kw)
        # glm5_next: manifold-constrained hyper-connections around the mixer and the MLP
        hc: dict[str, Any] = dict(sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                                  init_std=cfg.initializer_range, param_dtype=param_dtype, rngs=rngs)
        hyper = cfg.streams > 1
        self.attn_hc = ManifoldHyperConnection(h, cfg.streams, **hc) if hyper and glm else None
        self.ffn_hc = ManifoldHyperConnection(h, cfg.streams, **hc) if hyper and glm else None
        # qwen4_exp: gated residuals around the mixer and the MLP, a per-layer embedding on ple_layers
        gated = dict(combine=True, eps=cfg.rms_norm_eps, **kw)
        self.attn_hyper_connection = GatedResidual(h, cfg.streams, cfg.hc_lowrank, **gated) if qwen4 else None
        self.mlp_hyper_connection = GatedResidual(h, cfg.streams, cfg.hc_lowrank, **gated) if qwen4 else None
        with_ple = qwen4 and not full_attention and index in cfg.ple_layers
        self.ngram = ngram_hash(cfg, index) if with_ple else None
        self.ple = PerLayerEmbedding(
            h, cfg.streams, rows=self.ngram.rows, heads=(cfg.ngram_size - 1) * cfg.heads_per_ngram,
            embed_dim=cfg.ple_width, conv_kernel=cfg.ple_conv_kernel, dilation=cfg.ngram_size,
            eps=cfg.rms_norm_eps, **kw) if self.ngram is not None else None

    def _mix(self, x: jax.Array, rope: Rope, positions: jax.Array, cache: LayerCache | None,
             start: jax.Array, segments: jax.Array | None, lengths: jax.Array | None, history_every: int | None,
             ) -> tuple[jax.Array, LayerCache | None]:
        # the model builds each layer's cache entry for its mixer
        if isinstance(self.mixer, DeltaRuleMixer):
            assert cache is None or isinstance(cache, DeltaRuleState)
            return self.mixer(x, cache, segments, lengths, history_every)
        if isinstance(self.mixer, LatentAttention):
            assert cache is None or isinstance(cache, LatentCache | LatentStack)
            return self.mixer(x, rope, positions, cache, start, segments)
        if isinstance(self.mixer, HeadNormedAttention):
            assert cache is None or isinstance(cache, KVCache | KVStack | RingCache)
            # Lara 4 Mini's full-attention layers go without RoPE; a sliding window keeps its ring's
            # real tokens (lengths) and, for a prefix cache (history_every), the call's keys
            rope = rope if self.mixer.window is not None else None
            return self.mixer(x, rope, positions, cache, start, segments, lengths, history_every is not None)
        assert cache is None or isinstance(cache, KVCache | KVStack)
        return self.mixer(x, rope, positions, cache, start, segments)

    def _feed_forward(self, x: jax.Array) -> tuple[jax.Array, RouterStats | None]:
        if isinstance(self.mlp, SparseMoE):
            return self.mlp(x)
        return self.mlp(x), None

    def __call__(self, x: Any, rope: Rope, positions: jax.Array, cache: LayerCache | None,
                 start: jax.Array, segments: jax.Array | None = None, lengths: jax.Array | None = None,
                 history_every: int | None = None,
                 ) -> tuple[Any, LayerCache | None, RouterStats | None]:
        """x: the residual stream [B, T, hidden], or with hyper-connections a
        HyperState; returns (x after the layer, its new cache entry, router
        statistics of a MoE)."""
        mix = (rope, positions, cache, start, segments, lengths, history_every)
        if self.attn_hyper_connection is not None:
            assert isinstance(x, GatedStreams)  # the model passes streams to a layer with gated residuals
            return self._gated(x, *mix)
        if self.attn_hc is not None:
            assert isinstance(x, HyperState)  # the model passes streams to a layer with hyper-connections
            return self._hyper(x, *mix)
        if self.post_norm:
            h, new_cache = self._mix(x, *mix)
            x = constrain(x + self.post_attention_layernorm(h), HIDDEN)
            h, stats = self._feed_forward(x)
            return constrain(x + self.post_feedforward_layernorm(h), HIDDEN), new_cache, stats
        h, new_cache = self._mix(self.input_layernorm(x), *mix)
        x = constrain(x + h, HIDDEN)
        h, stats = self._feed_forward(self.post_attention_layernorm(x))
        return constrain(x + h, HIDDEN), new_cache, stats

    def _hyper(self, x: HyperState, rope: Rope, positions: jax.Array, cache: LayerCache | None, start: jax.Array,
               segments: jax.Array | None, lengths: jax.Array | None, history_every: int | None,
               ) -> tuple[HyperState, LayerCache | None, RouterStats | None]:
        """GLM-5-Next's layer: each block reads a mix of the streams and
        writes its output back into each (ManifoldHyperConnection); an
        indexed attention layer passes its selection on."""
        assert self.attn_hc is not None and self.ffn_hc is not None
        streams, selection = x
        post, comb, h = self.attn_hc(streams)
        h = self.input_layernorm(h)
        new_cache: LayerCache | None
        if isinstance(self.mixer, IndexedLatentAttention):
            assert cache is None or isinstance(cache, IndexedLatentCache)
            h, new_cache, selection = self.mixer(h, rope, positions, cache, start, selection, segments)
        else:
            h, new_cache = self._mix(h, rope, positions, cache, start, segments, lengths, history_every)
        streams = ManifoldHyperConnection.combine(post, comb, h, streams)
        post, comb, h = self.ffn_hc(streams)
        h, stats = self._feed_forward(self.post_attention_layernorm(h))
        return HyperState(ManifoldHyperConnection.combine(post, comb, h, streams), selection), new_cache, stats

    def _gated(self, x: GatedStreams, rope: Rope, positions: jax.Array, cache: LayerCache | None,
               start: jax.Array, segments: jax.Array | None, lengths: jax.Array | None, history_every: int | None,
               ) -> tuple[GatedStreams, LayerCache | None, RouterStats | None]:
        """Qwen4-Exp's layer: the per-layer embedding (if any) added to the
        streams, then each block reads a gated mix of them and writes its
        output into each at its injection weight (GatedResidual)."""
        assert self.attn_hyper_connection is not None and self.mlp_hyper_connection is not None
        streams, tokens = x
        ple: dict[str, Any] = {}
        if self.ple is not None:
            assert self.ngram is not None and (cache is None or isinstance(cache, DeltaRuleState))
            stored = None if cache is None else cache.ple_context  # tokens + 1; 0 before the start
            context = None if stored is None else jnp.where(stored == 0, self.ngram.eos, stored - 1)
            # hashed whole along the sequence (running maxima over it; cheap), then split as the streams are
            whole = ("batch", None)
            ids = self.ngram.device_ids(constrain(tokens, whole), context,
                                        None if segments is None else constrain(segments, whole))
            added, window = self.ple(streams, constrain(ids, ("batch", "length", None)),
                                     None if cache is None else cache.ple_conv, segments)
            streams = streams + added
            if cache is not None:
                assert cache.ple_conv is not None and stored is not None
                ple = self._ple_states(window, jnp.concatenate([stored, tokens.astype(jnp.int32) + 1], axis=1),
                                       cache, lengths, history_every)
        h, weights = self.attn_hyper_connection(streams)
        assert weights is not None  # a combining GatedResidual gives them
        new_cache: LayerCache | None
        if isinstance(self.mixer, IndexedGatedAttention):
            assert cache is None or isinstance(cache, IndexedKVCache)
            h, new_cache = self.mixer(h, rope, positions, cache, start, segments)
        else:
            h, new_cache = self._mix(h, rope, positions, cache, start, segments, lengths, history_every)
        if ple:
            assert isinstance(new_cache, DeltaRuleState)
            history = ple.pop("history")
            new_cache = new_cache._replace(**ple, history=None if new_cache.history is None
                                           else new_cache.history._replace(**history))
        streams = GatedResidual.inject(streams, h, weights)
        h, weights = self.mlp_hyper_connection(streams)
        h, stats = self._feed_forward(h)
        assert weights is not None  # a combining GatedResidual gives them
        return GatedStreams(GatedResidual.inject(streams, h, weights), tokens), new_cache, stats

    def _ple_states(self, window: jax.Array, seen: jax.Array, cache: DeltaRuleState, lengths: jax.Array | None,
                    history_every: int | None) -> dict[str, Any]:
        """The per-layer embedding's state fields after the call (and at
        every `history_every` tokens, as the mixer's history): from its
        convolution's inputs after the incoming state (window) and the
        tokens + 1 after the incoming context (seen), at each row's last
        real token (lengths) or the call's end."""
        assert self.ple is not None and cache.ple_conv is not None and cache.ple_context is not None
        b, t = seen.shape[0], window.shape[1] - self.ple.state_length
        size, context = self.ple.state_length, cache.ple_context.shape[-1]
        ends = jnp.full((b, 1), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)[:, None]
        out: dict[str, Any] = dict(ple_conv=states_at(window, ends, size)[:, 0].astype(cache.ple_conv.dtype),
                                   ple_context=states_at(seen, ends, context)[:, 0], history={})
        if history_every is not None:
            every = jnp.arange(1, t // history_every + 1, dtype=jnp.int32) * history_every
            every = jnp.broadcast_to(every, (b, every.shape[0]))
            out["history"] = dict(ple_conv=states_at(window, every, size).astype(cache.ple_conv.dtype),
                                  ple_context=states_at(seen, every, context))
        return out


class MultiTokenPredictor(nnx.Module):
    """The multi-token prediction module (Qwen3-Next's and Qwen3.5's mtp.*,
    Ling 3's layer after the decoder's: enorm, hnorm, eh_proj, the layer,
    shared_head.norm): the normed embedding of the next token and the normed
    final hidden state, concatenated through fc (2H -> H), then one of
    `mtp_num_layers` full-attention decoder layers (the k-th draft's), a
    final norm; the model's head gives the logits of the token after the
    next."""

    def __init__(self, cfg: ModelConfig, *, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs):
        h, norm = cfg.hidden_size, _norm(cfg)
        self.pre_fc_norm_embedding = norm(h, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.pre_fc_norm_hidden = norm(h, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.fc = linear(2 * h, h, dtype, param_dtype, cfg.initializer_range, rngs)
        # each layer with the MLP kind of the model's last layer (a MoE model's module routes too)
        self.layers = nnx.List([DecoderLayer(cfg, cfg.num_hidden_layers - 1, dtype=dtype, param_dtype=param_dtype,
                                             rngs=rngs, full_attention=True) for _ in range(cfg.mtp_num_layers)])
        self.norm = norm(h, eps=cfg.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, hidden: jax.Array, next_embedded: jax.Array, rope: Rope, positions: jax.Array,
                 step: int = 0, segments: jax.Array | None = None, cache: KVCache | LatentCache | None = None,
                 start: jax.Array | None = None) -> tuple[jax.Array, LayerCache | None]:
        """Normed output [B, T, H] from the final hidden states [B, T, H] at
        `positions` (or the previous step's output) and the embeddings of
        each position's next token, and the step-th layer's new cache (with
        one: its keys and values, the call's written from `start` [B]);
        segments [B, T]: packed documents."""
        x = jnp.concatenate([self.pre_fc_norm_embedding(next_embedded), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x, new, _ = self.layers[step](self.fc(x), rope, positions, cache,
                                      jnp.zeros((), jnp.int32) if start is None else start, segments)
        return self.norm(x), new


def _limit(limits: list[float] | None, index: int) -> float | None:
    """Layer `index`'s SwiGLU bound from a per-layer list (0 or none: unbounded)."""
    return limits[index] or None if limits else None


def _rotary_dim(cfg: ModelConfig) -> int:
    """The features RoPE turns: latent attention's shared key part, or the
    partial_rotary_factor share of a head."""
    if cfg.attention_kind == "latent":
        return cfg.qk_rope_head_dim
    return rotary_dim(cfg.head_dim, cfg.partial_rotary_factor)


def delta_rule_options(cfg: ModelConfig, platform: str | None = None) -> DeltaRuleOptions:
    """The GDN op's settings from the model config. gdn_implementation auto
    leaves the choice to the op (kernel where a compiled one exists, xla on
    CPU); a kernel named on a CPU runs in interpret mode, with a warning."""
    name = cfg.gdn_implementation
    if (platform or jax.default_backend()) == "cpu" and name in KERNEL_PLATFORMS:
        warnings.warn(f"gdn_implementation={name} on CPU: the kernel runs in interpret mode (slow; for checking "
                      f"numerics); auto runs the XLA path here.", stacklevel=3)
    return DeltaRuleOptions(
        implementation=None if name == "auto" else name, chunk_size=cfg.gdn_chunk_size,
        state_dtype=jnp.dtype(cfg.gdn_state_dtype), decay_dtype=jnp.dtype(cfg.gdn_decay_dtype),
        residuals=cfg.gdn_residuals, matmul_dtype=cfg.gdn_matmul_dtype, interpret=cfg.gdn_interpret)


def attention_kernel(cfg: ModelConfig, platform: str | None = None) -> Splash | None:
    """The splash kernel for attention over whole sequences, or None (the
    plain path): auto takes it on a TPU; splash named on a CPU runs in
    interpret mode, with a warning."""
    name, platform = cfg.attention_implementation, platform or jax.default_backend()
    if name == "xla" or (name == "auto" and platform != "tpu"):
        return None
    if platform == "cpu" and cfg.attention_interpret is None:
        warnings.warn("attention_implementation=splash on CPU: the kernel runs in interpret mode (slow; for "
                      "checking numerics); auto runs the plain path here.", stacklevel=3)
    return Splash(interpret=cfg.attention_interpret)


def check_platform(cfg: ModelConfig, platform: str | None = None) -> None:
    """Refuse, before any work, GDN and MoE settings this machine cannot run."""
    platform = platform or jax.default_backend()
    if cfg.num_experts and cfg.moe_implementation != "auto":
        grouped_matmul.resolve(cfg.moe_implementation, platform, "model.moe_implementation")
    if cfg.gdn_interpret is False and platform == "cpu":
        raise ValueError("model.gdn_interpret: false compiles the Pallas kernel for a TPU or GPU, and this "
                          "machine has neither; leave it unset (interpret mode on CPU)")
    if cfg.attention_implementation == "splash" and platform not in ("tpu", "cpu"):
        raise ValueError(f"model.attention_implementation: splash is a TPU kernel and this is {platform}; use auto "
                         "or xla")
    if cfg.attention_interpret is False and platform == "cpu":
        raise ValueError("model.attention_interpret: false compiles the splash kernel for a TPU, and this machine "
                         "has none; leave it unset (interpret mode on CPU)")


def for_target(model_cfg: Any, platform: str) -> Any:
    """The model config as the target runs it: `auto` takes the Pallas
    kernel the platform ("tpu" or "cuda") would pick, compiled rather than
    interpreted; refused when the config cannot run there."""
    if model_cfg.gdn_implementation == "auto":
        kernel = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
        model_cfg = model_cfg.model_copy(update={"gdn_implementation": kernel, "gdn_interpret": False})
    if model_cfg.attention_implementation == "auto":
        model_cfg = model_cfg.model_copy(update={"attention_implementation": "splash" if platform == "tpu" else "xla"})
    if model_cfg.attention_implementation == "splash" and platform == "tpu":
        model_cfg = model_cfg.model_copy(update={"attention_interpret": False})
    if model_cfg.num_experts:
        model_cfg = model_cfg.model_copy(update={"moe_implementation": grouped_matmul.resolve(
            model_cfg.moe_implementation, platform, "model.moe_implementation")})
    check_platform(model_cfg, platform)
    return model_cfg


def _run_layer(layer, *args):
    return layer(*args)


def _quantize(layer: DecoderLayer, cfg: ModelConfig) -> None:
    """Hold the layer's projections and routed experts quantized as the
    config says (gdnx.quantization), all but the routers and shared
    experts' gates."""
    block = (cfg.quantize_block[0], cfg.quantize_block[1])
    for path, module in nnx.iter_modules(layer):
        if isinstance(module, SparseMoE) or (
                isinstance(module, Linear) and path and path[-1] not in quantization.KEPT):
            module.quantize(cfg.quantize, block, cfg.quantize_activations)


def _stack(layers: list[DecoderLayer]) -> DecoderLayer:
    """One layer module whose parameters stack those of `layers` (alike in
    kind) on a new leading dim."""
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def _remat_policy(name: str):
    if name == "save_gdn_residuals":
        return jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES)
    return None  # "full": recompute everything in the layer


class CausalLM(nnx.Module):
    """A GDN hybrid causal LM of any family. `model(tokens)` -> logits [B, T, vocab];
    `model.forward(tokens, cache)` also carries a generation cache and
    returns the load-balancing loss."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None, seed: int = 0,
                 adapters: AdapterSpec | None = None):
        rngs = rngs or nnx.Rngs(seed)
        self.config = config
        dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                      embedding_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)
        layers = [DecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                  for i in range(config.num_hidden_layers)]
        # LoRA adapters (nnx.LoRAParam) beside the targeted projections, from
        # a stream of their own: the base weights are those of the same seed
        self.adapters = adapters
        if adapters is not None:
            adapter_rngs = nnx.Rngs(jax.random.fold_in(jax.random.key(seed), 0x10AA))
            if not sum(add_adapters(layer, adapters, param_dtype=param_dtype, rngs=adapter_rngs)
                       for layer in layers):
                raise ValueError(f"train.lora.targets: none of {sorted(adapters.targets)} is in this model")
        if config.quantize != "none":
            for layer in layers:
                _quantize(layer, config)
        if config.scanned:
            # Built as the unrolled stack (the same initial values), then
            # stacked per position in the cycle; the layers before the first
            # cycle (head) and after the last full one (tail) stay unrolled.
            head, cycle = config.layer_head, config.layer_cycle
            end = head + config.cycle_repeats * cycle
            self.head = nnx.List(layers[:head])
            self.cycle = nnx.List([_stack(layers[head + j:end:cycle]) for j in range(cycle)])
            self.tail = nnx.List(layers[end:])
        else:
            self.layers = nnx.List(layers)
        # Qwen4-Exp ends with a gated mix of its streams, normed per stream, and no final norm
        qwen4 = config.family == "qwen4_exp"
        self.norm = None if qwen4 else _norm(config)(config.hidden_size, eps=config.rms_norm_eps,
                                                     param_dtype=param_dtype)
        self.hyper_connection_mixer = GatedResidual(
            config.hidden_size, config.streams, config.hc_lowrank, combine=False, eps=config.rms_norm_eps,
            init_std=config.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs) if qwen4 else None
        self.lm_head = None if config.tie_word_embeddings else linear(
            config.hidden_size, config.vocab_size, dtype, param_dtype, config.initializer_range, rngs)
        self.mtp = MultiTokenPredictor(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs) \
            if config.mtp_num_layers else None
        if self.mtp is not None and adapters is not None and adapters.mtp:
            mtp_rngs = nnx.Rngs(jax.random.fold_in(jax.random.key(seed), 0x17B))
            for layer in self.mtp.layers:
                add_adapters(layer, adapters, param_dtype=param_dtype, rngs=mtp_rngs)
        if self.mtp is not None and config.quantize != "none":
            for layer in self.mtp.layers:
                _quantize(layer, config)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None,
                        **config_overrides: Any) -> "CausalLM":
        """Load a Hugging Face directory (config.json + safetensors) of any
        family gdnx builds (its model_type says which: qwen3_next, qwen3_5,
        qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, olmo_hybrid); keyword
        arguments override config fields (e.g. gdn_implementation="xla").

        mesh: every parameter is created sharded on it (gdnx.parallel's
        layout), each device reading its part of the files, so no host or
        device holds a whole copy of a sharded parameter. Without one, the
        parameters are whole on the default device."""
        from gdnx.checkpoints.hf import load_pretrained

        placement = None if mesh is None else lambda params, cfg: shardings(params, cfg, mesh)
        return load_pretrained(cls, path, placement=placement, **config_overrides)

    def save_pretrained(self, path: str | os.PathLike, *, fp8_layout: bool = False,
                        vision_from: str | os.PathLike | None = None) -> None:
        """Write config.json + safetensors in the family's own layout, which
        transformers loads; fp8_layout: a model held in fp8 as published FP8
        checkpoints store it (quantized weights are otherwise written
        dequantized); vision_from: a GLM-5-Next or Qwen4-Exp
        vision-language checkpoint whose vision tower the export carries."""
        from gdnx.checkpoints.hf import save_pretrained

        save_pretrained(self, path, fp8_layout=fp8_layout, vision_from=vision_from)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.forward(tokens).logits

    def _embed(self, tokens):
        if current_mesh() is None:
            return self.embed_tokens(tokens)
        # On a mesh: gather from the whole table (FSDP all-gathers it anyway;
        # XLA's partitioner otherwise replicates the gather's result to reshard
        # it), and an Explicit mesh wants the result's placement stated.
        table = constrain(self.embed_tokens.embedding[...], (None, None))
        place = out_sharding(HIDDEN, (*tokens.shape, self.config.hidden_size))
        x = table[tokens] if place is None else table.at[tokens].get(out_sharding=place)
        return constrain(x.astype(self.embed_tokens.dtype), HIDDEN)

    def forward(self, tokens: jax.Array, cache: Cache | None = None, segments: jax.Array | None = None,
                ) -> ModelOutput:
        """Logits [B, T, vocab] (float32), the new cache (with a cache) and the
        load-balancing loss. segments [B, T] (int): the document of each token
        when a row packs several; every layer then keeps to each token's
        document (GDN state and conv window restart, attention masked,
        positions restart)."""
        out = self.hidden_states(tokens, cache, segments)
        return ModelOutput(self.logits(out.hidden), out.cache, out.aux_loss)

    def mtp_logits(self, tokens: jax.Array, step: int = 0) -> jax.Array:
        """Teacher-forced multi-token prediction: float32 [B, T - 1, vocab],
        position t's logits of token t + 2 from the final hidden state at t
        and the embedding of token t + 1 (through the module's step-th
        layer)."""
        if self.mtp is not None and not 0 <= step < self.config.mtp_num_layers:
            raise ValueError(f"step: the multi-token prediction module has {self.config.mtp_num_layers} layers "
                             f"(model.mtp_num_layers), got {step}")
        return self.logits(self.mtp_hidden(self.hidden_states(tokens).hidden, tokens, depths=step + 1)[step])

    def mtp_hidden(self, hidden: jax.Array, tokens: jax.Array, segments: jax.Array | None = None,
                   depths: int | None = None) -> list[jax.Array]:
        """The multi-token prediction module's normed outputs, chained: the
        k-th [B, T - 1 - k, H] at position t from the k-th layer over the
        previous output (the model's final hidden states [B, T, H] first) and
        the embedding of token t + k + 1: the head on it predicts token
        t + k + 2. depths: the first that many (default: all)."""
        if self.mtp is None:
            raise ValueError("model.mtp_num_layers: this model has no multi-token prediction module (0)")
        cfg = self.config
        out = []
        # every depth runs over the row's whole length, the next tokens padded past its end: the module's
        # layers are causal and position-wise, so the first T - 1 - k positions are those of the shorter
        # sequence, and the attention keeps the length the splash kernel takes (a multiple of 128)
        n = tokens.shape[1]
        positions = jnp.arange(n, dtype=jnp.int32)
        rope = None if cfg.rope_theta is None else rope_tables(
            positions[None] if segments is None else document_positions(segments), _rotary_dim(cfg), cfg.rope_theta)
        for k in range(cfg.mtp_num_layers if depths is None else depths):
            following = jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1)))
            hidden, _ = self.mtp(hidden, self._embed(following), rope, positions, k, segments)
            out.append(hidden[:, :n - 1 - k])
        return out

    def mtp_extend(self, hidden: jax.Array, next_tokens: jax.Array, cache: KVCache | LatentCache,
                   start: jax.Array) -> tuple[jax.Array, KVCache | LatentCache]:
        """The multi-token prediction module's first layer over T positions
        of each row from start [B], with its own cache (a serving engine's
        drafter): position t from the final hidden state at t (or the
        module's output at t - 1, chaining) and next_tokens [B, T], the
        token at t + 1. Returns its normed outputs [B, T, H] (the head on
        one predicts the token at t + 2) and the cache with the T
        positions' keys and values written."""
        if self.mtp is None:
            raise ValueError("model.mtp_num_layers: this model has no multi-token prediction module (0)")
        cfg = self.config
        positions = start[:, None] + jnp.arange(next_tokens.shape[1], dtype=jnp.int32)
        rope = None if cfg.rope_theta is None else rope_tables(positions, _rotary_dim(cfg), cfg.rope_theta)
        out, new = self.mtp(hidden, self._embed(next_tokens), rope, positions, 0, None, cache, start)
        assert isinstance(new, KVCache | LatentCache)
        return out, new

    def logits(self, hidden: jax.Array) -> jax.Array:
        """The LM head on final hidden states [B, T, hidden]: float32 [B, T, vocab]."""
        vocab = out_sharding(("batch", "length", "vocab"), (*hidden.shape[:2], self.config.vocab_size))
        if self.lm_head is None:
            logits = self.embed_tokens.attend(hidden, out_sharding=vocab)
        else:
            logits = self.lm_head(hidden, out_sharding=vocab)
        return logits.astype(jnp.float32)

    def hidden_states(self, tokens: jax.Array, cache: Cache | None = None, segments: jax.Array | None = None, *,
                      lengths: jax.Array | None = None, history_every: int | None = None) -> HiddenOutput:
        """As forward, with the final (normed) hidden states [B, T, hidden] in
        place of the logits: what a loss computed in blocks (gdnx.loss) takes.

        For a serving engine, with a cache whose length is per row ([B]):
        lengths [B] counts each row's real tokens (the rest is padding that
        leaves every state as it was and is not added to the cache length),
        and history_every keeps the GDN layers' states after every that many
        tokens in their new state's history (DeltaRuleState.history)."""
        if not hasattr(tokens, "ndim") or tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens: expected integer token ids [B, T], got "
                            f"{getattr(tokens, 'dtype', type(tokens).__name__)} {getattr(tokens, 'shape', '')}")
        cfg = self.config
        t = tokens.shape[1]
        start = jnp.zeros((), jnp.int32) if cache is None else cache.length
        # [T], or [B, T] when each row of the cache is at its own length
        positions = start[..., None] + jnp.arange(t, dtype=jnp.int32)
        if segments is not None and cache is not None:
            raise ValueError("segments: packed documents are for training and scoring; generation takes none")
        if (lengths is not None or history_every is not None) and (cache is None or cache.length.ndim != 1):
            raise ValueError("lengths, history_every: apply to a cache with a length per row (Cache.init per_row)")
        if segments is not None and segments.shape != tokens.shape:
            raise ValueError(f"segments: expected the shape of tokens {tuple(tokens.shape)}, "
                             f"got {tuple(segments.shape)}")
        rope = None if cfg.rope_theta is None else rope_tables(
            positions.reshape(-1, t) if segments is None else document_positions(segments), _rotary_dim(cfg),
            cfg.rope_theta)
        x = self._embed(constrain(tokens, ("batch", "length")))
        if self.hyper_connection_mixer is not None:
            x = GatedStreams(expand_streams(x, cfg.streams).reshape(*x.shape[:-1], -1), tokens)
        elif cfg.streams > 1:
            x = HyperState(expand_streams(x, cfg.streams), self._no_selection(tokens, positions, cache, segments))
        run = _run_layer
        if cfg.remat_policy != "none" and cache is None:  # remat is for training; decoding keeps nothing
            run = nnx.remat(_run_layer, policy=_remat_policy(cfg.remat_policy))

        def through(layers, x, caches):
            """x through `layers` in turn: (x, their new caches, router stats)."""
            new, stats = [], []
            for layer, layer_cache in zip(layers, caches, strict=True):
                x, layer_cache, s = run(layer, x, rope, positions, layer_cache, start, segments, *serving)
                new.append(layer_cache)
                if s is not None:
                    stats.append(s)
            return x, tuple(new), stats

        serving = () if lengths is None and history_every is None else (lengths, history_every)
        caches = list(cache.layers) if cache is not None else [None] * self._cache_slots()
        if not cfg.scanned:
            x, new_layers, stats = through(self.layers, x, caches)
        else:
            x, new_layers, stats = self._scan(through, x, caches)
        new_cache = None if cache is None else Cache(new_layers, cache.length + (t if lengths is None else lengths))
        if isinstance(x, HyperState):
            x = stream_mean(x.streams)
        if isinstance(x, GatedStreams):
            assert self.hyper_connection_mixer is not None
            x, _ = self.hyper_connection_mixer(x.streams)
        else:
            assert self.norm is not None
            x = self.norm(x)
        return HiddenOutput(x, new_cache, load_balancing_loss(stats, cfg.num_experts))

    def _no_selection(self, tokens: jax.Array, positions: jax.Array, cache: Cache | None,
                      segments: jax.Array | None) -> Selection:
        """The selection before the first indexed layer: none, shaped as the
        indexed layers' (the best of the context's pools, up to the budget)."""
        cfg = self.config
        b, t = tokens.shape
        context = t if cache is None else cache.max_length
        n = min(cfg.index_topk // cfg.index_kpool, context // cfg.index_kpool)
        empty = Selection(jnp.zeros((b, t, n), jnp.int32), jnp.zeros((b, t, n), bool),
                          jnp.broadcast_to(positions.reshape(-1, t), (b, t)))
        if segments is None:
            return empty
        # packed rows: the indexed layers' selections carry their blocks' first slots and the documents' positions
        return empty._replace(starts=jnp.zeros((b, context // cfg.index_kpool), jnp.int32),
                              q_doc=jnp.zeros((b, t), jnp.int32))

    def _cache_slots(self) -> int:
        """Entries of a Cache: one per layer, or per head layer, cycle
        position and tail layer when scanned."""
        return len(self.head) + len(self.cycle) + len(self.tail) if self.config.scanned else len(self.layers)

    def _scan(self, through, x, caches):
        """The head's layers, the cycle's under one scan over its repeats
        (each repeat's parameters sliced from the stacked ones), then the
        tail's. The cycle's stacked caches ride in the scan's carry, each
        repeat's entry read at its index and written back there, so a
        decode step updates them in place (as scan outputs they would be
        written into a fresh stack every step)."""
        head, cycle = len(self.head), len(self.cycle)
        x, new_head, head_stats = through(self.head, x, caches[:head])
        caches = caches[head:]
        graphdef, stacked = nnx.split(self.cycle)
        held = None if caches[0] is None else tuple(caches[:cycle])

        def body(carry, xs):
            x, held = carry
            params, index = xs
            layer_caches = [None] * cycle if held is None else [entry_at(h, index) for h in held]
            with fold_dropout(index):  # each repeat draws its own LoRA dropout masks
                x, new, stats = through(nnx.merge(graphdef, params), x, layer_caches)
            if held is None:
                return (x, None), (None, stats)
            new = [unstacked(n) for n in new]  # attention wrote its positions into the stack itself
            kept, extra = zip(*(split_entry(n, h) for n, h in zip(new, held, strict=True)), strict=True)
            held = tuple(written(h, k, index) for h, k in zip(held, kept, strict=True))
            return (x, held), (tuple(extra), stats)

        indices = jnp.arange(self.config.cycle_repeats, dtype=jnp.int32)
        (x, held), (extras, cycle_stats) = jax.lax.scan(body, (x, held), (stacked, indices))
        new_cycle = [None] * cycle if held is None else [
            join_entry(h, e) for h, e in zip(held, extras, strict=True)]
        # the repeats' router statistics, pooled as the loss pools layers
        stats = [RouterStats(*(jnp.sum(f, axis=0) for f in s)) for s in cycle_stats]
        x, new_tail, tail_stats = through(self.tail, x, caches[cycle:])
        return x, (*new_head, *new_cycle, *new_tail), head_stats + stats + tail_stats


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of CausalLM(cfg), counted on a model of one layer of each
    kind (mixer, MoE or dense MLP) and multiplied out: building every layer,
    even abstractly, takes time that grows faster than the depth."""
    kinds = list(cfg.layer_kinds)
    unique = list(dict.fromkeys(kinds))
    mixers = [t.split("/") for t, _ in unique]
    small = cfg.model_copy(update={
        "num_hidden_layers": len(unique), "layer_types": [m[0] for m in mixers], "scan_layers": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [i for i, (_, moe) in enumerate(unique) if not moe],
        "indexer_types": ["shared" if "shared" in m else "full" for m in mixers],
        "ple_layers": [i for i, m in enumerate(mixers) if any(x.startswith("ple") for x in m)]})
    state = jax.eval_shape(lambda: nnx.state(CausalLM(small), nnx.Param))
    per_kind = [0] * len(unique)
    rest = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if getattr(path[0], "key", None) == "layers":
            per_kind[path[1].key] += leaf.size
        else:
            rest += leaf.size
    return rest + sum(per_kind[unique.index(k)] for k in kinds)
