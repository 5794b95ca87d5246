"""Load and save Hugging Face directories of every family gdnx builds
(config.json and safetensors, sharded with model.safetensors.index.json or
not); gdnx.checkpoints.hf_names says where each parameter lives.

Experts are read in the published per-expert layout
(mlp.experts.{e}.gate_proj.weight ...) or in the fused one transformers 5
keeps in memory (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]),
and written per expert, which every transformers version reads. The
multi-token prediction head (mtp.*; Ling 3's: the layers after
num_hidden_layers) and a vision-language checkpoint's vision tower are not
part of the language model: loading skips them and says so in one line.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import ml_dtypes
from jax.experimental import multihost_utils
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from gdnx import quantization
from gdnx.files import atomic_write, atomic_write_text, read_json_object
from gdnx.checkpoints import fp8
from gdnx.checkpoints.hf_config import VISION_LANGUAGE, hf_config_from_model, model_config_from_hf
from gdnx.checkpoints.hf_names import ALIASES, Experts, Index, locate, ngram_buffers
from gdnx.config.schema import ModelConfig
from gdnx.scales import is_scale, scale_path, weight_path
from gdnx.stacking import layer_paths

# not part of the language model: multi-token prediction (mtp.*), a
# vision-language checkpoint's vision tower, RoPE tables
SKIPPED = re.compile(r"^mtp\.|^model\.visual\.|rotary_emb\.inv_freq$")
SHARD_BYTES = 4 * 2 ** 30
# the families transformers writes as vision-language models (an export may carry the source's tower)
VISION_TOWERS = ("glm5_next", "qwen4_exp")
log = logging.getLogger("gdnx")
# The model as checkpoints see it: an nnx.Module built from a ModelConfig,
# holding it as `config`, with parameters named as gdnx.stacking lays them out.
Model = TypeVar("Model", bound=nnx.Module)


def _config_of(model: nnx.Module) -> ModelConfig:
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"model: expected a module holding its ModelConfig as .config, got {type(model).__name__}")
    return cfg


_STORED_INTEGERS = {"BOOL": "bool", **{f"{c}{b}": f"{n}{b}" for c, n in (("I", "int"), ("U", "uint"))
                                         for b in (8, 16, 32, 64)}}


class _Reader:
    """Slices of tensors by name across the directory's safetensors files,
    read as numpy on the host."""

    def __init__(self, directory: Path, aliases: tuple[tuple[str, str], ...] = (), layout: fp8.BlockFp8 | None = None):
        """aliases: (part of a name, what the files may have in its place).
        layout: the checkpoint's FP8 blocks (config.json's
        quantization_config), under which float8 tensors are read
        dequantized with their scales."""
        self.aliases, self.layout, self.directory = aliases, layout, directory
        self.raw: dict[str, fp8.RawTensors] = {}
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
                self.handles[f] = safe_open(directory / f, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{directory / f}: not a readable safetensors file ({e}); truncated or "
                                 "corrupt?") from None
        if not weight_map:
            weight_map = {k: f for f, h in self.handles.items() for k in h.keys()}
        self.weight_map = weight_map
        self.used: set[str] = set()

    def _resolve(self, key: str) -> str:
        """The name the files hold `key` under (itself, else an alias's)."""
        if key not in self.weight_map:
            for part, alias in self.aliases:
                if part in key and key.replace(part, alias) in self.weight_map:
                    return key.replace(part, alias)
        return key

    def has(self, key: str) -> bool:
        return self._resolve(key) in self.weight_map

    def _slice(self, key: str) -> Any:
        key = self._resolve(key)
        if key not in self.weight_map:
            raise KeyError(key)
        try:
            return self.handles[self.weight_map[key]].get_slice(key)
        except SafetensorError as e:
            raise ValueError(f"{self.weight_map[key]}: {key} cannot be read ({e}); truncated or corrupt?") from None

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape, from the header; refuses a tensor that is not
        floating point (an integer, boolean or NaN tensor is not one to cast
        and use)."""
        view = self._slice(key)
        key = self._resolve(key)
        stored = view.get_dtype()  # as in the file: F32, BF16, I64, BOOL, F8_E4M3, ...
        if stored in fp8.FLOAT8:
            self._check_scale(key, tuple(view.get_shape()))
        elif not stored.startswith(("F", "BF")):
            name = _STORED_INTEGERS.get(stored, stored.lower())
            raise ValueError(f"{self.weight_map[key]}: {key} is {name}, expected floating-point weights; "
                             "the file was not written as a model's weights")
        self.used.add(key)
        return tuple(view.get_shape())

    def _raw(self, key: str) -> fp8.RawTensors:
        f = self.weight_map[key]
        if f not in self.raw:
            self.raw[f] = fp8.RawTensors(self.directory / f)
        return self.raw[f]

    def _check_scale(self, key: str, shape: tuple[int, ...]) -> None:
        """A float8 tensor's scale: present, of its block grid's shape."""
        where = self.weight_map[key]
        if self.layout is None:
            raise ValueError(f"{where}: {key} is float8 and config.json has no quantization_config saying how "
                             "it is scaled")
        scale = key + fp8.SCALE_SUFFIX
        if scale not in self.weight_map:
            raise ValueError(f"{where}: {key} is float8 with no {scale} beside it")
        found, needed = self._raw(scale).shape(scale), fp8.scale_shape(shape, self.layout)
        if found != needed:
            raise ValueError(f"{self.weight_map[scale]}: {scale} has shape {found}; {key} {shape} in blocks of "
                             f"{self.layout.block} needs {needed}")
        self.used.add(scale)

    def get(self, key: str, index: Index | None = None) -> np.ndarray:
        """The tensor, or the part `index` selects (float8 tensors
        dequantized to float32 with their scales); refused when it holds NaN
        or an infinity."""
        view = self._slice(key)
        key = self._resolve(key)
        shape = tuple(view.get_shape())
        try:
            if view.get_dtype() in fp8.FLOAT8:
                self._check_scale(key, shape)
                assert self.layout is not None  # _check_scale refuses a float8 tensor without one
                scale = key + fp8.SCALE_SUFFIX
                value = fp8.dequantized(self._raw(key), key, self._raw(scale), scale, _whole(index or (), shape),
                                        self.layout)
            else:
                value = view[index if index is not None else tuple(slice(None) for _ in shape)]
        except SafetensorError as e:
            raise ValueError(f"{self.weight_map[key]}: {key} cannot be read ({e}); truncated or corrupt?") from None
        if not np.isfinite(value).all():
            raise ValueError(f"{self.weight_map[key]}: {key} holds NaN or infinite values; the checkpoint is damaged")
        return value


def _expert_keys(reader: _Reader, where: Experts, num_experts: int) -> list[str]:
    prefix, part, name, _ = where
    if reader.has(f"{prefix}.0.{name}.weight"):
        return [f"{prefix}.{e}.{name}.weight" for e in range(num_experts)]
    return [f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"]


def _experts_shape(reader: _Reader, where: Experts, num_experts: int) -> tuple[tuple[int, ...], str, str]:
    """The parameter's shape [E, in, out] as the file stores it, that
    storage in words, and the tensors' names."""
    keys = _expert_keys(reader, where, num_experts)
    shapes = [reader.shape(k) for k in keys]
    if len(keys) > 1:  # per expert: [out, in] each
        named = f"{where.prefix}.*.{where.name}.weight"
        if len(set(shapes)) != 1 or len(shapes[0]) != 2:
            raise ValueError(f"{named}: experts of shapes {sorted(set(shapes))}, expected one [out, in] shape")
        out, inp = shapes[0]
        return (len(keys), inp, out), f"{len(keys)} x {shapes[0]}", named
    shape = shapes[0]
    if len(shape) != 3:
        return shape, str(shape), keys[0]
    e, rows, cols = shape
    return (e, cols, rows // 2 if where.part != "down" else rows), str(shape), keys[0]


def _read_experts(reader: _Reader, where: Experts, num_experts: int, index: Index) -> np.ndarray:
    """Part of a routed-experts parameter [E, in, out] from the per-expert
    tensors ([out, in] each) or the fused ones (gate_up [E, 2I, H], down
    [E, H, I])."""
    experts, inputs, outputs = index
    keys = _expert_keys(reader, where, num_experts)
    if len(keys) > 1:
        return np.stack([reader.get(k, (outputs, inputs)).T for k in keys[experts]])
    if where.part == "up":  # the second half of gate_up's rows
        half = reader.shape(keys[0])[1] // 2
        outputs = slice(outputs.start + half, outputs.stop + half)
    return reader.get(keys[0], (experts, outputs, inputs)).transpose(0, 2, 1)


# the config fields a latent-attention tensor's shape follows, named when a file's shape does not fit
_SHAPED_BY = {
    "kv_a_proj_with_mqa": ("kv_lora_rank", "qk_rope_head_dim"),
    "kv_a_layernorm": ("kv_lora_rank",),
    "kv_b_proj": ("kv_lora_rank", "num_attention_heads", "qk_nope_head_dim", "v_head_dim"),
    "q_a_proj": ("q_lora_rank",),
    "q_a_layernorm": ("q_lora_rank",),
    "q_b_proj": ("q_lora_rank", "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim"),
    "ple_embedding": ("ngram_vocab_base", "ngram_rows_multiple", "ngram_size", "heads_per_ngram", "ple_embed_dim",
                      "ngram_split_parts"),
}


def _check_shape(reader: _Reader, cfg: ModelConfig, path: tuple, prefix: str, directory: Path,
                 shape: tuple[int, ...]) -> None:
    """Refuse a parameter whose tensors are missing (KeyError) or would not
    give this shape, from the files' headers (nothing read)."""
    where = locate(cfg, path, prefix)
    if isinstance(where, Experts):
        found, stored, keys = _experts_shape(reader, where, cfg.num_experts)
        note = " (experts stacked, in gdnx's [in, out] layout)"
    else:
        shapes = [reader.shape(k) for k in where.keys]
        try:
            found = tuple(jax.eval_shape(where.to_param, *(jax.ShapeDtypeStruct(x, jnp.float32)
                                                            for x in shapes)).shape)
            # the whole tensors, not only the parts a parameter takes of them: a fused tensor sliced by the
            # config's sizes would take a tensor with rows to spare (a tensor several parameters share is
            # checked by its rows in all). Sizes are compared, not shapes: transformers itself writes a
            # concatenation's parts split as it likes (OLMo Hybrid's q/k/v_conv1d in three equal parts)
            if where.pieces == 1 and found == shape:
                written = jax.eval_shape(where.to_hf, jax.ShapeDtypeStruct(shape, jnp.float32))
                if sum(math.prod(x.shape) for x in written) != sum(math.prod(x) for x in shapes):
                    found = ()
            elif where.pieces > 1 and shapes[0][0] != where.shared_rows:
                found = ()
        except (TypeError, ValueError):
            found = ()
        stored, keys, note = " and ".join(str(x) for x in shapes), ", ".join(where.keys), ""
    if found != shape:
        fields = next((f for part, f in _SHAPED_BY.items() if f".{part}." in keys), None)
        hint = f"; its shape follows model.{', model.'.join(fields)}" if fields else ""
        if path[0] == "layers" and path[2] == "mixer" and cfg.resolved_layer_types[int(path[1])] == "linear_attention":
            hint = f"; its shape follows config.json's {', '.join(_linear_fields(cfg, _hf_config(directory)))}"
        raise ValueError(f"{directory}: {keys}: the file's shape {stored}{note} does not fit this config, which "
                         f"needs {shape} in gdnx's layout (a matrix's [in, out]; the file stores [out, in]){hint}")


def _linear_fields(cfg: ModelConfig, hf: dict) -> tuple[str, ...]:
    """The config.json fields a linear-attention layer's shapes follow, as
    the file spells them (Kimi's may hold them in linear_attn_config,
    Ling's KDA heads may be its attention heads)."""
    if cfg.linear_kind != "kda":
        return ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if isinstance(hf.get("linear_attn_config"), dict):
        return tuple(f"linear_attn_config.{f}" for f in ("num_heads", "head_dim")
                     if f in hf["linear_attn_config"]) or ("linear_num_heads", "linear_head_dim")
    if cfg.family == "bailing_hybrid" and "linear_num_heads" not in hf:
        return ("num_attention_heads", "head_dim")
    return ("linear_num_heads", "linear_head_dim")


def _read(reader: _Reader, cfg: ModelConfig, path: tuple, prefix: str, index: Index) -> np.ndarray:
    """Part `index` of one layer's parameter at an unrolled path."""
    where = locate(cfg, path, prefix)
    if isinstance(where, Experts):
        return _read_experts(reader, where, cfg.num_experts, index)
    if where.read is None:  # small: read whole
        return np.asarray(where.to_param(*(reader.get(k) for k in where.keys)))[index]
    return where.read(reader.get, index)


def _whole(index: Index, shape: tuple[int, ...]) -> Index:
    """The index with every slice's bounds stated (a scalar's is empty)."""
    index = index + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _part_reader(reader: _Reader, cfg: ModelConfig, prefix: str, path: tuple, shape: tuple[int, ...],
                 dtype: Any) -> Callable[[Index | None], np.ndarray]:
    """index -> that part of the parameter at `path` (a model path: a
    stacked one reads each layer's part)."""
    paths, stacked = layer_paths(cfg, path)

    def part(index: Index | None) -> np.ndarray:
        index = _whole(index or (), shape)
        if stacked:
            return np.stack([_read(reader, cfg, q, prefix, index[1:]).astype(dtype, copy=False)
                             for q in paths[index[0]]])
        return _read(reader, cfg, paths[0], prefix, index).astype(dtype, copy=False)
    return part


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LM_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def _mtp_layer(cfg: ModelConfig, key: str) -> bool:
    """Whether `key` belongs to a Ling 3 or GLM-5-Next checkpoint's
    multi-token prediction layers, which they store as the layers after the
    decoder's (under model.layers. or model.language_model.layers.)."""
    m = _LAYER.match(key) or _LM_LAYER.match(key)
    return cfg.family in ("bailing_hybrid", "glm5_next") and m is not None and \
        int(m.group(1)) >= cfg.num_hidden_layers + cfg.mtp_num_layers


def export_prefix(cfg: ModelConfig) -> str:
    """Where an export puts the language model's tensors: under
    model.language_model. for GLM-5-Next and Qwen4-Exp (transformers
    writes them as vision-language models), else model."""
    return "model.language_model." if cfg.family in VISION_TOWERS else "model."


def checkpoint_prefix(path: str | os.PathLike) -> str:
    """Where a Hugging Face directory keeps its language model's tensors
    (language_model_prefix)."""
    directory = Path(path)
    return language_model_prefix(_hf_config(directory), _Reader(directory))


def language_model_prefix(hf: dict, reader: Any) -> str:
    """Where the language model's tensors are: model.language_model. in a
    vision-language checkpoint (a GLM-5-Next one may be flat), else model."""
    if hf.get("model_type") in VISION_LANGUAGE or reader.has("model.language_model.embed_tokens.weight"):
        return "model.language_model."
    return "model."


def _note_skipped(directory: Path, keys: list[str], cfg: ModelConfig) -> None:
    mtp_keys = [k for k in keys if _mtp_layer(cfg, k)]
    mtp_layers = sorted({int(m.group(1)) for k in mtp_keys if (m := _LAYER.match(k) or _LM_LAYER.match(k))})
    if mtp_layers:
        under = "model.language_model.layers." if _LM_LAYER.match(mtp_keys[0]) else "model.layers."
        log.warning(f"{directory}: skipped the multi-token prediction layers ({len(mtp_keys)} tensors under {under}"
                    f"{', '.join(map(str, mtp_layers))}.*); gdnx builds the language model")
    for start, what in (("model.visual.", "the vision tower"), ("mtp.", "the multi-token prediction head")):
        count = sum(k.startswith(start) for k in keys)
        if count:
            log.warning(f"{directory}: skipped {what} ({count} tensors under {start}*); gdnx builds the "
                        "language model")


def read_config(path: str | os.PathLike, overrides: dict | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory's config.json, with
    `overrides` (ModelConfig fields). An FP8 checkpoint held quantized
    (quantize=fp8) keeps its own blocks unless quantize_block is given; one
    quantized again as int8 is refused."""
    hf = _hf_config(Path(path))
    try:
        cfg = model_config_from_hf(hf, overrides)
    except ValueError as e:  # name the file the fields are in
        text = str(e)
        if text.startswith("config.json"):
            raise ValueError(f"{Path(path) / 'config.json'}{text.removeprefix('config.json')}") from None
        raise
    if cfg.family == "bailing_hybrid" and "mtp_num_layers" not in (overrides or {}) and hf.get(
            "num_nextn_predict_layers", hf.get("num_mtp_layers", 0)):
        # Ling 3's multi-token prediction layer, where the files hold it (transformers writes none)
        try:
            held = _Reader(Path(path)).has(f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight")
        except FileNotFoundError:  # a config without weights
            held = False
        if held:
            cfg = cfg.model_copy(update={"mtp_num_layers": 1})
    layout = fp8.quantization(hf, str(path))
    if layout is None or cfg.quantize == "none":
        return cfg
    if cfg.quantize != "fp8":
        raise ValueError(f"model.quantize: {path} is already quantized (fp8, blocks of {layout.block[0]} x "
                         f"{layout.block[1]}); hold it as fp8 (--quantize fp8) or leave it unquantized")
    if "quantize_block" in (overrides or {}):
        return cfg
    return cfg.model_copy(update={"quantize_block": layout.block})


def _hf_config(directory: Path) -> dict:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    return read_json_object(config_file)


def _layer_kind_hint(cfg: ModelConfig, reader: _Reader, missing: list[str], prefix: str) -> str:
    """Where a layer's weights are of another kind than the config's
    layer_types says (a config mistake that surfaces as missing weights),
    the field to look at."""
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.(\w+)\.")
    wanted: dict[int, set[str]] = {}
    for key in missing:
        if m := pattern.match(key):
            wanted.setdefault(int(m.group(1)), set()).add(m.group(2))
    for i, parts in sorted(wanted.items()):
        held = {m.group(2) for k in reader.weight_map if (m := pattern.match(k)) and int(m.group(1)) == i}
        other = sorted(held - parts - {"mlp", "input_layernorm", "post_attention_layernorm"})
        if other and i < len(cfg.resolved_layer_types):
            return (f"; the file's {prefix}layers.{i} holds {', '.join(o + '.*' for o in other)} where this config's "
                    f"layer {i} is {cfg.resolved_layer_types[i]!r}: config.json's layer_types (or its attention "
                    "interval) does not match the weights")
    return ""


def load_params(path: str | os.PathLike, cfg: ModelConfig, params: nnx.State,
                placement: Callable[[Any, ModelConfig], Any] | None = None) -> nnx.State:
    """The directory's weights as the parameters `params` (abstract: the
    model's nnx.Param state under eval_shape) of a model built from `cfg`;
    a missing, extra or misshapen tensor is refused before anything is read.

    placement(abstract parameters, config) -> a jax.sharding.Sharding per
    parameter: each parameter is created with it, each device's part read
    from the files' slices, so no host or device holds a whole copy of a
    sharded parameter. None: every parameter whole on the default device.
    In a multi-process run each process reads its devices' parts."""
    directory = Path(path)
    layout = fp8.quantization(_hf_config(directory), str(directory))
    reader = _Reader(directory, ALIASES.get(cfg.family, ()), layout)
    prefix = language_model_prefix(_hf_config(directory), reader)
    if layout is not None and cfg.quantize == "none":
        log.warning(f"{directory}: FP8 weights (blocks of {layout.block[0]} x {layout.block[1]}) dequantized to "
                    f"{cfg.param_dtype} on load; model.quantize=fp8 (--quantize fp8) holds them as fp8")
    _check_ngram_buffers(reader, cfg, prefix, directory)
    missing = []
    flat = nnx.to_flat_state(params)
    for p, var in flat:
        if is_scale(p[-1]):
            continue  # a quantized weight's factors: computed from its tensors, which are checked
        paths, stacked = layer_paths(cfg, p)  # a scanned model's stacked parameter gathers one tensor per layer
        shape = tuple(var.shape[1:] if stacked else var.shape)
        try:
            for q in paths:
                _check_shape(reader, cfg, q, prefix, directory, shape)
        except KeyError as e:
            missing.append(str(e.args[0]))
    if missing:
        raise ValueError(f"{directory}: missing weights: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                         + _layer_kind_hint(cfg, reader, missing, prefix))
    unused = [k for k in reader.weight_map if k not in reader.used]
    unexpected = [k for k in unused if not SKIPPED.search(k) and not _mtp_layer(cfg, k)]
    if unexpected:
        raise ValueError(f"{directory}: weights this model has no place for: {', '.join(sorted(unexpected)[:8])}")
    _note_skipped(directory, unused, cfg)
    if placement is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        places = [device] * len(flat)
    else:
        places = jax.tree.leaves(placement(params, cfg), is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    loaded = []
    shapes = {p: tuple(var.shape) for p, var in flat}
    quantized: dict[tuple, Callable] = {}  # per weight, its blocks quantized once for its values and its factors
    for (p, var), place in zip(flat, places, strict=True):
        name = str(p[-1])
        if is_scale(name) or scale_path(p) in shapes:
            part = _quantized_reader(reader, cfg, prefix, p, shapes, quantized)
        else:
            part = _part_reader(reader, cfg, prefix, p, tuple(var.shape), var.dtype)
        loaded.append((p, var.replace(jax.make_array_from_callback(tuple(var.shape), place, part))))
        if is_scale(name):  # both of the weight's parts made: its quantized blocks let go
            quantized.pop(weight_path(p), None)
    return nnx.from_flat_state(loaded)


def _quantized_reader(reader: _Reader, cfg: ModelConfig, prefix: str, path: tuple,
                      shapes: dict[tuple, tuple[int, ...]], quantized: dict[tuple, Callable],
                      ) -> Callable[[Index | None], np.ndarray]:
    """index -> that part of a quantized weight's values or of its factors
    (gdnx.quantization), quantized from the files' tensors block by block:
    a part reads the whole blocks it touches, so every device's part equals
    the same slice of the whole weight quantized at once. quantized: the
    weights' block quantizers so far, shared by a weight's two readers."""
    scale = is_scale(path[-1])
    base = weight_path(path) if scale else path
    shape = shapes[base]
    block = (cfg.quantize_block[0], cfg.quantize_block[1])
    rows, cols = quantization.fitted(shape, block)
    if base not in quantized:
        weights = _part_reader(reader, cfg, prefix, base, shape, np.float32)

        # the devices' parts of the factors select the blocks their values' parts did (when the shards follow
        # the blocks): kept for them, a local device's worth
        @functools.lru_cache(maxsize=jax.local_device_count())
        def quantize_blocks(bounds: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
            *lead, (r0, r1), (c0, c1) = bounds
            region = (*(slice(a, b) for a, b in lead), slice(r0 * cols, min(r1 * cols, shape[-2])),
                      slice(c0 * rows, min(c1 * rows, shape[-1])))
            return quantization.quantize_host(weights(region), cfg.quantize, block)
        quantized[base] = quantize_blocks

    def blocks(index: Index) -> tuple[np.ndarray, np.ndarray]:
        """(values, factors) of the blocks `index` (over the factor grid) selects."""
        return quantized[base](tuple((i.start, i.stop) for i in index))

    def part(index: Index | None) -> np.ndarray:
        if scale:
            return blocks(_whole(index or (), quantization.grid(shape, block)))[1]
        index = _whole(index or (), shape)
        lead, (r, c) = index[:-2], index[-2:]
        r0, c0 = r.start // cols, c.start // rows
        values = blocks((*lead, slice(r0, -(-r.stop // cols)), slice(c0, -(-c.stop // rows))))[0]
        return values[..., r.start - r0 * cols:r.stop - r0 * cols, c.start - c0 * rows:c.stop - c0 * rows]
    return part


def load_pretrained(build: Callable[[ModelConfig], Model], path: str | os.PathLike, *,
                    placement: Callable[[Any, ModelConfig], Any] | None = None, **config_overrides: Any,
                    ) -> Model:
    """The model `build` makes from the directory's config.json (with
    `config_overrides`), holding the directory's weights, placed per
    `placement` (load_params)."""
    cfg = read_config(path, config_overrides)
    abstract = nnx.eval_shape(lambda: build(cfg))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]  # two filters, three parts
    params = load_params(path, cfg, params, placement)
    rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, rest)
    return nnx.merge(graphdef, params, rest)


def _host(x: jax.Array) -> np.ndarray:
    """The whole array on this host: gathered from the other processes when
    they hold parts of it (every process must call this, in the same order)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def hf_tensors(model: nnx.Module) -> Iterator[tuple[str, np.ndarray]]:
    """The model's parameters under Hugging Face names and layouts (its
    family's text model), one host array at a time (a tensor several
    parameters share once all of them are in); quantized weights written
    dequantized, in the parameters' dtype. A parameter sharded over several
    processes is gathered: every process iterates this alike."""
    cfg = _config_of(model)
    for key, tensor, _ in _tensors(model, jnp.dtype(cfg.param_dtype)):
        yield key, tensor


def fp8_tensors(model: nnx.Module) -> Iterator[tuple[str, np.ndarray]]:
    """As `hf_tensors`, a model held in fp8 written as published FP8
    checkpoints store it: each quantized matrix float8_e4m3fn [out, in] with
    its `_scale_inv` per block of model.quantize_block. Where gdnx's layout
    is the file's transposed, the values and factors are the model's (the
    factors to a float32 ulp: the weights pass through float32); a tensor
    gdnx fuses or regroups by head (the GDN input projections, KDA's
    q|k|v) is quantized again in the file's blocks."""
    cfg = _config_of(model)
    block = (cfg.quantize_block[0], cfg.quantize_block[1])
    for key, tensor, quantized in _tensors(model, jnp.dtype(jnp.float32)):
        if not quantized:
            yield key, tensor
            continue
        values, scale = quantization.quantize_host(tensor.swapaxes(-1, -2), "fp8", block)
        yield key, np.ascontiguousarray(values.swapaxes(-1, -2))
        yield key + fp8.SCALE_SUFFIX, np.ascontiguousarray(scale.swapaxes(-1, -2))


def _check_ngram_buffers(reader: _Reader, cfg: ModelConfig, prefix: str, directory: Path) -> None:
    """Refuse a Qwen4-Exp checkpoint whose n-gram hashing constants (its
    tables' primes, offsets and multipliers) are not what the config gives:
    the ids would index other rows."""
    fields = {"layer_multipliers": "ngram_seed", "ngram_heads_vocab_sizes": "ngram_vocab_base",
              "ngram_heads_offsets": "ngram_vocab_base"}
    for key, want in ngram_buffers(cfg, prefix).items():
        if not reader.has(key):
            continue  # transformers computes them when a file leaves them out
        got = reader.get(key)
        reader.used.add(key)
        if got.shape != want.shape or not np.array_equal(got, want):
            field = fields[key.rsplit(".", 1)[1]]
            raise ValueError(f"{directory}: {key}: the checkpoint's n-gram tables hash as {got.tolist()}, this "
                             f"config as {want.tolist()}; check model.{field} (and ngram_size, heads_per_ngram, "
                             f"ple_layers)")


def _tensors(model: nnx.Module, dequantized: np.dtype) -> Iterator[tuple[str, np.ndarray, bool]]:
    """(key, tensor, whether a quantized weight gave it): a quantized weight
    dequantized in `dequantized`."""
    cfg = _config_of(model)
    pending: dict[str, list[tuple[int, np.ndarray]]] = {}  # shared tensors: (offset, rows) so far

    def piece(key: str, offset: int, rows: np.ndarray, pieces: int, axis: int = 0) -> Iterator[tuple[str, np.ndarray]]:
        parts = pending.setdefault(key, [])
        parts.append((offset, rows))
        if len(parts) == pieces:
            del pending[key]
            yield key, np.ascontiguousarray(np.concatenate([r for _, r in sorted(parts, key=lambda p: p[0])],
                                                           axis=axis))

    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for p, var in flat.items():
        if is_scale(p[-1]):
            continue
        whole = _host(var[...])
        scale = flat.get(scale_path(p))
        if scale is not None:
            block = (cfg.quantize_block[0], cfg.quantize_block[1])
            whole = np.asarray(quantization.dequantize(jnp.asarray(whole), jnp.asarray(_host(scale[...])), block,
                                                       dequantized))
        paths, stacked = layer_paths(cfg, p)
        for i, q in enumerate(paths):
            where = locate(cfg, q, export_prefix(cfg))
            value = whole[i] if stacked else whole
            if isinstance(where, Experts) and where.fused:  # gate_up [E, 2I, H], down [E, H, I]
                if where.part == "down":
                    out = iter([(f"{where.prefix}.down_proj", np.ascontiguousarray(value.transpose(0, 2, 1)))])
                else:
                    out = piece(f"{where.prefix}.gate_up_proj", int(where.part == "up"), value.transpose(0, 2, 1),
                                2, axis=1)
            elif isinstance(where, Experts):
                out = ((f"{where.prefix}.{e}.{where.name}.weight", np.ascontiguousarray(value[e].T))
                       for e in range(value.shape[0]))
            elif where.pieces > 1:
                (key,), (rows,) = where.keys, where.to_hf(value)
                out = piece(key, where.offset, rows, where.pieces)
            else:
                out = ((key, np.ascontiguousarray(tensor)) for key, tensor in zip(where.keys, where.to_hf(value)))
            for key, tensor in out:
                yield key, tensor, scale is not None
    assert not pending, f"tensors missing a part: {sorted(pending)}"  # every shared tensor's parameters are built
    for key, buffer in ngram_buffers(cfg, export_prefix(cfg)).items():
        yield key, buffer, False


def _vision_tower(directory: Path, cfg: ModelConfig) -> tuple[dict, Iterator[tuple[str, np.ndarray]]]:
    """A vision-language checkpoint's tower: its config.json's fields
    besides the language model's (vision_config, the image and video token
    ids) and its model.visual.* tensors, read one at a time."""
    if cfg.family not in VISION_TOWERS:
        raise ValueError(f"vision_from: carries a vision tower of {' or '.join(VISION_TOWERS)}; this model is "
                         f"{cfg.family}")
    hf = _hf_config(directory)
    if hf.get("model_type") != cfg.family or not isinstance(hf.get("vision_config"), dict):
        raise ValueError(f"vision_from {directory}: not a {cfg.family} vision-language checkpoint (model_type "
                         f"{cfg.family} with a vision_config); got model_type {hf.get('model_type')!r}")
    reader = _Reader(directory, (), None)
    keys = sorted(k for k in reader.weight_map if k.startswith("model.visual."))
    if not keys:
        raise ValueError(f"vision_from {directory}: holds no vision tower tensors (model.visual.*)")
    fields = {k: v for k, v in hf.items() if k not in ("text_config", "architectures", "model_type", "dtype",
                                                        "torch_dtype", "transformers_version")}
    return fields, ((k, reader.handles[reader.weight_map[k]].get_tensor(k)) for k in keys)


def hf_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    return dict(hf_tensors(model))


def _save_shard(tensors: dict[str, np.ndarray], path: str) -> None:
    save_file(tensors, path, metadata={"format": "pt"})


def save_pretrained(model: nnx.Module, path: str | os.PathLike, *, shard_bytes: int = SHARD_BYTES,
                    fp8_layout: bool = False, vision_from: str | os.PathLike | None = None) -> None:
    """Write config.json and the weights as safetensors, in files of up to
    shard_bytes (with model.safetensors.index.json when more than one),
    filled tensor by tensor: the host holds one file's tensors at a time. A
    sharded model writes the same bits as a whole one; with several
    processes every process takes part and process 0 writes the files.
    fp8_layout: a model held in fp8 written as an FP8 checkpoint
    (`fp8_tensors`, config.json's quantization_config); otherwise quantized
    weights are written dequantized. vision_from: a vision-language
    checkpoint (GLM-5-Next's or Qwen4-Exp's) whose vision tower
    (model.visual.*, its vision_config and token ids) the export carries
    beside the language model; without one such an export has none."""
    cfg = _config_of(model)
    tower = _vision_tower(Path(vision_from), cfg) if vision_from is not None else None
    if fp8_layout and cfg.quantize != "fp8":
        raise ValueError(f"fp8_layout: the model is held {cfg.quantize!r}, not fp8; the FP8 layout writes an fp8 "
                         "model's blocks as they are (load it with quantize='fp8')")
    directory = Path(path)
    writer = jax.process_index() == 0
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    total = 0

    def flush() -> None:
        if writer:
            name = directory / f".model-part-{len(written) + 1:05d}.safetensors"
            atomic_write(name, functools.partial(_save_shard, dict(shard)))
            written.append((name, list(shard)))
        shard.clear()

    kept: set[str] = set()
    tensors = (fp8_tensors if fp8_layout else hf_tensors)(model)
    if tower is not None:
        tensors = itertools.chain(tensors, tower[1])
    for key, tensor in tensors:
        if fp8_layout and tensor.dtype != ml_dtypes.float8_e4m3fn and not key.endswith(fp8.SCALE_SUFFIX):
            module, _, name = key.rpartition(".")
            if name in ("weight", "bias"):  # a module's own tensor; a bare parameter (A_log) names no module
                kept.add(module)
        if shard and sum(v.nbytes for v in shard.values()) + tensor.nbytes > shard_bytes:
            flush()
        shard[key] = tensor
        total += tensor.nbytes
    flush()
    if not writer:
        return
    names = ["model.safetensors"] if len(written) == 1 else [
        f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    for (part, _), name in zip(written, names):
        os.replace(part, directory / name)
    if len(written) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for (_, keys), name in zip(written, names) for k in keys}}
        atomic_write_text(directory / "model.safetensors.index.json", json.dumps(index, indent=2))
    config = hf_config_from_model(cfg)
    if tower is not None:
        config = {**tower[0], **config}
    elif cfg.family in VISION_TOWERS:
        log.warning(f"{directory}: written without a vision tower (no vision_from): transformers builds one at its "
                    "default sizes, randomly initialised; the language model is the export's")
    if fp8_layout:
        if cfg.tie_word_embeddings:  # no lm_head tensor is written, but transformers builds the module
            kept.add("lm_head")
        config["quantization_config"] = fp8.quantization_config(cfg.quantize_block, sorted(kept))
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2))
