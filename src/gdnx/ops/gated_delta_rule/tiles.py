"""Tile sizes of the Pallas kernels, per target, with a fallback.

`chunk_gated_delta_rule(..., tiles=None)` looks up the table of the kernel
for the device the op runs on (TPU by device kind, GPU by compute
capability) and falls back to the default entry for a device it does not
list, or when the kernel is compiled from a host without that device
(deviceless compilation: pass `tiles_for(implementation, device)` of the
target device). Every entry is compiled for its target in the test suite.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, overload

import jax


@dataclasses.dataclass(frozen=True)
class GpuTiles:
    """Launch parameters of the pallas_gpu kernels."""

    block_k: int = 16         # K block of the chunk-parallel kernels' loops
    block_v: int = 16         # V block of the chunk-parallel kernels' loops
    output_block_v: int = 32  # V per program of the output and dv_local kernels
    state_block_k: int = 32   # rows of K per block of the state the sequential kernels carry
    state_block_v: int = 16   # V per program of the sequential kernels
    num_warps: int = 8
    grads_num_warps: int = 8  # warps of the V/K-sum gradient kernel (its own register balance)
    num_stages: int = 2       # software pipelining depth of the loops' loads

    def __post_init__(self):
        for name in ("block_k", "block_v", "output_block_v", "state_block_k", "state_block_v", "num_warps",
                     "grads_num_warps", "num_stages"):
            x = getattr(self, name)
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                raise ValueError(f"tiles.{name}: expected a positive int, got {x!r}")
        for name in ("block_k", "block_v", "output_block_v", "state_block_k", "state_block_v"):
            x = getattr(self, name)
            # powers of two (Triton's arrays); Triton's dot takes no dim under 16
            if x < 16 or x & (x - 1):
                raise ValueError(f"tiles.{name}: expected a power of two >= 16, got {x}")


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """Grid parameters of the pallas_tpu kernels."""

    head_tile: int = 1    # key heads per grid step; must divide HK

    def __post_init__(self):
        if not isinstance(self.head_tile, int) or isinstance(self.head_tile, bool) or self.head_tile < 1:
            raise ValueError(f"tiles.head_tile: expected a positive int, got {self.head_tile!r}")


# GPU by compute capability: the sizes that measured fewest spilled registers
# (ptxas, docs/benchmarks.md). The output-side kernels recompute QK^T per V
# block, so they take V blocks as wide as registers allow (64 on sm_90, 32
# on sm_80). The gradient-sum kernel with float32 products spills 116 B at 8
# warps on sm_90 and 8-16 B at 4 (on sm_80, 4 warps spill more than 8). At
# K = V = 128 no kernel asks for more than ~100 KiB of shared memory with two
# stages (H100/H200 give a block 232,448 B, A100 166,912 B).
GPU_TILES = {
    "9.0": GpuTiles(block_k=16, block_v=16, output_block_v=64, state_block_k=32, state_block_v=16, num_warps=8,
                    grads_num_warps=4, num_stages=2),
    "8.0": GpuTiles(block_k=16, block_v=16, output_block_v=32, state_block_k=32, state_block_v=16, num_warps=8,
                    grads_num_warps=8, num_stages=2),
}
GPU_FALLBACK = GpuTiles()
# TPU by device kind. v5p and v6e have the VMEM for two key heads per step
# (Qwen3-Next with residuals: ~2.9 MB), halving the grid steps.
TPU_TILES = {
    "TPU v4": TpuTiles(head_tile=1),
    "TPU v5 lite": TpuTiles(head_tile=1),
    "TPU v5": TpuTiles(head_tile=2),
    "TPU v6 lite": TpuTiles(head_tile=2),
}
TPU_FALLBACK = TpuTiles()
KERNEL_PLATFORMS = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


@overload
def tiles_for(implementation: Literal["pallas_gpu"], device: jax.Device | None = None) -> GpuTiles: ...
@overload
def tiles_for(implementation: Literal["pallas_tpu"], device: jax.Device | None = None) -> TpuTiles: ...
@overload
def tiles_for(implementation: str, device: jax.Device | None = None) -> GpuTiles | TpuTiles: ...
def tiles_for(implementation: str, device: jax.Device | None = None) -> GpuTiles | TpuTiles:
    """The table's tiles of `implementation` ("pallas_gpu" or "pallas_tpu")
    for `device` (default: the first device of the default backend)."""
    if implementation not in KERNEL_PLATFORMS:
        raise ValueError(f"implementation: expected one of {sorted(KERNEL_PLATFORMS)}, got {implementation!r}")
    device = jax.devices()[0] if device is None else device
    on_target = device.platform == KERNEL_PLATFORMS[implementation]
    if implementation == "pallas_gpu":
        key = str(getattr(device, "compute_capability", ""))
        return GPU_TILES.get(key, GPU_FALLBACK) if on_target else GPU_FALLBACK
    return TPU_TILES.get(device.device_kind, TPU_FALLBACK) if on_target else TPU_FALLBACK


@overload
def check_tiles(implementation: Literal["pallas_gpu"], tiles: object) -> GpuTiles: ...
@overload
def check_tiles(implementation: Literal["pallas_tpu"], tiles: object) -> TpuTiles: ...
def check_tiles(implementation: str, tiles: object) -> GpuTiles | TpuTiles:
    """`tiles` (None: from the table) as the kind the implementation takes."""
    if tiles is None:
        return tiles_for(implementation)
    kind = GpuTiles if implementation == "pallas_gpu" else TpuTiles
    if not isinstance(tiles, kind):
        raise TypeError(f"tiles: implementation={implementation!r} takes {kind.__name__} or None, "
                        f"got {type(tiles).__name__}")
    return tiles
