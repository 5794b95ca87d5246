"""Where each gdnx parameter lives in a Hugging Face checkpoint, per family.

Most parameters are one tensor under the same name (Linear kernels
transposed, the conv weight with a unit axis). The GDN input projections
differ: gdnx keeps them fused per key head (gdnx.layers.gated_deltanet);
Qwen3-Next's checkpoints store exactly that, Qwen3.5's store in_proj_qkv
([all q | all k | all v]) and in_proj_z, in_proj_b, in_proj_a, OLMo
Hybrid's q/k/v/g_proj and b/a_proj. OLMo Hybrid's checkpoints also keep
the conv weight in three parts (q/k/v_conv1d) and name two norms as OLMo
does (attention_layer_norm, feedforward_layer_norm). Kimi Linear's keep
KDA's q, k, v projections and convs in three parts, its A_log as
[1, 1, H, 1], its MLPs (dense and MoE) under block_sparse_moe (the
published checkpoints' dense layers under mlp, which the reader takes as
an alias: ALIASES), its shared expert as shared_experts and its routed
experts as w1 / w3 / w2 (gate, up, down). Ling 3's name the embeddings
word_embeddings, the mixers attention (their output projections dense),
the correction bias expert_bias, and keep A_log as [H]. GLM-5-Next's keep
KDA as Kimi's with A_log as [H], the hyper-connections' parameters as
layers.N.hc_{attn,ffn}_{fn,base,scale}, and the experts one by one.
Qwen4-Exp's keep the GDN layers as Qwen3.5's, the gated residuals'
parameters as hc_norm / input_mix_weight_{down,up} / block_inject_weight,
the per-layer embedding's convolution as [W, 1, K] and each n-gram table in
ngram_split_parts row pieces (torch.chunk's: the last may be shorter, and
there may be fewer), beside the hashing's constants (`ngram_buffers`).
Every conversion is a reshape,
transpose, split or concatenation, so a load and a save give back the same
bits. The conversions to a parameter take numpy arrays (a load reads
slices on the host) or jax values (a shape check under eval_shape), and
each kind of tensor also reads any slice of its parameter from the slices
of its Hugging Face tensors, so a sharded load reads only what each device
holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from gdnx.config.schema import ModelConfig
from gdnx.layers.ngram_embedding import ngram_hash

# (index into a parameter: one slice per dim) -> that part of the parameter
Index = tuple[slice, ...]
# (Hugging Face tensor name, index into it) -> that part of the tensor, as numpy
ReadSlice = Callable[[str, Index], np.ndarray]


class Tensors(NamedTuple):
    """One gdnx parameter as Hugging Face tensors: their names and the two
    conversions; `read` gives any slice of the parameter from slices of the
    tensors (None: the parameter is small and read whole). A tensor several
    parameters share (Lara 4 Mini's in_proj) takes `pieces` parameters' rows,
    `shared_rows` in all: to_hf gives this parameter's, which start at row
    `offset`."""
    keys: tuple[str, ...]
    to_param: Callable[..., Any]  # the tensors, in keys' order -> the parameter
    to_hf: Callable[[Any], tuple[Any, ...]]  # the parameter -> the tensors
    read: Callable[[ReadSlice, Index], np.ndarray] | None = None
    pieces: int = 1
    offset: int = 0
    shared_rows: int = 0


def _xp(*xs: Any) -> Any:
    """numpy for host arrays, jax.numpy for jax values (traced included)."""
    return np if all(isinstance(x, np.ndarray) for x in xs) else jnp


class Experts(NamedTuple):
    """A routed-experts parameter [E, ...]: per expert ({prefix}.{e}.{name}.weight)
    in published checkpoints, or fused ({prefix}.gate_up_proj, {prefix}.down_proj),
    which is how `fused` families (Lara 4 Mini) are written."""
    prefix: str
    part: str  # gate, up or down
    name: str  # the per-expert tensor's module: {part}_proj, or Kimi's w1, w3, w2
    fused: bool = False


# Kimi Linear's per-expert module names
_KIMI_EXPERTS = {"gate": "w1", "up": "w3", "down": "w2"}
# per family: (a part of a tensor name, what a checkpoint may have in its place)
ALIASES: dict[str, tuple[tuple[str, str], ...]] = {"kimi_linear": ((".block_sparse_moe.", ".mlp."),)}
# per family: (a part of a tensor name as files hold it, the same in the module
# names of transformers' model in memory, which is what a PEFT adapter names)
MODULE_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "kimi_linear": ((".block_sparse_moe.", ".mlp."), (".self_attn.f_a_proj", ".self_attn.forget_gate.f_a_proj"),
                    (".self_attn.f_b_proj", ".self_attn.forget_gate.f_b_proj")),
    "glm5_next": ((".self_attn.f_a_proj", ".self_attn.forget_gate.f_a_proj"),
                  (".self_attn.f_b_proj", ".self_attn.forget_gate.f_b_proj")),
    "bailing_hybrid": ((".attention.f_proj", ".self_attn.forget_gate.f_proj"),
                       (".attention.dense", ".self_attn.o_proj"), (".attention.", ".self_attn.")),
}


def _t(x: Any) -> Any:
    return x.swapaxes(-1, -2)


def _same(key: str) -> Tensors:
    return Tensors((key,), lambda w: w, lambda p: (p,), lambda get, index: get(key, index))


def _transposed(key: str) -> Tensors:
    return Tensors((key,), _t, lambda p: (_t(p),), lambda get, index: get(key, index[::-1]).T)


def _conv(key: str) -> Tensors:
    return Tensors((key,), lambda w: w[:, 0], lambda p: (p[:, None],))


def _per_key_head(keys: Sequence[str], rows: Sequence[Sequence[int]], num_key_heads: int, *, offset: int = 0,
                  pieces: int = 1, shared_rows: int = 0) -> Tensors:
    """A fused kernel [hidden, HK * W] whose columns are, per key head, its
    slice of each part in turn; the parts are the row blocks `rows[j]` of
    the tensor keys[j] ([out, hidden], out in head order), from row `offset`
    of a tensor that `pieces` parameters share (one key then, of
    `shared_rows` rows)."""
    hk = num_key_heads
    width = sum(map(sum, rows)) // hk  # a key head's columns

    def assemble(tensors: Sequence[Any], heads: int, first_row: int = 0) -> Any:
        """The kernel's columns of `heads` consecutive key heads from the
        tensors' rows of those heads (each part's rows `size * heads / hk`),
        which start at row first_row."""
        parts = []
        for w, sizes in zip(tensors, rows):
            start = first_row
            for size in sizes:
                stop = start + size * heads // hk
                parts.append(w[start:stop].T.reshape(w.shape[1], heads, -1))
                start = stop
        return _xp(*tensors).concatenate(parts, axis=-1).reshape(parts[0].shape[0], -1)

    def read(get: ReadSlice, index: Index) -> np.ndarray:
        # the whole key heads the columns touch: each part's rows of those heads
        inputs, columns = index
        first, last = columns.start // width, math.ceil(columns.stop / width)
        tensors = []
        for key, sizes in zip(keys, rows):
            offsets = [offset + sum(sizes[:i]) for i in range(len(sizes))]
            tensors.append(np.concatenate([
                get(key, (slice(o + first * size // hk, o + last * size // hk), inputs))
                for o, size in zip(offsets, sizes)], axis=0))
        kernel = assemble(tensors, last - first)
        return kernel[:, columns.start - first * width:columns.stop - first * width]

    def to_hf(kernel: Any) -> tuple[Any, ...]:
        widths = [size // hk for sizes in rows for size in sizes]
        offsets = [sum(widths[:i]) for i in range(1, len(widths))]
        grouped = kernel.reshape(kernel.shape[0], hk, -1)
        xp = _xp(kernel)
        parts = iter(p.reshape(kernel.shape[0], -1).T for p in xp.split(grouped, offsets, axis=-1))
        return tuple(xp.concatenate([next(parts) for _ in sizes], axis=0) for sizes in rows)

    return Tensors(tuple(keys), lambda *tensors: assemble(tensors, hk, offset), to_hf, read, pieces, offset,
                   shared_rows)


def _gdn(cfg: ModelConfig, name: str, prefix: str) -> Tensors:
    """A GatedDeltaNet parameter (`name` its attribute) under linear_attn."""
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    hv, hk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    olmo = cfg.family == "olmo_hybrid"
    p = prefix + "linear_attn."
    if name == "conv_weight" and olmo:
        return Tensors(tuple(p + f"{x}_conv1d.weight" for x in "qkv"),
                       lambda q, k, v: _xp(q, k, v).concatenate([q, k, v], axis=0)[:, 0],
                       lambda w: tuple(x[:, None] for x in _xp(w).split(w, [kd, 2 * kd], axis=0)))
    if name == "conv_weight":
        return _conv(p + "conv1d.weight")
    if name in ("dt_bias", "A_log"):
        return _same(p + name)
    lara = cfg.family == "lara_mini"
    if name == "norm_weight":
        norms = {"olmo_hybrid": "o_norm.weight", "lara_mini": "out_norm.weight"}
        return _same(p + norms.get(cfg.family, "norm.weight"))
    if name == "out_proj":
        return _transposed(p + ("o_proj.weight" if olmo else "out_proj.weight"))
    if cfg.family == "qwen3_next":
        return _transposed(p + name + ".weight")
    if lara:  # one in_proj, rows [q | k | v | z | b | a]
        rows = 2 * kd + 2 * vd + 2 * hv
        if name == "in_proj_qkvz":
            return _per_key_head([p + "in_proj.weight"], [[kd, kd, vd, vd]], hk, pieces=2, shared_rows=rows)
        return _per_key_head([p + "in_proj.weight"], [[hv, hv]], hk, offset=2 * kd + 2 * vd, pieces=2,
                             shared_rows=rows)
    if name == "in_proj_qkvz" and olmo:
        return _per_key_head([p + f"{x}_proj.weight" for x in "qkvg"], [[kd], [kd], [vd], [vd]], hk)
    if name == "in_proj_qkvz":
        return _per_key_head([p + "in_proj_qkv.weight", p + "in_proj_z.weight"], [[kd, kd, vd], [vd]], hk)
    names = ("b_proj", "a_proj") if olmo else ("in_proj_b", "in_proj_a")
    return _per_key_head([p + n + ".weight" for n in names], [[hv], [hv]], hk)


def _kda(cfg: ModelConfig, name: str, prefix: str) -> Tensors:
    """A KimiDeltaAttention parameter (`name` its attribute) under self_attn
    (Kimi) or attention (Ling, whose A_log is [H] and o_proj is dense)."""
    ling = cfg.family == "bailing_hybrid"
    p = prefix + ("attention." if ling else "self_attn.")
    d = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    if name == "in_proj_qkv":
        return _per_key_head([p + f"{x}_proj.weight" for x in "qkv"], [[d], [d], [d]], cfg.linear_num_key_heads)
    if name == "conv_weight":
        return Tensors(tuple(p + f"{x}_conv1d.weight" for x in "qkv"),
                       lambda q, k, v: _xp(q, k, v).concatenate([q, k, v], axis=0)[:, 0],
                       lambda w: tuple(x[:, None] for x in _xp(w).split(w, [d, 2 * d], axis=0)))
    if name == "A_log" and (ling or cfg.family == "glm5_next"):
        return _same(p + "A_log")
    if name == "A_log":
        return Tensors((p + "A_log",), lambda w: w.reshape(-1), lambda a: (a.reshape(1, 1, -1, 1),))
    if name == "dt_bias":
        return _same(p + name)
    if name == "norm_weight":
        return _same(p + "o_norm.weight")
    return _transposed(p + {"out_proj": "dense" if ling else "o_proj"}.get(name, name) + ".weight")


# Qwen4-Exp's names for a GatedResidual's parameters
_GATED_RESIDUAL = {"norm": "hc_norm", "down": "input_mix_weight_down", "up": "input_mix_weight_up",
                   "inject_weight": "block_inject_weight"}


def _gated_residual(module: str, tail: Sequence[str]) -> Tensors:
    name = f"{module}.{_GATED_RESIDUAL[tail[0]]}.weight"
    return _same(name) if tail[0] == "norm" else _transposed(name)


def chunk_rows(rows: int, parts: int) -> list[int]:
    """The row counts torch.chunk(rows, parts) gives (transformers' save of
    a split n-gram table): ceil(rows / parts) each, the last the rest."""
    size = -(-rows // parts)
    return [min(size, rows - start) for start in range(0, rows, size)]


def _ngram_table(cfg: ModelConfig, layer: int, module: str) -> Tensors:
    rows = chunk_rows(ngram_hash(cfg, layer).rows, cfg.ngram_split_parts)
    keys = tuple(f"{module}.ngram_embedding.shard_{i}.weight" for i in range(len(rows)))
    bounds = np.cumsum([0, *rows])

    def read(get: ReadSlice, index: Index) -> np.ndarray:
        wanted, columns = index
        parts = []
        for key, a, z in zip(keys, bounds[:-1], bounds[1:]):
            lo, hi = max(wanted.start, a), min(wanted.stop, z)
            if lo < hi:
                parts.append(get(key, (slice(lo - a, hi - a), columns)))
        return np.concatenate(parts, axis=0)

    return Tensors(keys, lambda *shards: _xp(*shards).concatenate(shards, axis=0),
                   lambda table: tuple(_xp(table).split(table, [int(b) for b in bounds[1:-1]], axis=0)), read)


def ngram_buffers(cfg: ModelConfig, prefix: str) -> dict[str, np.ndarray]:
    """Per PLE layer, the hashing's constants Qwen4-Exp's checkpoints store
    beside its tables (int64): the multipliers, each table's rows (primes)
    and first row."""
    out = {}
    for layer in cfg.ple_layers:
        h = ngram_hash(cfg, layer)
        module = f"{prefix}layers.{layer}.ple.ple_embedding."
        out[module + "layer_multipliers"] = np.asarray(h.multipliers, np.int64)
        out[module + "ngram_heads_vocab_sizes"] = np.asarray(h.sizes, np.int64)
        out[module + "ngram_heads_offsets"] = np.asarray(h.offsets, np.int64)
    return out


# OLMo Hybrid's names for the norms before a layer's mixer and its MLP (or,
# in its post-norm attention layers, after the mixer)
_OLMO_NORMS = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}


def locate(cfg: ModelConfig, path: tuple, prefix: str = "model.", in_memory: bool = False) -> Tensors | Experts:
    """The Hugging Face tensors of the gdnx parameter at `path` (an nnx state
    path); `prefix` is where the language model's tensors live
    (model.language_model. in a vision-language checkpoint). in_memory: as
    transformers' model in memory names them where that differs from the
    files by more than a rename (Lara 4 Mini's GDN layers: Qwen3.5's)."""
    if in_memory and cfg.family == "lara_mini":
        cfg = cfg.model_copy(update={"family": "qwen3_5"})
    ling = cfg.family == "bailing_hybrid"
    if path == ("embed_tokens", "embedding"):
        return _same(prefix + ("word_embeddings" if ling else "embed_tokens") + ".weight")
    if path == ("lm_head", "kernel"):
        return _transposed("lm_head.weight")
    if path == ("norm", "weight"):
        return _same(prefix + "norm.weight")
    if path[0] == "hyper_connection_mixer":
        return _gated_residual(prefix + "hyper_connection_mixer", path[1:])
    if path[0] == "mtp" and ling:  # the layer after the decoder's (DeepSeek's layout), its head the model's
        layer = f"{prefix}layers.{cfg.num_hidden_layers}."
        if path[1] == "fc":
            return _transposed(layer + "eh_proj.weight")
        if path[1] != "layers":
            return _same(layer + _LING_MTP[path[1]] + ".weight")
        return _layer(cfg, (cfg.num_hidden_layers + int(path[2]), *path[3:]), prefix, full_attention=True)
    if path[0] == "mtp":  # the multi-token prediction module, top-level mtp.* (also beside a vision tower)
        if path[1] == "fc":
            return _transposed("mtp.fc.weight")
        if path[1] != "layers":
            return _same(f"mtp.{path[1]}.weight")
        return _layer(cfg, path[2:], "mtp.", full_attention=True)
    return _layer(cfg, path[1:], prefix)


# Ling 3's names for the multi-token prediction module's norms
_LING_MTP = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}


def _layer(cfg: ModelConfig, path: tuple, prefix: str, full_attention: bool = False) -> Tensors | Experts:
    """A decoder layer's parameter at (index, block, ...) under `prefix`
    (full_attention: a multi-token prediction layer's)."""
    ling = cfg.family == "bailing_hybrid"
    i, block, *tail = path
    layer = f"{prefix}layers.{i}."
    if block.endswith("layernorm"):
        if cfg.family == "olmo_hybrid":
            block = _OLMO_NORMS.get(block, block)
        return _same(layer + block + ".weight")
    if block in ("attn_hc", "ffn_hc"):  # GLM-5-Next's hyper-connections: hc_attn_fn, hc_ffn_base, ...
        key = f"{layer}hc_{block.removesuffix('_hc')}_{tail[0]}"
        return _transposed(key) if tail[0] == "fn" else _same(key)
    if block in ("attn_hyper_connection", "mlp_hyper_connection"):  # Qwen4-Exp's gated residuals
        return _gated_residual(layer + block, tail)
    if block == "ple":
        if tail[0] == "embedding":
            return _ngram_table(cfg, int(i), layer + "ple.ple_embedding")
        if tail[0] == "conv_weight":
            return Tensors((layer + "ple.conv1d.weight",), lambda w: w[:, 0].T, lambda p: (p.T[:, None],))
        leaf = tail[-1]
        return _transposed(f"{layer}ple.{tail[0]}.weight") if leaf == "kernel" else _same(f"{layer}ple.{tail[0]}.{leaf}")
    linear = not full_attention and cfg.resolved_layer_types[int(i)] == "linear_attention"
    if block == "mixer" and linear and cfg.linear_kind == "kda":
        return _kda(cfg, tail[0], layer)
    if block == "mixer" and tail[0] in ("conv_weight", "dt_bias", "A_log", "norm_weight", "in_proj_qkvz",
                                        "in_proj_ba", "out_proj"):
        return _gdn(cfg, tail[0], layer)
    kimi = cfg.family == "kimi_linear"
    mlp = "block_sparse_moe." if kimi else "mlp."
    if tail[0].startswith("experts_"):
        part = tail[0].removeprefix("experts_")
        return Experts(layer + mlp + "experts", part, _KIMI_EXPERTS[part] if kimi else f"{part}_proj",
                       fused=cfg.family == "lara_mini")
    if block == "mlp" and tail == ["e_score_correction_bias"]:
        return _same(layer + mlp + ("gate.expert_bias" if ling else "gate.e_score_correction_bias"))
    if (kimi or ling or cfg.family == "glm5_next") and tail[0] == "shared_expert":
        tail = ["shared_experts", *tail[1:]]
    if ling and block == "mixer" and tail[0] == "o_proj":
        tail = ["dense", *tail[1:]]
    mixer = "attention." if ling else "self_attn."
    module = layer + (mixer if block == "mixer" else mlp) + ".".join(tail[:-1])
    leaf = tail[-1]
    return _transposed(module + ".weight") if leaf == "kernel" else _same(module + "." + leaf)
