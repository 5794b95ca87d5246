"""What the Triton (Pallas GPU) kernels of every delta-rule op share: the
padded layout and block specs of their three grid shapes, float32 products
as tensor-core passes, the l2norm row scales, the launch with the tiles'
warps and stages, and block loops inside a kernel.

Triton needs every loaded or stored array to have a power-of-two size: K and
V are zero-padded to powers of two (inert: zero key and value columns never
touch the real ones), C is one already, and the blocks are powers of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gdnx.ops.delta_rule import pallas, primitives
from gdnx.ops.delta_rule.tiles import GpuTiles

# Custom-call targets of a Triton kernel (the name moved between JAX
# versions). jax.export refuses them unless told: they carry no
# compatibility guarantee, so export for the GPU you will run on.
TRITON_CUSTOM_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pad(x, axis, to):
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, pads)


class GridLayout:
    """Padded sizes and the block specs of the three grid shapes.

    Key-head arrays are [NC, R, HK, rows, cols], value-head arrays
    [NC, R, HK, G, rows, cols]; `key=True` picks the key head of the
    program's value head.
    """

    def __init__(self, q, v, num_seqs, tiles: GpuTiles):
        self.nc, self.rows, self.hk, self.c, self.k_dim = q.shape
        self.grp, self.v_dim = v.shape[3], v.shape[5]
        self.kp, self.vp = pow2(self.k_dim), pow2(self.v_dim)
        self.bk, self.bv = min(tiles.block_k, self.kp), min(tiles.block_v, self.vp)
        self.sbk, self.sbv = min(tiles.state_block_k, self.kp), min(tiles.state_block_v, self.vp)
        self.obv = min(tiles.output_block_v, self.vp)
        self.nob, self.snvb = self.vp // self.obv, self.vp // self.sbv
        self.num_seqs = num_seqs

    # chunk-parallel, one program per (chunk, row, value head)
    @property
    def head_grid(self):
        return (self.nc, self.rows, self.hk * self.grp)

    def head_spec(self, rows, cols, key=False):
        g = self.grp
        if key:
            return pl.BlockSpec((1, 1, 1, rows, cols), lambda c, r, h: (c, r, h // g, 0, 0))
        return pl.BlockSpec((1, 1, 1, 1, rows, cols), lambda c, r, h: (c, r, h // g, h % g, 0, 0))

    # chunk-parallel, one program per (chunk, row, value head, V block)
    @property
    def block_grid(self):
        return (self.nc, self.rows, self.hk * self.grp * self.nob)

    def block_spec(self, rows, cols, key=False, v_blocked=True):
        g, n = self.grp, self.nob
        if key:
            return pl.BlockSpec((1, 1, 1, rows, cols), lambda c, r, x: (c, r, x // n // g, 0, 0))
        return pl.BlockSpec((1, 1, 1, 1, rows, cols),
                            lambda c, r, x: (c, r, x // n // g, x // n % g, 0, x % n if v_blocked else 0))

    # sequential, one program per (row, value head, V block), all chunks of the row
    @property
    def seq_grid(self):
        return (self.rows, self.hk * self.grp, self.snvb)

    def seq_spec(self, rows, cols, key=False, v_blocked=True):
        g, nc = self.grp, self.nc
        if key:
            return pl.BlockSpec((nc, 1, 1, rows, cols), lambda r, h, vb: (0, r, h // g, 0, 0))
        return pl.BlockSpec((nc, 1, 1, 1, rows, cols),
                            lambda r, h, vb: (0, r, h // g, h % g, 0, vb if v_blocked else 0))

    def seq_state_spec(self):
        g = self.grp
        return pl.BlockSpec((self.num_seqs, 1, 1, self.kp, self.sbv), lambda r, h, vb: (0, h // g, h % g, 0, vb))

    def flag_spec(self):
        return pl.BlockSpec((self.nc, 1), lambda r, h, vb: (0, r))

    def pad_keys(self, x):
        return pad(x, -1, self.kp)

    def pad_values(self, x):
        return pad(x, -1, self.vp)

    def pad_state(self, x):
        return pad(pad(x, -1, self.vp), -2, self.kp)


# Float32 products on the GPU: three TF32 tensor-core passes per product
# (a = hi + lo, a b ~ hi hi + hi lo + lo hi), relative error ~2^-22, instead
# of Triton's "ieee" FMA loops, whose code is slow to compile
# (docs/benchmarks.md). Interpret mode keeps exact float32 (the CPU has no TF32).
FLOAT32_PRODUCTS = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def on_hardware(opts, interpret: bool):
    if interpret or opts.matmul_dtype is not None or opts.state_dtype != jnp.float32:
        return opts
    return opts._replace(matmul_dtype=FLOAT32_PRODUCTS)


def norm_rows(x, opts):
    """[NC, R, HK, C, K] q or k -> [NC, R, HK, 1, C]: the l2norm scale of
    every row (ones without l2norm), in the accumulation dtype."""
    if not opts.use_qk_l2norm:
        return jnp.ones(x.shape[:3] + (1, x.shape[3]), opts.state_dtype)
    return jnp.swapaxes(primitives.l2norm_scale(x.astype(opts.state_dtype)), -1, -2)


def launch(kernel, *, grid, in_specs, out_specs, out_shape, tiles: GpuTiles, interpret: bool, flops: int, exps: int,
          args, num_warps: int | None = None):
    """pallas_call at the tiles' warps (num_warps: this kernel's own) and stages."""
    outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, cost_estimate=pallas.cost(flops, exps, list(args) + list(outs)),
    )(*args)


def block_ds(i, size):
    """Block i of `size` along an axis (i a Python int or a loop index)."""
    if isinstance(i, int):
        return pl.ds(i * size, size)
    return pl.ds(pl.multiple_of(i * size, size), size)


def block_cols(idx, i, size):
    """Index of column block i of the [rows, cols] tile at idx."""
    return idx + (slice(None), block_ds(i, size))


def loop_blocks(n, body, init):
    """fori_loop over n blocks; the kernel holds one block's code."""
    return jax.lax.fori_loop(0, n, body, init)


def each_block(n, body):
    """body(i) for i < n, in a loop, for its stores."""
    def step(i, carry):
        body(i)
        return carry

    jax.lax.fori_loop(0, n, step, jnp.int32(0))


def as_operand(x, opts):
    """An input block as it enters products: bfloat16 as loaded (with a
    float32 factor, `primitives.dot` takes exact bfloat16 passes), any other
    dtype in the accumulation dtype."""
    return x if x.dtype == jnp.bfloat16 else x.astype(opts.state_dtype)
