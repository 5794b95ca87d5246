"""Where each parameter lives on the mesh.

Parameter names follow Hugging Face's, so one table keyed by a parameter's
name (and its module's) gives its logical axes. Matrices are split over
fsdp on the model width and over tensor on heads / the MLP width (the
routed experts on their width or whole experts: gdnx.parallel.moe); columns
that belong to a head group (a GDN key head's q|k|v|z, an attention head's
q|gate) are split by whole groups. The conv taps stay whole, and so do the
vectors (norm weights, biases the table does not name, per-head decays).
Every parameter of two or more dims (per layer) must be in the table: one
it does not name is an error, never silently replicated.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from gdnx.config.schema import ModelConfig
from gdnx.parallel.moe import expert_axes, split_experts
from gdnx.parallel.rules import spec
from gdnx.scales import is_scale, weight_name
from gdnx.stacking import STACKED

_EXPERTS = ("experts_gate", "experts_up", "experts_down")

# (module name, parameter name) -> logical axes
_TABLE: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("in_proj_qkvz", "kernel"): ("embed", "key_heads"),
    ("in_proj_ba", "kernel"): ("embed", "key_heads"),
    ("in_proj_qkv", "kernel"): ("embed", "key_heads"),       # KDA: [q_i | k_i | v_i] per head
    ("f_a_proj", "kernel"): ("embed", None),                 # KDA's low-rank gates: the rank stays whole
    ("f_b_proj", "kernel"): (None, "key_heads"),
    ("g_a_proj", "kernel"): ("embed", None),
    ("g_b_proj", "kernel"): (None, "key_heads"),
    ("b_proj", "kernel"): ("embed", "key_heads"),
    ("f_proj", "kernel"): ("embed", "key_heads"),             # Ling's KDA gates, direct
    # Ling's output gates: KDA's [hidden, H * K] and latent attention's [hidden, H], its KDA heads being
    # its attention heads (ModelConfig checks)
    ("g_proj", "kernel"): ("embed", "heads"),
    ("mixer", "A_log"): ("value_heads",),
    ("mixer", "dt_bias"): ("value_heads",),
    ("out_proj", "kernel"): ("value_heads", "embed"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("q_a_proj", "kernel"): ("embed", None),                 # latent attention: the latents stay whole
    ("q_b_proj", "kernel"): (None, "heads"),
    ("kv_a_proj_with_mqa", "kernel"): ("embed", None),
    ("kv_b_proj", "kernel"): (None, "heads"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("mlp", "experts_gate"): expert_axes(False)[0],
    ("mlp", "experts_up"): expert_axes(False)[0],
    ("mlp", "experts_down"): expert_axes(False)[1],
    ("gate", "kernel"): ("embed", None),
    ("shared_expert_gate", "kernel"): ("embed", None),
    ("mixer", "conv_weight"): (None, None),  # [width, channels]: small, kept whole
    ("fc", "kernel"): (None, "embed"),  # multi-token prediction's [2 hidden, hidden]: fsdp splits its output
    # GLM-5-Next's sparse-attention indexer: every query reads the sum over its heads, so they stay whole
    # (wq_b is 1536 x 4096 at GLM-5.3-Flash's sizes); the model width splits over fsdp
    ("wq_b", "kernel"): (None, None),
    ("wk", "kernel"): ("embed", None),
    ("weights_proj", "kernel"): ("embed", None),
    ("indexer", "index_kpool_compress_ape"): (None, None),
    ("indexer", "index_kpool_compress_gate"): (None, "embed"),
    # hyper-connections' [streams x hidden, (2 + streams) streams]: small, kept whole
    ("attn_hc", "fn"): (None, None),
    ("ffn_hc", "fn"): (None, None),
    # Qwen4-Exp: the gated residuals' low-rank gates ([streams x hidden, rank], [rank, streams x hidden],
    # [streams x hidden, streams]) are small, kept whole; its indexer's heads whole as GLM's
    ("down", "kernel"): (None, None),
    ("up", "kernel"): (None, None),
    ("inject_weight", "kernel"): (None, None),
    ("index_qk_proj", "kernel"): ("embed", None),
    # its per-layer embeddings: the n-gram tables' rows over the mesh (gdnx.parallel.rules), the projections
    # from the n-gram features to each stream's key (fsdp on the features' side)
    ("embedding", "table"): ("ngram_rows", None),
    ("key_proj", "kernel"): (None, "embed"),
    ("value_proj", "kernel"): (None, "embed"),
    ("ple", "conv_weight"): (None, None),
}


def head_units(cfg: ModelConfig) -> dict[str, int]:
    """Group counts of the head-shaped dims: a mesh axis must divide these."""
    return {"key_heads": cfg.linear_num_key_heads, "value_heads": cfg.linear_num_key_heads,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads}


def _names(key_path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in key_path
            if not (hasattr(k, "name") and k.name == "value")]


def logical_axes(names: list[str], ndim: int, split_experts: bool = False) -> tuple[str | None, ...]:
    """The logical axes of the parameter at this path (module names then its
    own name). A scanned stack's parameters lead with their "layers" dim.
    Vectors and scalars the table does not name stay whole; a matrix it does
    not name raises ValueError. split_experts: the routed experts' weights
    are split by expert, not by width (gdnx.parallel.moe.split_experts)."""
    if STACKED in names:  # also under the optimizer's moments (mu, nu, ...)
        return ("layers", *logical_axes([n for n in names if n != STACKED], ndim - 1, split_experts))
    if len(names) >= 3 and names[-1] in ("lora_a", "lora_b"):
        # a LoRA adapter (gdnx.layers.lora): A [in, rank] split like its
        # projection's input, B [rank, out] like its output
        owner = names[-2]
        base = logical_axes([*names[:-2], "kernel" if owner == "lora" else owner.removesuffix("_lora")], ndim,
                            split_experts)
        return (*base[:-1], None) if names[-1] == "lora_a" else (*base[:-2], None, base[-1])
    if is_scale(names[-1]):  # a quantized weight's block factors: split as the weight (where they divide)
        return logical_axes([*names[:-1], weight_name(names[-1])], ndim, split_experts)
    if split_experts and len(names) >= 2 and names[-2] == "mlp" and names[-1] in _EXPERTS:
        gate_up, down = expert_axes(True)
        return down if names[-1] == "experts_down" else gate_up
    axes = _TABLE.get((names[-2], names[-1])) if len(names) >= 2 else None
    if axes is not None and len(axes) == ndim:
        return axes
    if ndim >= 2:
        raise ValueError(f"parameter {'/'.join(names)} (rank {ndim}): no sharding declared for it in "
                         f"gdnx.parallel.params._TABLE" + ("" if axes is None else f" at rank {ndim}"))
    return (None,) * ndim  # norm weights, biases, per-head decays, scalars: small, kept whole


def shardings(tree: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """A NamedSharding per array leaf of `tree`: the parameters, or any tree
    that holds them under their names (the optimizer's moments)."""
    units = head_units(cfg)
    split = bool(cfg.num_experts) and split_experts(cfg.moe_split, cfg.num_experts, cfg.moe_intermediate_size, mesh)

    def one(key_path, x):
        names = _names(key_path)
        axes = logical_axes(names, x.ndim, split)
        # a scale's dims count blocks, not the weight's head groups
        return NamedSharding(mesh, spec(axes, x.shape, units=None if is_scale(names[-1]) else units,
                                        mesh=mesh))
    return jax.tree_util.tree_map_with_path(one, tree)


def shard(tree: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """`tree` placed on `mesh` per `shardings`."""
    return jax.device_put(tree, shardings(tree, cfg, mesh))
