"""LoRA adapters as a PEFT adapter directory (adapter_config.json and
adapter_model.safetensors) that PEFT applies to the Hugging Face base model.

gdnx keeps one adapter per projection as it holds the weights; where a
family's checkpoint splits that projection into several modules (Qwen3.5's
in_proj_qkv and in_proj_z, OLMo Hybrid's q/k/v/g_proj), each module gets
the same A and its rows of B (the columns of B are the projection's output
columns, which gdnx.checkpoints.hf_names maps onto the modules' rows), so
the PEFT adapter computes exactly what the gdnx one does. Routed experts are
parameters in transformers, not modules: an adapter on them is refused
here (export the merged model instead). So is one on a Qwen3-Next MLP
projection (gate_proj, up_proj, down_proj: the shared expert's): PEFT
loads a qwen3_next adapter as one trained on the Qwen2-MoE layout
and moves every target of those names onto the routed experts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from gdnx.checkpoints.hf_names import MODULE_NAMES, Experts, locate
from gdnx.config.schema import LoraConfig, ModelConfig
from gdnx.files import atomic_write, atomic_write_text
from gdnx.layers.lora import adapted_weight
from gdnx.stacking import layer_paths

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def peft_tensors(cfg: ModelConfig, adapters: dict[tuple, np.ndarray], prefix: str = "model.",
                 ) -> tuple[dict[str, np.ndarray], list[str]]:
    """PEFT's tensors (base_model.model.<module>.lora_A / lora_B.weight) for
    the flat adapter parameters {path: host array}, and the modules they adapt."""
    out: dict[str, np.ndarray] = {}
    modules: list[str] = []
    for path, a in adapters.items():
        if path[-1] != "lora_a":
            continue
        b = adapters[(*path[:-1], "lora_b")]
        paths, stacked = layer_paths(cfg, adapted_weight(path))
        for i, q in enumerate(paths):
            where = locate(cfg, q, prefix, in_memory=True)
            if isinstance(where, Experts):
                raise ValueError("--adapter: the run's adapters include the routed experts, which transformers "
                                 "holds as parameters, not modules PEFT adapts; export with --merge-lora")
            a_i, b_i = (a[i], b[i]) if stacked else (a, b)
            for key, rows in zip(where.keys, where.to_hf(b_i)):
                module = key.removesuffix(".weight")
                for stored, in_memory in MODULE_NAMES.get(cfg.family, ()):
                    module = module.replace(stored, in_memory)
                out[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a_i.T)
                out[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(rows)
                modules.append(module)
    return out, modules


def save_adapter(cfg: ModelConfig, lora: LoraConfig, adapters: dict[tuple, Any], out: Path, base: str,
                 prefix: str = "model.") -> None:
    """Write the PEFT adapter directory `out` for the base model `base` (a
    path or a hub name, recorded as base_model_name_or_path)."""
    moved = sorted({"gate_proj", "up_proj", "down_proj"} & set(lora.targets))
    if cfg.family == "qwen3_next" and moved:
        raise ValueError(f"--adapter: PEFT loads a qwen3_next adapter's {', '.join(moved)} onto the routed experts, "
                         "not the shared expert this run adapted; export with --merge-lora, or train without those "
                         "targets")
    tensors, modules = peft_tensors(cfg, {p: np.asarray(v) for p, v in adapters.items()}, prefix)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        # the exact modules (PEFT full-matches a string against each module's name)
        "target_modules": "(" + "|".join(re.escape(m) for m in sorted(set(modules))) + ")",
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS, lambda name: save_file(tensors, name, metadata={"format": "pt"}))
    atomic_write_text(out / CONFIG, json.dumps(config, indent=2))
