"""Training from a checkpoint: `model.init_from` names a Hugging Face
directory (config.json and safetensors, any family gdnx builds) or a gdnx
run (its newest intact checkpoint, for staged training).

The architecture comes from the checkpoint: a config sets only the fields
that change how the same weights are computed or stored (the GDN op's
knobs, dtypes, remat, scanning, the positions, the MoE loss weight); an
architecture field it sets to another value than the checkpoint's is
refused, naming both. The tokenizer (data.tokenizer, for text and SFT
data) defaults to the checkpoint's. The weights are read straight into
their mesh shardings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdnx import quantization
from gdnx.checkpoints.hf import load_params as load_hf_params
from gdnx.checkpoints.hf import read_config as read_hf_config
from gdnx.checkpoints.orbax import CONFIG_FILE, is_run
from gdnx.checkpoints.orbax import load_params as load_run_params
from gdnx.config.reading import ConfigError, build_config, read_config_data, resolve_paths
from gdnx.config.schema import Config, ModelConfig
from gdnx.data.source import run_tokenizer
from gdnx.models import CausalLM
from gdnx.parallel import as_auto
from gdnx.parallel.rules import is_explicit
from gdnx.scales import is_scale, scale_path, weight_path
from gdnx.stacking import layer_paths

# ModelConfig fields a config may set whatever the checkpoint's: how the same
# weights are computed and stored, not what they are
FREE_FIELDS = ("init_from", "gdn_implementation", "moe_implementation", "moe_split", "gdn_interpret",
               "attention_implementation", "attention_interpret",
               "gdn_state_dtype", "gdn_decay_dtype", "gdn_matmul_dtype", "gdn_chunk_size", "gdn_residuals", "dtype",
               "param_dtype", "remat_policy", "scan_layers", "router_aux_loss_coef", "max_position_embeddings", "initializer_range",
               "quantize", "quantize_block")


def run_config(path: Path, field: str = "model.init_from") -> Config:
    try:
        return Config.model_validate(json.loads((path / CONFIG_FILE).read_text()))
    except ValueError:
        raise ValueError(f"{field} {path}: {CONFIG_FILE} is not a gdnx run config (corrupt?)") from None


def source_config(path: Path, field: str = "model.init_from") -> ModelConfig:
    """The ModelConfig of the checkpoint at `path` (a Hugging Face directory
    or a gdnx run); errors name the config field that gave the path."""
    if is_run(path):
        return run_config(path, field).model
    if not (path / "config.json").is_file():
        raise ValueError(f"{field} {path}: neither a Hugging Face directory (config.json and safetensors) "
                         "nor a gdnx run (checkpoints/ and config.json)")
    try:
        return read_hf_config(path)
    except ValueError as e:
        raise ValueError(f"{field} {path}: {e}") from None


def source_tokenizer(path: Path) -> Path | None:
    """The tokenizer.json that goes with the checkpoint, if it has one."""
    if is_run(path):
        return run_tokenizer(run_config(path))
    found = path / "tokenizer.json"
    return found if found.is_file() else None


def resolve(data: dict) -> dict:
    """Raw config data (as written, before validation) with the model's
    architecture taken from model.init_from, when set. ValueError for an
    architecture field the config sets to another value."""
    model = dict(data.get("model") or {})
    if not model.get("init_from"):
        return data
    path = Path(str(model["init_from"])).expanduser().resolve()
    source = source_config(path).model_dump()
    for field, value in model.items():
        if field in FREE_FIELDS or field not in source or value == source[field]:
            continue
        raise ValueError(f"model.{field}: {value!r} in the config, {source[field]!r} in the checkpoint "
                         f"(model.init_from {path}): the architecture comes from the checkpoint; leave "
                         f"model.{field} out (`base: finetune` sets no architecture)")
    arch = {k: v for k, v in source.items() if k not in FREE_FIELDS}
    free = {k: v for k, v in model.items() if k in FREE_FIELDS}
    if free.get("quantize", "none") != "none" and not is_run(path):
        # as generate and serve read it: an FP8 checkpoint held as int8 or int4 would be rounded twice
        # (refused), held as fp8 it keeps its own blocks
        held = read_hf_config(path, {"quantize": free["quantize"]})
        free.setdefault("quantize_block", list(held.quantize_block))
    resolved = {**data, "model": {**arch, **free, "init_from": str(path)}}
    data_section = dict(resolved.get("data") or {})
    tokenizer = source_tokenizer(path)
    if data_section.get("source") in ("text", "sft") and not data_section.get("tokenizer") and tokenizer:
        resolved["data"] = {**data_section, "tokenizer": str(tokenizer)}
    return resolved


def load_train_config(name: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """load_config for training: the same file, bases and overrides, with
    model.init_from's architecture and tokenizer filled in."""
    try:
        data = resolve(read_config_data(name, overrides))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return resolve_paths(build_config(data))


def initial_params(cfg: ModelConfig, params: Any, placement: Any | None, field: str = "model.init_from") -> Any:
    """The parameters of model.init_from, as `params` (the abstract nnx.Param
    state of CausalLM(cfg)), each created with its sharding from `placement`
    (a tree of shardings like params, or None: the default device); errors
    name `field` as the config field that gave the path."""
    assert cfg.init_from is not None
    path = Path(cfg.init_from)
    if not is_run(path):
        return load_hf_params(path, cfg, params, None if placement is None else lambda _params, _cfg: placement)
    if placement is not None:
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, placement)
    run = run_config(path, field)  # read once: its model and whether it trained LoRA adapters
    source = run.model
    if run.train.lora is not None:
        raise ValueError(f"{field} {path}: the run trained LoRA adapters; export it merged (gdnx export "
                         f"{path} --out DIR --merge-lora) and use DIR")
    if source.scanned == cfg.scanned:
        return load_run_params(path, params)[0] if cfg.quantize == "none" else _quantized_run(path, cfg, params)
    # the run's layers scanned and these not, or the reverse: the same
    # weights, each restored split as the weight it becomes here (every
    # device reading its part), laid out as here (and quantized, as a
    # Hugging Face checkpoint's are on load)
    mine = source.model_copy(update={"param_dtype": cfg.param_dtype})
    held = _split_as(mine, nnx.state(nnx.eval_shape(lambda: CausalLM(mine)), nnx.Param), cfg, params)
    restored = load_run_params(path, held)[0]
    layers: dict[tuple, jax.Array] = {}
    for p, var in nnx.to_flat_state(restored):
        paths, stacked = layer_paths(mine, p)
        layers.update({q: var[...][i] if stacked else var[...] for i, q in enumerate(paths)})

    def weight(p: tuple) -> jax.Array:
        paths, stacked = layer_paths(cfg, p)
        return jnp.stack([layers[q] for q in paths]) if stacked else layers[paths[0]]

    flat = nnx.to_flat_state(params)
    variables = dict(flat)
    block = (cfg.quantize_block[0], cfg.quantize_block[1])
    quantized: dict[tuple, tuple[jax.Array, jax.Array]] = {}  # per weight: its values and factors
    out = []
    for p, var in flat:
        name = str(p[-1])
        factors = is_scale(name)
        base = weight_path(p) if factors else p
        if factors or scale_path(p) in variables:
            if base not in quantized:
                layout = (_auto(getattr(variables[base], "sharding", None)),
                          _auto(getattr(variables[scale_path(base)], "sharding", None)))
                quantized[base] = _quantize(weight(base), cfg, block, layout)
            value = quantized[base][factors]
        else:
            value = weight(p)
        out.append((p, _placed(var, value)))
    return nnx.from_flat_state(out)


def check_source(cfg: ModelConfig, field: str = "model.init_from") -> None:
    """Refuse a config whose architecture is not model.init_from's (a config
    built in Python, not through load_train_config); `field`: the config
    field that gave the path, named in the error."""
    if cfg.init_from is None:
        return
    source = source_config(Path(cfg.init_from), field).model_dump()
    mine = cfg.model_dump()
    diffs = [f for f in source if f not in FREE_FIELDS and source[f] != mine.get(f)]
    if diffs:
        hint = ("build the config with gdnx.training.init_from.load_train_config, which takes the architecture "
                "from it") if field == "model.init_from" else "give a checkpoint of this model's architecture"
        raise ValueError(f"model.{diffs[0]}: {mine.get(diffs[0])!r} here, {source[diffs[0]]!r} in the checkpoint "
                         f"({field} {cfg.init_from}); {hint}")


def _auto(sharding: Any) -> Any:
    """`sharding` on its mesh made Auto where the mesh is Explicit: the
    re-layout stacks and slices, and quantizing reshapes into blocks, which
    an Explicit mesh's types refuse."""
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) and is_explicit(sharding.mesh):
        return NamedSharding(as_auto(sharding.mesh), sharding.spec)
    return sharding


def _quantize(value: jax.Array, cfg: ModelConfig, block: tuple[int, int], out: tuple[Any, Any]) -> Any:
    """`value` quantized in blocks as cfg says, as one program whose values
    and factors are laid out as `out` says (one program whatever the
    layout, so a split weight's bits are the whole weight's)."""
    return jax.jit(quantization.quantize, static_argnums=(1, 2), out_shardings=out)(value, cfg.quantize, block)


def _split_as(source: ModelConfig, held: Any, cfg: ModelConfig, params: Any) -> Any:
    """`held` (the abstract state of a run of `source`), each leaf given
    the sharding of the leaf of `params` (CausalLM(cfg)'s) that holds its
    layers, on the same mesh made Auto (_auto), a layer dim added or
    dropped where one stacks its layers and the other does not."""
    holder: dict[tuple, tuple[Any, bool]] = {}  # per unrolled layer path: the leaf here, and whether it stacks
    for p, var in nnx.to_flat_state(params):
        paths, stacked = layer_paths(cfg, p)
        holder.update({q: (var, stacked) for q in paths})

    def split(p: tuple, var: Any) -> Any:
        paths, stacked = layer_paths(source, p)
        like, stacked_here = holder[paths[0]]
        sharding = _auto(getattr(like, "sharding", None))
        if not isinstance(sharding, NamedSharding):
            return var
        spec = (*sharding.spec, *(None,) * (len(like.shape) - len(sharding.spec)))
        if stacked and not stacked_here:
            spec = (None, *spec)
        elif stacked_here and not stacked:
            spec = spec[1:]
        return var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype,
                                                sharding=NamedSharding(sharding.mesh, P(*spec))))

    return nnx.from_flat_state([(p, split(p, var)) for p, var in nnx.to_flat_state(held)])


def _placed(var: Any, value: jax.Array) -> Any:
    """`var` holding `value`, placed where var's sharding (if any) says."""
    sharding = getattr(var, "sharding", None)
    return var.replace(value if sharding is None else jax.device_put(value, sharding))


def _quantized_run(path: Path, cfg: ModelConfig, params: Any) -> Any:
    """A run's weights held quantized here (the base of QLoRA: a run's own
    weights are never quantized, since only LoRA trains over such a base):
    each restored in float where its quantized values go (every device
    reading its part), then quantized in blocks as a Hugging Face
    checkpoint's are on load, values and factors laid out as `params`'."""
    flat = nnx.to_flat_state(params)
    variables = dict(flat)

    def factors(p: tuple) -> tuple | None:
        return scale_path(p) if scale_path(p) in variables else None

    def auto(p: tuple) -> Any:
        return _auto(getattr(variables[p], "sharding", None))

    floats = nnx.from_flat_state([
        (p, var.replace(jax.ShapeDtypeStruct(var.shape, cfg.param_dtype if factors(p) else var.dtype,
                                             sharding=auto(p))))
        for p, var in flat if not is_scale(p[-1])])
    restored = dict(nnx.to_flat_state(load_run_params(path, floats)[0]))
    block = (cfg.quantize_block[0], cfg.quantize_block[1])
    out = []
    for p, var in restored.items():
        scale = factors(p)
        if scale is None:
            out.append((p, _placed(variables[p], var[...])))
            continue
        values, grid = _quantize(var[...], cfg, block, (auto(p), auto(scale)))
        out += [(p, _placed(variables[p], values)), (scale, _placed(variables[scale], grid))]
    return nnx.from_flat_state(out)
