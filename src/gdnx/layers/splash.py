"""Causal softmax attention over whole sequences through JAX's Pallas TPU
splash attention kernel (jax.experimental.pallas.ops.tpu.splash_attention):
the training step's and a cache-free forward's attention without the
[T, T] scores in memory, so that memory grows with the sequence, not its
square (layers/attention.causal_attention, the plain path, holds float32
scores per head and is the reference).

What it takes: queries and keys of one length T (a multiple of
MIN_LENGTH), positions running with the index (a causal mask by index is
then the mask by position), packed documents as segment ids. Grouped-query
heads run through the kernel's multi-query form, one call per key-value
head. On a mesh the kernel runs under shard_map, each shard its rows with
every head (a Pallas call carries no partitioning rule). Anything else
(a cache, positions per row, a context axis splitting the sequence, a
sliding window, a sparse index's selection) takes the plain path.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec as P

from gdnx.ops.delta_rule.tiles import target_platform
from gdnx.parallel.rules import current_mesh, is_explicit, spec

# the kernel's tiles: queries and keys in blocks of up to 512 rows, the last dimension of a TPU block a
# multiple of 128
MIN_LENGTH = 128
MAX_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Splash:
    """The kernel as a layer runs it. interpret: Pallas interpret mode (on a
    CPU, for checking numerics); None: interpret unless the program is
    traced for a TPU (the default backend, or a compile_target's)."""
    interpret: bool | None = None

    def runs(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> bool:
        """Whether these operands take the kernel (else the plain path)."""
        t = q.shape[1]
        if positions.ndim != 1 or k.shape[1] != t or t % MIN_LENGTH:
            return False
        mesh = current_mesh()
        return mesh is None or spec(("batch", "length"), q.shape[:2], mesh=mesh)[1] is None

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None) -> jax.Array:
        """q [B, T, H, D] over k [B, T, Hkv, D] and v [B, T, Hkv, Dv], scaled
        by D^-1/2, causal, within each document of segments [B, T] (None:
        one document a row). Returns [B, T, H, Dv] in q's dtype."""
        interpret = target_platform() != "tpu" if self.interpret is None else self.interpret
        mesh = current_mesh()
        if mesh is None:
            return _attention(q, k, v, segments, interpret)
        rows = spec(("batch", "length"), q.shape[:2], mesh=mesh)[0]
        heads, seq = P(rows, None, None, None), P(rows, None)
        args = (q, k, v) if segments is None else (q, k, v, segments)
        specs = (heads, heads, heads) if segments is None else (heads, heads, heads, seq)
        if is_explicit(mesh):
            args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, specs, strict=True))

        def local(*xs):
            return _attention(*xs[:3], xs[3] if len(xs) > 3 else None, interpret)

        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)


def _block(t: int) -> int:
    block = MAX_BLOCK
    while t % block:
        block //= 2
    return block


@functools.lru_cache(maxsize=64)
def _kernel(t: int, heads: int, interpret: bool) -> splash.SplashAttentionKernel:
    """The multi-query kernel for `heads` query heads over one key-value
    head of length t (its mask's block map is built once per shape)."""
    b = _block(t)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = masks.MultiHeadMask([masks.CausalMask((t, t))] * heads)
    # built in a thread of its own, outside the asking trace and its mesh (both are per thread: the kernel's
    # block map is made of eager arrays), and kept as numpy constants, which any later trace may embed
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        kernel = pool.submit(splash.make_splash_mqa_single_device, mask, block_sizes=sizes,
                             interpret=interpret).result()
    return jax.tree.map(np.asarray, kernel)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, interpret: bool) -> jax.Array:
    b, t, h, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    kernel = _kernel(t, h // hkv, interpret)
    # the kernel does not scale: the queries carry D^-1/2
    qg = (q * d ** -0.5).astype(q.dtype).reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, R, T, D]
    kg, vg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)                                       # [B, Hkv, T, D]

    def one(qh, kh, vh, seg):
        return kernel(qh, kh, vh, segment_ids=None if seg is None else splash.SegmentIds(q=seg, kv=seg))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head, in_axes=(0, 0, 0, None if segments is None else 0))(qg, kg, vg, segments)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dv).astype(q.dtype)
