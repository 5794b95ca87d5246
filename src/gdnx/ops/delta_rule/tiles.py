"""Tile sizes of the Pallas kernels, chosen per target device and shape.

`chunk_gated_delta_rule(..., tiles=None)` takes the table's entry for the
device the kernel is compiled for (TPU by device kind, GPU by compute
capability; the default entry for a device the table does not list) and
fits it to the call's shapes (`choose_tiles`). That device is the default
backend's first one, or the one named by `compile_target` while a program
is traced for another machine (deviceless compilation: `gdnx plan`, the
compile tests). Explicit tiles win and are checked against the shapes.
Every entry is compiled for its target in the test suite.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Literal, overload

import jax

from gdnx.ops.delta_rule.options import KERNEL_PLATFORMS


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


# A value head's float32 words in a TPU grid step, per head: its state and
# the chunk algebra's [C, D] and [C, C] temporaries (a rough count, checked
# by compiling: VMEM_HEADS value heads of K = V = 128 at chunk 64 fit).
def _head_words(c: int, k_dim: int, v_dim: int) -> int:
    return k_dim * v_dim + 2 * c * max(k_dim, v_dim) + 4 * c * c


_REFERENCE_HEAD = _head_words(64, 128, 128)


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """Grid parameters of the pallas_tpu kernels: every value head of a grid
    step's key heads runs in one batched form of the chunk algebra."""

    head_tile: int | None = None  # key heads per grid step (dividing HK); None: as many as value_heads allows
    value_heads: int = 8          # value heads a grid step holds at K = V = 128 and chunk 64 (fewer when larger)
    vmem_limit_mib: int = 32      # the kernels' scoped VMEM limit

    def __post_init__(self):
        for name in ("head_tile", "value_heads", "vmem_limit_mib"):
            x = getattr(self, name)
            if (x is not None or name != "head_tile") and (not isinstance(x, int) or isinstance(x, bool) or x < 1):
                raise ValueError(f"tiles.{name}: expected a positive int, got {x!r}")

    def key_heads_per_step(self, key_heads: int, group: int, chunk: int, k_dim: int, v_dim: int) -> int:
        """The head tile of a call: `head_tile`, else the most key heads
        dividing `key_heads` whose value heads (`group` each) fit
        `value_heads` scaled by their size."""
        if self.head_tile is not None:
            return self.head_tile
        fits = max(1, self.value_heads * _REFERENCE_HEAD // _head_words(chunk, k_dim, v_dim) // group)
        return max(d for d in range(1, key_heads + 1) if key_heads % d == 0 and d <= fits)


# GPU by compute capability: the sizes with the fewest spilled registers
# under ptxas (the per-kernel table is in docs/benchmarks.md). The
# output-side kernels recompute QK^T per V block, so they take V blocks as
# wide as registers allow (64 on sm_90, 32 on sm_80). The gradient-sum
# kernel takes 4 warps on sm_90 and 8 on sm_80, where each spills least. At
# K = V = 128 no kernel asks for more than ~100 KiB of shared memory with two
# stages (H100/H200 give a block 232,448 B, A100 166,912 B).
GPU_TILES = {
    "9.0": GpuTiles(block_k=16, block_v=16, output_block_v=64, state_block_k=32, state_block_v=16, num_warps=8,
                    grads_num_warps=4, num_stages=2),
    "8.0": GpuTiles(block_k=16, block_v=16, output_block_v=32, state_block_k=32, state_block_v=16, num_warps=8,
                    grads_num_warps=8, num_stages=2),
}
GPU_FALLBACK = GpuTiles()
# TPU by device kind, from deviceless compiles of the op's programs: the
# scoped VMEM each generation gives a kernel (v4 16 MiB, v5p 64, v5e and v6e
# 128) and the value heads that fit in it with double-buffered blocks.
TPU_TILES = {
    "TPU v4": TpuTiles(value_heads=4, vmem_limit_mib=15),
    "TPU v5 lite": TpuTiles(value_heads=32, vmem_limit_mib=100),
    "TPU v5": TpuTiles(value_heads=16, vmem_limit_mib=60),
    "TPU v6 lite": TpuTiles(value_heads=32, vmem_limit_mib=100),
}
TPU_FALLBACK = TpuTiles()

_TARGET: contextvars.ContextVar[jax.Device | None] = contextvars.ContextVar("gdnx_compile_target", default=None)


@contextlib.contextmanager
def compile_target(device: jax.Device) -> Iterator[None]:
    """Choose the kernels' tiles for `device` while tracing inside this
    context: a program traced here and compiled for another machine (a TPU
    slice's topology device, a GPU target) gets that machine's tiles."""
    token = _TARGET.set(device)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_platform() -> str:
    """The platform programs are traced for: the `compile_target`'s, else
    the default backend's."""
    target = _TARGET.get()
    return target.platform if target is not None else jax.default_backend()


@overload
def tiles_for(implementation: Literal["pallas_gpu"], device: jax.Device | None = None) -> GpuTiles: ...
@overload
def tiles_for(implementation: Literal["pallas_tpu"], device: jax.Device | None = None) -> TpuTiles: ...
@overload
def tiles_for(implementation: str, device: jax.Device | None = None) -> GpuTiles | TpuTiles: ...
def tiles_for(implementation: str, device: jax.Device | None = None) -> GpuTiles | TpuTiles:
    """The table's tiles of `implementation` ("pallas_gpu" or "pallas_tpu")
    for `device` (default: the `compile_target`, else the first device of
    the default backend), before they are fitted to a call's shapes."""
    if implementation not in KERNEL_PLATFORMS:
        raise ValueError(f"implementation: expected one of {sorted(KERNEL_PLATFORMS)}, got {implementation!r}")
    device = device or _TARGET.get() or jax.devices()[0]
    on_target = device.platform == KERNEL_PLATFORMS[implementation]
    if implementation == "pallas_gpu":
        key = str(getattr(device, "compute_capability", ""))
        return GPU_TILES.get(key, GPU_FALLBACK) if on_target else GPU_FALLBACK
    return TPU_TILES.get(device.device_kind, TPU_FALLBACK) if on_target else TPU_FALLBACK


@overload
def choose_tiles(implementation: Literal["pallas_gpu"], tiles: object, *, key_heads: int) -> GpuTiles: ...
@overload
def choose_tiles(implementation: Literal["pallas_tpu"], tiles: object, *, key_heads: int) -> TpuTiles: ...
@overload
def choose_tiles(implementation: str, tiles: object, *, key_heads: int) -> GpuTiles | TpuTiles: ...
def choose_tiles(implementation: str, tiles: object, *, key_heads: int) -> GpuTiles | TpuTiles:
    """The tiles a kernel runs with on a call with `key_heads` key heads (per
    shard under shard_map). None: the target's table entry, whose head tile
    the kernel fits to the call's heads (`TpuTiles.key_heads_per_step`).
    Explicit tiles are checked: their kind, and that they fit the shapes."""
    if tiles is None:
        return tiles_for(implementation)
    kind = GpuTiles if implementation == "pallas_gpu" else TpuTiles
    if not isinstance(tiles, kind):
        raise TypeError(f"tiles: implementation={implementation!r} takes {kind.__name__} or None, "
                        f"got {type(tiles).__name__}")
    if isinstance(tiles, TpuTiles) and tiles.head_tile is not None and key_heads % tiles.head_tile:
        raise ValueError(f"tiles.head_tile={tiles.head_tile} must divide the key heads HK={key_heads}")
    return tiles
