"""`gdnx export`: a training run's newest intact checkpoint as a Hugging
Face directory (config.json, safetensors, sharded with an index above 4
GiB, and the run's tokenizer files) that transformers loads; for a LoRA
run, its adapters merged into the base weights (merge_lora) or as a PEFT
adapter directory for the base model (adapter). A whole model (model,
merge_lora) may be written as a block-scaled FP8 checkpoint (fp8)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

from gdnx.data.source import run_tokenizer

# beside a tokenizer.json, the files transformers' tokenizer also reads
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
Form = Literal["model", "merge_lora", "adapter"]


def export_run(run_dir: Path, out: Path, form: Form = "model", fp8: bool = False) -> tuple[int, list[str]]:
    """Write run_dir's newest intact checkpoint to `out` (new or empty).
    form: model (a run without LoRA), merge_lora (a LoRA run's adapters
    merged into its base), adapter (a LoRA run's adapters for PEFT). fp8:
    the whole model quantized to float8_e4m3fn in blocks of
    model.quantize_block, written in the published FP8 layout (what the
    run's model.quantize=fp8 holds; a QLoRA run's merged weights quantized
    again). Returns its step and one note per thing worth saying (a damaged
    newer checkpoint skipped, no tokenizer to copy)."""
    import jax.numpy as jnp
    from flax import nnx

    from gdnx.checkpoints.hf import checkpoint_prefix
    from gdnx.checkpoints.orbax import is_run
    from gdnx.checkpoints.peft import save_adapter
    from gdnx.files import read_json_object
    from gdnx.models import CausalLM
    from gdnx.models.adapters import merged_params
    from gdnx.quantization import dequantized_params, quantize
    from gdnx.scales import scale_path
    from gdnx.runs import load_run

    if fp8 and form == "adapter":
        raise ValueError("--fp8: an adapter is written as PEFT stores it; --fp8 writes a whole model (without a "
                         "flag, or with --merge-lora)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new one")
    if not is_run(run_dir):
        raise ValueError(f"RUN_DIR {run_dir}: not a gdnx training run (checkpoints/ and config.json)")
    model, config, step, notes = load_run(run_dir)
    lora = config.train.lora
    if lora is None and form != "model":
        raise ValueError(f"--{form.replace('_', '-')}: the run trained every weight (no train.lora); export it "
                         "without the flag")
    if lora is not None and form == "model":
        raise ValueError("RUN_DIR: the run trained LoRA adapters on a frozen base: export them merged into it "
                         "(--merge-lora) or as a PEFT adapter for it (--adapter)")
    # a GLM-5-Next run started from a vision-language checkpoint: the export carries its vision tower
    base_dir = Path(config.model.init_from) if config.model.init_from else None
    vision_from = base_dir if config.model.family == "glm5_next" and base_dir is not None and (
        base_dir / "config.json").is_file() and "vision_config" in read_json_object(base_dir / "config.json") \
        else None
    if form == "adapter":
        assert lora is not None and config.model.init_from is not None
        base = Path(config.model.init_from)
        hf_dir = (base / "config.json").is_file() and any(base.glob("*.safetensors"))
        prefix = checkpoint_prefix(base) if hf_dir else "model."
        adapters = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
        save_adapter(config.model, lora, {p: v[...] for p, v in adapters.items()}, out, str(base), prefix)
    elif form == "model" and not fp8:
        model.save_pretrained(out, vision_from=vision_from)
    else:
        flat = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        cfg = config.model
        block = (cfg.quantize_block[0], cfg.quantize_block[1])
        if cfg.quantize != "none":  # a quantized base: merged into its dequantized weights
            flat = dequantized_params(flat, block, cfg.param_dtype)
            cfg = cfg.model_copy(update={"quantize": "none"})
        if lora is not None:
            flat = merged_params(flat, lora.alpha / lora.rank)
        if fp8:
            cfg = cfg.model_copy(update={"quantize": "fp8"})
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg)), nnx.Param)
        held = dict(nnx.to_flat_state(abstract))
        for path in held:
            scale = scale_path(path)
            if scale in held:
                flat[path], flat[scale] = quantize(jnp.asarray(flat[path]), "fp8", block)
        params = nnx.from_flat_state([(p, var.replace(flat[p])) for p, var in held.items()])
        nnx.merge(graphdef, params).save_pretrained(out, fp8_layout=fp8, vision_from=vision_from)
    tokenizer = run_tokenizer(config)
    if tokenizer is None:
        notes.append(f"the run ({config.data.source}{' as raw bytes' if config.data.source != 'mqar' else ''}) "
                     "has no tokenizer.json: none copied")
    else:
        for name in _TOKENIZER_FILES:
            if (tokenizer.parent / name).is_file() and (name != "tokenizer.json" or tokenizer.name == name):
                shutil.copyfile(tokenizer.parent / name, out / name)
        if tokenizer.name != "tokenizer.json":
            shutil.copyfile(tokenizer, out / "tokenizer.json")
    return step, notes
