"""Chunked gated delta rule forward as a Pallas GPU kernel (Triton lowering).

One program per (row, key head, V block); it walks the chunks in a loop,
carrying one float32 state [K, BV] for each of the key head's G value heads,
so QK^T and KK^T are formed once per key head and chunk. Packed sequences
arrive re-laid by the chunk plan; per-chunk flags (reset, seq, last) are read
from small int32 arrays.

Triton needs every loaded or stored array to have a power-of-two size: K and
V are zero-padded to powers of two (inert: zero key and value columns never
touch the real ones), C is one already, and BV is a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gdnx.ops.gated_delta_rule import chunk_math, pallas_common

DEFAULT_BLOCK_V = 64
# Custom-call targets of a Triton kernel (the name moved between JAX
# versions). jax.export refuses them unless told: they carry no
# compatibility guarantee, so export for the GPU you will run on.
TRITON_CUSTOM_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, final_ref, *residual_refs,
            num_chunks, grp, scale, acc_dtype, decay_dtype, l2norm, save_residuals):
    first_v_block = pl.program_id(2) == 0

    def chunk(c, states):
        q = q_ref[c, 0, 0].astype(acc_dtype)
        k = k_ref[c, 0, 0].astype(acc_dtype)
        if l2norm:
            q, k = chunk_math.l2norm(q), chunk_math.l2norm(k)
        qk, kk = chunk_math.key_products(q, k)
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        new_states = []
        for j in range(grp):
            state = jnp.where(reset, h0_ref[seq, 0, j].astype(acc_dtype), states[j])
            prep = chunk_math.prepare(
                q, k, v_ref[c, 0, 0, j].astype(acc_dtype), g_ref[c, 0, 0, j], b_ref[c, 0, 0, j], qk, kk,
                scale=scale, decay_dtype=decay_dtype, inverse=chunk_math.unit_lower_inverse_rows)
            o, new_state = chunk_math.step(state, q, k, prep)
            o_ref[c, 0, 0, j] = o.astype(o_ref.dtype)
            if save_residuals:
                states_ref, tinv_ref = residual_refs
                states_ref[c, 0, 0, j] = state.astype(states_ref.dtype)

                @pl.when(first_v_block)  # the inverse does not depend on the V block
                def _():
                    tinv_ref[c, 0, 0, j] = prep.tinv.astype(tinv_ref.dtype)

            @pl.when(last)
            def _():
                final_ref[seq, 0, j] = new_state.astype(final_ref.dtype)

            new_states.append(new_state)
        return tuple(new_states)

    zeros = jnp.zeros(h0_ref.shape[-2:], acc_dtype)
    jax.lax.fori_loop(0, num_chunks, chunk, (zeros,) * grp)


def kernel_call(q, k, v, g, beta, h0, flags, *, scale, acc_dtype, decay_dtype, l2norm, save_residuals,
                interpret, block_v=DEFAULT_BLOCK_V, num_warps=4, num_stages=2):
    nc, rows, hk, c, dk = q.shape
    grp, dv = v.shape[3], v.shape[5]
    kp, vp = _pow2(dk), _pow2(dv)
    bv = min(block_v, vp)
    if bv != _pow2(bv):
        raise ValueError(f"block_v={block_v} must be a power of two")

    def pad(x, axis, to):
        return jnp.pad(x, [(0, 0)] * (axis % x.ndim) + [(0, to - x.shape[axis])] + [(0, 0)] * (-axis - 1))

    q, k = pad(q, -1, kp), pad(k, -1, kp)
    v = pad(v, -1, vp)
    h0 = pad(pad(h0, -1, vp), -2, kp)
    n = h0.shape[0]

    def per_key_head(ri, hi, vi):
        return (0, ri, hi, 0, 0)

    def per_v_block(ri, hi, vi):
        return (0, ri, hi, 0, 0, vi)

    def per_gate(ri, hi, vi):
        return (0, ri, hi, 0, 0, 0)

    def per_state(ri, hi, vi):
        return (0, hi, 0, 0, vi)

    flag_spec = pl.BlockSpec((nc, 1), lambda ri, hi, vi: (0, ri))
    qk_spec = pl.BlockSpec((nc, 1, 1, c, kp), per_key_head)
    v_spec = pl.BlockSpec((nc, 1, 1, grp, c, bv), per_v_block)
    gate_spec = pl.BlockSpec((nc, 1, 1, grp, 1, c), per_gate)
    state_spec = pl.BlockSpec((n, 1, grp, kp, bv), per_state)
    out_shape = [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype)]
    out_specs = [v_spec, state_spec]
    if save_residuals:
        out_shape += [jax.ShapeDtypeStruct((nc, rows, hk, grp, kp, vp), h0.dtype),
                      jax.ShapeDtypeStruct((nc, rows, hk, grp, c, c), acc_dtype)]
        out_specs += [pl.BlockSpec((nc, 1, 1, grp, kp, bv), per_v_block),
                      pl.BlockSpec((nc, 1, 1, grp, c, c), per_gate)]
    kernel = functools.partial(
        _kernel, num_chunks=nc, grp=grp, scale=scale, acc_dtype=acc_dtype, decay_dtype=decay_dtype,
        l2norm=l2norm, save_residuals=save_residuals)
    outs = pl.pallas_call(
        kernel,
        grid=(rows, hk, vp // bv),
        in_specs=[flag_spec] * 3 + [qk_spec, qk_spec, v_spec, gate_spec, gate_spec, state_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gated_delta_rule_fwd",
    )(*flags, q, k, v, g, beta, h0)
    o, final = outs[0][..., :dv], outs[1][..., :dk, :dv]
    if save_residuals:
        return o, final, outs[2][..., :dk, :dv], outs[3]
    return o, final


def chunk_gated_delta_rule_pallas_gpu(q, k, v, g, beta, h0, *, interpret=None, block_v=DEFAULT_BLOCK_V,
                                      num_warps=4, num_stages=2, **kw):
    pallas_common.check_dims("pallas_gpu", q.shape[-1], v.shape[-1])
    kernel = functools.partial(kernel_call, interpret=pallas_common.resolve_interpret(interpret),
                               block_v=block_v, num_warps=num_warps, num_stages=num_stages)
    return pallas_common.run(kernel, q, k, v, g, beta, h0, **kw)
