"""A chunked delta-rule op as Pallas Mosaic TPU kernels, for any Variant.

Grid (row, head tile, chunk): rows and head tiles are parallel, chunks are
sequential ("arbitrary") and the float32 state of the tile's value heads
lives in VMEM scratch from one chunk to the next. The backward kernel walks
the same grid with the chunks reversed, carrying dS in VMEM scratch and
summing dq, dk over each key head's value heads in the kernel. Packed sequences arrive
re-laid by the chunk plan; per-chunk flags (reset, seq, last) come in as
scalar-prefetch operands, and the h0 / final-state blocks are addressed by
the chunk's sequence index.

Every block keeps its last two dims whole ((C, K), (C, V), (1, C), (K, V),
(C, C)), so any head dim and any chunk size satisfy the (8, 128) rule.

A grid step runs the Variant's chunk algebra (its looped forms) once,
vmapped over every value head of its key heads: each product is a batched
[heads, C, D] product, so the MXU works through the heads' products back to
back where one head at a time left it waiting on each product's latency
(Qwen3-Next's GDN on a TPU v5e, T=32768: forward 48.7 -> 23.1 ms with all
32 value heads in a step). The products a key head's group shares (the
gated delta rule's QK^T, KK^T) are formed once per key head; a gate per
channel (KDA) comes in [C, K] blocks per value head. The chunk inverse is
solved by row blocks (primitives.unit_lower_inverse_rows: 23.1 -> 12.5 ms).

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


def _fwd_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, final_ref, *rest,
                variant: Variant, rows, grp, opts, save_residuals):
    *residual_refs, state_ref = rest
    state_dtype = opts.state_dtype
    idx = pl.program_id(2) * rows + pl.program_id(0)

    @pl.when(reset_ref[idx] != 0)
    def _():
        state_ref[...] = _value_heads(h0_ref[0], grp).astype(state_dtype)

    # Every value head of the tile in one batched form of the chunk algebra
    # ([heads, C, D] products): one grid step's products keep the MXU busy
    # where a head at a time left it waiting on each product's latency.
    q, k = opts.keys(q_ref[0, 0]), opts.keys(k_ref[0, 0])
    shared = () if variant.key_products is None else jax.vmap(
        functools.partial(variant.key_products, matmul_dtype=opts.matmul_dtype))(q, k)
    forward = functools.partial(variant.value_head_forward, looped=True, inverse=unit_lower_inverse_rows,
                                **_algebra(opts))
    o, new_state, tinv = jax.vmap(forward)(
        _per_value_head(q, grp), _per_value_head(k, grp), _value_heads(v_ref[0, 0], grp).astype(state_dtype),
        _value_heads(g_ref[0, 0], grp), _value_heads(b_ref[0, 0], grp),
        tuple(_per_value_head(x, grp) for x in shared), state_ref[...])
    o_ref[0, 0] = o.reshape(o_ref.shape[2:]).astype(o_ref.dtype)
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
                variant: Variant, rows, num_chunks, grp, opts):
    state_dtype = opts.state_dtype
    step = pl.program_id(2)
    idx = (num_chunks - 1 - step) * rows + pl.program_id(0)

    @pl.when(step == 0)
    def _():
        dstate_ref[...] = jnp.zeros(dstate_ref.shape, dstate_ref.dtype)

    @pl.when(last_ref[idx] != 0)
    def _():
        dstate_ref[...] = dstate_ref[...] + _value_heads(dfinal_ref[0], grp).astype(state_dtype)

    q, k = opts.keys(q_ref[0, 0]), opts.keys(k_ref[0, 0])
    shared = () if variant.key_products is None else jax.vmap(
        functools.partial(variant.key_products, matmul_dtype=opts.matmul_dtype))(q, k)
    backward = functools.partial(variant.value_head_backward, looped=True, **_algebra(opts))
    vg, dshared = jax.vmap(backward)(
        _per_value_head(q, grp), _per_value_head(k, grp), _value_heads(v_ref[0, 0], grp).astype(state_dtype),
        _value_heads(g_ref[0, 0], grp), _value_heads(b_ref[0, 0], grp),
        tuple(_per_value_head(x, grp) for x in shared), _value_heads(tinv_ref[0, 0], grp).astype(state_dtype),
        _value_heads(states_ref[0, 0], grp).astype(state_dtype), _value_heads(do_ref[0, 0], grp).astype(state_dtype),
        dstate_ref[...])
    dv_ref[0, 0] = vg.dv.reshape(dv_ref.shape[2:]).astype(dv_ref.dtype)
    dg_ref[0, 0] = vg.dg.reshape(dg_ref.shape[2:]).astype(dg_ref.dtype)
    db_ref[0, 0] = vg.dbeta.reshape(db_ref.shape[2:]).astype(db_ref.dtype)
    dstate_ref[...] = vg.dstate_in
    dq, dk = _key_groups(vg.dq, grp), _key_groups(vg.dk, grp)
    if variant.key_products_bwd is not None:
        dq_k, dk_k = jax.vmap(functools.partial(variant.key_products_bwd, matmul_dtype=opts.matmul_dtype))(
            q, k, *(_key_groups(d, grp) for d in dshared))
        dq, dk = dq + dq_k, dk + dk_k
    dq_ref[0, 0] = dq.astype(dq_ref.dtype)
    dk_ref[0, 0] = dk.astype(dk_ref.dtype)

    @pl.when(reset_ref[idx] != 0)
    def _():
        dh0_ref[0] = dstate_ref[...].reshape(dh0_ref.shape[1:]).astype(dh0_ref.dtype)
        dstate_ref[...] = jnp.zeros(dstate_ref.shape, dstate_ref.dtype)


class _Specs:
    """Block specs over the chunk layout for a grid (row, head tile, step);
    chunk = step forward, or num_chunks - 1 - step in reverse."""

    def __init__(self, q, v, rows, head_tile, reverse, gate: Gate):
        nc, _, _, c, k_dim = q.shape
        grp, v_dim = v.shape[3], v.shape[5]
        ht = head_tile

        def chunk(ci):
            return nc - 1 - ci if reverse else ci

        def per_chunk(ri, hi, ci, *_):
            return (chunk(ci), ri, hi, 0, 0, 0)

        def per_key_head(ri, hi, ci, *_):
            return (chunk(ci), ri, hi, 0, 0)

        def per_sequence(ri, hi, ci, reset_ref, seq_ref, last_ref):
            return (seq_ref[chunk(ci) * rows + ri], hi, 0, 0, 0)

        self.keys = pl.BlockSpec((1, 1, ht, c, k_dim), per_key_head)
        self.values = pl.BlockSpec((1, 1, ht, grp, c, v_dim), per_chunk)
        self.rows = pl.BlockSpec((1, 1, ht, grp, 1, c), per_chunk)
        self.gates = pl.BlockSpec((1, 1, ht, grp, c, k_dim), per_chunk) if gate == "channel" else self.rows
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
        interpret=_tpu_interpreter() if interpret else False,
        cost_estimate=cost,
    )(*(f.reshape(-1) for f in flags), *args)  # flags indexed chunk * rows + row


def _tpu_interpreter():
    """The TPU interpreter (TPU memory semantics: VMEM, out-of-bounds reads,
    uninitialised memory), except inside shard_map over several devices:
    there it opens every kernel call with a barrier across all devices that
    deadlocks against XLA's CPU collectives (context parallelism), so the
    same kernel runs in the generic Pallas interpreter instead."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1 and any(t == AxisType.Manual for t in mesh.axis_types):
        return True
    return pltpu.InterpretParams()


def _head_tile(tiles: TpuTiles, q, v) -> int:
    _, _, hk, c, k_dim = q.shape
    head_tile = tiles.key_heads_per_step(hk, v.shape[3], c, k_dim, v.shape[5])
    if hk % head_tile:
        raise ValueError(f"head_tile={head_tile} must divide the key heads HK={hk}")
    return head_tile


def forward(q, k, v, g, beta, h0, flags, *, variant: Variant, opts, save_residuals, interpret: bool,
            tiles: TpuTiles):
    head_tile = _head_tile(tiles, q, v)
    nc, rows, hk, c, k_dim = q.shape
    grp, v_dim = v.shape[3], v.shape[5]
    sp = _Specs(q, v, rows, head_tile, reverse=False, gate=variant.gate)
    out_shape = [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype)]
    out_specs = [sp.values, sp.sequence_state]
    if save_residuals:
        out_shape += [jax.ShapeDtypeStruct((nc, rows, hk, grp, k_dim, v_dim), h0.dtype),
                      jax.ShapeDtypeStruct((nc, rows, hk, grp, c, c), opts.state_dtype)]
        out_specs += [sp.chunk_state, sp.inverse]
    kernel = functools.partial(_fwd_kernel, variant=variant, rows=rows, grp=grp, opts=opts,
                               save_residuals=save_residuals)
    grid = (rows, hk // head_tile, nc)
    cost = _cost(variant, grid, head_tile, grp, c, k_dim, v_dim, variant.forward_parts, ("key_products",),
                 (q, k, v, g, beta, h0, *out_shape))
    return _call(kernel, grid=grid, in_specs=[sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.sequence_state],
                 out_specs=out_specs, out_shape=out_shape,
                 scratch=[pltpu.VMEM((head_tile * grp, k_dim, v_dim), opts.state_dtype)],
                 tiles=tiles, interpret=interpret, cost=cost, flags=flags, args=(q, k, v, g, beta, h0))


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags, *, variant: Variant, opts, interpret: bool,
             tiles: TpuTiles):
    head_tile = _head_tile(tiles, q, v)
    nc, rows, hk, c, k_dim = q.shape
    grp, v_dim = v.shape[3], v.shape[5]
    sp = _Specs(q, v, rows, head_tile, reverse=True, gate=variant.gate)
    state_dtype = opts.state_dtype
    out_shape = [jax.ShapeDtypeStruct(q.shape, state_dtype), jax.ShapeDtypeStruct(k.shape, state_dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
                 jax.ShapeDtypeStruct(beta.shape, beta.dtype), jax.ShapeDtypeStruct(dfinal.shape, state_dtype)]
    out_specs = [sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.sequence_state]
    kernel = functools.partial(_bwd_kernel, variant=variant, rows=rows, num_chunks=nc, grp=grp, opts=opts)
    grid = (rows, hk // head_tile, nc)
    cost = _cost(variant, grid, head_tile, grp, c, k_dim, v_dim, variant.backward_parts,
                 ("key_products", "key_grads"), (q, k, v, g, beta, tinv, states, do, dfinal, *out_shape))
    return _call(kernel, grid=grid,
                 in_specs=[sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.inverse, sp.chunk_state, sp.values,
                           sp.sequence_state],
                 out_specs=out_specs, out_shape=out_shape,
                 scratch=[pltpu.VMEM((head_tile * grp, k_dim, v_dim), state_dtype)],
                 tiles=tiles, interpret=interpret, cost=cost, flags=flags,
                 args=(q, k, v, g, beta, tinv, states, do, dfinal))


def backend(variant: Variant) -> Backend:
    """The TPU kernels of `variant`'s op."""
    return Backend("pallas_tpu", variant=variant, platform="tpu", forward=functools.partial(forward, variant=variant),
                   backward=functools.partial(backward, variant=variant), tiles=TpuTiles,
                   check_shapes=functools.partial(pallas.check_dims, "pallas_tpu"), fold_batch=True)
