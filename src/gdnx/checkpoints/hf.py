"""Load and save Hugging Face directories of every family gdnx builds
(config.json and safetensors, sharded with model.safetensors.index.json or
not); gdnx.checkpoints.hf_names says where each parameter lives.

Experts are read in the published per-expert layout
(mlp.experts.{e}.gate_proj.weight ...) or in the fused one transformers 5
keeps in memory (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]),
and written per expert, which every transformers version reads. The
multi-token prediction head (mtp.*) and a vision-language checkpoint's
vision tower are not part of the language model: loading skips them and
says so in one line.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from gdnx.files import atomic_write, atomic_write_text, read_json_object
from gdnx.checkpoints.hf_config import VISION_LANGUAGE, hf_config_from_model, model_config_from_hf
from gdnx.checkpoints.hf_names import Experts, locate
from gdnx.config.schema import ModelConfig
from gdnx.stacking import layer_paths

# not part of the language model: multi-token prediction (mtp.*), a
# vision-language checkpoint's vision tower, RoPE tables
SKIPPED = re.compile(r"^mtp\.|^model\.visual\.|rotary_emb\.inv_freq$")
SHARD_BYTES = 4 * 2 ** 30
log = logging.getLogger("gdnx")
# The model as checkpoints see it: an nnx.Module built from a ModelConfig,
# holding it as `config`, with parameters named as gdnx.stacking lays them out.
Model = TypeVar("Model", bound=nnx.Module)


def _config_of(model: nnx.Module) -> ModelConfig:
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"model: expected a module holding its ModelConfig as .config, got {type(model).__name__}")
    return cfg


def _t(x):
    return jnp.swapaxes(x, -1, -2)


_STORED_INTEGERS = {"BOOL": "bool", **{f"{c}{b}": f"{n}{b}" for c, n in (("I", "int"), ("U", "uint"))
                                         for b in (8, 16, 32, 64)}}


class _Reader:
    """Tensors by name across the directory's safetensors files."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{index}: not a safetensors index (JSON with a weight_map)") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{directory}: no *.safetensors files")
            weight_map = {}
        self.handles = {}
        for f in files:
            try:
                self.handles[f] = safe_open(directory / f, framework="flax")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{directory / f}: not a readable safetensors file ({e}); truncated or "
                                 "corrupt?") from None
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
        try:
            handle = self.handles[self.weight_map[key]]
            stored = handle.get_slice(key).get_dtype()  # as in the file: F32, BF16, I64, BOOL, ...
            value = handle.get_tensor(key)
        except SafetensorError as e:
            raise ValueError(f"{self.weight_map[key]}: {key} cannot be read ({e}); truncated or corrupt?") from None
        # a weight is floating point and finite; an integer, boolean or NaN tensor is not one to cast and use
        if not stored.startswith(("F", "BF")):
            name = _STORED_INTEGERS.get(stored, stored.lower())
            raise ValueError(f"{self.weight_map[key]}: {key} is {name}, expected floating-point weights; "
                             "the file was not written as a model's weights")
        if not bool(jnp.isfinite(value).all()):
            raise ValueError(f"{self.weight_map[key]}: {key} holds NaN or infinite values; the checkpoint is damaged")
        return value


def _load_experts(reader: _Reader, where: Experts, num_experts: int) -> jax.Array:
    prefix, part = where
    if reader.has(f"{prefix}.0.{part}_proj.weight"):
        return jnp.stack([_t(reader.get(f"{prefix}.{e}.{part}_proj.weight")) for e in range(num_experts)])
    if part == "down":
        return _t(reader.get(f"{prefix}.down_proj"))
    fused = reader.get(f"{prefix}.gate_up_proj")  # [E, 2I, H]
    half = fused.shape[1] // 2
    return _t(fused[:, :half] if part == "gate" else fused[:, half:])


def _load_one(reader: _Reader, cfg: ModelConfig, path: tuple, prefix: str, directory: Path,
              shape: tuple[int, ...]) -> jax.Array:
    """The parameter at an unrolled path from its Hugging Face tensors,
    refused unless it has this shape."""
    where = locate(cfg, path, prefix)
    if isinstance(where, Experts):
        value = _load_experts(reader, where, cfg.num_experts)
        stored = f"{tuple(value.shape)} (experts stacked, in gdnx's [in, out] layout)"
    else:
        tensors = [reader.get(k) for k in where.keys]
        value = where.to_param(*tensors)
        stored = " and ".join(str(tuple(t.shape)) for t in tensors)
    if tuple(value.shape) != shape:
        keys = where.prefix if isinstance(where, Experts) else ", ".join(where.keys)
        raise ValueError(f"{directory}: {keys}: the file's shape {stored} does not fit this config, which needs "
                         f"{shape} in gdnx's layout (a matrix's [in, out]; the file stores [out, in])")
    return value


def _note_skipped(directory: Path, keys: list[str]) -> None:
    for start, what in (("model.visual.", "the vision tower"), ("mtp.", "the multi-token prediction head")):
        count = sum(k.startswith(start) for k in keys)
        if count:
            log.warning(f"{directory}: skipped {what} ({count} tensors under {start}*); gdnx builds the "
                        "language model")


def load_pretrained(build: Callable[[ModelConfig], Model], path: str | os.PathLike, **config_overrides: Any,
                    ) -> Model:
    """The model `build` makes from the directory's config.json (with
    `config_overrides`), holding the directory's weights."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    hf = read_json_object(config_file)
    cfg = model_config_from_hf(hf, config_overrides)
    prefix = "model.language_model." if hf.get("model_type") in VISION_LANGUAGE else "model."
    abstract = nnx.eval_shape(lambda: build(cfg))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]  # two filters, three parts
    reader = _Reader(directory)
    missing, loaded = [], []
    for p, var in nnx.to_flat_state(params):
        # a scanned model's stacked parameter gathers one tensor per layer
        paths, stacked = layer_paths(cfg, p)
        shape = tuple(var.shape[1:] if stacked else var.shape)
        try:
            values = [_load_one(reader, cfg, q, prefix, directory, shape) for q in paths]
        except KeyError as e:
            missing.append(str(e.args[0]))
            continue
        value = jnp.stack(values) if stacked else values[0]
        loaded.append((p, var.replace(jnp.asarray(value, var.dtype))))
    if missing:
        raise ValueError(f"{directory}: missing weights: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unused = [k for k in reader.weight_map if k not in reader.used]
    unexpected = [k for k in unused if not SKIPPED.search(k)]
    if unexpected:
        raise ValueError(f"{directory}: weights this model has no place for: {', '.join(sorted(unexpected)[:8])}")
    _note_skipped(directory, unused)
    params = nnx.from_flat_state(loaded)
    rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, rest)
    return nnx.merge(graphdef, params, rest)


def hf_state_dict(model: nnx.Module) -> dict[str, jax.Array]:
    """The model's parameters under Hugging Face names and layouts (its
    family's text model)."""
    cfg = _config_of(model)
    out = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        paths, stacked = layer_paths(cfg, p)
        for i, q in enumerate(paths):
            where = locate(cfg, q)
            value = var[i] if stacked else var[...]
            if isinstance(where, Experts):
                for e in range(value.shape[0]):
                    out[f"{where.prefix}.{e}.{where.part}_proj.weight"] = _t(value[e])
            else:
                out.update(zip(where.keys, where.to_hf(value)))
    return out


def _save_shard(tensors: dict[str, jax.Array], path: str) -> None:
    save_file(tensors, path, metadata={"format": "pt"})


def save_pretrained(model: nnx.Module, path: str | os.PathLike, *, shard_bytes: int = SHARD_BYTES) -> None:
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
    config = hf_config_from_model(_config_of(model))
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2))

