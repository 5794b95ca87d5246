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

Each value head runs the Variant's chunk algebra in its looped forms, the
chunk inverse blocked (primitives.unit_lower_inverse_blocks: its serial
steps were most of the forward's time on a TPU v5e); the products a key
head's group shares (the gated delta rule's QK^T, KK^T) are formed once per
key head, and a gate per channel (KDA) comes in [C, K] blocks per value head.

VMEM budget per grid step (`vmem_bytes`), head tile of HT key heads with G
value heads each, inputs of b bytes, float32 state, double-buffered blocks:
    2 HT [2 C K b + G (2 C V b + 16 C + 8 K V)]   q, k, v, o, gates, h0, final
  + 4 HT G K V                                     state scratch
  + 8 HT G (K V + C C)                             residual blocks, when saved
  + 4 (8 C^2 + 4 C max(K, V))                      live temporaries
  + 8 HT G C K                                     per-channel gates: the float32 [C, K] blocks
  + 4 (2 log2(C) + 3) C K                          and their decay factors
Qwen3-Next (K=V=128, G=2, C=64, bf16) with HT=1: 1.45 MB; Kimi Linear's KDA
(K=V=128, G=1, C=64, float32 gates): 1.44 MB; both with residuals. The
kernel asks for an explicit scoped VMEM limit of twice the budget, at least
16 MiB (the usual default) and at most 64 MiB; a head tile whose budget
passes 32 MiB is refused with an error that says so.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType

from gdnx.ops.delta_rule import pallas
from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.chunked import ChunkFlags
from gdnx.ops.delta_rule.primitives import unit_lower_inverse_blocks
from gdnx.ops.delta_rule.tiles import TpuTiles
from gdnx.ops.delta_rule.variant import Gate, Variant

MIN_VMEM_LIMIT = 16 * 2**20
MAX_VMEM_LIMIT = 64 * 2**20
MAX_VMEM_BUDGET = 32 * 2**20


def vmem_bytes(variant: Variant, head_tile, grp, c, k_dim, v_dim, in_bytes, save_residuals):
    per_tile = 2 * head_tile * (2 * c * k_dim * in_bytes
                                + grp * (2 * c * v_dim * in_bytes + 4 * c * 4 + 2 * k_dim * v_dim * 4))
    scratch = head_tile * grp * k_dim * v_dim * 4
    residuals = 2 * head_tile * grp * (k_dim * v_dim * 4 + c * c * 4) if save_residuals else 0
    temporaries = (8 * c * c + 4 * c * max(k_dim, v_dim)) * 4 + variant.extra_vmem(c, k_dim)
    if variant.gate == "channel":  # float32 [C, K] gate blocks
        per_tile += 2 * head_tile * grp * c * k_dim * 4
    return per_tile + scratch + residuals + temporaries


def _shared(variant: Variant, q, k, opts):
    if variant.key_products is None:
        return ()
    return variant.key_products(q, k, matmul_dtype=opts.matmul_dtype)


def _fwd_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, final_ref, *rest,
                variant: Variant, rows, head_tile, grp, opts, save_residuals):
    *residual_refs, state_ref = rest
    state_dtype = opts.state_dtype
    idx = pl.program_id(2) * rows + pl.program_id(0)

    @pl.when(reset_ref[idx] != 0)
    def _():
        state_ref[...] = h0_ref[0].astype(state_dtype)

    for i in range(head_tile):
        q, k = opts.keys(q_ref[0, 0, i]), opts.keys(k_ref[0, 0, i])
        shared = _shared(variant, q, k, opts)
        for j in range(grp):
            state = state_ref[i, j]
            v, g, beta = v_ref[0, 0, i, j].astype(state_dtype), g_ref[0, 0, i, j], b_ref[0, 0, i, j]
            o, new_state, tinv = variant.value_head_forward(q, k, v, g, beta, shared, state, looped=True,
                                                            inverse=unit_lower_inverse_blocks, **opts.algebra())
            o_ref[0, 0, i, j] = o.astype(o_ref.dtype)
            if save_residuals:
                states_ref, tinv_ref = residual_refs
                states_ref[0, 0, i, j] = state.astype(states_ref.dtype)
                tinv_ref[0, 0, i, j] = tinv.astype(tinv_ref.dtype)
            state_ref[i, j] = new_state

    @pl.when(last_ref[idx] != 0)
    def _():
        final_ref[0] = state_ref[...].astype(final_ref.dtype)


def _bwd_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, tinv_ref, states_ref, do_ref,
                dfinal_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, dstate_ref, *,
                variant: Variant, rows, num_chunks, head_tile, grp, opts):
    state_dtype = opts.state_dtype
    step = pl.program_id(2)
    idx = (num_chunks - 1 - step) * rows + pl.program_id(0)

    @pl.when(step == 0)
    def _():
        dstate_ref[...] = jnp.zeros(dstate_ref.shape, dstate_ref.dtype)

    @pl.when(last_ref[idx] != 0)
    def _():
        dstate_ref[...] = dstate_ref[...] + dfinal_ref[0].astype(state_dtype)

    for i in range(head_tile):
        q, k = opts.keys(q_ref[0, 0, i]), opts.keys(k_ref[0, 0, i])
        shared = _shared(variant, q, k, opts)
        dq: Any = 0.0
        dk: Any = 0.0
        dshared: tuple = ()
        for j in range(grp):
            v, g, beta = v_ref[0, 0, i, j].astype(state_dtype), g_ref[0, 0, i, j], b_ref[0, 0, i, j]
            tinv, state = tinv_ref[0, 0, i, j].astype(state_dtype), states_ref[0, 0, i, j].astype(state_dtype)
            do = do_ref[0, 0, i, j].astype(state_dtype)
            vg, ds = variant.value_head_backward(q, k, v, g, beta, shared, tinv, state, do, dstate_ref[i, j],
                                                 looped=True, **opts.algebra())
            dshared = ds if j == 0 else tuple(a + b for a, b in zip(dshared, ds))
            dv_ref[0, 0, i, j] = vg.dv.astype(dv_ref.dtype)
            dg_ref[0, 0, i, j] = vg.dg.astype(dg_ref.dtype)
            db_ref[0, 0, i, j] = vg.dbeta.astype(db_ref.dtype)
            dstate_ref[i, j] = vg.dstate_in
            dq, dk = dq + vg.dq, dk + vg.dk
        if variant.key_products_bwd is not None:
            dq_k, dk_k = variant.key_products_bwd(q, k, *dshared, matmul_dtype=opts.matmul_dtype)
            dq, dk = dq + dq_k, dk + dk_k
        dq_ref[0, 0, i] = dq.astype(dq_ref.dtype)
        dk_ref[0, 0, i] = dk.astype(dk_ref.dtype)

    @pl.when(reset_ref[idx] != 0)
    def _():
        dh0_ref[0] = dstate_ref[...].astype(dh0_ref.dtype)
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


def _call(kernel, *, grid, in_specs, out_specs, out_shape, scratch, budget, head_tile, interpret, cost,
          flags: ChunkFlags, args):
    if budget > MAX_VMEM_BUDGET:
        raise ValueError(f"implementation='pallas_tpu': head_tile={head_tile} needs ~{budget / 2**20:.0f} MiB of "
                         f"VMEM, over the {MAX_VMEM_BUDGET // 2**20} MiB budget; use a smaller head_tile")
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=min(max(MIN_VMEM_LIMIT, 2 * budget), MAX_VMEM_LIMIT)),
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


def _check_tile(hk, head_tile):
    if hk % head_tile:
        raise ValueError(f"head_tile={head_tile} must divide the key heads HK={hk}")


def forward(q, k, v, g, beta, h0, flags, *, variant: Variant, opts, save_residuals, interpret: bool,
            tiles: TpuTiles):
    head_tile = tiles.head_tile
    nc, rows, hk, c, k_dim = q.shape
    grp, v_dim = v.shape[3], v.shape[5]
    _check_tile(hk, head_tile)
    sp = _Specs(q, v, rows, head_tile, reverse=False, gate=variant.gate)
    out_shape = [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype)]
    out_specs = [sp.values, sp.sequence_state]
    if save_residuals:
        out_shape += [jax.ShapeDtypeStruct((nc, rows, hk, grp, k_dim, v_dim), h0.dtype),
                      jax.ShapeDtypeStruct((nc, rows, hk, grp, c, c), opts.state_dtype)]
        out_specs += [sp.chunk_state, sp.inverse]
    kernel = functools.partial(_fwd_kernel, variant=variant, rows=rows, head_tile=head_tile, grp=grp, opts=opts,
                               save_residuals=save_residuals)
    grid = (rows, hk // head_tile, nc)
    cost = _cost(variant, grid, head_tile, grp, c, k_dim, v_dim, variant.forward_parts, ("key_products",),
                 (q, k, v, g, beta, h0, *out_shape))
    return _call(kernel, grid=grid, in_specs=[sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.sequence_state],
                 out_specs=out_specs, out_shape=out_shape,
                 scratch=[pltpu.VMEM((head_tile, grp, k_dim, v_dim), opts.state_dtype)],
                 budget=vmem_bytes(variant, head_tile, grp, c, k_dim, v_dim, q.dtype.itemsize, save_residuals),
                 head_tile=head_tile, interpret=interpret, cost=cost, flags=flags, args=(q, k, v, g, beta, h0))


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags, *, variant: Variant, opts, interpret: bool,
             tiles: TpuTiles):
    head_tile = tiles.head_tile
    nc, rows, hk, c, k_dim = q.shape
    grp, v_dim = v.shape[3], v.shape[5]
    _check_tile(hk, head_tile)
    sp = _Specs(q, v, rows, head_tile, reverse=True, gate=variant.gate)
    state_dtype = opts.state_dtype
    out_shape = [jax.ShapeDtypeStruct(q.shape, state_dtype), jax.ShapeDtypeStruct(k.shape, state_dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
                 jax.ShapeDtypeStruct(beta.shape, beta.dtype), jax.ShapeDtypeStruct(dfinal.shape, state_dtype)]
    out_specs = [sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.sequence_state]
    kernel = functools.partial(_bwd_kernel, variant=variant, rows=rows, num_chunks=nc, head_tile=head_tile,
                               grp=grp, opts=opts)
    # Inputs, residuals and cotangents in, gradients out: about twice the forward's blocks.
    budget = 2 * vmem_bytes(variant, head_tile, grp, c, k_dim, v_dim, max(q.dtype.itemsize, 4), True)
    grid = (rows, hk // head_tile, nc)
    cost = _cost(variant, grid, head_tile, grp, c, k_dim, v_dim, variant.backward_parts,
                 ("key_products", "key_grads"), (q, k, v, g, beta, tinv, states, do, dfinal, *out_shape))
    return _call(kernel, grid=grid,
                 in_specs=[sp.keys, sp.keys, sp.values, sp.gates, sp.rows, sp.inverse, sp.chunk_state, sp.values,
                           sp.sequence_state],
                 out_specs=out_specs, out_shape=out_shape,
                 scratch=[pltpu.VMEM((head_tile, grp, k_dim, v_dim), state_dtype)],
                 budget=budget, head_tile=head_tile, interpret=interpret, cost=cost, flags=flags,
                 args=(q, k, v, g, beta, tinv, states, do, dfinal))


def backend(variant: Variant) -> Backend:
    """The TPU kernels of `variant`'s op."""
    return Backend("pallas_tpu", variant=variant, platform="tpu", forward=functools.partial(forward, variant=variant),
                   backward=functools.partial(backward, variant=variant), tiles=TpuTiles,
                   check_shapes=functools.partial(pallas.check_dims, "pallas_tpu"), fold_batch=True)
