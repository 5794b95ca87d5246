"""FP8 checkpoints in the published block-scaled layout, written here
from a plain checkpoint's tensors (numpy and ml_dtypes only: no torch)."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate", "conv1d")
E4M3_MAX = 448.0


def _quantize(w: np.ndarray, block: tuple[int, int], factors: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float8 values, stored factors, the float32 weight they stand for)."""
    rows, cols = block
    r, c = w.shape[-2:]
    gr, gc = -(-r // rows), -(-c // cols)
    padded = np.zeros((*w.shape[:-2], gr * rows, gc * cols), np.float32)
    padded[..., :r, :c] = w
    blocks = padded.reshape(*w.shape[:-2], gr, rows, gc, cols)
    amax = np.maximum(np.abs(blocks).max(axis=(-3, -1)), 1e-12)
    scale = (amax / E4M3_MAX).astype(np.float32)
    if factors == "ue8m0":
        exponent = np.ceil(np.log2(scale)).astype(np.int32)
        scale = np.ldexp(np.float32(1), exponent).astype(np.float32)
        stored = (exponent + 127).astype(np.uint8)
    else:
        stored = scale.astype(ml_dtypes.bfloat16 if factors == "bfloat16" else np.float32)
        scale = stored.astype(np.float32)
    full = np.repeat(np.repeat(scale, rows, axis=-2), cols, axis=-1)[..., :r, :c]
    q = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return q, stored, q.astype(np.float32) * full


def fp8_values(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The float32 weight float8 values and their float32 factors stand for."""
    rows, cols = block
    r, c = values.shape[-2:]
    full = np.repeat(np.repeat(scale.astype(np.float32), rows, axis=-2), cols, axis=-1)[..., :r, :c]
    return values.astype(np.float32) * full


def fp8_tensors(tensors: dict, block: tuple[int, int], factors: str = "float32") -> tuple[dict, dict, list]:
    """(the FP8 checkpoint's tensors, the float32 values they stand for, the
    modules kept unquantized): every matrix but the embeddings, head, norms,
    routers, shared experts' gates and convolutions quantized."""
    quantized, plain, kept = {}, {}, []
    for name, w in tensors.items():
        if w.ndim >= 2 and name.endswith(("weight", "_proj")) and not any(k in name for k in KEPT):
            q, stored, value = _quantize(w.astype(np.float32), block, factors)
            quantized[name], quantized[name + "_scale_inv"], plain[name] = q, stored, value
        else:
            quantized[name], plain[name] = w, w
            kept.append(name.rsplit(".", 1)[0])
    return quantized, plain, kept


def write_fp8(directory, config: dict, tensors: dict, block: tuple[int, int], kept: list) -> None:
    """An FP8 checkpoint directory: its tensors and config.json with the
    quantization_config."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": list(block),
                                                "modules_to_not_convert": sorted(set(kept))}}
    (directory / "config.json").write_text(json.dumps(config))


def fp8_checkpoint(src, fp8_dir, plain_dir, block, factors="float32"):
    """Write src's weights as an FP8 checkpoint (fp8_dir) and the values it
    stands for in float32 (plain_dir, for transformers); returns the FP8
    checkpoint's tensors."""
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    quantized, plain, kept = fp8_tensors(tensors, block, factors)
    shutil.copytree(src, plain_dir)
    for f in plain_dir.glob("*.safetensors*"):
        f.unlink()
    save_file(plain, str(plain_dir / "model.safetensors"))
    write_fp8(fp8_dir, json.loads((src / "config.json").read_text()), quantized, block, kept)
    return quantized
