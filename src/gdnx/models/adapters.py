"""LoRA adapters on a model (gdnx.layers.lora): added to the projections
named in an AdapterSpec, and merged back into the base weights.

An adapter lives beside its projection: <path>/<projection>/lora/{lora_a,
lora_b} for a Linear, <path>/mlp/<experts weight>_lora/{lora_a, lora_b}
for routed experts; a scanned stack's adapters are stacked like the rest
of its layers.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.config.schema import LoraConfig
from gdnx.layers.lora import EXPERTS, AdapterSpec, Linear, LoRA, adapted_weight
from gdnx.layers.moe import EXPERT_WEIGHTS, SparseMoE


def adapter_spec(lora: LoraConfig | None) -> AdapterSpec | None:
    """The adapters train.lora asks for (None: no LoRA)."""
    if lora is None:
        return None
    return AdapterSpec(lora.rank, lora.alpha, lora.dropout, frozenset(lora.targets), lora.mtp)


def _path(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def add_adapters(module: nnx.Module, spec: AdapterSpec, *, param_dtype: DTypeLike, rngs: nnx.Rngs) -> int:
    """Give every projection of `module` that spec targets an adapter;
    returns how many."""
    count = 0
    for path, node in list(nnx.iter_graph(module)):
        if isinstance(node, Linear) and path and str(path[-1]) in spec.targets:
            d_in, d_out = node.kernel.shape
            node.lora = LoRA(d_in, d_out, spec, param_dtype=param_dtype, rngs=rngs, path=_path(path))
            count += 1
        elif isinstance(node, SparseMoE) and EXPERTS in spec.targets:
            for name in EXPERT_WEIGHTS:
                e, d_in, d_out = getattr(node, name).shape
                setattr(node, f"{name}_lora", LoRA(d_in, d_out, spec, param_dtype=param_dtype, rngs=rngs,
                                                   path=f"{_path(path)}/{name}", experts=e))
                count += 1
    return count


def merged_params(params: dict[tuple, Any], scale: float) -> dict[tuple, Any]:
    """Flat parameters {path: array} with each adapter merged into its base
    weight (W + scale * A B, in float32, stored in W's dtype) and the
    adapters gone."""
    out = {p: v for p, v in params.items() if p[-1] not in ("lora_a", "lora_b")}
    for p, a in params.items():
        if p[-1] != "lora_a":
            continue
        b = params[(*p[:-1], "lora_b")]
        target = adapted_weight(p)
        w = out[target]
        delta = jnp.einsum("...ir,...ro->...io", jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
        out[target] = (jnp.asarray(w, jnp.float32) + scale * delta).astype(w.dtype)
    return out
