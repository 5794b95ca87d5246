"""Chunked gated delta rule forward as a Pallas Mosaic TPU kernel.

Grid (row, head tile, chunk): rows and head tiles are parallel, chunks are
sequential ("arbitrary") and the float32 state of the tile's value heads
lives in VMEM scratch from one chunk to the next. Packed sequences arrive
re-laid by the chunk plan; per-chunk flags (reset, seq, last) come in as
scalar-prefetch operands, and the h0 / final-state blocks are addressed by
the chunk's sequence index.

Every block keeps its last two dims whole ((C, K), (C, V), (1, C), (K, V),
(C, C)), so any head dim and any chunk size satisfy the (8, 128) rule.

VMEM budget per grid step (`vmem_bytes`), head tile of HT key heads with G
value heads each, inputs of b bytes, float32 state, double-buffered blocks:
    2 HT [2 C K b + G (2 C V b + 16 C + 8 K V)]   q, k, v, o, gates, h0, final
  + 4 HT G K V                                     state scratch
  + 8 HT G (K V + C C)                             residual blocks, when saved
  + 4 (8 C^2 + 4 C max(K, V))                      live temporaries
Qwen3-Next (K=V=128, G=2, C=64, bf16) with HT=1: 1.45 MB. The kernel asks
for an explicit scoped VMEM limit of twice the budget, at least 16 MiB (the
usual default) and at most 64 MiB; a head tile whose budget passes 32 MiB is
refused with an error that says so.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gdnx.ops.gated_delta_rule import chunk_math, pallas_common

MIN_VMEM_LIMIT = 16 * 2**20
MAX_VMEM_LIMIT = 64 * 2**20
MAX_VMEM_BUDGET = 32 * 2**20


def vmem_bytes(head_tile, grp, c, dk, dv, in_bytes, save_residuals):
    per_tile = 2 * head_tile * (2 * c * dk * in_bytes + grp * (2 * c * dv * in_bytes + 4 * c * 4 + 2 * dk * dv * 4))
    scratch = head_tile * grp * dk * dv * 4
    residuals = 2 * head_tile * grp * (dk * dv * 4 + c * c * 4) if save_residuals else 0
    temporaries = (8 * c * c + 4 * c * max(dk, dv)) * 4
    return per_tile + scratch + residuals + temporaries


def _kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, final_ref, *rest,
            rows, head_tile, grp, scale, acc_dtype, decay_dtype, l2norm, save_residuals):
    *residual_refs, state_ref = rest
    idx = pl.program_id(2) * rows + pl.program_id(0)

    @pl.when(reset_ref[idx] != 0)
    def _():
        state_ref[...] = h0_ref[0].astype(acc_dtype)

    for i in range(head_tile):
        q = q_ref[0, 0, i].astype(acc_dtype)
        k = k_ref[0, 0, i].astype(acc_dtype)
        if l2norm:
            q, k = chunk_math.l2norm(q), chunk_math.l2norm(k)
        qk, kk = chunk_math.key_products(q, k)
        for j in range(grp):
            prep = chunk_math.prepare(
                q, k, v_ref[0, 0, i, j].astype(acc_dtype), g_ref[0, 0, i, j], b_ref[0, 0, i, j], qk, kk,
                scale=scale, decay_dtype=decay_dtype, inverse=chunk_math.unit_lower_inverse_rows)
            state = state_ref[i, j]
            o, new_state = chunk_math.step(state, q, k, prep)
            o_ref[0, 0, i, j] = o.astype(o_ref.dtype)
            if save_residuals:
                states_ref, tinv_ref = residual_refs
                states_ref[0, 0, i, j] = state.astype(states_ref.dtype)
                tinv_ref[0, 0, i, j] = prep.tinv.astype(tinv_ref.dtype)
            state_ref[i, j] = new_state

    @pl.when(last_ref[idx] != 0)
    def _():
        final_ref[0] = state_ref[...].astype(final_ref.dtype)


def kernel_call(q, k, v, g, beta, h0, flags, *, scale, acc_dtype, decay_dtype, l2norm, save_residuals,
                interpret, head_tile=1):
    nc, rows, hk, c, dk = q.shape
    grp, dv = v.shape[3], v.shape[5]
    if hk % head_tile:
        raise ValueError(f"head_tile={head_tile} must divide the key heads HK={hk}")
    budget = vmem_bytes(head_tile, grp, c, dk, dv, q.dtype.itemsize, save_residuals)
    if budget > MAX_VMEM_BUDGET:
        raise ValueError(f"implementation='pallas_tpu': head_tile={head_tile} needs ~{budget / 2**20:.0f} MiB of "
                         f"VMEM, over the {MAX_VMEM_BUDGET // 2**20} MiB budget; use a smaller head_tile")
    reset, seq, last = (f.reshape(-1) for f in flags)  # index chunk * rows + row

    def chunk_block(ri, hi, ci, *_):
        return (ci, ri, hi) + (0,) * 3

    def qk_block(ri, hi, ci, *_):
        return (ci, ri, hi, 0, 0)

    def state_block(ri, hi, ci, reset_ref, seq_ref, last_ref):
        return (seq_ref[ci * rows + ri], hi, 0, 0, 0)

    qk_spec = pl.BlockSpec((1, 1, head_tile, c, dk), qk_block)
    v_spec = pl.BlockSpec((1, 1, head_tile, grp, c, dv), chunk_block)
    gate_spec = pl.BlockSpec((1, 1, head_tile, grp, 1, c), chunk_block)
    state_spec = pl.BlockSpec((1, head_tile, grp, dk, dv), state_block)
    out_shape = [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype)]
    out_specs = [v_spec, state_spec]
    if save_residuals:
        out_shape += [jax.ShapeDtypeStruct((nc, rows, hk, grp, dk, dv), h0.dtype),
                      jax.ShapeDtypeStruct((nc, rows, hk, grp, c, c), acc_dtype)]
        out_specs += [pl.BlockSpec((1, 1, head_tile, grp, dk, dv), chunk_block),
                      pl.BlockSpec((1, 1, head_tile, grp, c, c), chunk_block)]
    kernel = functools.partial(
        _kernel, rows=rows, head_tile=head_tile, grp=grp, scale=scale, acc_dtype=acc_dtype,
        decay_dtype=decay_dtype, l2norm=l2norm, save_residuals=save_residuals)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(rows, hk // head_tile, nc),
        in_specs=[qk_spec, qk_spec, v_spec, gate_spec, gate_spec, state_spec],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((head_tile, grp, dk, dv), acc_dtype)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=min(max(MIN_VMEM_LIMIT, 2 * budget), MAX_VMEM_LIMIT)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="gated_delta_rule_fwd",
    )(reset, seq, last, q, k, v, g, beta, h0)


def chunk_gated_delta_rule_pallas_tpu(q, k, v, g, beta, h0, *, interpret=None, head_tile=1, **kw):
    pallas_common.check_dims("pallas_tpu", q.shape[-1], v.shape[-1])
    kernel = functools.partial(kernel_call, interpret=pallas_common.resolve_interpret(interpret), head_tile=head_tile)
    return pallas_common.run(kernel, q, k, v, g, beta, h0, **kw)
