"""Checkpoints with a multi-token prediction module (mtp.*), built from a
tiny Hugging Face checkpoint of a family that has one."""

from __future__ import annotations

import json
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file


def mtp_checkpoint(src, dst, rng):
    """src with an MTP module: (directory, the MTP tensors, the full-attention layer it copies)."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    layer = config["layer_types"].index("full_attention")
    tensors = load_file(src / "model.safetensors")
    h = config["hidden_size"]
    mtp = {f"mtp.layers.0.{k.removeprefix(f'model.layers.{layer}.')}":
           (v + 0.02 * rng.standard_normal(v.shape)).astype(v.dtype)
           for k, v in tensors.items() if k.startswith(f"model.layers.{layer}.")}
    mtp["mtp.fc.weight"] = (0.1 * rng.standard_normal((h, 2 * h))).astype(np.float32)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
    save_file({**tensors, **mtp}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return dst, mtp, layer
