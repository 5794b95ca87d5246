"""Block-scaled FP8 checkpoints, as Qwen and DeepSeek publish them.

config.json's `quantization_config` = {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128], activation_scheme: dynamic,
modules_to_not_convert: [...]}: each quantized matrix W [out, in] is
stored as float8_e4m3fn with `<name>_scale_inv`, one factor per block of
weight_block_size (rows, columns), the blocks at the right and bottom edges
partial; W = fp8 x scale_inv block by block. The factors are float32 (or
bfloat16), or UE8M0 exponents (float8_e8m0fnu or uint8: 2^(e - 127)).
Experts are stored per expert, each its own matrix and factors; a 3-D
tensor takes one factor block grid per leading index. What
modules_to_not_convert names is stored unquantized and read as any other
tensor. numpy cannot read float8 through safetensors, so these tensors are
read from the file's bytes (its header gives their place), a slice at a
time.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

# safetensors dtype names of the float8 formats read here
FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
EXPONENTS = {"F8_E8M0": ml_dtypes.float8_e8m0fnu, "U8": np.uint8}
FACTORS = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
SCALE_SUFFIX = "_scale_inv"
READ_METHODS = ("fp8",)


@dataclass(frozen=True)
class BlockFp8:
    """A checkpoint's FP8 layout: the (rows, columns) of a scale's block."""
    block: tuple[int, int]


def quantization_config(block: tuple[int, int], kept: list[str]) -> dict:
    """config.json's quantization_config of an FP8 checkpoint with blocks of
    `block` and the modules `kept` unquantized."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            "modules_to_not_convert": kept}


def quantization(hf_config: dict, where: str) -> BlockFp8 | None:
    """The layout config.json's quantization_config states (None without
    one); a method gdnx does not read is a ValueError naming it."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in READ_METHODS:
        raise ValueError(f"{where}: config.json's quantization_config.quant_method is {method!r}; gdnx reads "
                         "fp8 (float8_e4m3fn weights with a weight_scale_inv per block, as Qwen and DeepSeek "
                         "publish them), not gptq, awq, bitsandbytes or other methods")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}: quantization_config.fmt is {fmt!r}; gdnx reads e4m3")
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{where}: quantization_config.weight_block_size: expected [rows, columns] of positive "
                         f"ints, got {block!r}")
    return BlockFp8((block[0], block[1]))


class RawTensors:
    """Tensors read from a safetensors file's bytes (dtypes numpy has no
    name for in safetensors), a slice at a time through a memory map."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(size))
        self.start = 8 + size

    def dtype(self, key: str) -> str:
        return self.header[key]["dtype"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def get(self, key: str, index: tuple[slice, ...], dtype: DTypeLike) -> np.ndarray:
        entry = self.header[key]
        begin, _ = entry["data_offsets"]
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start + begin,
                         shape=(math.prod(entry["shape"]) * np.dtype(dtype).itemsize,))
        return np.asarray(data.view(dtype).reshape(entry["shape"])[index])


def factors(raw: RawTensors, key: str, index: tuple[slice, ...]) -> np.ndarray:
    """The scale factors at `index` (of the scale's grid) as float32."""
    stored = raw.dtype(key)
    if stored in FACTORS:
        return raw.get(key, index, FACTORS[stored]).astype(np.float32)
    if stored in EXPONENTS:
        exponents = raw.get(key, index, EXPONENTS[stored])
        if stored != "U8":
            return exponents.astype(np.float32)
        return np.ldexp(np.float32(1), exponents.astype(np.int32) - 127).astype(np.float32)
    raise ValueError(f"{raw.path.name}: {key} is {stored}; expected float32, bfloat16 or float16 factors or UE8M0 "
                     "exponents (float8_e8m0fnu or uint8)")


def scale_shape(shape: tuple[int, ...], layout: BlockFp8) -> tuple[int, ...]:
    """The factor grid a quantized tensor of `shape` needs."""
    rows, cols = layout.block
    return (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // cols))


def dequantized(raw: RawTensors, key: str, scale_raw: RawTensors, scale_key: str, index: tuple[slice, ...],
                layout: BlockFp8) -> np.ndarray:
    """The float32 values of the quantized tensor `key` at `index` (slices
    with their bounds stated, one per dim): each value times its block's
    factor."""
    values = raw.get(key, index, FLOAT8[raw.dtype(key)]).astype(np.float32)
    rows, cols = layout.block
    lead, (r, c) = index[:-2], index[-2:]
    grid = factors(scale_raw, scale_key, (*lead, slice(r.start // rows, -(-r.stop // rows)),
                                          slice(c.start // cols, -(-c.stop // cols))))
    ri = np.arange(r.start, r.stop) // rows - r.start // rows
    ci = np.arange(c.start, c.stop) // cols - c.start // cols
    return values * grid[..., ri, :][..., ci]
