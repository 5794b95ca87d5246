"""Quantization: int8, int4 or float8_e4m3fn weights, one float32 scale
per block; activations in the model's dtype (weight-only) or, with fp8
weights, in float8 per token group.

A quantized matrix keeps its place and layout ([in, out], the routed
experts [E, in, out]) in the weight's dtype int8, int4 or float8_e4m3fn, beside a
`<name>_scale` parameter holding one factor per block of `block` = (rows of
the [out, in] matrix as Hugging Face stores it, its columns), the edge
blocks partial: the layout of the FP8 checkpoints Qwen and DeepSeek
publish (gdnx.checkpoints.fp8), so those load as they are stored. Each
product dequantizes its weight first (value x its block's factor, in the
activations' dtype): memory at rest is a byte a weight (int4: half, as
XLA packs it), the arithmetic that of the unquantized model. int4 wants
smaller blocks than FP8's 128 x 128 for its 15 levels: (1, 128), one
output row by 128 inputs, is the usual group. qwix does the quantizing (absmax per block,
its rounding and float8 saturation).

With activations=fp8 (model.quantize_activations) an fp8 weight's product
takes its input in float8 too: one float32 factor per token and group of
the block's columns (the weight's input blocks), from the input's own
absmax (DeepSeek's 1 x 128 activation tiles against 128 x 128 weight
blocks), for every matrix the blocks tile (the others: weight-only). On
GPUs tokamax's Triton kernel reads both operands in float8 (half of
bfloat16's bytes) and applies both factors per tile; its products run on
the tensor cores in float16 (mma.sync in the PTX for H100: XLA's Triton
pipeline issues no float8 wgmma for it, and tokamax's Mosaic GPU kernel,
which does, takes per-channel weight factors only, not 128 x 128 blocks).
Elsewhere the same numbers come from the dequantized operands in float32
(CPUs and TPUs before v7 have no float8 products).

What stays unquantized: the embeddings and the LM head, norms, the
routers and the shared experts' gates, the delta-rule layers' small
parameters and convolutions, and LoRA adapters (trained over a frozen
quantized base).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from qwix import QArray

from gdnx.parallel.rules import current_mesh, is_explicit
from gdnx.scales import is_scale, scale_path

Quantize = Literal["none", "int8", "int4", "fp8"]
DTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}
# projections that stay unquantized, by module name (the routers: their scores choose experts)
KEPT = frozenset({"gate", "shared_expert_gate", "lm_head"})


def fitted(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """block for a weight of `shape` [..., in, out]: a side longer than the
    weight's is the whole of it (the same one block; [1, 10**6] is a factor
    per output row), so nothing is padded or repeated past the weight."""
    return min(block[0], shape[-1]), min(block[1], shape[-2])


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale's shape for a weight of `shape` [..., in, out] in blocks of
    (out rows, in columns)."""
    rows, cols = fitted(shape, block)
    return (*shape[:-2], -(-shape[-2] // cols), -(-shape[-1] // rows))


def tiles(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Whether blocks of (out rows, in columns) tile a weight [..., in, out]
    whole (no partial edge block): its factors then broadcast over it as a
    qwix.QArray's do."""
    rows, cols = block
    return shape[-2] % cols == 0 and shape[-1] % rows == 0


def activations_for(activations: str, shape: tuple[int, ...], block: tuple[int, int]) -> str:
    """The activations a weight [..., in, out] multiplies: fp8 only where the
    blocks tile it (the activation groups are its input blocks); a matrix
    they do not tile (Qwen3-Next's 64-wide in_proj_ba at 128 x 128) keeps
    its products in the activations' dtype."""
    return activations if tiles(shape, block) else "none"


def quantize_tokens(x: jax.Array, group: int) -> QArray:
    """x [M, K] as float8_e4m3fn with one float32 factor per row and group of
    `group` columns (K a multiple of it), from the group's absmax."""
    return qwix.quantize(x.astype(jnp.float32), jnp.float8_e4m3fn, channelwise_axes=[0], tiled_axes={1: group})


def fp8_product(x: jax.Array, values: jax.Array, scale: jax.Array, block: tuple[int, int]) -> jax.Array:
    """x [..., K] @ the fp8 weight [K, N] (values, factors per block; the
    blocks tile it) with x quantized per token group: in float32."""
    from gdnx.ops.grouped_matmul import grouped_matmul, traced_platform

    lead, k = x.shape[:-1], x.shape[-1]
    xq = quantize_tokens(x.reshape(-1, k), block[1])
    if traced_platform() == "gpu":  # one group: tokamax's kernel, float8 on the tensor cores
        w = QArray(values[None], scale[None], qtype=values.dtype)
        sizes = jnp.full((1,), xq.shape[0], jnp.int32)
        y = grouped_matmul(xq, w, sizes, implementation="triton", out_dtype=jnp.float32)
    else:
        y = jnp.dot(qwix.dequantize(xq), dequantize(values, scale, block, jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
    return y.reshape(*lead, y.shape[-1])


def _padded(w, block: tuple[int, int]):
    rows, cols = fitted(w.shape, block)
    g = grid(w.shape, block)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, g[-2] * cols - w.shape[-2]), (0, g[-1] * rows - w.shape[-1])]
    return jnp.pad(w, pad)


def quantize(w: jax.Array, kind: str, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """(values in int8 / int4 / float8_e4m3fn of w's shape, float32 factors of its
    block grid) for w [..., in, out] in float: w ~ values x factor."""
    rows, cols = fitted(w.shape, block)
    padded = _padded(w.astype(jnp.float32), block)
    # one grid per leading index (each expert its own factors)
    q = qwix.quantize(padded, DTYPES[kind], channelwise_axes=range(w.ndim - 2),
                      tiled_axes={w.ndim - 2: cols, w.ndim - 1: rows})
    index = tuple(slice(0, n) for n in w.shape)
    return q.qvalue[index], q.scale.astype(jnp.float32)


def factors(scale: jax.Array, shape: tuple[int, ...], block: tuple[int, int]) -> jax.Array:
    """Each weight's factor [..., in, out] from the block grid."""
    rows, cols = fitted(shape, block)
    full = jnp.repeat(jnp.repeat(scale, cols, axis=-2), rows, axis=-1)
    return full[..., :shape[-2], :shape[-1]]


def dequantize(values: jax.Array, scale: jax.Array, block: tuple[int, int], dtype: DTypeLike) -> jax.Array:
    """The weight values x factors, in `dtype`. On an Explicit mesh the
    (small) factors are expanded whole and then laid out as the values."""
    mesh = current_mesh()
    if mesh is None or not is_explicit(mesh):
        return (values.astype(jnp.float32) * factors(scale, values.shape, block)).astype(dtype)
    full = factors(jax.sharding.reshard(scale, P()), values.shape, block)
    full = jax.sharding.reshard(full, jax.typeof(values).sharding.spec)
    return (values.astype(jnp.float32) * full).astype(dtype)


def quantize_host(w: np.ndarray, kind: str, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """quantize on the host (the loader's parts), as numpy."""
    host = jax.device_put(w, jax.local_devices(backend="cpu")[0])
    q, s = _quantize_jit(host, kind, block)
    return np.asarray(q), np.asarray(s)


_quantize_jit = jax.jit(quantize, static_argnums=(1, 2))


def dequantized_params(params: dict[tuple, jax.Array], block: tuple[int, int], dtype: DTypeLike,
                       ) -> dict[tuple, jax.Array]:
    """Flat parameters {path: array} with every quantized weight dequantized
    (in `dtype`) and its factors gone: the unquantized model's parameters."""
    out = {}
    for path, value in params.items():
        if is_scale(path[-1]):
            continue
        scale = params.get(scale_path(path))
        out[path] = value if scale is None else dequantize(jnp.asarray(value), jnp.asarray(scale), block, dtype)
    return out
