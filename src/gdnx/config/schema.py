"""The run configuration: pydantic models, validated field by field.

`ModelConfig` is the architecture (Hugging Face field names, so a
checkpoint's config.json maps onto it; `family` says which of the GDN
hybrids it builds) plus the GDN knobs; `TrainConfig`
and `DataConfig` drive `gdnx train`. Unknown keys are errors everywhere.
"""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator

from gdnx.ops.checks import float_dtype
from gdnx.ops.grouped_matmul import IMPLEMENTATIONS as GROUPED_MATMUL_IMPLEMENTATIONS
from gdnx.ops.delta_rule.options import (
    CHUNK_IMPLEMENTATIONS,
    CHUNK_SIZES,
    DEFAULTS,
    KERNEL_PLATFORMS,
    RESIDUAL_POLICIES,
    Implementation,
    ResidualPolicy,
)

LAYER_TYPES = ("linear_attention", "full_attention", "sliding_attention")
# qwen3_next: Qwen3-Next; qwen3_5: Qwen3.5, dense (num_experts 0) or MoE;
# olmo_hybrid: OLMo Hybrid; kimi_linear: Kimi Linear (KDA and latent
# attention); bailing_hybrid: Ling 3 (KDA with the bounded gate, latent
# attention with RoPE and a head gate); lara_mini: Lara 4 Mini (GDN,
# sliding-window and full attention); glm5_next: GLM-5-Next (KDA with the
# bounded gate, latent attention without RoPE reading the tokens a sparse
# indexer picks, hyper-connection streams); qwen4_exp: Qwen4-Exp (GDN with a
# selectable output gate, gated attention reading the tokens a block-pooled
# indexer picks, gated-residual streams, hashed n-gram per-layer
# embeddings). docs/model.md has what differs between them.
Family = Literal["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "lara_mini", "glm5_next",
                 "qwen4_exp"]
# the families whose linear-attention layers are KDA and whose full attention is latent attention
KDA_FAMILIES = ("kimi_linear", "bailing_hybrid", "glm5_next")
FAMILIES: tuple[str, ...] = get_args(Family)
# depth from which scan_layers: null scans the stack
SCAN_MIN_LAYERS = 8
# The GDN op's choices, from the op itself
_CHOICES = {"gdn_implementation": ("auto", *CHUNK_IMPLEMENTATIONS), "gdn_chunk_size": CHUNK_SIZES,
            "gdn_residuals": RESIDUAL_POLICIES, "moe_implementation": ("auto", *GROUPED_MATMUL_IMPLEMENTATIONS)}


def _numeric(annotation: Any) -> bool:
    """Whether a field's type admits an int or a float (but not a bool)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _numeric(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        return bool not in args and any(_numeric(a) for a in args)
    return annotation in (int, float)


class _Strict(BaseModel):
    # infinities and NaN are never meant; a bool is not a number (YAML's
    # `true` would otherwise pass as 1)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v, info):
        if isinstance(v, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(v).lower()}")
        return v


class ModelConfig(_Strict):
    """A GDN hybrid's architecture and the GDN knobs."""

    # the weights to start training from: a Hugging Face directory or a gdnx
    # run (its newest intact checkpoint), whose architecture this config holds
    init_from: str | None = None
    family: Family = "qwen3_next"
    vocab_size: PositiveInt = 151936
    hidden_size: PositiveInt = 2048
    num_hidden_layers: PositiveInt = 48
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu"] = "silu"
    initializer_range: PositiveFloat = 0.02
    # layer pattern: explicit layer_types, or every full_attention_interval-th layer is full attention
    full_attention_interval: PositiveInt = 4
    layer_types: list[Literal["linear_attention", "full_attention", "sliding_attention"]] | None = None
    # sliding_attention layers (lara_mini): each token sees itself and the
    # sliding_window - 1 tokens before it
    sliding_window: PositiveInt | None = None

    # gated full attention
    num_attention_heads: PositiveInt = 16
    num_key_value_heads: PositiveInt = 2
    head_dim: PositiveInt = 256
    attention_bias: bool = False
    rope_theta: PositiveFloat | None = 10000000.0  # None: no rotary embedding (olmo_hybrid allows it)
    partial_rotary_factor: float = Field(0.25, gt=0.0, le=1.0)
    max_position_embeddings: PositiveInt = 262144

    # Multi-head latent attention (the KDA families' full_attention layers): keys
    # and values from a compressed latent of kv_lora_rank features plus a
    # rope part of qk_rope_head_dim shared by every head; the query through a
    # q_lora_rank bottleneck, or none (null)
    kv_lora_rank: PositiveInt = 512
    q_lora_rank: PositiveInt | None = None
    qk_nope_head_dim: PositiveInt = 128
    qk_rope_head_dim: int = Field(64, ge=0)  # 0: no rope part (glm5_next)
    v_head_dim: PositiveInt = 128
    # calls with a cache and few queries (decode, verify; a prefill while it
    # costs fewer FLOPs) attend over the cached latents with kv_b_proj folded
    # into the query and output (DeepSeek's); false always expands keys and
    # values from the latents
    mla_absorb: bool = True

    # Sparse attention. glm5_next (DeepSeek's DSA over k-pools): per query, an
    # indexer of index_n_heads x index_head_dim scores every complete pool of
    # index_kpool tokens and the attention reads the index_topk / index_kpool
    # best pools plus (index_kpool_always_select_tail) the query's unfinished
    # one; a "shared" layer (indexer_types; null: every layer "full") reads the
    # tokens the last "full" layer picked. qwen4_exp (QSA): the same budget
    # over blocks of index_kpool tokens, keys mean-pooled, one key head
    index_topk: PositiveInt = 2048
    index_kpool: PositiveInt = 16
    index_n_heads: PositiveInt = 32
    index_head_dim: PositiveInt = 128
    index_kpool_always_select_tail: bool = True
    indexer_types: list[Literal["full", "shared"]] | None = None
    # Hyper-connections: hc_mult residual streams. glm5_next's are mixed by a
    # matrix of hc_sinkhorn_iters Sinkhorn-Knopp steps; qwen4_exp's blocks
    # read them through a gate of rank hc_lowrank
    hc_mult: PositiveInt = 4
    hc_eps: PositiveFloat = 1e-6
    hc_sinkhorn_iters: PositiveInt = 20
    hc_lowrank: PositiveInt = 320
    # qwen4_exp's per-layer embeddings (PLE) on the linear_attention layers
    # ple_layers (0-based): per token, its 2..ngram_size-grams within its
    # document hashed into heads_per_ngram tables per order (each a prime
    # number of rows from ngram_vocab_base on, all padded to a multiple of
    # ngram_rows_multiple; multipliers from ngram_seed), ple_embed_dim
    # features in all (null: hidden_size), a dilated convolution of
    # ple_conv_kernel taps; checkpoints store each table in
    # ngram_split_parts pieces
    ple_layers: list[int] = []
    ple_embed_dim: PositiveInt | None = None
    ple_conv_kernel: PositiveInt = 4
    ngram_size: int = Field(3, ge=2)
    heads_per_ngram: PositiveInt = 8
    ngram_vocab_base: PositiveInt = 20_000_000
    ngram_rows_multiple: PositiveInt = 128
    ngram_seed: int = 1234
    ngram_split_parts: PositiveInt = 512
    # qwen4_exp's GDN output gate on the normed output
    linear_output_gate: Literal["silu", "sigmoid"] = "silu"
    # glm5_next's SwiGLUs (dense and experts): gate capped at it before the
    # activation, up clipped to [-it, it]; null: unbounded
    swiglu_limit: PositiveFloat | None = None

    # Gated DeltaNet, or KDA (KDA_FAMILIES; key and value heads alike)
    linear_num_key_heads: PositiveInt = 16
    linear_num_value_heads: PositiveInt = 32
    linear_key_head_dim: PositiveInt = 128
    linear_value_head_dim: PositiveInt = 128
    linear_conv_kernel_dim: int = Field(4, ge=2)
    linear_allow_neg_eigval: bool = False  # beta = 2 sigmoid(b), in [0, 2]: negative transition eigenvalues
    # KDA's gate: null, Kimi's -exp(A_log) softplus(f + dt_bias); a negative
    # bound, Ling's lower_bound * sigmoid(exp(A_log) (f + dt_bias))
    linear_gate_lower_bound: float | None = Field(None, lt=0.0)

    # MLP: dense SwiGLU, or sparse MoE with a shared expert (num_experts > 0)
    intermediate_size: PositiveInt = 5120
    num_experts: int = Field(512, ge=0)
    num_experts_per_tok: PositiveInt = 10
    moe_intermediate_size: PositiveInt = 512
    shared_expert_intermediate_size: PositiveInt = 512
    norm_topk_prob: bool = True
    # the KDA families' router: sigmoid scores with a per-expert correction bias
    # for the choice, top-k within the topk_group best of n_group groups of
    # experts, the weights (renormalised with norm_topk_prob) times
    # routed_scaling_factor; its shared expert has no gate
    n_group: PositiveInt = 1
    topk_group: PositiveInt = 1
    routed_scaling_factor: PositiveFloat = 1.0
    # bailing_hybrid: per layer, a bound on the SwiGLU of the routed experts
    # (swiglu_limits) and of the shared expert (swiglu_limits_shared): silu(gate)
    # capped at it, up clipped to [-it, it]; 0 or null: unbounded
    swiglu_limits: list[Annotated[float, Field(ge=0.0)]] | None = None
    swiglu_limits_shared: list[Annotated[float, Field(ge=0.0)]] | None = None
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: list[int] = Field(default_factory=list)
    router_aux_loss_coef: float = Field(0.001, ge=0.0)
    # the routed experts' grouped matmuls (gdnx.ops.grouped_matmul): auto takes the platform's
    moe_implementation: str = "auto"
    # how the tensor axis splits the routed experts: width (each device a slice of every expert's width), experts
    # (each device whole experts, a share of them), auto (experts where a width slice would not fill 128 lanes and
    # the axis divides the experts, else width; docs/sharding.md)
    moe_split: Literal["auto", "width", "experts"] = "auto"
    # multi-token prediction (Qwen3-Next's and Qwen3.5's mtp.*: config.json's mtp_num_hidden_layers; Ling 3's
    # layer after the decoder's, DeepSeek's layout: one): one module of fc over [normed embedding of the next
    # token | normed hidden state], then this many full-attention decoder layers (the k-th draft through the
    # k-th), a final norm and the model's head
    mtp_num_layers: int = Field(0, ge=0)

    # special tokens, carried to and from Hugging Face config.json
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    # GDN op knobs
    gdn_implementation: Literal["auto"] | Implementation = "auto"  # auto: the op's choice for the platform
    gdn_interpret: bool | None = None
    gdn_state_dtype: str = str(DEFAULTS.state_dtype)
    gdn_decay_dtype: str = str(DEFAULTS.decay_dtype)
    gdn_matmul_dtype: str | None = None
    gdn_chunk_size: int = DEFAULTS.chunk_size
    gdn_residuals: ResidualPolicy = DEFAULTS.residuals

    # attention over a whole sequence (training, a forward without a cache): splash, JAX's Pallas TPU
    # kernel (gdnx.layers.splash: no [T, T] scores in memory), or xla, the plain path; auto takes splash on a
    # TPU and xla elsewhere. attention_interpret: the kernel in Pallas interpret mode (null: on a CPU only)
    attention_implementation: Literal["auto", "xla", "splash"] = "auto"
    attention_interpret: bool | None = None

    # numerics and memory
    dtype: str = "float32"
    param_dtype: str = "float32"
    # weight-only quantization (gdnx.quantization): the projections and routed experts held as int8, int4
    # or float8_e4m3fn with a float32 factor per block of quantize_block ([rows, columns] of a Hugging Face
    # [out, in] matrix, as FP8 checkpoints' weight_block_size; int4 wants smaller, e.g. [1, 128]; a side past
    # the matrix's is all of it: [1, 1000000] is a factor per output row); products in `dtype`
    quantize: Literal["none", "int8", "int4", "fp8"] = "none"
    quantize_block: tuple[PositiveInt, PositiveInt] = (128, 128)
    # fp8 weights' products with the activations in float8 too, one factor per token and group of
    # quantize_block's columns (dynamic, from the activations' own absmax): fp8 tensor cores on H100/H200
    # (tokamax's kernel); inference only
    quantize_activations: Literal["none", "fp8"] = "none"
    remat_policy: Literal["none", "full", "save_gdn_residuals"] = "none"
    # the decoder stack under one scan over its repeating cycle of layers
    # (compile time flat in depth) or unrolled; null: scanned from
    # SCAN_MIN_LAYERS layers (docs/benchmarks.md has both at 4, 16, 48)
    scan_layers: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "use_gdn_kernel" in data:
            raise ValueError("use_gdn_kernel: renamed gdn_implementation; auto stays auto, false is xla, true is "
                             "the kernel by name (pallas_tpu or pallas_gpu)")
        return data

    @field_validator("gdn_state_dtype", "gdn_decay_dtype", "dtype", "param_dtype")
    @classmethod
    def _dtypes(cls, v, info):
        return float_dtype(v).name

    @field_validator("gdn_matmul_dtype")
    @classmethod
    def _matmul_dtype(cls, v, info):
        return None if v is None else float_dtype(v).name

    @field_validator(*_CHOICES, mode="before")
    @classmethod
    def _one_of(cls, v, info):
        choices = _CHOICES[info.field_name]
        if v not in choices:
            raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        # Fields of a kind of layer the model does not build are left alone: a
        # config that transformers loads (say, every layer dense through
        # mlp_only_layers with MoE fields at their defaults) loads here too.
        errors = []
        if self.mtp_num_layers and self.family not in ("qwen3_next", "qwen3_5", "bailing_hybrid"):
            errors.append(("mtp_num_layers", f"multi-token prediction modules are built for qwen3_next, qwen3_5 and "
                           f"bailing_hybrid, got family {self.family}"))
        if self.mtp_num_layers > 1 and self.family == "bailing_hybrid":
            errors.append(("mtp_num_layers", f"gdnx builds one of Ling 3's multi-token prediction layers (each "
                           f"carries its own norms and projection), got {self.mtp_num_layers}"))
        if self.quantize_activations != "none" and self.quantize != "fp8":
            errors.append(("quantize_activations", f"fp8 activations multiply fp8 weights: needs quantize=fp8, got "
                           f"quantize={self.quantize}"))
        used = set(self.resolved_layer_types)
        if "linear_attention" in used and self.linear_num_value_heads % self.linear_num_key_heads:
            errors.append(("linear_num_value_heads", f"must be a multiple of linear_num_key_heads="
                           f"{self.linear_num_key_heads}, got {self.linear_num_value_heads}"))
        if {"full_attention", "sliding_attention"} & used and self.num_attention_heads % self.num_key_value_heads:
            errors.append(("num_attention_heads", f"must be a multiple of num_key_value_heads="
                           f"{self.num_key_value_heads}, got {self.num_attention_heads}"))
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            errors.append(("layer_types", f"expected {self.num_hidden_layers} entries (num_hidden_layers), "
                           f"got {len(self.layer_types)}"))
        moe = any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        if moe and self.num_experts_per_tok > self.num_experts:
            errors.append(("num_experts_per_tok", f"must be <= num_experts={self.num_experts}, "
                           f"got {self.num_experts_per_tok}"))
        per_group = self.num_experts // self.n_group
        if moe and self.num_experts % self.n_group:
            errors.append(("n_group", f"must divide num_experts={self.num_experts}, got {self.n_group}"))
        elif moe and self.topk_group > self.n_group:
            errors.append(("topk_group", f"must be <= n_group={self.n_group}, got {self.topk_group}"))
        elif moe and self.topk_group < self.n_group and per_group < 2:
            errors.append(("n_group", f"groups are scored by their best two experts; {self.n_group} groups of "
                           f"{self.num_experts} experts hold {per_group}"))
        elif moe and self.num_experts_per_tok > self.topk_group * per_group:
            errors.append(("num_experts_per_tok", f"must be <= the {self.topk_group * per_group} experts of "
                           f"topk_group={self.topk_group} groups, got {self.num_experts_per_tok}"))
        if self.family == "glm5_next":
            errors += self._glm5_next_errors(used)
        if self.family == "qwen4_exp":
            errors += self._qwen4_exp_errors(used)
        elif self.ple_layers:
            errors.append(("ple_layers", f"per-layer embeddings are qwen4_exp's, not {self.family}'s"))
        if self.family != "qwen4_exp" and self.linear_output_gate != "silu":
            errors.append(("linear_output_gate", f"qwen4_exp's GDN chooses its output gate, {self.family}'s is "
                           "silu"))
        if self.family != "glm5_next" and self.swiglu_limit is not None:
            errors.append(("swiglu_limit", f"bounds the SwiGLUs of glm5_next only, not {self.family}'s"))
        if self.family in ("kimi_linear", "glm5_next") and self.rope_theta is not None:
            errors.append(("rope_theta", f"{self.family}'s latent attention has no rotary embedding; set it to "
                           f"null, got {self.rope_theta}"))
        if "sliding_attention" in used and self.family != "lara_mini":
            errors.append(("layer_types", f"sliding_attention layers are lara_mini's, not {self.family}'s"))
        if "sliding_attention" in used and self.sliding_window is None:
            errors.append(("sliding_window", "sliding_attention layers need a window (tokens each one sees)"))
        if self.family == "lara_mini" and self.rope_theta is None:
            errors.append(("rope_theta", "lara_mini's sliding-window layers rotate q and k; set a base (its "
                           "checkpoints' 10000.0)"))
        if self.family == "bailing_hybrid" and self.rope_theta is None:
            errors.append(("rope_theta", "bailing_hybrid's latent attention rotates its rope part; set a base "
                           "(its checkpoints' 6000000.0)"))
        if self.family != "bailing_hybrid" and (self.swiglu_limits or self.swiglu_limits_shared):
            errors.append(("swiglu_limits", f"bounds the SwiGLU of bailing_hybrid only, not {self.family}"))
        for name in ("swiglu_limits", "swiglu_limits_shared"):
            limits = getattr(self, name)
            if limits is not None and len(limits) != self.num_hidden_layers:
                errors.append((name, f"expected {self.num_hidden_layers} entries (num_hidden_layers), "
                               f"got {len(limits)}"))
        if self.family == "bailing_hybrid" and "linear_attention" in used and (
                self.linear_num_key_heads != self.num_attention_heads):
            errors.append(("linear_num_key_heads", f"bailing_hybrid's KDA layers have its {self.num_attention_heads} "
                           f"attention heads (num_attention_heads), got {self.linear_num_key_heads}"))
        if self.linear_gate_lower_bound is not None and self.family not in KDA_FAMILIES:
            errors.append(("linear_gate_lower_bound", f"bounds KDA's gate ({', '.join(KDA_FAMILIES)}), not "
                           f"{self.family}'s"))
        if self.family in KDA_FAMILIES and "linear_attention" in used and (
                self.linear_num_value_heads != self.linear_num_key_heads
                or self.linear_value_head_dim != self.linear_key_head_dim):
            errors.append(("linear_num_value_heads", "KDA layers have as many value heads as key heads "
                           "and value heads as wide as key heads; got "
                           f"{self.linear_num_key_heads} x {self.linear_key_head_dim} keys, "
                           f"{self.linear_num_value_heads} x {self.linear_value_head_dim} values"))
        if self.family == "olmo_hybrid" and moe:
            errors.append(("num_experts", f"olmo_hybrid has dense MLPs only; set it to 0, got {self.num_experts}"))
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            errors.append(("mlp_only_layers", f"layer indices must be in [0, {self.num_hidden_layers}), got {bad}"))
        if self.gdn_implementation not in ("auto", *KERNEL_PLATFORMS) and self.gdn_interpret is not None:
            errors.append(("gdn_interpret", "applies to the Pallas kernels only; set gdn_implementation to auto, "
                           "pallas_tpu or pallas_gpu, or leave gdn_interpret unset"))
        if self.attention_implementation == "xla" and self.attention_interpret is not None:
            errors.append(("attention_interpret", "applies to the splash kernel only; set attention_implementation "
                           "to auto or splash, or leave attention_interpret unset"))
        if errors:
            raise ValueError("; ".join(f"{field}: {msg}" for field, msg in errors))
        return self

    def _glm5_next_errors(self, used: set[str]) -> list[tuple[str, str]]:
        errors = []
        if self.index_topk % self.index_kpool:
            errors.append(("index_topk", f"must be a multiple of index_kpool={self.index_kpool}, "
                           f"got {self.index_topk}"))
        if self.indexer_types is not None:
            if len(self.indexer_types) != self.num_hidden_layers:
                errors.append(("indexer_types", f"expected {self.num_hidden_layers} entries (num_hidden_layers), "
                               f"got {len(self.indexer_types)}"))
            else:
                attention = [i for i, t in enumerate(self.resolved_layer_types) if t == "full_attention"]
                if attention and self.indexer_types[attention[0]] == "shared":
                    errors.append(("indexer_types", f"the first attention layer ({attention[0]}) has no full "
                                   "layer before it to share the selection of; it must be 'full'"))
        if self.qk_rope_head_dim:
            errors.append(("qk_rope_head_dim", f"glm5_next's latent attention has no rope part; set it to 0, "
                           f"got {self.qk_rope_head_dim}"))
        if not self.index_kpool_always_select_tail:
            errors.append(("index_kpool_always_select_tail", "without the query's unfinished pool, a query before "
                           f"the first complete pool of {self.index_kpool} tokens attends to nothing; set it to true"))
        if "full_attention" in used and self.q_lora_rank is None:
            errors.append(("q_lora_rank", "glm5_next's indexer reads the low-rank query; set its rank"))
        return errors

    def _qwen4_exp_errors(self, used: set[str]) -> list[tuple[str, str]]:
        errors = []
        if self.hc_mult < 2:
            errors.append(("hc_mult", f"qwen4_exp's gated residual mixes at least 2 streams, got {self.hc_mult}"))
        if not self.num_experts:
            errors.append(("num_experts", "qwen4_exp routes every layer's MLP; got 0"))
        if "full_attention" in used:
            if self.index_topk % self.index_kpool:
                errors.append(("index_topk", f"must be a multiple of index_kpool={self.index_kpool}, "
                               f"got {self.index_topk}"))
            rotary = int(self.head_dim * self.partial_rotary_factor)
            if rotary > self.index_head_dim:
                errors.append(("index_head_dim", f"the indexer rotates as the attention does ({rotary} features); "
                               f"expected >= {rotary}, got {self.index_head_dim}"))
            if self.rope_theta is None:
                errors.append(("rope_theta", "qwen4_exp's attention and indexer rotate q and k; set a base"))
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        bad = [i for i in self.ple_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            errors.append(("ple_layers", f"layer indices must be in [0, {self.num_hidden_layers}), got {bad}"))
        elif any(self.resolved_layer_types[i] != "linear_attention" for i in self.ple_layers):
            errors.append(("ple_layers", "per-layer embeddings go on linear_attention layers only, got "
                           f"{[i for i in self.ple_layers if self.resolved_layer_types[i] != 'linear_attention']}"))
        if self.ple_layers and self.ple_width % heads:
            errors.append(("ple_embed_dim", f"must be a multiple of the {heads} n-gram tables "
                           f"((ngram_size - 1) x heads_per_ngram), got {self.ple_width}"))
        if self.ple_layers and heads * self.ngram_vocab_base >= 2 ** 31:  # row ids are int32
            errors.append(("ngram_vocab_base", f"a layer's {heads} tables of at least {self.ngram_vocab_base} rows "
                           f"each must hold fewer than 2^31 rows in all (int32 row ids)"))
        if self.ple_layers and self.eos_token_id is None:
            errors.append(("eos_token_id", "the n-gram context restarts after end-of-sequence; set its id"))
        return errors

    @property
    def ple_width(self) -> int:
        """A per-layer embedding's features (ple_embed_dim, else hidden_size)."""
        return self.ple_embed_dim or self.hidden_size

    @property
    def shared_index_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it is an attention layer that reads the
        selection of the last full one (glm5_next's indexer_types)."""
        kinds = self.indexer_types or ["full"] * self.num_hidden_layers
        return tuple(t == "full_attention" and k == "shared" for t, k in zip(self.resolved_layer_types, kinds))

    @property
    def streams(self) -> int:
        """Residual streams per token: hc_mult for glm5_next and qwen4_exp,
        else 1 (a plain residual)."""
        return self.hc_mult if self.family in ("glm5_next", "qwen4_exp") else 1

    @property
    def linear_kind(self) -> Literal["gdn", "kda"]:
        """The delta rule of the linear_attention layers: GDN's per-head
        gate, or KDA's per-channel one (KDA_FAMILIES)."""
        return "kda" if self.family in KDA_FAMILIES else "gdn"

    @property
    def attention_kind(self) -> Literal["gated", "normed", "latent", "head_normed"]:
        """The full_attention layers: gated (Qwen), normed (OLMo Hybrid),
        multi-head latent attention (KDA_FAMILIES) or q/k normed per head
        with no gate (lara_mini, whose sliding_attention layers are too)."""
        if self.family in KDA_FAMILIES:
            return "latent"
        return {"olmo_hybrid": "normed", "lara_mini": "head_normed"}.get(self.family, "gated")  # type: ignore[return-value]

    @property
    def shared_expert_gated(self) -> bool:
        """Whether a MoE's shared expert is scaled by a sigmoid gate (Qwen's)."""
        return self.family in ("qwen3_next", "qwen3_5", "qwen4_exp")

    @property
    def router_kind(self) -> Literal["softmax", "sigmoid"]:
        """The MoE router: softmax over experts with a gated shared expert
        (Qwen), or sigmoid scores, grouped choice and an ungated shared
        expert (KDA_FAMILIES)."""
        return "sigmoid" if self.family in KDA_FAMILIES else "softmax"

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return tuple("full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                     for i in range(self.num_hidden_layers))

    @property
    def layer_kinds(self) -> tuple[tuple[str, bool], ...]:
        """Per layer: its mixer (a shared-index attention layer, and each
        layer with a per-layer embedding, its own kind) and whether its MLP
        is a MoE."""
        # each per-layer embedding's tables have rows of their own (primes): one kind per PLE layer
        shared, ple = self.shared_index_layers, sorted(self.ple_layers)
        return tuple((t + ("/shared" if shared[i] else "") + (f"/ple{ple.index(i)}" if i in ple else ""),
                      self.is_moe_layer(i)) for i, t in enumerate(self.resolved_layer_types))

    @property
    def layer_head(self) -> int:
        """Layers before the scanned cycle (a scanned model keeps them
        unrolled, as `head`): e.g. the dense first layers of Kimi Linear."""
        return _scan_layout(self.layer_kinds)[0]

    @property
    def layer_cycle(self) -> int:
        """The period of the stack after its head: the fewest layers after
        which the layer kinds (mixer and MLP) repeat; the whole depth if they
        never do."""
        return _scan_layout(self.layer_kinds)[1]

    @property
    def cycle_repeats(self) -> int:
        """Full cycles after the head (a scanned model's leading parameter
        dim); the layers after the last one are left over (the tail)."""
        return _scan_layout(self.layer_kinds)[2]

    @property
    def scanned(self) -> bool:
        """Whether the model runs its layers under a scan: scan_layers, or
        when unset, a stack of SCAN_MIN_LAYERS or more whose cycle repeats."""
        if self.scan_layers is None:
            return self.num_hidden_layers >= SCAN_MIN_LAYERS and self.cycle_repeats >= 2
        return self.scan_layers

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


@functools.lru_cache(maxsize=64)
def _scan_layout(kinds: tuple[tuple[str, bool], ...]) -> tuple[int, int, int]:
    """(head, cycle, repeats) for a stack of these layer kinds, the layout
    whose program holds the fewest layers (head + one cycle + tail: what a
    compile grows with), then the shorter cycle, then the shorter head. The
    head is the layers before the cycle's first repeat, the tail those after
    its last. (0, depth, 1) when no cycle repeats."""
    n = len(kinds)
    best, size = (0, n, 1), n
    for cycle in range(1, n // 2 + 1):
        for head in range(n - 2 * cycle + 1):
            repeats = 1
            while head + (repeats + 1) * cycle <= n and \
                    kinds[head + repeats * cycle:head + (repeats + 1) * cycle] == kinds[head:head + cycle]:
                repeats += 1
            if repeats >= 2 and n - (repeats - 1) * cycle < size:
                best, size = (head, cycle, repeats), n - (repeats - 1) * cycle
    return best


class DataConfig(_Strict):
    """Training data: the embedded MQAR task; text files (.txt, .jsonl or a
    directory of them), tokenized into <out_dir>/data on first use; a
    directory `gdnx prepare` wrote (tokens); or supervised fine-tuning
    examples (sft: .jsonl of messages or prompt/completion, the loss on the
    responses), tokenized into <out_dir>/data on first use; or prompts
    with reference answers for reinforcement learning (rl: .jsonl, the
    completions drawn by the engine each step; train.rl)."""

    source: Literal["mqar", "text", "tokens", "sft", "rl"] = "mqar"
    path: str | None = None
    tokenizer: str | None = None  # a Hugging Face tokenizer.json; bytes when None
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)  # documents held out for evaluation (text, sft)
    # sft: several whole examples per row (the longest, then the shortest while they fit) or one
    sft_packing: bool = True
    # sft: an example longer than data.seq_len + 1 tokens is dropped or cut to it (counted in the log)
    sft_overlong: Literal["drop", "truncate"] = "drop"
    eos_token: str | None = None  # the tokenizer's end-of-document token when it has none of the usual names
    seq_len: PositiveInt = 128
    num_pairs: PositiveInt = 16
    num_keys: PositiveInt = 128
    num_values: PositiveInt = 128

    @model_validator(mode="after")
    def _consistent(self):
        if self.source == "text" and self.path is None:
            raise ValueError("path: data.source=text needs data.path (a .txt or .jsonl file, or a directory of "
                             "them)")
        if self.source == "sft" and self.path is None:
            raise ValueError("path: data.source=sft needs data.path (a .jsonl file of examples, or a directory of "
                             "them)")
        if self.source == "rl" and self.path is None:
            raise ValueError("path: data.source=rl needs data.path (a .jsonl file of prompts with their answers)")
        if self.source == "tokens" and self.path is None:
            raise ValueError("path: data.source=tokens needs data.path (a directory `gdnx prepare` wrote)")
        if self.source == "mqar" and self.seq_len < 2 * self.num_pairs + 1:
            raise ValueError(f"seq_len: {self.num_pairs} pairs and one query need >= {2 * self.num_pairs + 1}, "
                             f"got {self.seq_len}")
        if self.source == "mqar" and self.num_keys < self.num_pairs:
            raise ValueError(f"num_keys: must be >= num_pairs={self.num_pairs} (keys are distinct), "
                             f"got {self.num_keys}")
        return self


# the projections a LoRA adapter can target (train.lora.targets), by name:
# the GDN projections (in_proj_qkvz, in_proj_ba, out_proj), KDA's
# (in_proj_qkv, its gates' f_a/f_b/g_a/g_b_proj, b_proj, out_proj),
# attention's (q/k/v/o_proj; latent attention's q_proj or q_a/q_b_proj,
# kv_a_proj_with_mqa, kv_b_proj, o_proj), the MLP's (dense, and a MoE's
# shared expert), and the routed experts
LoraTarget = Literal["in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
                     "b_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                     "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj", "experts"]
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)
# every projection but the routed experts (whose adapters multiply by the experts' count)
_DEFAULT_LORA_TARGETS: tuple[LoraTarget, ...] = tuple(t for t in get_args(LoraTarget) if t != "experts")


class LoraConfig(_Strict):
    """LoRA (train.lora): the base weights frozen, adapters of this rank on
    the targeted projections trained (scale alpha / rank, as PEFT)."""

    rank: PositiveInt = 16
    alpha: PositiveFloat = 32.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapter's input (not on routed experts)
    targets: list[LoraTarget] = Field(default_factory=lambda: list(_DEFAULT_LORA_TARGETS), min_length=1)
    # adapters on the multi-token prediction module's layers too, trained with its loss (train.mtp_loss_weight)
    # so that the drafter follows the fine-tuned model; off: the module stays frozen with the base
    mtp: bool = False


RL_LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
RL_REWARDS = ("exact", "numeric", "regex", "json")
RL_ENGINE_SLOTS = 64  # the most completions an RL run's engine decodes together
# each loss's clip range (low, high) as its paper gives it: DAPO raises the upper bound (clip-higher); GSPO's
# sequence-level ratios, geometric means over tokens, sit much nearer 1
RL_CLIPS = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


class RLConfig(_Strict):
    """Reinforcement learning from verifiable rewards (train.rl, with
    data.source=rl; docs/rl.md): each step's train.batch_size completions
    are group_size per prompt, drawn by gdnx's engine on the current
    weights, scored and normalised within their group."""

    group_size: int = Field(8, ge=2)       # completions per prompt (G)
    max_new_tokens: PositiveInt = 64       # each completion's length, at most
    # grpo: per-sequence mean, advantages / group std; dr_grpo: no std, sums / (completions x max_new_tokens);
    # dapo: token-level mean, clip-higher, groups whose rewards are all equal dropped; gspo: sequence-level ratio
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "grpo"
    # the ratio clipped to [1 - clip_low, 1 + clip_high]; None: the loss's own (RL_CLIPS)
    clip_low: PositiveFloat | None = None
    clip_high: PositiveFloat | None = None
    # optimizer steps on each batch of completions (the ratio to the weights that drew them is clipped)
    updates_per_rollout: PositiveInt = 1
    kl_coef: float = Field(0.0, ge=0.0)    # the k3 estimate of KL to the reference (the initial weights; under
    #                                        LoRA the base with its adapters off)
    # the KL term's reference read from a checkpoint of the model's architecture (a Hugging Face directory or a
    # gdnx run) in place of the initial weights
    reference: str | None = None
    # exact, numeric (the last number), regex (reward_pattern matched), json (valid under reward_schema) or a
    # user function module:function(completion, example) -> float
    reward: str = "exact"
    reward_pattern: str | None = None      # regex: a completion scores 1 when it matches (re.search)
    reward_schema: str | None = None       # json: a JSON schema (its text, or a .json file)
    # seconds a user's reward function may take on one completion: past it the run stops with a line naming it
    reward_timeout_s: PositiveFloat = 60.0
    # importance weights min(exp(trainer - sampler), cap) on each token (truncated importance sampling):
    # corrects the sampler/trainer mismatch of the default mode; null: none
    importance_cap: PositiveFloat | None = 2.0
    # the trainer replays the engine's computation (prompts prefilled a block at a time, one decode step per
    # completion token, the engine's shapes), so its log-probabilities are the sampler's bit for bit; the engine
    # runs batch-invariant. Off: one pass over each row (equal to float rounding)
    bitwise: bool = False
    # host memory for the rollout engine's prefix cache, in MiB: a prompt's completions after the first take its
    # whole blocks from it rather than prefill them again; 0: each completion prefills its prompt
    prefix_cache_mb: int = Field(1024, ge=0)

    @field_validator("reward")
    @classmethod
    def _reward(cls, v):
        if v not in RL_REWARDS and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"expected one of {', '.join(RL_REWARDS)} or module:function, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.reward == "regex" and self.reward_pattern is None:
            raise ValueError("reward_pattern: reward=regex needs a pattern")
        if self.reward == "json" and self.reward_schema is None:
            raise ValueError("reward_schema: reward=json needs a JSON schema (its text or a .json file)")
        if self.reference is not None and not self.kl_coef:
            raise ValueError("reference: only the KL term reads it; set train.rl.kl_coef above 0")
        return self

    @property
    def clip(self) -> tuple[float, float]:
        """(low, high): the ratio's clip range is [1 - low, 1 + high]."""
        low, high = RL_CLIPS[self.loss]
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)


class WandbConfig(_Strict):
    """The Weights & Biases run (train.trackers holding wandb)."""

    project: str = "gdnx"
    name: str | None = None          # None: W&B names the run
    # offline: written under out_dir/wandb for `wandb sync`; disabled: nothing written
    mode: Literal["online", "offline", "disabled"] = "online"


class TrainConfig(_Strict):
    """Optimiser, schedule, checkpoints and logging."""

    steps: PositiveInt = 4000
    batch_size: PositiveInt = 16
    # micro-batches per step (gradients summed over them): the same step,
    # one micro-batch's activations in memory
    grad_accum_steps: PositiveInt = 1
    learning_rate: PositiveFloat = 3e-3
    warmup_steps: int = Field(100, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.1, ge=0.0)
    adam_b1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_b2: float = Field(0.98, ge=0.0, lt=1.0)
    grad_clip: PositiveFloat = 1.0
    seed: int = 0
    out_dir: str = "runs/default"
    checkpoint_every: PositiveInt = 200
    keep_checkpoints: PositiveInt = 2
    log_every: PositiveInt = 20
    eval_every: int = Field(200, ge=0)
    target_accuracy: float | None = Field(0.99, gt=0.0, le=1.0)
    # steps in a row whose loss or gradient norm is not finite (the parameters
    # are not updated) before the run stops
    nonfinite_steps_limit: PositiveInt = 5
    # a model with a multi-token prediction module (model.mtp_num_layers) trains it beside the model: its
    # loss (the mean over its depths) at this weight, as DeepSeek-V3 and MaxText do; 0 leaves it as it is.
    # Under LoRA the module stays frozen with the base
    mtp_loss_weight: float = Field(0.3, ge=0.0)
    # LoRA adapters on a frozen base (model.init_from); null trains every weight
    lora: LoraConfig | None = None
    # reinforcement learning (data.source=rl)
    rl: RLConfig | None = None
    # where metrics go besides metrics.jsonl (always written): tensorboard (event files under
    # out_dir/tensorboard), wandb (train.wandb)
    trackers: list[Literal["jsonl", "tensorboard", "wandb"]] = ["jsonl"]
    wandb: WandbConfig = WandbConfig()

    @model_validator(mode="after")
    def _consistent(self):
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps: must be < steps={self.steps}, got {self.warmup_steps}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"grad_accum_steps: must divide batch_size={self.batch_size}, "
                             f"got {self.grad_accum_steps}")
        return self


class ParallelConfig(_Strict):
    """The device mesh (docs/sharding.md): axis sizes, -1 for "the rest"."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    context: int = 1
    shard_mode: Literal["auto", "explicit"] = "auto"

    @field_validator("data", "fsdp", "expert", "tensor", "context")
    @classmethod
    def _size(cls, v):
        if v != -1 and v < 1:
            raise ValueError(f"expected a positive axis size or -1 (the devices the other axes leave), got {v}")
        return v

    @model_validator(mode="after")
    def _one_rest(self):
        rest = [a for a in ("data", "fsdp", "expert", "tensor", "context") if getattr(self, a) == -1]
        if len(rest) > 1:
            raise ValueError(f"{rest[1]}: only one axis can be -1, and {rest[0]} already is")
        return self


class Config(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @model_validator(mode="after")
    def _vocab(self):
        if self.data.source == "mqar":
            need = self.data.num_keys + self.data.num_values
            if self.model.vocab_size < need:
                raise ValueError(f"model.vocab_size: MQAR with {self.data.num_keys} keys and "
                                 f"{self.data.num_values} values needs >= {need}, got {self.model.vocab_size}")
        expert = self.parallel.expert
        if expert not in (1, -1) and not self.model.num_experts:
            raise ValueError(f"parallel.expert: an expert axis ({expert}) splits routed experts, and the model has "
                             "none (model.num_experts 0)")
        if expert not in (1, -1) and self.model.num_experts % expert:
            raise ValueError(f"parallel.expert: the expert axis ({expert}) must divide model.num_experts "
                             f"({self.model.num_experts})")
        if self.train.lora is not None and self.model.init_from is None:
            raise ValueError("train.lora: adapters train on a frozen base; set model.init_from to the checkpoint "
                             "to adapt")
        if self.train.lora is not None and self.train.lora.mtp and not self.model.mtp_num_layers:
            raise ValueError("train.lora.mtp: the model has no multi-token prediction module to adapt "
                             "(model.mtp_num_layers 0)")
        if (self.data.source == "rl") != (self.train.rl is not None):
            raise ValueError("train.rl: reinforcement learning takes data.source=rl and a train.rl section together; "
                             f"got data.source={self.data.source} and train.rl "
                             f"{'set' if self.train.rl is not None else 'null'}")
        if self.train.rl is not None:
            rl = self.train.rl
            if self.train.batch_size % rl.group_size:
                raise ValueError(f"train.batch_size: the completions of a step, {rl.group_size} per prompt "
                                 f"(train.rl.group_size); expected a multiple of it, got {self.train.batch_size}")
            if rl.max_new_tokens >= self.data.seq_len:
                raise ValueError(f"train.rl.max_new_tokens: a completion and its prompt fit data.seq_len="
                                 f"{self.data.seq_len} tokens; expected fewer, got {rl.max_new_tokens}")
            if rl.bitwise and self.train.batch_size > RL_ENGINE_SLOTS:
                raise ValueError(f"train.batch_size: bitwise mode replays a step's completions in the engine's "
                                 f"{RL_ENGINE_SLOTS} slots at most; expected <= {RL_ENGINE_SLOTS}, got "
                                 f"{self.train.batch_size}")
            if self.train.checkpoint_every % rl.updates_per_rollout:
                raise ValueError(f"train.checkpoint_every: a checkpoint falls between rollouts, so that a resumed run "
                                 f"draws the same completions; expected a multiple of train.rl.updates_per_rollout="
                                 f"{rl.updates_per_rollout}, got {self.train.checkpoint_every}")
            if self.train.steps % rl.updates_per_rollout:
                raise ValueError(f"train.steps: the run ends between rollouts, so that a run resumed to go further "
                                 f"draws the same completions; expected a multiple of train.rl.updates_per_rollout="
                                 f"{rl.updates_per_rollout}, got {self.train.steps}")
        if self.data.seq_len > self.model.max_position_embeddings:
            # what generation would refuse later is refused before training
            raise ValueError(f"data.seq_len: {self.data.seq_len} is more than the model's "
                             f"{self.model.max_position_embeddings} positions; lower it or raise "
                             "model.max_position_embeddings")
        return self
