"""Load and save Hugging Face Qwen3-Next directories (config.json and
safetensors, sharded with model.safetensors.index.json or not).

Experts are read in the published per-expert layout
(mlp.experts.{e}.gate_proj.weight ...) or in the fused one transformers 5
keeps in memory (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]),
and written per expert, which every transformers version reads. mtp.*
(multi-token prediction) weights are not part of this model and are skipped.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import TYPE_CHECKING, Any
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from gdnx.checkpoints.files import atomic_write, atomic_write_text
from gdnx.checkpoints.hf_config import hf_config_from_model, model_config_from_hf

if TYPE_CHECKING:  # the model imports this module to load and save itself
    from gdnx.models.qwen3_next import Qwen3Next

IGNORED = re.compile(r"^mtp\.|rotary_emb\.inv_freq$")
SHARD_BYTES = 4 * 2 ** 30


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def _hf_name(path: tuple) -> tuple[str, str]:
    """(HF key, how the tensor differs: 'same', 'T' transposed, 'conv'
    [D, 1, W], 'experts_gate'/'experts_up'/'experts_down' split per expert)."""
    if path == ("embed_tokens", "embedding"):
        return "model.embed_tokens.weight", "same"
    if path == ("lm_head", "kernel"):
        return "lm_head.weight", "T"
    if path == ("norm", "weight"):
        return "model.norm.weight", "same"
    _, i, *rest = path
    prefix = f"model.layers.{i}."
    block, *tail = rest
    if block in ("input_layernorm", "post_attention_layernorm"):
        return prefix + block + ".weight", "same"
    leaf = tail[-1]
    if block == "mixer" and tail[0] in ("conv_weight", "dt_bias", "A_log", "norm_weight"):
        name = {"conv_weight": "conv1d.weight", "norm_weight": "norm.weight"}.get(tail[0], tail[0])
        return prefix + "linear_attn." + name, "conv" if tail[0] == "conv_weight" else "same"
    module = "linear_attn" if block == "mixer" and tail[0].startswith(("in_proj", "out_proj")) else \
        "self_attn" if block == "mixer" else "mlp"
    if tail[0].startswith("experts_"):
        return prefix + "mlp.experts", tail[0]
    kind = {"kernel": "T", "bias": "same", "weight": "same"}[leaf]
    suffix = "weight" if leaf in ("kernel", "weight") else "bias"
    return prefix + module + "." + ".".join(tail[:-1]) + "." + suffix, kind


class _Reader:
    """Tensors by name across the directory's safetensors files."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{directory}: no *.safetensors files")
            weight_map = {}
        self.handles = {f: safe_open(directory / f, framework="flax") for f in files}
        if not weight_map:
            weight_map = {k: f for f, h in self.handles.items() for k in h.keys()}
        self.weight_map = weight_map
        self.used: set[str] = set()

    def has(self, key):
        return key in self.weight_map

    def get(self, key):
        if key not in self.weight_map:
            raise KeyError(key)
        self.used.add(key)
        return self.handles[self.weight_map[key]].get_tensor(key)


def _load_experts(reader: _Reader, prefix: str, kind: str, num_experts: int):
    part = kind.removeprefix("experts_")
    if reader.has(f"{prefix}.0.{part}_proj.weight"):
        return jnp.stack([_t(reader.get(f"{prefix}.{e}.{part}_proj.weight")) for e in range(num_experts)])
    if part == "down":
        return _t(reader.get(f"{prefix}.down_proj"))
    fused = reader.get(f"{prefix}.gate_up_proj")  # [E, 2I, H]
    half = fused.shape[1] // 2
    return _t(fused[:, :half] if part == "gate" else fused[:, half:])


def load_pretrained(cls: type[Qwen3Next], path: str | os.PathLike, **config_overrides: Any) -> Qwen3Next:
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (expected a Hugging Face Qwen3-Next directory)")
    cfg = model_config_from_hf(json.loads(config_file.read_text()), config_overrides)
    abstract = nnx.eval_shape(lambda: cls(cfg))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]  # two filters, three parts
    reader = _Reader(directory)
    flat = nnx.to_flat_state(params)
    missing, loaded = [], []
    for p, var in flat:
        key, kind = _hf_name(p)
        try:
            if kind.startswith("experts_"):
                value = _load_experts(reader, key, kind, cfg.num_experts)
            else:
                value = reader.get(key)
                value = _t(value) if kind == "T" else value[:, 0] if kind == "conv" else value
        except KeyError as e:
            missing.append(str(e.args[0]))
            continue
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{directory}: {key}: expected shape {tuple(var.shape)} for this config, "
                             f"got {tuple(value.shape)}")
        loaded.append((p, var.replace(jnp.asarray(value, var.dtype))))
    if missing:
        raise ValueError(f"{directory}: missing weights: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unexpected = [k for k in reader.weight_map if k not in reader.used and not IGNORED.search(k)]
    if unexpected:
        raise ValueError(f"{directory}: weights this model has no place for: {', '.join(sorted(unexpected)[:8])}")
    params = nnx.from_flat_state(loaded)
    rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, rest)
    return nnx.merge(graphdef, params, rest)


def hf_state_dict(model: Qwen3Next) -> dict[str, jax.Array]:
    """The model's parameters under Hugging Face names and layouts."""
    out = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key, kind = _hf_name(p)
        value = var[...]
        if kind.startswith("experts_"):
            part = kind.removeprefix("experts_")
            for e in range(value.shape[0]):
                out[f"{key}.{e}.{part}_proj.weight"] = _t(value[e])
        else:
            out[key] = _t(value) if kind == "T" else value[:, None] if kind == "conv" else value
    return out


def _save_shard(tensors: dict[str, jax.Array], path: str) -> None:
    save_file(tensors, path, metadata={"format": "pt"})


def save_pretrained(model: Qwen3Next, path: str | os.PathLike, *, shard_bytes: int = SHARD_BYTES) -> None:
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: jnp.asarray(v) for k, v in hf_state_dict(model).items()}
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for k, v in tensors.items():
        if shards[-1] and size + v.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        atomic_write(directory / name, functools.partial(_save_shard, shard))
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        atomic_write_text(directory / "model.safetensors.index.json", json.dumps(index, indent=2))
    config = hf_config_from_model(model.config)
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2))

