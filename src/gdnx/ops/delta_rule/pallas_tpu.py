"""A chunked delta-rule op as Pallas Mosaic TPU kernels, for any Variant.

Grid (row, head tile, chunk): rows and head tiles are parallel, chunks are
sequential ("arbitrary") and the float32 state of the tile's value heads
lives in VMEM scratch from one chunk to the next. The backward kernel walks
the same grid with the chunks reversed, carrying dS in VMEM scratch and
summing dq, dk over each key head's value heads in the kernel. Packed sequences arrive
re-laid by the chunk plan; per-chunk flags (reset, seq, last) come in as
scalar-prefetch operands, and the h0 / final-state blocks are addressed by
the chunk's sequence index.

q, k, v (and a gate per channel) are read, and o and their gradients
written, where the tokens lie ([R, T, H * D]): a block is one chunk's rows
and a head tile's lanes, so no re-layout runs around the kernels (at
T=32768 on a TPU v5e the re-layout alone took 4.8 ms as a program of its
own; in the op's program the forward went from 9.7 to 8.9 ms without it). A head
tile's lanes are a multiple of 128 or every head; chunks are multiples of
16 rows. The gate rows, beta, states and inverses keep their last two dims
whole ((1, C), (K, V), (C, C)).

A grid step runs the Variant's chunk algebra (its unrolled forms with
bfloat16 products, else its looped ones: `_looped`) once,
vmapped over every value head of its key heads: each product is a batched
[heads, C, D] product, so the MXU works through the heads' products back to
back where one head at a time left it waiting on each product's latency
(Qwen3-Next's GDN on a TPU v5e, T=32768: forward 48.7 -> 23.1 ms with all
32 value heads in a step). The products a key head's group shares (the
gated delta rule's QK^T, KK^T) are formed once per key head; a gate per
channel (KDA) comes in [C, K] blocks per value head. The chunk inverse is
solved by row blocks (primitives.unit_lower_inverse_rows: 23.1 -> 9.7 ms).

The head tile and the scoped VMEM limit come from the target's tiles
(tiles.TpuTiles): as many key heads as the generation's VMEM holds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType

from gdnx.ops.delta_rule import pallas
from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.chunked import ChunkFlags
from gdnx.ops.delta_rule.primitives import unit_lower_inverse_rows
from gdnx.ops.delta_rule.tiles import TpuTiles
from gdnx.ops.delta_rule.variant import Gate, Variant


def _heads(x, n):
    """[C, n * D] lanes of a token block as [n, C, D] (slices at multiples of
    128 lanes, or the whole block: no data moves)."""
    d = x.shape[-1] // n
    return jnp.stack([x[:, i * d:(i + 1) * d] for i in range(n)])


def _lanes(x):
    """[n, C, D] -> [C, n * D], the heads side by side as the tokens hold them."""
    return jnp.concatenate([x[i] for i in range(x.shape[0])], axis=-1)


def _value_heads(x, grp):
    """[HT, G, ...] blocks of a tile's value heads as [HT * G, ...]."""
    return x.reshape((x.shape[0] * grp,) + x.shape[2:])


def _per_value_head(x, grp):
    """[HT, ...] key-head blocks repeated for each value head of the group."""
    return jnp.repeat(x, grp, axis=0)


def _key_groups(x, grp):
    """[HT * G, ...] per value head summed over each key head's group."""
    return jnp.sum(x.reshape((x.shape[0] // grp, grp) + x.shape[1:]), axis=1)


def _algebra(opts) -> dict:
    """The Variant's keyword arguments in these kernels: float32 segment sums
    of the gates as three exact bfloat16 passes (their 0/1 operand makes
    every product exact), half the MXU passes of a float32 product."""
    return dict(opts.algebra(), split_segments=opts.decay_dtype == jnp.float32)


def _gates(g_ref, variant: Variant, heads, grp):
    """A tile's gates per value head: [C, K] blocks from the token slots (a
    gate per channel) or [1, C] rows."""
    return _heads(g_ref[0], heads * grp) if variant.gate == "channel" else _value_heads(g_ref[0, 0], grp)


def _looped(opts) -> bool:
    """The Variant's looped forms, or its unrolled ones (the inverse is
    given either way). With bfloat16 products the unrolled forms run: KDA
    forms every bit's decay factors once per chunk, shared by the pairwise
    products and their adjoints, where the loop formed them at each use (a
    v5e at T=32768: forward 24.3 -> 22.0 ms, forward and backward 80.5 ->
    65.1). Float32 products keep the loop: their bfloat16 parts of every
    bit's factors at once pass the v5e's VMEM (188 of 128 MiB)."""
    return opts.matmul_dtype != jnp.bfloat16


def _fwd_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, final_ref, *rest,
                variant: Variant, rows, heads, grp, opts, save_residuals):
    *residual_refs, state_ref = rest
    state_dtype = opts.state_dtype
    idx = pl.program_id(2) * rows + pl.program_id(0)

    @pl.when(reset_ref[idx] != 0)
    def _():
        state_ref[...] = _value_heads(h0_ref[0], grp).astype(state_dtype)

    # Every value head of the tile in one batched form of the chunk algebra
    # ([heads, C, D] products): one grid step's products keep the MXU busy
    # where a head at a time left it waiting on each product's latency.
    q, k = opts.keys(_heads(q_ref[0], heads)), opts.keys(_heads(k_ref[0], heads))
    shared = () if variant.key_products is None else jax.vmap(
        functools.partial(variant.key_products, matmul_dtype=opts.matmul_dtype))(q, k)
    forward = functools.partial(variant.value_head_forward, looped=_looped(opts), inverse=unit_lower_inverse_rows,
                                **_algebra(opts))
    o, new_state, tinv = jax.vmap(forward)(
        _per_value_head(q, grp), _per_value_head(k, grp), _heads(v_ref[0], heads * grp).astype(state_dtype),
        _gates(g_ref, variant, heads, grp), _value_heads(b_ref[0, 0], grp),
        tuple(_per_value_head(x, grp) for x in shared), state_ref[...])
    o_ref[0] = _lanes(o).astype(o_ref.dtype)
    if save_residuals:
        states_ref, tinv_ref = residual_refs
        states_ref[0, 0] = state_ref[...].reshape(states_ref.shape[2:]).astype(states_ref.dtype)
        tinv_ref[0, 0] = tinv.reshape(tinv_ref.shape[2:]).astype(tinv_ref.dtype)
    state_ref[...] = new_state

    @pl.when(last_ref[idx] != 0)
    def _():
        final_ref[0] = state_ref[...].reshape(final_ref.shape[1:]).astype(final_ref.dtype)


def _bwd_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, tinv_ref, states_ref, do_ref,
                dfinal_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, dstate_ref, *,
                variant: Variant, rows, num_chunks, heads, grp, opts):
    state_dtype = opts.state_dtype
    step = pl.program_id(2)
    idx = (num_chunks - 1 - step) * rows + pl.program_id(0)

    @pl.when(step == 0)
    def _():
        dstate_ref[...] = jnp.zeros(dstate_ref.shape, dstate_ref.dtype)

    @pl.when(last_ref[idx] != 0)
    def _():
        dstate_ref[...] = dstate_ref[...] + _value_heads(dfinal_ref[0], grp).astype(state_dtype)

    q, k = opts.keys(_heads(q_ref[0], heads)), opts.keys(_heads(k_ref[0], heads))
    shared = () if variant.key_products is None else jax.vmap(
        functools.partial(variant.key_products, matmul_dtype=opts.matmul_dtype))(q, k)
    backward = functools.partial(variant.value_head_backward, looped=_looped(opts), **_algebra(opts))
    vg, dshared = jax.vmap(backward)(
        _per_value_head(q, grp), _per_value_head(k, grp), _heads(v_ref[0], heads * grp).astype(state_dtype),
        _gates(g_ref, variant, heads, grp), _value_heads(b_ref[0, 0], grp),
        tuple(_per_value_head(x, grp) for x in shared), _value_heads(tinv_ref[0, 0], grp).astype(state_dtype),
        _value_heads(states_ref[0, 0], grp).astype(state_dtype), _heads(do_ref[0], heads * grp).astype(state_dtype),
        dstate_ref[...])
    dv_ref[0] = _lanes(vg.dv).astype(dv_ref.dtype)
    if variant.gate == "channel":
        dg_ref[0] = _lanes(vg.dg).astype(dg_ref.dtype)
    else:
        dg_ref[0, 0] = vg.dg.reshape(dg_ref.shape[2:]).astype(dg_ref.dtype)
    db_ref[0, 0] = vg.dbeta.reshape(db_ref.shape[2:]).astype(db_ref.dtype)
    dstate_ref[...] = vg.dstate_in
    dq, dk = _key_groups(vg.dq, grp), _key_groups(vg.dk, grp)
    if variant.key_products_bwd is not None:
        dq_k, dk_k = jax.vmap(functools.partial(variant.key_products_bwd, matmul_dtype=opts.matmul_dtype))(
            q, k, *(_key_groups(d, grp) for d in dshared))
        dq, dk = dq + dq_k, dk + dk_k
    dq_ref[0] = _lanes(dq).astype(dq_ref.dtype)
    dk_ref[0] = _lanes(dk).astype(dk_ref.dtype)

    @pl.when(reset_ref[idx] != 0)
    def _():
        dh0_ref[0] = dstate_ref[...].reshape(dh0_ref.shape[1:]).astype(dh0_ref.dtype)
        dstate_ref[...] = jnp.zeros(dstate_ref.shape, dstate_ref.dtype)


def _lane_blocks(heads: int, shape) -> bool:
    """A head tile whose token blocks satisfy Mosaic's rule: their lanes (the
    tile's heads x head dim) a multiple of 128, or every head."""
    return heads == shape.hk or (heads * shape.k_dim % 128 == 0 and heads * shape.grp * shape.v_dim % 128 == 0)


class _Shape:
    """A call's sizes, from q [R, NC*C, HK, K], v [R, NC*C, HV, V] and the
    beta rows [NC, R, HK, G, 1, C], and its head tile."""

    def __init__(self, q, v, beta, tiles: TpuTiles):
        self.rows, _, self.hk, self.k_dim = q.shape
        self.v_dim = v.shape[3]
        self.num_chunks, self.grp, self.chunk = beta.shape[0], beta.shape[3], beta.shape[-1]
        fits = tiles.key_heads_per_step(self.hk, self.grp, self.chunk, self.k_dim, self.v_dim)
        if self.hk % fits:
            raise ValueError(f"tiles.head_tile={fits} must divide the key heads HK={self.hk}")
        if not _lane_blocks(fits, self):
            if tiles.head_tile is not None:
                raise ValueError(f"tiles.head_tile={fits}: a tile's key heads x K={self.k_dim} and value heads x "
                                 f"V={self.v_dim} must be multiples of 128 lanes, or the tile every key head "
                                 f"(HK={self.hk})")
            aligned = [d for d in range(1, self.hk + 1) if self.hk % d == 0 and _lane_blocks(d, self)]
            fits = max([d for d in aligned if d <= fits], default=min(aligned))
        self.head_tile = fits
        self.grid = (self.rows, self.hk // fits, self.num_chunks)


class _Specs:
    """Block specs for a grid (row, head tile, step); chunk = step forward,
    or num_chunks - 1 - step in reverse. q, k, v, a gate per channel and o
    are read and written where the tokens lie ([R, NC*C, H*D]: a block is a
    chunk's rows and a head tile's lanes); gate rows, beta, states and
    inverses in the chunk layout."""

    def __init__(self, shape: _Shape, reverse, gate: Gate):
        nc, c, ht, grp = shape.num_chunks, shape.chunk, shape.head_tile, shape.grp
        k_dim, v_dim = shape.k_dim, shape.v_dim

        def chunk(ci):
            return nc - 1 - ci if reverse else ci

        def per_chunk(ri, hi, ci, *_):
            return (chunk(ci), ri, hi, 0, 0, 0)

        def per_token_block(ri, hi, ci, *_):
            return (ri, chunk(ci), hi)

        def per_sequence(ri, hi, ci, reset_ref, seq_ref, last_ref):
            return (seq_ref[chunk(ci) * shape.rows + ri], hi, 0, 0, 0)

        self.keys = pl.BlockSpec((1, c, ht * k_dim), per_token_block)
        self.values = pl.BlockSpec((1, c, ht * grp * v_dim), per_token_block)
        self.rows = pl.BlockSpec((1, 1, ht, grp, 1, c), per_chunk)
        self.gates = pl.BlockSpec((1, c, ht * grp * k_dim), per_token_block) if gate == "channel" else self.rows
        self.sequence_state = pl.BlockSpec((1, ht, grp, k_dim, v_dim), per_sequence)
        self.chunk_state = pl.BlockSpec((1, 1, ht, grp, k_dim, v_dim), per_chunk)
        self.inverse = pl.BlockSpec((1, 1, ht, grp, c, c), per_chunk)


def _cost(variant: Variant, grid, head_tile, grp, c, k_dim, v_dim, parts, key_parts, arrays):
    """Estimate over the grid: per step, the key head parts once per key head
    of the tile and the value head parts once per value head."""
    steps = grid[0] * grid[1] * grid[2] * head_tile
    f = variant.chunk_flops(c, k_dim, v_dim)
    flops = steps * (sum(f.get(p, 0) for p in key_parts) + grp * sum(f[p] for p in parts))
    return pallas.cost(flops, steps * grp * variant.transcendentals(c, k_dim), arrays)


def _call(kernel, *, grid, in_specs, out_specs, out_shape, scratch, tiles: TpuTiles, interpret, cost,
          flags: ChunkFlags, args):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=tiles.vmem_limit_mib * 2**20),
        interpret=tpu_interpreter() if interpret else False,
        cost_estimate=cost,
    )(*(f.reshape(-1) for f in flags), *args)  # flags indexed chunk * rows + row


def tpu_interpreter():
    """The TPU interpreter (TPU memory semantics: VMEM, out-of-bounds reads,
    uninitialised memory), except inside shard_map over several devices:
    there it opens every kernel call with a barrier across all devices that
    deadlocks against XLA's CPU collectives (context parallelism), so the
    same kernel runs in the generic Pallas interpreter instead."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1 and any(t == AxisType.Manual for t in mesh.axis_types):
        return True
    return pltpu.InterpretParams()


def _flat(x):
    """[R, S, H, D] -> [R, S, H * D] (no copy)."""
    return x.reshape(x.shape[:2] + (-1,))


def forward(q, k, v, g, beta, h0, flags, *, variant: Variant, opts, save_residuals, interpret: bool,
            tiles: TpuTiles):
    sh = _Shape(q, v, beta, tiles)
    nc, rows, hk, grp, c, k_dim, v_dim = sh.num_chunks, sh.rows, sh.hk, sh.grp, sh.chunk, sh.k_dim, sh.v_dim
    sp = _Specs(sh, reverse=False, gate=variant.gate)
    out_shape = [jax.ShapeDtypeStruct(_flat(v).shape, q.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype)]
    out_specs = [sp.values, sp.sequence_state]
    if save_residuals:
        out_shape += [jax.ShapeDtypeStruct((nc, rows, hk, grp, k_dim, v_dim), h0.dtype),
                      jax.ShapeDtypeStruct((nc, rows, hk, grp, c, c), opts.state_dtype)]
        out_specs += [sp.chunk_state, sp.inverse]
    kernel = functools.partial(_fwd_kernel, variant=variant, rows=rows, heads=sh.head_tile, grp=grp, opts=opts,
                               save_residuals=save_residuals)
    gate = _flat(g) if variant.gate == "channel" else g
    args = (_flat(q), _flat(k), _flat(v), gate, beta, h0)
    cost = _cost(variant, sh.grid, sh.head_tile, grp, c, k_dim, v_dim, variant.forward_parts, ("key_products",),
                 (*args, *out_shape))
    o, *rest = _call(kernel, grid=sh.grid,
                     in_specs=[sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.sequence_state],
                     out_specs=out_specs, out_shape=out_shape,
                     scratch=[pltpu.VMEM((sh.head_tile * grp, k_dim, v_dim), opts.state_dtype)],
                     tiles=tiles, interpret=interpret, cost=cost, flags=flags, args=args)
    return (o.reshape(v.shape), *rest)


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags, *, variant: Variant, opts, interpret: bool,
             tiles: TpuTiles):
    sh = _Shape(q, v, beta, tiles)
    nc, rows, grp, c, k_dim, v_dim = sh.num_chunks, sh.rows, sh.grp, sh.chunk, sh.k_dim, sh.v_dim
    sp = _Specs(sh, reverse=True, gate=variant.gate)
    state_dtype = opts.state_dtype
    channel = variant.gate == "channel"
    gate = _flat(g) if channel else g
    out_shape = [jax.ShapeDtypeStruct(_flat(q).shape, state_dtype), jax.ShapeDtypeStruct(_flat(k).shape, state_dtype),
                 jax.ShapeDtypeStruct(_flat(v).shape, v.dtype), jax.ShapeDtypeStruct(gate.shape, g.dtype),
                 jax.ShapeDtypeStruct(beta.shape, beta.dtype), jax.ShapeDtypeStruct(dfinal.shape, state_dtype)]
    out_specs = [sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.sequence_state]
    kernel = functools.partial(_bwd_kernel, variant=variant, rows=rows, num_chunks=nc, heads=sh.head_tile, grp=grp,
                               opts=opts)
    args = (_flat(q), _flat(k), _flat(v), gate, beta, tinv, states, _flat(do), dfinal)
    cost = _cost(variant, sh.grid, sh.head_tile, grp, c, k_dim, v_dim, variant.backward_parts,
                 ("key_products", "key_grads"), (*args, *out_shape))
    dq, dk, dv, dg, dbeta, dh0 = _call(
        kernel, grid=sh.grid,
        in_specs=[sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.inverse, sp.chunk_state, sp.values,
                  sp.sequence_state],
        out_specs=out_specs, out_shape=out_shape,
        scratch=[pltpu.VMEM((sh.head_tile * grp, k_dim, v_dim), state_dtype)],
        tiles=tiles, interpret=interpret, cost=cost, flags=flags, args=args)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape), dbeta, dh0


def backend(variant: Variant) -> Backend:
    """The TPU kernels of `variant`'s op."""
    return Backend("pallas_tpu", variant=variant, platform="tpu", forward=functools.partial(forward, variant=variant),
                   backward=functools.partial(backward, variant=variant), tiles=TpuTiles,
                   check_shapes=functools.partial(pallas.check_dims, "pallas_tpu"), fold_batch=True,
                   token_layout=True)
