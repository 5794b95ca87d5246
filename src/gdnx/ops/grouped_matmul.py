"""Grouped matrix products: the MoE layers' experts.

`grouped_matmul(x, w, group_sizes)`: x [M, K] holds rows sorted by group
(the token copies sorted by expert), group g's `group_sizes[g]` rows times
its own matrix w[g] [K, N]; rows past the groups' total are zeros. Forward
and backward never build a dense per-group copy of x.

Implementations (the `implementation` argument, the model config's
moe_implementation):
  tiled   gdnx's own, plain JAX: the rows cut into tiles, one product per
          (tile, group) pair that meets (at most tiles + groups pairs),
          batched; what runs on CPUs. Its products are at most
          (M + groups x tile) rows, the tile chosen from M / groups.
  xla     jax.lax.ragged_dot. XLA:TPU lowers it as grouped products (a
          Mosaic kernel of XLA's own); on CPUs and GPUs it becomes a
          dense product over every group (x broadcast to [groups, M, K]:
          hundreds of GiB at 512 experts), so it is refused there.
  triton  tokamax's Pallas Triton kernel (GPUs; forward and both
          gradients grouped).
  mosaic  tokamax's Pallas Mosaic kernel (Hopper and later GPUs; TPU v5
          and later).
auto (None) takes `DEFAULTS` for the platform. Quantized experts (a
qwix.QArray: int8 / int4 / float8 values with one factor per block) go to
tokamax's kernels as they are, which scale each tile as they load it (no
dequantized copy of the experts); the others dequantize them first. Their
gradient flows to x alone (the quantized weights are frozen), through the
dequantized weights. tokamax chooses its kernels'
tiles; a call traced for a machine that is not attached (gdnx plan) must
run under `jax.default_device(<that machine's device>)` so that tokamax
checks and tiles for it.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax.typing import DTypeLike
from qwix import QArray

IMPLEMENTATIONS = ("tiled", "xla", "triton", "mosaic")
# the platforms each runs on (jax's platform names; "cuda" and "rocm" are "gpu")
PLATFORMS = {"tiled": ("cpu", "gpu", "tpu"), "xla": ("tpu",), "triton": ("gpu",), "mosaic": ("gpu", "tpu")}
DEFAULTS = {"cpu": "tiled", "tpu": "xla", "gpu": "triton"}


def platform_of(name: str) -> str:
    """jax's platform name for a backend or target name ("cuda" -> "gpu")."""
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


def resolve(implementation: str | None, platform: str, field: str = "moe_implementation") -> str:
    """The implementation to run on `platform`: auto (None) picks the
    platform's default; one that cannot run there is a ValueError naming
    `field`, as is a platform with none (never a dense fallback)."""
    platform = platform_of(platform)
    if implementation is None or implementation == "auto":
        if platform not in DEFAULTS:
            raise ValueError(f"{field}: no grouped-matmul implementation runs on {platform!r} (the MoE experts "
                             f"need one of {', '.join(f'{k} on {v}' for k, v in DEFAULTS.items())})")
        return DEFAULTS[platform]
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{field}: expected auto or one of {IMPLEMENTATIONS}, got {implementation!r}")
    if platform not in PLATFORMS[implementation]:
        why = (f": XLA:{platform.upper()} lowers jax.lax.ragged_dot to a dense product over every expert"
               if implementation == "xla" else "")
        raise ValueError(f"{field}: {implementation} does not run on {platform}{why}; on {platform} use "
                         f"{' or '.join(k for k, v in PLATFORMS.items() if platform in v) or 'none'} (auto picks "
                         f"{DEFAULTS.get(platform, 'none')})")
    return implementation


class _QuietAutotuning(logging.Filter):
    """tokamax warns on every trace whose shapes its tuned tables lack; its
    default tiles are what runs, and once per shape is noise to a user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Autotuning cache miss" not in record.getMessage()


_quiet = _QuietAutotuning()


def traced_platform() -> str:
    """The platform programs are traced for: jax.default_device's when set
    (a plan's target), else the default backend's."""
    device = getattr(jax.config, "jax_default_device", None)
    if isinstance(device, jax.Device):
        return device.platform
    return device if isinstance(device, str) else jax.default_backend()


def _tokamax():
    try:
        import tokamax
        from absl import flags
    except ImportError:
        raise ValueError("moe_implementation: triton and mosaic are tokamax's kernels: pip install tokamax") from None
    # tokamax reads its settings from absl flags, parsing sys.argv on first use unless something parsed them: a
    # program's own arguments (gdnx serve --port, pytest -p) are not absl's, so its defaults are taken as parsed
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    logging.getLogger("absl").addFilter(_quiet)
    return tokamax


def grouped_matmul(x: jax.Array | QArray, w: jax.Array | QArray, group_sizes: jax.Array, *,
                   implementation: str | None = None, out_dtype: DTypeLike | None = None) -> jax.Array:
    """x [M, K] rows sorted by group, w [G, K, N], group_sizes int32 [G]
    (summing to at most M) -> [M, N] in out_dtype (default x's dtype).
    Either operand may be a qwix.QArray whose factors tile it (x: one per
    row and group of columns, float8 activations: inference only, no
    gradient). implementation: one of IMPLEMENTATIONS, None for the default
    backend's."""
    if len(x.shape) != 2 or len(w.shape) != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul: expected x [M, K], w [G, K, N], group_sizes [G], got {x.shape}, "
                         f"{w.shape}, {group_sizes.shape}")
    name = resolve(implementation, traced_platform(), "implementation")
    group_sizes = group_sizes.astype(jnp.int32)
    if isinstance(x, QArray):
        out_dtype = out_dtype or jnp.float32
        if name in ("triton", "mosaic"):
            return _tokamax().ragged_dot(x, w, group_sizes, implementation=name,
                                         preferred_element_type=jnp.float32).astype(out_dtype)
        x = qwix.dequantize(x)
    out_dtype = out_dtype or x.dtype
    if isinstance(w, QArray):
        if name in ("triton", "mosaic"):
            return _quantized(x, w, group_sizes, name).astype(out_dtype)
        w = qwix.dequantize(w).astype(x.dtype)
    if name == "tiled":
        return _tiled(x, w, group_sizes).astype(out_dtype)
    if name == "xla":
        return jax.lax.ragged_dot(x, w, group_sizes).astype(out_dtype)
    return _tokamax().ragged_dot(x, w, group_sizes, implementation=name).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _quantized(x: jax.Array, w: QArray, group_sizes: jax.Array, name: str) -> jax.Array:
    return _tokamax().ragged_dot(x, w, group_sizes, implementation=name).astype(x.dtype)


def _quantized_fwd(x, w, group_sizes, name):
    return _quantized(x, w, group_sizes, name), (x, w, group_sizes)


def _quantized_bwd(name, res, dy):
    x, w, group_sizes = res
    _, pull = jax.vjp(lambda x: grouped_matmul(x, qwix.dequantize(w).astype(x.dtype), group_sizes,
                                               implementation=name), x)
    frozen = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0) if not jnp.issubdtype(a.dtype, jnp.floating)
                          else jnp.zeros_like(a), w)
    return pull(dy)[0], frozen, np.zeros(group_sizes.shape, jax.dtypes.float0)


_quantized.defvjp(_quantized_fwd, _quantized_bwd)


def tile_rows(rows: int, groups: int) -> int:
    """The tiled implementation's rows per tile: about rows / groups (a
    group's share), a power of two from 8 to 128, so that the pairs'
    products stay near M rows and their count near the tiles'."""
    share = max(rows // max(groups, 1), 1)
    return int(min(128, max(8, 1 << (share.bit_length() - 1))))


@jax.jit  # one program per shape when called eagerly, not one per operation
def _tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul by (tile, group) pairs; differentiated by JAX (the
    gathers' transposes are scatter-adds: still no dense copy)."""
    m, groups = x.shape[0], w.shape[0]
    tile = tile_rows(m, groups)
    tiles = -(-m // tile)
    pairs = tiles + groups  # a group's rows meet at most (its rows' tiles); summed over groups: tiles + groups - 1
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    # the tiles each group meets (none when empty), and where its pairs start in the pair list
    first, last = starts // tile, (ends - 1) // tile
    count = jnp.where(group_sizes > 0, last - first + 1, 0)
    pair_start = jnp.cumsum(count) - count
    p = jnp.arange(pairs, dtype=jnp.int32)
    group = jnp.clip(jnp.searchsorted(pair_start + count, p, side="right", method="compare_all"), 0,
                     groups - 1).astype(jnp.int32)
    real = p < jnp.sum(count)
    tile_of = jnp.where(real, first[group] + p - pair_start[group], 0)
    padded = jnp.pad(x, ((0, tiles * tile - m), (0, 0))).reshape(tiles, tile, -1)
    products = jnp.einsum("ptk,pkn->ptn", padded[tile_of], w[group].astype(x.dtype),
                          preferred_element_type=jnp.float32)
    row = tile_of[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)
    mine = real[:, None] & (row >= starts[group][:, None]) & (row < ends[group][:, None])
    products = jnp.where(mine[..., None], products, 0)
    out = jnp.zeros((tiles, tile, w.shape[2]), jnp.float32).at[tile_of].add(products)
    return out.reshape(tiles * tile, -1)[:m].astype(x.dtype)
