"""Chunked KDA as Pallas GPU kernels (Triton lowering), in phases.

The gated delta rule's GPU layout (delta_rule/triton.py: grids, padding to
powers of two, float32 products as three TF32 passes, l2norm scales applied
to the loaded key blocks) with KDA's per-channel chunk algebra (kda/math.py). Every decay is
per key channel, so the chunk-parallel kernels walk K in blocks of BK
columns and form each block's decay factors themselves; what is summed over
K (the pairwise products, dA) is carried as [C, C].

    forward   prepare    (chunk, row, value head)            per K block: decays, KK^T and QK^T
                                                              with them, q exp(G), k exp(G_last - G);
                                                              then (I + A)^-1, U, W
              state      (row, value head, V block)          sequential: Vn, chunk states
              output     (chunk, row, value head x V block)  O = (q exp(G)) S + P Vn
    backward  prepare    again, with the saved inverse, writing k k^T
              dv_local   (chunk, row, value head x V block)  P^T dO, Vn
              dstate     (row, value head, V block)          reverse sequential: dS, dVn
              grad_sums  (chunk, row, value head)            dv, dbeta; per K block dx; dA, dP [C, C]
              state_grads (chunk, row, value head)           per K block dq, dk, dg through the state
              pair_grads (chunk, row, value head)            per K block dq, dk, dg through the pairs, added

The prepare kernel writes scale q exp(G), k exp(G_last - G) [C, K] and P
[C, C] for the later phases, so that only it forms the pairwise products
in the forward. The sequential kernels carry the [K, BV] state as K/BK
blocks. The gradients take three kernels, the sums over V and K first,
then the terms through the state and those through the pairwise products,
so that none holds another's tiles (the [C, C] cotangents only the last;
with bfloat16 products none spills on sm_90); all run at the tiles'
num_warps, not the gated delta rule's grads_num_warps (where they spill
least). The w loop of prepare forms the decays again for q exp(G) and
k exp(G_last - G), which the pairs' loop would otherwise hold. dq and dk
come out per value head and are summed over each key head's group outside
the kernels.
Registers and spills per kernel and target: docs/benchmarks.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdnx.ops.delta_rule import pallas
from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.chunked import ChunkFlags, ChunkOptions
from gdnx.ops.delta_rule.costs import matmul_flops
from gdnx.ops.delta_rule.primitives import col_to_row, iotas, mm, mm_nt, mm_tn, row_to_col, unit_lower_inverse_loop
from gdnx.ops.delta_rule.tiles import GpuTiles
from gdnx.ops.delta_rule.triton import (
    GridLayout,
    as_operand,
    block_cols,
    block_ds,
    each_block,
    launch,
    loop_blocks,
    norm_rows,
    on_hardware,
)
from gdnx.ops.kda import math as kda_math


def _split(opts) -> bool:
    # Float32 segment sums as three exact bfloat16 passes (kda_math._segment_sums):
    # a float32 FMA dot of [C, C] x [C, BK] holds a C-long row per output in registers.
    return opts.decay_dtype == jnp.float32


def _decay_kw(opts) -> dict:
    return dict(state_dtype=opts.state_dtype, decay_dtype=opts.decay_dtype, split_segments=_split(opts))


def _pair_kw(opts) -> dict:
    """kda_math's pairwise products in a kernel: one bit per loop step."""
    return dict(matmul_dtype=opts.matmul_dtype, split_segments=_split(opts), bits=kda_math.looped_bits)


def _key_block(ref, idx, kb, bk, scale_col, opts):
    """Column block kb of q or k, l2norm-scaled, in the accumulation dtype."""
    return ref[block_cols(idx, kb, bk)].astype(opts.state_dtype) * scale_col


def _gamma_col(g, opts):
    """exp(G_last) [K, 1] of a chunk's gates g [C, K]."""
    return jnp.transpose(jnp.exp(jnp.sum(g.astype(opts.decay_dtype), axis=0, keepdims=True))).astype(
        opts.state_dtype)


def _costs(lay) -> tuple[int, dict[str, int], int]:
    heads = lay.nc * lay.rows * lay.hk * lay.grp
    return heads, kda_math.chunk_flops(lay.c, lay.kp, lay.vp), kda_math.transcendentals(lay.c, lay.kp)


# --- forward ---------------------------------------------------------------

def _prepare_kernel(q_ref, k_ref, rq_ref, rk_ref, v_ref, g_ref, b_ref, *refs, opts, bk, bv, given_inverse):
    """U, W, P, scale q exp(G), k exp(G_last - G), and the inverse unless
    given (the backward: then the pairwise k k^T, A / beta)."""
    acc, mmd = opts.state_dtype, opts.matmul_dtype
    key, head = (0, 0, 0), (0, 0, 0, 0)
    rq, rk = row_to_col(rq_ref[key]), row_to_col(rk_ref[key])
    beta = row_to_col(b_ref[head].astype(acc))
    c = k_ref.shape[-2]
    if given_inverse:
        tinv_ref, u_ref, w_ref, p_ref, qeg_ref, kek_ref, akk_ref = refs
    else:
        u_ref, w_ref, p_ref, qeg_ref, kek_ref, tinv_ref = refs

    def pairs(kb, carry):
        akk, p = carry
        q, k = _key_block(q_ref, key, kb, bk, rq, opts), _key_block(k_ref, key, kb, bk, rk, opts)
        dec = kda_math.decays(g_ref[block_cols(head, kb, bk)], **_decay_kw(opts))
        p, akk = kda_math.pair_products([(q, k, False), (k, k, True)], dec, into=[p, akk], **_pair_kw(opts))
        return akk, p

    zeros = jnp.zeros((c, c), acc)
    akk, p = loop_blocks(k_ref.shape[-1] // bk, pairs, (zeros, zeros))
    p_ref[head] = opts.scale * p
    if given_inverse:
        tinv = tinv_ref[head]
        akk_ref[head] = akk    # dbeta's last term takes it
    else:
        tinv = unit_lower_inverse_loop(beta * akk)
        tinv_ref[head] = tinv

    def u_block(vb):
        cols = block_cols(head, vb, bv)
        u_ref[cols] = mm(tinv, beta * v_ref[cols].astype(acc), matmul_dtype=mmd)

    def w_block(kb):
        q, k = _key_block(q_ref, key, kb, bk, rq, opts), _key_block(k_ref, key, kb, bk, rk, opts)
        dec = kda_math.decays(g_ref[block_cols(head, kb, bk)], **_decay_kw(opts))
        qeg_ref[block_cols(head, kb, bk)] = opts.scale * q * dec.eg
        kek_ref[block_cols(head, kb, bk)] = k * dec.ek
        w_ref[block_cols(head, kb, bk)] = mm(tinv, (beta * dec.eg) * k, matmul_dtype=mmd)

    each_block(v_ref.shape[-1] // bv, u_block)
    each_block(k_ref.shape[-1] // bk, w_block)


def _rows(idx, kb, bk):
    """Rows kb * bk ... of the [K, V] tile at idx."""
    return idx + (block_ds(kb, bk), slice(None))


def _gamma_cols(g_ref, idx, nkb, bk, opts):
    """exp(G_last) of each K block of the chunk's gates, as [BK, 1] columns."""
    return [_gamma_col(g_ref[block_cols(idx, kb, bk)], opts) for kb in range(nkb)]


def _state_kernel(reset_ref, seq_ref, last_ref, w_ref, u_ref, kek_ref, g_ref, h0_ref, vn_ref, states_ref, final_ref,
                  *, num_chunks, opts, bk):
    """Walk a row's chunks: Vn = U - W S, S' = exp(G_last) S + (k exp(G_last - G))^T Vn;
    the state [K, BV] is carried as K/BK blocks."""
    acc, mmd = opts.state_dtype, opts.matmul_dtype
    nkb = w_ref.shape[-1] // bk

    def chunk(c, state):
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        idx = (c, 0, 0, 0)
        state = tuple(jnp.where(reset, h0_ref[_rows((seq, 0, 0), kb, bk)].astype(acc), s) for kb, s in enumerate(state))
        for kb, s in enumerate(state):
            states_ref[_rows(idx, kb, bk)] = s
        vn = u_ref[idx] - sum(mm(w_ref[block_cols(idx, kb, bk)], s, matmul_dtype=mmd) for kb, s in enumerate(state))
        vn_ref[idx] = vn
        gammas = _gamma_cols(g_ref, idx, nkb, bk, opts)
        state = tuple(gm * s + mm_tn(kek_ref[block_cols(idx, kb, bk)], vn, matmul_dtype=mmd)
                      for kb, (gm, s) in enumerate(zip(gammas, state)))

        @pl.when(last)
        def _():
            for kb, s in enumerate(state):
                final_ref[_rows((seq, 0, 0), kb, bk)] = s.astype(final_ref.dtype)

        return state

    bv = h0_ref.shape[-1]
    jax.lax.fori_loop(0, num_chunks, chunk, tuple(jnp.zeros((bk, bv), acc) for _ in range(nkb)))


def _output_kernel(qeg_ref, p_ref, states_ref, vn_ref, o_ref, *, opts):
    head = (0, 0, 0, 0)
    o = mm(qeg_ref[head], states_ref[head], matmul_dtype=opts.matmul_dtype) + mm(
        p_ref[head], vn_ref[head], matmul_dtype=opts.matmul_dtype)
    o_ref[head] = o.astype(o_ref.dtype)


def _prepare(lay, q, k, rq, rk, v, g, beta, tinv, opts, tiles, interpret):
    """(u, w, p, qeg, kek, tinv) per value head, chunk-parallel; given tinv,
    (u, w, p, qeg, kek, k k^T)."""
    acc, c, kp, vp = opts.state_dtype, lay.c, lay.kp, lay.vp
    shape = (lay.nc, lay.rows, lay.hk, lay.grp)
    ck, cv, cc = (jax.ShapeDtypeStruct(shape + dims, acc) for dims in ((c, kp), (c, vp), (c, c)))
    in_specs = [lay.head_spec(c, kp, key=True)] * 2 + [lay.head_spec(1, c, key=True)] * 2 + [
        lay.head_spec(c, vp), lay.head_spec(c, kp), lay.head_spec(1, c)]
    outs = [lay.head_spec(c, vp), lay.head_spec(c, kp), lay.head_spec(c, c), lay.head_spec(c, kp),
            lay.head_spec(c, kp)]
    kernel = functools.partial(_prepare_kernel, opts=opts, bk=lay.bk, bv=lay.bv, given_inverse=tinv is not None)
    heads, f, exps = _costs(lay)
    flops = heads * (f["decays"] + f["pairs"] + f["prepare"])
    common = dict(grid=lay.head_grid, tiles=tiles, interpret=interpret, flops=flops, exps=heads * exps)
    if tinv is not None:
        return launch(kernel, in_specs=in_specs + [lay.head_spec(c, c)], out_specs=outs + [lay.head_spec(c, c)],
                      out_shape=[cv, ck, cc, ck, ck, cc], args=(q, k, rq, rk, v, g, beta, tinv), **common)
    return launch(kernel, in_specs=in_specs, out_specs=outs + [lay.head_spec(c, c)],
                  out_shape=[cv, ck, cc, ck, ck, cc], args=(q, k, rq, rk, v, g, beta), **common)


def _pad_inputs(lay, q, k, v, g):
    return lay.pad_keys(q), lay.pad_keys(k), lay.pad_values(v), lay.pad_keys(g)


def forward(q, k, v, g, beta, h0, flags: ChunkFlags, *, opts: ChunkOptions, save_residuals: bool, interpret: bool,
            tiles: GpuTiles):
    lay = GridLayout(q, v, h0.shape[0], tiles)
    opts = on_hardware(opts, interpret)
    acc = opts.state_dtype
    rq, rk = norm_rows(q, opts), norm_rows(k, opts)
    q, k, v, g = _pad_inputs(lay, q, k, v, g)
    h0 = lay.pad_state(h0)
    u, w, p, qeg, kek, tinv = _prepare(lay, q, k, rq, rk, v, g, beta, None, opts, tiles, interpret)

    c, kp, sbv, obv = lay.c, lay.kp, lay.sbv, lay.obv
    shape = (lay.nc, lay.rows, lay.hk, lay.grp)
    heads, f, exps = _costs(lay)
    whole = functools.partial(lay.seq_spec, v_blocked=False)
    vn, states, final = launch(
        functools.partial(_state_kernel, num_chunks=lay.nc, opts=opts, bk=lay.sbk), grid=lay.seq_grid,
        in_specs=[lay.flag_spec()] * 3 + [whole(c, kp), lay.seq_spec(c, sbv), whole(c, kp), whole(c, kp),
                                          lay.seq_state_spec()],
        out_specs=[lay.seq_spec(c, sbv), lay.seq_spec(kp, sbv), lay.seq_state_spec()],
        out_shape=[jax.ShapeDtypeStruct(shape + (c, lay.vp), acc), jax.ShapeDtypeStruct(shape + (kp, lay.vp), acc),
                   jax.ShapeDtypeStruct(h0.shape, h0.dtype)],
        tiles=tiles, interpret=interpret, flops=heads * f["state"], exps=heads * lay.snvb * kp,
        args=(*flags, w, u, kek, g, h0))
    o = launch(functools.partial(_output_kernel, opts=opts), grid=lay.block_grid,
               in_specs=[lay.block_spec(c, kp, v_blocked=False), lay.block_spec(c, c, v_blocked=False),
                         lay.block_spec(kp, obv), lay.block_spec(c, obv)],
               out_specs=lay.block_spec(c, obv), out_shape=jax.ShapeDtypeStruct(shape + (c, lay.vp), q.dtype),
               tiles=tiles, interpret=interpret, flops=heads * f["output"], exps=0, args=(qeg, p, states, vn))
    o, final = o[..., :lay.v_dim], final[..., :lay.k_dim, :lay.v_dim]
    if save_residuals:
        return o, final, states[..., :lay.k_dim, :lay.v_dim].astype(h0.dtype), tinv
    return o, final


# --- backward --------------------------------------------------------------

def _dv_local_kernel(p_ref, do_ref, u_ref, w_ref, states_ref, dvl_ref, vn_ref, *, opts):
    """P^T dO (the part of dVn that needs no dS) and Vn = U - W S."""
    head, mmd = (0, 0, 0, 0), opts.matmul_dtype
    dvl_ref[head] = mm_tn(p_ref[head], as_operand(do_ref[head], opts), matmul_dtype=mmd)
    vn_ref[head] = u_ref[head] - mm(w_ref[head], states_ref[head], matmul_dtype=mmd)


def _dstate_kernel(reset_ref, seq_ref, last_ref, qeg_ref, kek_ref, w_ref, g_ref, do_ref, dvl_ref, dfinal_ref,
                   dvn_ref, dstates_ref, dh0_ref, *, num_chunks, opts, bk):
    """Walk a row's chunks in reverse carrying dS (as K/BK blocks):
    dVn = P^T dO + (k exp(G_last - G)) dS', dS = exp(G_last) dS' + (scale q exp(G))^T dO - W^T dVn."""
    acc, mmd = opts.state_dtype, opts.matmul_dtype
    nkb = w_ref.shape[-1] // bk

    def chunk(step, dstate):
        c = num_chunks - 1 - step
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        idx = (c, 0, 0, 0)
        dstate = tuple(s + jnp.where(last, dfinal_ref[_rows((seq, 0, 0), kb, bk)].astype(acc), 0.0)
                       for kb, s in enumerate(dstate))
        for kb, s in enumerate(dstate):
            dstates_ref[_rows(idx, kb, bk)] = s
        dvn = dvl_ref[idx] + sum(mm(kek_ref[block_cols(idx, kb, bk)], s, matmul_dtype=mmd)
                                 for kb, s in enumerate(dstate))
        dvn_ref[idx] = dvn
        do = as_operand(do_ref[idx], opts)
        gammas = _gamma_cols(g_ref, idx, nkb, bk, opts)
        dstate_in = tuple(gm * s + mm_tn(qeg_ref[block_cols(idx, kb, bk)], do, matmul_dtype=mmd)
                          - mm_tn(w_ref[block_cols(idx, kb, bk)], dvn, matmul_dtype=mmd)
                          for kb, (gm, s) in enumerate(zip(gammas, dstate)))

        @pl.when(reset)
        def _():
            for kb, s in enumerate(dstate_in):
                dh0_ref[_rows((seq, 0, 0), kb, bk)] = s.astype(dh0_ref.dtype)

        return tuple(jnp.where(reset, 0.0, s) for s in dstate_in)

    bv = dh0_ref.shape[-1]
    jax.lax.fori_loop(0, num_chunks, chunk, tuple(jnp.zeros((bk, bv), acc) for _ in range(nkb)))


def _state_sums(states_ref, dstates_ref, do_ref, vn_ref, dvn_ref, head, kb, *, bk, bv, nvb, full, opts):
    """Sums over V blocks for K block kb: dW = -dVn S^T (when dvn_ref), and
    when full dqs = dO S^T (of q exp(G) / scale), dks = Vn dS'^T (of
    k exp(G_last - G)) and dgamma = sum_V S dS' (a [BK, 1] column)."""
    acc, mmd = opts.state_dtype, opts.matmul_dtype
    c = vn_ref.shape[-2]

    def v_block(vb, sums):
        cols, blk = block_cols(head, vb, bv), head + (block_ds(kb, bk), block_ds(vb, bv))
        s = states_ref[blk]
        if not full:
            return (sums[0] - mm_nt(dvn_ref[cols], s, matmul_dtype=mmd),)
        ds = dstates_ref[blk]
        return (sums[0] + mm_nt(as_operand(do_ref[cols], opts), s, matmul_dtype=mmd),
                sums[1] + mm_nt(vn_ref[cols], ds, matmul_dtype=mmd),
                sums[2] + jnp.sum(s * ds, axis=1, keepdims=True))

    zeros_ck = jnp.zeros((c, bk), acc)
    init = (zeros_ck, zeros_ck, jnp.zeros((bk, 1), acc)) if full else (zeros_ck,)
    return loop_blocks(nvb, v_block, init)


def _grad_sums_kernel(k_ref, rk_ref, v_ref, g_ref, b_ref, tinv_ref, u_ref, w_ref, vn_ref, states_ref, do_ref, dvn_ref,
                      akk_ref, dv_ref, db_ref, dx_ref, da_ref, dp_ref, *, opts, bk, bv):
    """What needs the sums over V and K: dv, dbeta (its last term from the
    prepare kernel's k k^T), dx (of beta exp(G) k, per K block) and the
    [C, C] cotangents of A and P (beta dA, scale dP) for `_pair_grads_kernel`
    (kda_math.value_head_backward, block by block)."""
    acc, mmd = opts.state_dtype, opts.matmul_dtype
    key, head = (0, 0, 0), (0, 0, 0, 0)
    rk = row_to_col(rk_ref[key])
    beta = row_to_col(b_ref[head].astype(acc))
    tinv = tinv_ref[head]
    c = k_ref.shape[-2]
    nvb = v_ref.shape[-1] // bv

    def value_block(vb, carry):
        dbv_u, dp, v_dbv = carry
        cols = block_cols(head, vb, bv)
        dbv = mm_tn(tinv, dvn_ref[cols], matmul_dtype=mmd)          # of beta v
        dv_ref[cols] = (beta * dbv).astype(dv_ref.dtype)
        return (dbv_u + mm_nt(dbv, u_ref[cols], matmul_dtype=mmd),
                dp + mm_nt(as_operand(do_ref[cols], opts), vn_ref[cols], matmul_dtype=mmd),
                v_dbv + jnp.sum(v_ref[cols].astype(acc) * dbv, axis=1, keepdims=True))

    zeros_cc, zeros_c1 = jnp.zeros((c, c), acc), jnp.zeros((c, 1), acc)
    dbv_u, dp, v_dbv = loop_blocks(nvb, value_block, (zeros_cc, zeros_cc, zeros_c1))
    r, j = iotas(c)
    # stored now, scaled as the key gradients take it: the key blocks' loop does not hold it
    dp_ref[head] = jnp.where(r >= j, opts.scale * dp, 0)

    # dA's two terms carried as one [C, C] sum; k k^T is read, not formed here (registers: no spill)
    def key_sums(kb, carry):
        dx_wu, egkdx = carry
        k = _key_block(k_ref, key, kb, bk, rk, opts)
        eg = kda_math.prefix_decays(g_ref[block_cols(head, kb, bk)], **_decay_kw(opts))
        dw, = _state_sums(states_ref, None, do_ref, vn_ref, dvn_ref, head, kb, bk=bk, bv=bv, nvb=nvb, full=False,
                          opts=opts)
        dx = mm_tn(tinv, dw, matmul_dtype=mmd)                      # through W = T X
        dx_ref[block_cols(head, kb, bk)] = dx
        return (dx_wu + mm_nt(dx, w_ref[block_cols(head, kb, bk)], matmul_dtype=mmd),
                egkdx + jnp.sum(eg * k * dx, axis=1, keepdims=True))

    dx_wu, egkdx = loop_blocks(k_ref.shape[-1] // bk, key_sums, (dbv_u, zeros_c1))
    # the inverse is not differentiated through: dA = -(T^T dU) U^T - (T^T dW) W^T
    da = jnp.where(r > j, -dx_wu, 0)
    db_ref[head] = col_to_row(v_dbv + egkdx + jnp.sum(da * akk_ref[head], axis=1, keepdims=True)).astype(db_ref.dtype)
    da_ref[head] = beta * da


def _state_grads_kernel(q_ref, k_ref, rq_ref, rk_ref, g_ref, b_ref, vn_ref, states_ref, dstates_ref, do_ref, dx_ref,
                        dq_ref, dk_ref, dg_ref, *, opts, bk, bv):
    """The parts of dq, dk, dg per K block through the state and W
    (kda_math.state_grads)."""
    acc = opts.state_dtype
    key, head = (0, 0, 0), (0, 0, 0, 0)
    rq, rk = row_to_col(rq_ref[key]), row_to_col(rk_ref[key])
    beta = row_to_col(b_ref[head].astype(acc))
    nvb = vn_ref.shape[-1] // bv

    def key_block(kb):
        cols = block_cols(head, kb, bk)
        q, k = _key_block(q_ref, key, kb, bk, rq, opts), _key_block(k_ref, key, kb, bk, rk, opts)
        dec = kda_math.decays(g_ref[cols], **_decay_kw(opts))
        dqs, dks, dgamma = _state_sums(states_ref, dstates_ref, do_ref, vn_ref, None, head, kb, bk=bk, bv=bv,
                                       nvb=nvb, full=True, opts=opts)
        dq, dk, dg = kda_math.state_grads(q, k, dec, beta, opts.scale * dqs, dks, dx_ref[cols], col_to_row(dgamma),
                                          split_segments=_split(opts))
        dq_ref[cols] = dq
        dk_ref[cols] = dk
        dg_ref[cols] = dg

    each_block(q_ref.shape[-1] // bk, key_block)


def _pair_grads_kernel(q_ref, k_ref, rq_ref, rk_ref, g_ref, dp_ref, da_ref, dq0_ref, dk0_ref, dg0_ref, dq_ref, dk_ref,
                       dg_ref, *, opts, bk):
    """The pairwise products' parts of dq, dk, dg per K block
    (kda_math.pair_grads), given scale dP and beta dA, added to the state's."""
    key, head = (0, 0, 0), (0, 0, 0, 0)
    rq, rk = row_to_col(rq_ref[key]), row_to_col(rk_ref[key])
    dp, da = dp_ref[head], da_ref[head]

    def key_block(kb):
        cols = block_cols(head, kb, bk)
        q, k = _key_block(q_ref, key, kb, bk, rq, opts), _key_block(k_ref, key, kb, bk, rk, opts)
        dec = kda_math.decays(g_ref[cols], **_decay_kw(opts))
        dq, dk, dg = kda_math.pair_grads(q, k, dec, dp, da, **_pair_kw(opts))
        dq_ref[cols] = dq0_ref[cols] + dq
        dk_ref[cols] = dk0_ref[cols] + dk
        dg_ref[cols] = (dg0_ref[cols] + dg).astype(dg_ref.dtype)

    each_block(k_ref.shape[-1] // bk, key_block)


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags: ChunkFlags, *, opts: ChunkOptions, interpret: bool,
             tiles: GpuTiles):
    lay = GridLayout(q, v, dfinal.shape[0], tiles)
    opts = on_hardware(opts, interpret)
    acc = opts.state_dtype
    rq, rk = norm_rows(q, opts), norm_rows(k, opts)
    q, k, v, g = _pad_inputs(lay, q, k, v, g)
    do = lay.pad_values(do)
    states, dfinal = lay.pad_state(states.astype(acc)), lay.pad_state(dfinal)
    u, w, p, qeg, kek, akk = _prepare(lay, q, k, rq, rk, v, g, beta, tinv, opts, tiles, interpret)

    c, kp, vp, obv, sbv = lay.c, lay.kp, lay.vp, lay.obv, lay.sbv
    shape = (lay.nc, lay.rows, lay.hk, lay.grp)
    heads, f, exps = _costs(lay)
    mmf = matmul_flops
    cv = jax.ShapeDtypeStruct(shape + (c, vp), acc)
    dvl, vn = launch(functools.partial(_dv_local_kernel, opts=opts), grid=lay.block_grid,
                     in_specs=[lay.block_spec(c, c, v_blocked=False), lay.block_spec(c, obv), lay.block_spec(c, obv),
                               lay.block_spec(c, kp, v_blocked=False), lay.block_spec(kp, obv)],
                     out_specs=[lay.block_spec(c, obv)] * 2, out_shape=[cv, cv], tiles=tiles, interpret=interpret,
                     flops=heads * (mmf(c, c, vp) + mmf(c, kp, vp)), exps=0, args=(p, do, u, w, states))
    whole = functools.partial(lay.seq_spec, v_blocked=False)
    dvn, dstates, dh0 = launch(
        functools.partial(_dstate_kernel, num_chunks=lay.nc, opts=opts, bk=lay.sbk), grid=lay.seq_grid,
        in_specs=[lay.flag_spec()] * 3 + [whole(c, kp)] * 4 + [lay.seq_spec(c, sbv)] * 2 + [lay.seq_state_spec()],
        out_specs=[lay.seq_spec(c, sbv), lay.seq_spec(kp, sbv), lay.seq_state_spec()],
        out_shape=[cv, jax.ShapeDtypeStruct(shape + (kp, vp), acc), jax.ShapeDtypeStruct(dfinal.shape, acc)],
        tiles=tiles, interpret=interpret, flops=heads * 3 * mmf(c, kp, vp), exps=heads * lay.snvb * kp,
        args=(*flags, qeg, kek, w, g, do, dvl, dfinal))

    hs = lay.head_spec
    key = [hs(c, kp, key=True)] * 2 + [hs(1, c, key=True)] * 2
    ck, cc = (jax.ShapeDtypeStruct(shape + dims, acc) for dims in ((c, kp), (c, c)))
    dv, dbeta, dx, da, dp = launch(
        functools.partial(_grad_sums_kernel, opts=opts, bk=lay.bk, bv=lay.bv), grid=lay.head_grid,
        in_specs=key[1::2] + [hs(c, vp), hs(c, kp), hs(1, c), hs(c, c), hs(c, vp), hs(c, kp), hs(c, vp), hs(kp, vp),
                              hs(c, vp), hs(c, vp), hs(c, c)],
        out_specs=[hs(c, vp), hs(1, c), hs(c, kp), hs(c, c), hs(c, c)],
        out_shape=[jax.ShapeDtypeStruct(shape + (c, vp), v.dtype), jax.ShapeDtypeStruct(beta.shape, beta.dtype), ck,
                   cc, cc],
        tiles=tiles, interpret=interpret, flops=heads * (f["decays"] // 2 + f["grads"] // 2),
        exps=heads * exps, args=(k, rk, v, g, beta, tinv, u, w, vn, states, do, dvn, akk))
    # the state's part and the pairs' adjoints in kernels of their own (together they spill)
    dq, dk, dg = launch(
        functools.partial(_state_grads_kernel, opts=opts, bk=lay.bk, bv=lay.bv), grid=lay.head_grid,
        in_specs=key + [hs(c, kp), hs(1, c), hs(c, vp), hs(kp, vp), hs(kp, vp), hs(c, vp), hs(c, kp)],
        out_specs=[hs(c, kp)] * 3, out_shape=[ck] * 3,
        tiles=tiles, interpret=interpret, flops=heads * (f["decays"] + f["grads"] // 2),
        exps=heads * exps, args=(q, k, rq, rk, g, beta, vn, states, dstates, do, dx))
    dq, dk, dg = launch(
        functools.partial(_pair_grads_kernel, opts=opts, bk=lay.bk), grid=lay.head_grid,
        in_specs=key + [hs(c, kp), hs(c, c), hs(c, c)] + [hs(c, kp)] * 3, out_specs=[hs(c, kp)] * 3,
        out_shape=[ck, ck, jax.ShapeDtypeStruct(g.shape, g.dtype)],
        tiles=tiles, interpret=interpret, flops=heads * (f["decays"] + f["pairs_bwd"]),
        exps=heads * exps, args=(q, k, rq, rk, g, dp, da, dq, dk, dg))
    k_dim, v_dim = lay.k_dim, lay.v_dim
    return (dq.sum(3)[..., :k_dim], dk.sum(3)[..., :k_dim], dv[..., :v_dim], dg[..., :k_dim], dbeta,
            dh0[..., :k_dim, :v_dim])


BACKEND = Backend("pallas_gpu", variant=kda_math.VARIANT, platform="gpu", forward=forward, backward=backward,
                  tiles=GpuTiles,
                      check_shapes=functools.partial(pallas.check_dims, "pallas_gpu"), fold_batch=True)
