"""Chunked gated delta rule as Pallas GPU kernels (Triton lowering).

Forward: one program per (row, key head, V block); it walks the chunks in a
loop, carrying one float32 state [K, BV] for each of the key head's G value
heads, so QK^T and KK^T are formed once per key head and chunk. Packed
sequences arrive re-laid by the chunk plan; per-chunk flags (reset, seq,
last) are read from small int32 arrays.

Backward: the same programs walk the chunks in reverse carrying dS [K, BV]
per value head. dv and d(initial state) belong to the program's V block;
every other gradient sums over V, so each program writes its block's share
under a leading V-block index and XLA adds them.

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


def _load_keys(q_ref, k_ref, c, acc_dtype, l2norm):
    q = q_ref[c, 0, 0].astype(acc_dtype)
    k = k_ref[c, 0, 0].astype(acc_dtype)
    if l2norm:
        q, k = chunk_math.l2norm(q), chunk_math.l2norm(k)
    return q, k


def _fwd_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, final_ref,
                *residual_refs, num_chunks, grp, cfg, save_residuals):
    acc_dtype = cfg.acc_dtype
    first_v_block = pl.program_id(2) == 0

    def chunk(c, states):
        q, k = _load_keys(q_ref, k_ref, c, acc_dtype, cfg.l2norm)
        qk, kk = chunk_math.key_products(q, k, operands=cfg.operands)
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        new_states = []
        for j in range(grp):
            state = jnp.where(reset, h0_ref[seq, 0, j].astype(acc_dtype), states[j])
            o, new_state, tinv = chunk_math.value_head_forward(
                q, k, v_ref[c, 0, 0, j].astype(acc_dtype), g_ref[c, 0, 0, j], b_ref[c, 0, 0, j], qk, kk, state,
                inverse=chunk_math.unit_lower_inverse_masked, **cfg.algebra())
            o_ref[c, 0, 0, j] = o.astype(o_ref.dtype)
            if save_residuals:
                states_ref, tinv_ref = residual_refs
                states_ref[c, 0, 0, j] = state.astype(states_ref.dtype)

                @pl.when(first_v_block)  # the inverse does not depend on the V block
                def _():
                    tinv_ref[c, 0, 0, j] = tinv.astype(tinv_ref.dtype)

            @pl.when(last)
            def _():
                final_ref[seq, 0, j] = new_state.astype(final_ref.dtype)

            new_states.append(new_state)
        return tuple(new_states)

    zeros = jnp.zeros(h0_ref.shape[-2:], acc_dtype)
    jax.lax.fori_loop(0, num_chunks, chunk, (zeros,) * grp)


def _bwd_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, tinv_ref, states_ref, do_ref,
                dfinal_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, *, num_chunks, grp, cfg):
    acc_dtype = cfg.acc_dtype
    # Every gradient but dv and dh0 sums over V; this program adds its V
    # block's share, stored under its own leading index and summed outside.
    def chunk(step, dstates):
        c = num_chunks - 1 - step
        q, k = _load_keys(q_ref, k_ref, c, acc_dtype, False)
        qk, kk = chunk_math.key_products(q, k, operands=cfg.operands)
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        dq = dk = dqk = dkk = 0.0
        new_dstates = []
        for j in range(grp):
            dstate_out = dstates[j] + jnp.where(last, dfinal_ref[seq, 0, j].astype(acc_dtype), 0.0)
            vg = chunk_math.value_head_backward(
                q, k, v_ref[c, 0, 0, j].astype(acc_dtype), g_ref[c, 0, 0, j], b_ref[c, 0, 0, j], qk, kk,
                tinv_ref[c, 0, 0, j].astype(acc_dtype), states_ref[c, 0, 0, j].astype(acc_dtype),
                do_ref[c, 0, 0, j].astype(acc_dtype), dstate_out, **cfg.algebra())
            dv_ref[c, 0, 0, j] = vg.dv.astype(dv_ref.dtype)
            dg_ref[0, c, 0, 0, j] = vg.dg
            db_ref[0, c, 0, 0, j] = vg.dbeta
            dq, dk, dqk, dkk = dq + vg.dq, dk + vg.dk, dqk + vg.dqk, dkk + vg.dkk

            @pl.when(reset)
            def _():
                dh0_ref[seq, 0, j] = vg.dstate_in.astype(dh0_ref.dtype)

            new_dstates.append(jnp.where(reset, 0.0, vg.dstate_in))
        dq_k, dk_k = chunk_math.key_products_bwd(q, k, dqk, dkk, operands=cfg.operands)
        dq_ref[0, c, 0, 0] = dq + dq_k
        dk_ref[0, c, 0, 0] = dk + dk_k
        return tuple(new_dstates)

    zeros = jnp.zeros(dh0_ref.shape[-2:], acc_dtype)
    jax.lax.fori_loop(0, num_chunks, chunk, (zeros,) * grp)


def _pad(x, axis, to):
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, pads)


class _Layout:
    """Padded sizes and block specs for a grid (row, key head, V block)."""

    def __init__(self, q, v, num_seqs, block_v):
        self.nc, self.rows, self.hk, self.c, self.dk = q.shape
        self.grp, self.dv = v.shape[3], v.shape[5]
        self.kp, self.vp = _pow2(self.dk), _pow2(self.dv)
        self.bv = min(block_v, self.vp)
        if self.bv != _pow2(self.bv):
            raise ValueError(f"block_v={block_v} must be a power of two")
        nc, c, kp, bv, grp = self.nc, self.c, self.kp, self.bv, self.grp
        self.flag = pl.BlockSpec((nc, 1), lambda ri, hi, vi: (0, ri))
        self.keys = pl.BlockSpec((nc, 1, 1, c, kp), lambda ri, hi, vi: (0, ri, hi, 0, 0))
        self.values = pl.BlockSpec((nc, 1, 1, grp, c, bv), lambda ri, hi, vi: (0, ri, hi, 0, 0, vi))
        self.gates = pl.BlockSpec((nc, 1, 1, grp, 1, c), lambda ri, hi, vi: (0, ri, hi, 0, 0, 0))
        self.inverse = pl.BlockSpec((nc, 1, 1, grp, c, c), lambda ri, hi, vi: (0, ri, hi, 0, 0, 0))
        self.chunk_state = pl.BlockSpec((nc, 1, 1, grp, kp, bv), lambda ri, hi, vi: (0, ri, hi, 0, 0, vi))
        self.sequence_state = pl.BlockSpec((num_seqs, 1, grp, kp, bv), lambda ri, hi, vi: (0, hi, 0, 0, vi))
        # per-V-block partial sums: leading axis = V block
        self.keys_partial = pl.BlockSpec((1, nc, 1, 1, c, kp), lambda ri, hi, vi: (vi, 0, ri, hi, 0, 0))
        self.gates_partial = pl.BlockSpec((1, nc, 1, 1, grp, 1, c), lambda ri, hi, vi: (vi, 0, ri, hi, 0, 0, 0))

    @property
    def grid(self):
        return (self.rows, self.hk, self.vp // self.bv)

    def pad_keys(self, x):
        return _pad(x, -1, self.kp)

    def pad_values(self, x):
        return _pad(x, -1, self.vp)

    def pad_state(self, x):
        return _pad(_pad(x, -1, self.vp), -2, self.kp)


def _call(kernel, lay, in_specs, out_specs, out_shape, interpret, num_warps, num_stages, *args):
    return pl.pallas_call(
        kernel, grid=lay.grid, in_specs=[lay.flag] * 3 + in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*args)


def forward(q, k, v, g, beta, h0, flags, *, cfg, save_residuals, interpret, block_v=DEFAULT_BLOCK_V, num_warps=4,
            num_stages=2):
    lay = _Layout(q, v, h0.shape[0], block_v)
    q, k, v, h0 = lay.pad_keys(q), lay.pad_keys(k), lay.pad_values(v), lay.pad_state(h0)
    out_shape = [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype)]
    out_specs = [lay.values, lay.sequence_state]
    if save_residuals:
        out_shape += [jax.ShapeDtypeStruct(v.shape[:4] + (lay.kp, lay.vp), h0.dtype),
                      jax.ShapeDtypeStruct(v.shape[:4] + (lay.c, lay.c), cfg.acc_dtype)]
        out_specs += [lay.chunk_state, lay.inverse]
    kernel = functools.partial(_fwd_kernel, num_chunks=lay.nc, grp=lay.grp, cfg=cfg, save_residuals=save_residuals)
    outs = _call(kernel, lay, [lay.keys, lay.keys, lay.values, lay.gates, lay.gates, lay.sequence_state],
                 out_specs, out_shape, interpret, num_warps, num_stages, *flags, q, k, v, g, beta, h0)
    dk, dv = lay.dk, lay.dv
    o, final = outs[0][..., :dv], outs[1][..., :dk, :dv]
    if save_residuals:
        return o, final, outs[2][..., :dk, :dv], outs[3]
    return o, final


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags, *, cfg, interpret, block_v=DEFAULT_BLOCK_V,
             num_warps=4, num_stages=2):
    lay = _Layout(q, v, dfinal.shape[0], block_v)
    acc_dtype = cfg.acc_dtype
    if cfg.l2norm:  # the kernel takes the normalised q, k; the caller chains dq, dk through l2norm
        q, k = chunk_math.l2norm(q.astype(acc_dtype)), chunk_math.l2norm(k.astype(acc_dtype))
    q, k, v, do = lay.pad_keys(q), lay.pad_keys(k), lay.pad_values(v), lay.pad_values(do)
    states, dfinal = lay.pad_state(states), lay.pad_state(dfinal)
    nvb = lay.grid[2]
    out_shape = [jax.ShapeDtypeStruct((nvb,) + q.shape, acc_dtype), jax.ShapeDtypeStruct((nvb,) + k.shape, acc_dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((nvb,) + g.shape, acc_dtype),
                 jax.ShapeDtypeStruct((nvb,) + beta.shape, acc_dtype), jax.ShapeDtypeStruct(dfinal.shape, acc_dtype)]
    out_specs = [lay.keys_partial, lay.keys_partial, lay.values, lay.gates_partial, lay.gates_partial,
                 lay.sequence_state]
    kernel = functools.partial(_bwd_kernel, num_chunks=lay.nc, grp=lay.grp, cfg=cfg)
    dq, dk, dv, dg, dbeta, dh0 = _call(
        kernel, lay, [lay.keys, lay.keys, lay.values, lay.gates, lay.gates, lay.inverse, lay.chunk_state, lay.values,
                      lay.sequence_state],
        out_specs, out_shape, interpret, num_warps, num_stages, *flags, q, k, v, g, beta, tinv, states, do, dfinal)
    kd, vd = lay.dk, lay.dv
    return (dq.sum(0)[..., :kd], dk.sum(0)[..., :kd], dv[..., :vd], dg.sum(0).astype(g.dtype),
            dbeta.sum(0).astype(beta.dtype), dh0[..., :kd, :vd])


def chunk_gated_delta_rule_pallas_gpu(q, k, v, g, beta, h0, *, interpret=None, block_v=DEFAULT_BLOCK_V,
                                      num_warps=4, num_stages=2, **kw):
    pallas_common.check_dims("pallas_gpu", q.shape[-1], v.shape[-1])
    knobs = dict(interpret=pallas_common.resolve_interpret(interpret), block_v=block_v, num_warps=num_warps,
                 num_stages=num_stages)
    kernels = pallas_common.Kernels(functools.partial(forward, **knobs), functools.partial(backward, **knobs))
    return pallas_common.run(kernels, q, k, v, g, beta, h0, **kw)
