"""Chunked gated delta rule as Pallas GPU kernels (Triton lowering), in phases.

Only the state recursion is sequential; everything else runs chunk-parallel,
so a single long sequence still fills the GPU:

    forward   prepare    (chunk, row, value head)           decays, (I + A)^-1, U, W
              state      (row, value head, V block)         sequential: Vn, chunk states
              output     (chunk, row, value head x V block) O = eq q S + P Vn
    backward  prepare    again, with the saved inverse      U, W
              dv_local   (chunk, row, value head x V block) P^T dO, Vn
              dstate     (row, value head, V block)         reverse sequential: dS, dVn
              grads      (chunk, row, value head)           dv; dq, dk but for QK^T, KK^T;
                                                            the gates' [C, C] terms
              gate_grads (chunk, row, value head)           dg, dbeta; dq, dk

Register pressure decides the shape of every kernel: a thread of 8 warps
holds 1/256 of each tile, so a float32 [C, K] tile at C = 64, K = 128
costs 32 of its 255 registers. Every kernel therefore walks
K in blocks of BK columns and V in blocks of BV (loops, not unrolled: the
kernel holds one block's code); what is summed over K or V is carried as
[C, C] or narrower, and what a later pass needs over all of K (dq, dk
before the QK^T, KK^T terms) goes through memory to the next kernel. The
sequential kernels carry the [K, BV] state as K/BK blocks. Packed
sequences arrive re-laid by the chunk plan, with per-chunk flags (reset,
seq, last) read from int32 arrays. dq and dk come out per value head and
are summed over each key head's group outside the kernels.

q and k reach the kernels raw; with l2norm, the scale 1 / |x| of every
row is computed once outside (a [C] row per chunk and key head) and each
kernel multiplies the key blocks it loads by it.

Triton needs every loaded or stored array to have a power-of-two size: K and
V are zero-padded to powers of two (inert: zero key and value columns never
touch the real ones), C is one already, and BK, BV are powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdnx.ops.delta_rule import pallas, primitives
from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.chunked import ChunkFlags, ChunkOptions
from gdnx.ops.delta_rule.costs import matmul_flops
from gdnx.ops.delta_rule.tiles import GpuTiles
from gdnx.ops.delta_rule.triton import (
    FLOAT32_PRODUCTS,
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
from gdnx.ops.gated_delta_rule import math as chunk_math

def _costs(lay) -> tuple[int, dict[str, int], int]:
    """(value head chunks, chunk_flops at the padded dims, exps per decay pass)."""
    heads = lay.nc * lay.rows * lay.hk * lay.grp
    return heads, chunk_math.chunk_flops(lay.c, lay.kp, lay.vp), chunk_math.transcendentals(lay.c, lay.kp)


# --- blocks inside a kernel ------------------------------------------------

def _keys(ref, idx, kb, bk, scale_col, opts):
    """Column block kb of q or k at idx, in the accumulation dtype, its rows
    scaled by scale_col (the l2norm scale; None: raw, for a kernel that
    scales the other factor of its products instead)."""
    x = ref[block_cols(idx, kb, bk)].astype(opts.state_dtype)
    return x if scale_col is None else x * scale_col


def _decays(g_ref, idx, opts):
    # A float32 FMA dot of the segment sums holds a C-long row and column
    # per output in registers (255 registers and spills at C = 64); three
    # bfloat16 passes are as exact (see primitives.segment_sums).
    return chunk_math.decays(g_ref[idx], state_dtype=opts.state_dtype, decay_dtype=opts.decay_dtype,
                             split_segments=opts.decay_dtype == jnp.float32)


def _bf16_products(opts) -> bool:
    """Whether products of bfloat16 values may take one bfloat16 pass: each
    product is exact in float32, so for float32 products as for bfloat16."""
    return opts.matmul_dtype in (None, FLOAT32_PRODUCTS) or opts.matmul_dtype == jnp.bfloat16


def _dot(x, y, contract, opts):
    """dot_general in the accumulation dtype: two bfloat16 operands in one
    pass when `_bf16_products`, anything else through `primitives.dot`."""
    if x.dtype == y.dtype == jnp.bfloat16:
        if _bf16_products(opts):
            return jax.lax.dot_general(x, y, (contract, ((), ())), preferred_element_type=opts.state_dtype)
        # primitives.dot accumulates two operands of one dtype in that dtype
        x, y = x.astype(opts.state_dtype), y.astype(opts.state_dtype)
    return primitives.dot(x, y, contract, opts.matmul_dtype)


def _key_products(x_ref, y_ref, rx_ref, ry_ref, bk, opts):
    """(rx x)(ry y)^T of one key head's chunk as rx (x y^T) ry: the raw
    blocks' products summed over K, the l2norm scales applied once."""
    key = (0, 0, 0)

    def block(kb, xy):
        return xy + _dot(as_operand(x_ref[block_cols(key, kb, bk)], opts), as_operand(y_ref[block_cols(key, kb, bk)], opts),
                         ((1,), (1,)), opts)

    c = x_ref.shape[-2]
    xy = loop_blocks(x_ref.shape[-1] // bk, block, jnp.zeros((c, c), opts.state_dtype))
    return primitives.row_to_col(rx_ref[key]) * xy * ry_ref[key]


def _output_mix(q_ref, k_ref, rq_ref, rk_ref, dec, opts, bk):
    """P = scale tril(QK^T * D) of one value head's chunk."""
    return chunk_math.output_mix(_key_products(q_ref, k_ref, rq_ref, rk_ref, bk, opts), dec, scale=opts.scale)


def _key_dot(ref, idx, kb, bk, b, contract, opts):
    """dot_general of q's or k's raw column block kb with a float32 b."""
    return primitives.dot(as_operand(ref[block_cols(idx, kb, bk)], opts), b, contract, opts.matmul_dtype)


def _state_times(ref, idx, state, bk, opts):
    """sum over K blocks of ref[idx][:, block] @ state[block]: [C, BV]."""
    return sum(primitives.mm(ref[block_cols(idx, kb, bk)].astype(opts.state_dtype), s, matmul_dtype=opts.matmul_dtype)
               for kb, s in enumerate(state))


# --- forward ---------------------------------------------------------------

def _prepare_kernel(k_ref, rk_ref, v_ref, g_ref, b_ref, *refs, opts, bk, bv, given_inverse):
    """U, W (and the inverse, unless given) of one value head's chunk."""
    acc = opts.state_dtype
    key, head = (0, 0, 0), (0, 0, 0, 0)
    rk = primitives.row_to_col(rk_ref[key])
    dec = _decays(g_ref, head, opts)
    beta = primitives.row_to_col(b_ref[head].astype(acc))
    nkb = k_ref.shape[-1] // bk
    if given_inverse:
        tinv_ref, u_ref, w_ref = refs
        tinv = tinv_ref[head]
    else:
        u_ref, w_ref, tinv_ref = refs

        kk = _key_products(k_ref, k_ref, rk_ref, rk_ref, bk, opts)
        tinv = chunk_math.chunk_inverse(kk, beta, dec, inverse=primitives.unit_lower_inverse_loop)
        tinv_ref[head] = tinv

    def u_block(vb):
        cols = block_cols(head, vb, bv)
        u_ref[cols] = chunk_math.wy_values(tinv, v_ref[cols].astype(acc), beta, matmul_dtype=opts.matmul_dtype)

    def w_block(kb):
        k = _keys(k_ref, key, kb, bk, rk, opts)
        w_ref[block_cols(head, kb, bk)] = chunk_math.wy_keys(tinv, k, beta, dec, matmul_dtype=opts.matmul_dtype)

    each_block(v_ref.shape[-1] // bv, u_block)
    each_block(nkb, w_block)


def _state_kernel(reset_ref, seq_ref, last_ref, k_ref, rk_ref, w_ref, u_ref, g_ref, h0_ref, vn_ref, states_ref,
                  final_ref, *, num_chunks, opts, bk):
    """Walk a row's chunks: Vn = U - W S, S' = gamma S + k^T (ek Vn); the
    state [K, BV] is carried as K/BK blocks."""
    acc = opts.state_dtype
    nkb = k_ref.shape[-1] // bk

    def rows(idx, kb):
        return idx + (block_ds(kb, bk), slice(None))

    def chunk(c, state):
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        state = tuple(jnp.where(reset, h0_ref[rows((seq, 0, 0), kb)].astype(acc), s) for kb, s in enumerate(state))
        for kb, s in enumerate(state):
            states_ref[rows((c, 0, 0, 0), kb)] = s
        rk = primitives.row_to_col(rk_ref[c, 0, 0])
        dec = _decays(g_ref, (c, 0, 0, 0), opts)
        vn = u_ref[c, 0, 0, 0] - _state_times(w_ref, (c, 0, 0, 0), state, bk, opts)
        vn_ref[c, 0, 0, 0] = vn
        # (rk k)^T (ek Vn) = k^T (rk ek Vn): the key blocks stay as loaded
        ekvn = (rk * dec.ek) * vn
        state = tuple(dec.gamma * s + _key_dot(k_ref, (c, 0, 0), kb, bk, ekvn, ((0,), (0,)), opts)
                      for kb, s in enumerate(state))

        @pl.when(last)
        def _():
            for kb, s in enumerate(state):
                final_ref[rows((seq, 0, 0), kb)] = s.astype(final_ref.dtype)

        return state

    bv = h0_ref.shape[-1]
    jax.lax.fori_loop(0, num_chunks, chunk, tuple(jnp.zeros((bk, bv), acc) for _ in range(nkb)))


def _output_kernel(q_ref, k_ref, rq_ref, rk_ref, g_ref, states_ref, vn_ref, o_ref, *, opts, bk):
    """O = scale exp(G) q S + P Vn for one (chunk, value head, V block)."""
    key, head = (0, 0, 0), (0, 0, 0, 0)
    dec = _decays(g_ref, head, opts)
    p = _output_mix(q_ref, k_ref, rq_ref, rk_ref, dec, opts, bk)
    rq = primitives.row_to_col(rq_ref[key])

    def qs_block(kb, qs):
        # (rq q) S = rq (q S): the raw query block enters the product
        return qs + _key_dot(q_ref, key, kb, bk, states_ref[head + (block_ds(kb, bk), slice(None))], ((1,), (0,)), opts)

    qs = loop_blocks(q_ref.shape[-1] // bk, qs_block, jnp.zeros(o_ref.shape[-2:], opts.state_dtype))
    o = (opts.scale * dec.eg * rq) * qs + primitives.mm(p, vn_ref[head], matmul_dtype=opts.matmul_dtype)
    o_ref[head] = o.astype(o_ref.dtype)


def _prepare(lay, k, rk, v, g, beta, tinv, opts, tiles, interpret):
    """(u, w, tinv): U [.., C, Vp] and W [.., C, Kp] per value head, chunk-parallel."""
    acc = opts.state_dtype
    c = lay.c
    shape = lay.head_grid[:2] + (lay.hk, lay.grp)
    u_shape = jax.ShapeDtypeStruct(shape + (c, lay.vp), acc)
    w_shape = jax.ShapeDtypeStruct(shape + (c, lay.kp), acc)
    in_specs = [lay.head_spec(c, lay.kp, key=True), lay.head_spec(1, c, key=True), lay.head_spec(c, lay.vp),
                lay.head_spec(1, c), lay.head_spec(1, c)]
    kernel = functools.partial(_prepare_kernel, opts=opts, bk=lay.bk, bv=lay.bv, given_inverse=tinv is not None)
    heads, f, exps = _costs(lay)
    flops = heads * (f["key_products"] // 2 + f["prepare"])
    if tinv is not None:
        u, w = launch(kernel, grid=lay.head_grid, in_specs=in_specs + [lay.head_spec(c, c)],
                     out_specs=[lay.head_spec(c, lay.vp), lay.head_spec(c, lay.kp)], out_shape=[u_shape, w_shape],
                     tiles=tiles, interpret=interpret, flops=flops, exps=heads * exps,
                     args=(k, rk, v, g, beta, tinv))
        return u, w, tinv
    return launch(kernel, grid=lay.head_grid, in_specs=in_specs,
                 out_specs=[lay.head_spec(c, lay.vp), lay.head_spec(c, lay.kp), lay.head_spec(c, c)],
                 out_shape=[u_shape, w_shape, jax.ShapeDtypeStruct(shape + (c, c), acc)], tiles=tiles,
                 interpret=interpret, flops=flops, exps=heads * exps, args=(k, rk, v, g, beta))


def forward(q, k, v, g, beta, h0, flags: ChunkFlags, *, opts: ChunkOptions, save_residuals: bool, interpret: bool,
            tiles: GpuTiles):
    lay = GridLayout(q, v, h0.shape[0], tiles)
    opts = on_hardware(opts, interpret)
    acc = opts.state_dtype
    rq, rk = norm_rows(q, opts), norm_rows(k, opts)
    q, k, v, h0 = lay.pad_keys(q), lay.pad_keys(k), lay.pad_values(v), lay.pad_state(h0)
    u, w, tinv = _prepare(lay, k, rk, v, g, beta, None, opts, tiles, interpret)

    c, obv, sbv, kp = lay.c, lay.obv, lay.sbv, lay.kp
    shape = (lay.nc, lay.rows, lay.hk, lay.grp)
    heads, f, exps = _costs(lay)
    vn, states, final = launch(
        functools.partial(_state_kernel, num_chunks=lay.nc, opts=opts, bk=lay.sbk), grid=lay.seq_grid,
        in_specs=[lay.flag_spec()] * 3 + [lay.seq_spec(c, kp, key=True), lay.seq_spec(1, c, key=True),
                                          lay.seq_spec(c, kp, v_blocked=False), lay.seq_spec(c, sbv),
                                          lay.seq_spec(1, c, v_blocked=False), lay.seq_state_spec()],
        out_specs=[lay.seq_spec(c, sbv), lay.seq_spec(kp, sbv), lay.seq_state_spec()],
        out_shape=[jax.ShapeDtypeStruct(shape + (c, lay.vp), acc), jax.ShapeDtypeStruct(shape + (kp, lay.vp), acc),
                   jax.ShapeDtypeStruct(h0.shape, h0.dtype)],
        tiles=tiles, interpret=interpret, flops=heads * f["state"], exps=heads * lay.snvb * exps,
        args=(*flags, k, rk, w, u, g, h0))

    o = launch(functools.partial(_output_kernel, opts=opts, bk=lay.bk), grid=lay.block_grid,
              in_specs=[lay.block_spec(c, kp, key=True), lay.block_spec(c, kp, key=True),
                        lay.block_spec(1, c, key=True), lay.block_spec(1, c, key=True),
                        lay.block_spec(1, c, v_blocked=False), lay.block_spec(kp, obv), lay.block_spec(c, obv)],
              out_specs=lay.block_spec(c, obv), out_shape=jax.ShapeDtypeStruct(shape + (c, lay.vp), q.dtype),
              tiles=tiles, interpret=interpret, flops=heads * (f["output"] + lay.nob * f["key_products"] // 2),
              exps=heads * lay.nob * exps, args=(q, k, rq, rk, g, states, vn))
    o, final = o[..., :lay.v_dim], final[..., :lay.k_dim, :lay.v_dim]
    if save_residuals:
        return o, final, states[..., :lay.k_dim, :lay.v_dim].astype(h0.dtype), tinv
    return o, final


# --- backward --------------------------------------------------------------

def _dv_local_kernel(q_ref, k_ref, rq_ref, rk_ref, g_ref, do_ref, u_ref, w_ref, states_ref, dvl_ref, vn_ref, *,
                     opts, bk):
    """P^T dO (the part of dVn that needs no dS) and Vn = U - W S."""
    head = (0, 0, 0, 0)
    p = _output_mix(q_ref, k_ref, rq_ref, rk_ref, _decays(g_ref, head, opts), opts, bk)
    dvl_ref[head] = primitives.mm_tn(p, as_operand(do_ref[head], opts), matmul_dtype=opts.matmul_dtype)

    def ws_block(kb, ws):
        w = w_ref[block_cols(head, kb, bk)]
        return ws + primitives.mm(w, states_ref[head + (block_ds(kb, bk), slice(None))], matmul_dtype=opts.matmul_dtype)

    vn_ref[head] = u_ref[head] - loop_blocks(w_ref.shape[-1] // bk, ws_block, jnp.zeros(vn_ref.shape[-2:],
                                                                                     opts.state_dtype))


def _dstate_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, rq_ref, rk_ref, w_ref, g_ref, do_ref, dvl_ref,
                   dfinal_ref, dvn_ref, dstates_ref, dh0_ref, *, num_chunks, opts, bk):
    """Walk a row's chunks in reverse carrying dS (as K/BK blocks):
    dVn = P^T dO + ek (k dS'), dS = gamma dS' + q^T (eq dO) - W^T dVn.

    The carry is dS^T, [BV, BK] per block, so that no float32 operand of a
    product is transposed: k dS' is (dS'^T k^T)^T with the bfloat16 key
    block transposed, and the dS^T terms are (eq dO)^T q and dVn^T W. A
    transposed float32 operand costs registers (the carried dS form spills
    far more under ptxas: docs/benchmarks.md).
    """
    acc = opts.state_dtype
    nkb = k_ref.shape[-1] // bk

    def rows(idx, kb):
        return idx + (block_ds(kb, bk), slice(None))

    def chunk(step, dstate_t):
        c = num_chunks - 1 - step
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        dstate_t = tuple(s + jnp.where(last, jnp.transpose(dfinal_ref[rows((seq, 0, 0), kb)].astype(acc)), 0.0)
                         for kb, s in enumerate(dstate_t))
        for kb, s in enumerate(dstate_t):
            dstates_ref[rows((c, 0, 0, 0), kb)] = jnp.transpose(s)
        key, head = (c, 0, 0), (c, 0, 0, 0)
        rk = jnp.transpose(rk_ref[key])
        dec = _decays(g_ref, head, opts)
        # the l2norm scales multiply the [C, BV] factors, not the key blocks
        k_ds_t = sum(primitives.dot(s, as_operand(k_ref[block_cols(key, kb, bk)], opts), ((1,), (1,)), opts.matmul_dtype)
                     for kb, s in enumerate(dstate_t))
        dvn = dvl_ref[head] + (rk * dec.ek) * jnp.transpose(k_ds_t)
        dvn_ref[head] = dvn
        dvn_t = jnp.transpose(dvn)
        # eq from a cumulative sum of one-sign gates (no [C, C] tile); scaled
        # before the transpose (XLA:CPU, interpreting, cannot run a bf16 dot
        # of row * transpose(dO))
        eg_row = jnp.exp(jax.lax.cumsum(g_ref[head].astype(opts.decay_dtype), axis=1)).astype(acc)
        eq_do_t = jnp.transpose(jnp.transpose(rq_ref[key] * opts.scale * eg_row) * do_ref[head].astype(acc))
        dstate_in_t = tuple(
            primitives.dot(eq_do_t, as_operand(q_ref[block_cols(key, kb, bk)], opts), ((1,), (0,)), opts.matmul_dtype)
            + dec.gamma * s
            - primitives.mm(dvn_t, w_ref[block_cols(head, kb, bk)], matmul_dtype=opts.matmul_dtype)
            for kb, s in enumerate(dstate_t))

        @pl.when(reset)
        def _():
            for kb, s in enumerate(dstate_in_t):
                dh0_ref[rows((seq, 0, 0), kb)] = jnp.transpose(s).astype(dh0_ref.dtype)

        return tuple(jnp.where(reset, 0.0, s) for s in dstate_in_t)

    bv = dh0_ref.shape[-1]
    jax.lax.fori_loop(0, num_chunks, chunk, tuple(jnp.zeros((bv, bk), acc) for _ in range(nkb)))


def _grads_kernel(q_ref, k_ref, rq_ref, rk_ref, v_ref, g_ref, b_ref, tinv_ref, u_ref, w_ref, vn_ref, states_ref,
                  dstates_ref, do_ref, dvn_ref, dq_ref, dk_ref, dv_ref, da_ref, dp_ref, dbeta_ref, dgcum_ref, *,
                  opts, bk, bv):
    """dv; dq, dk but for the QK^T, KK^T terms; the [C, C] gate terms.

    Sums over V are added up block by block; the state sums, per K block,
    over the V blocks of that block's rows of S and dS'.
    """
    acc = opts.state_dtype
    key, head = (0, 0, 0), (0, 0, 0, 0)
    rq, rk = primitives.row_to_col(rq_ref[key]), primitives.row_to_col(rk_ref[key])
    dec = _decays(g_ref, head, opts)
    beta = primitives.row_to_col(b_ref[head].astype(acc))
    tinv = tinv_ref[head]
    c = q_ref.shape[-2]
    nkb, nvb = q_ref.shape[-1] // bk, v_ref.shape[-1] // bv

    def value_block(vb, sums):
        cols = block_cols(head, vb, bv)
        dv, part = chunk_math.value_grads(do_ref[cols].astype(acc), dvn_ref[cols], vn_ref[cols], u_ref[cols],
                                          v_ref[cols].astype(acc), tinv, beta, matmul_dtype=opts.matmul_dtype)
        dv_ref[cols] = dv.astype(dv_ref.dtype)
        return chunk_math.add_sums(sums, part)

    zeros_cc, zeros_c1 = jnp.zeros((c, c), acc), jnp.zeros((c, 1), acc)
    vsums = loop_blocks(nvb, value_block, chunk_math.ValueSums(dp=zeros_cc, dbv_u=zeros_cc, v_dbv=zeros_c1))
    dp_ref[head] = vsums.dp

    def key_block(kb, carry):
        ksums, dgamma = carry

        def state_block(vb, sums):
            cols, block = block_cols(head, vb, bv), head + (block_ds(kb, bk), block_ds(vb, bv))
            return chunk_math.add_sums(sums, chunk_math.state_sums(
                states_ref[block], dstates_ref[block], do_ref[cols].astype(acc), dvn_ref[cols], vn_ref[cols],
                matmul_dtype=opts.matmul_dtype))

        zeros_ck = jnp.zeros((c, bk), acc)
        ssums = loop_blocks(nvb, state_block, chunk_math.StateSums(zeros_ck, zeros_ck, zeros_ck, jnp.zeros((1, 1), acc)))
        cols = block_cols(head, kb, bk)
        dq, dk, part = chunk_math.key_grads(
            _keys(q_ref, key, kb, bk, rq, opts), _keys(k_ref, key, kb, bk, rk, opts), w_ref[cols], ssums,
            tinv, beta, dec, scale=opts.scale, matmul_dtype=opts.matmul_dtype)
        dq_ref[cols] = dq
        dk_ref[cols] = dk
        return chunk_math.add_sums(ksums, part), dgamma + ssums.dgamma

    # dA's two [C, C] terms are carried as one sum: one tile fewer in registers
    ksums, dgamma = loop_blocks(nkb, key_block, (chunk_math.KeySums(vsums.dbv_u, zeros_c1, zeros_c1, zeros_c1),
                                             jnp.zeros((1, 1), acc)))
    terms = chunk_math.gate_terms(dec, beta, vsums._replace(dbv_u=zeros_cc), ksums, dgamma, scale=opts.scale)
    da_ref[head] = terms.da
    dbeta_ref[head] = primitives.col_to_row(terms.dbeta)
    dgcum_ref[head] = primitives.col_to_row(terms.dgcum)


def _gate_grads_kernel(q_ref, k_ref, rq_ref, rk_ref, g_ref, b_ref, da_ref, dp_ref, dbeta_ref, dgcum_ref, dqv_ref,
                       dkv_ref, dq_ref, dk_ref, dg_ref, db_ref, *, opts, bk):
    """dg, dbeta, and dq, dk with the QK^T, KK^T terms added."""
    acc = opts.state_dtype
    key, head = (0, 0, 0), (0, 0, 0, 0)
    rq = primitives.row_to_col(rq_ref[key])
    dec = _decays(g_ref, head, opts)
    beta = primitives.row_to_col(b_ref[head].astype(acc))
    nkb = q_ref.shape[-1] // bk
    qk = _key_products(q_ref, k_ref, rq_ref, rk_ref, bk, opts)
    kk = _key_products(k_ref, k_ref, rk_ref, rk_ref, bk, opts)
    terms = chunk_math.GateTerms(da=da_ref[head], dp=dp_ref[head], dbeta=primitives.row_to_col(dbeta_ref[head]),
                                 dgcum=primitives.row_to_col(dgcum_ref[head]))
    gg = chunk_math.gate_grads(qk, kk, dec, beta, terms, scale=opts.scale)
    dg_ref[head] = gg.dg.astype(dg_ref.dtype)
    db_ref[head] = gg.dbeta.astype(db_ref.dtype)

    # through (rq q)(rk k)^T and (rk k)(rk k)^T. Products in float32: the
    # l2norm scales go on the [C, C] cotangents so that the raw key blocks
    # enter exact bfloat16 passes. Products in bfloat16: scaled key blocks,
    # rounded, and two [C, C] factors, not three (fewer registers).
    if opts.matmul_dtype == jnp.bfloat16:
        rk = primitives.row_to_col(rk_ref[key])

        def key_block(kb):
            cols = block_cols(head, kb, bk)
            q, k = _keys(q_ref, key, kb, bk, rq, opts), _keys(k_ref, key, kb, bk, rk, opts)
            dq, dk = chunk_math.key_products_bwd(q, k, gg.dqk, gg.dkk, matmul_dtype=opts.matmul_dtype)
            dq_ref[cols] = dqv_ref[cols] + dq
            dk_ref[cols] = dkv_ref[cols] + dk
    else:
        rk_row = rk_ref[key]
        dqk_k, dqk_q_t = gg.dqk * rk_row, jnp.transpose(gg.dqk * rq)
        dkk_k = (gg.dkk + jnp.transpose(gg.dkk)) * rk_row

        def key_block(kb):
            cols = block_cols(head, kb, bk)
            q, k = as_operand(q_ref[block_cols(key, kb, bk)], opts), as_operand(k_ref[block_cols(key, kb, bk)], opts)
            dq_ref[cols] = dqv_ref[cols] + _dot(dqk_k, k, ((1,), (0,)), opts)
            dk_ref[cols] = (dkv_ref[cols] + _dot(dqk_q_t, q, ((1,), (0,)), opts)
                            + _dot(dkk_k, k, ((1,), (0,)), opts))

    each_block(nkb, key_block)


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags: ChunkFlags, *, opts: ChunkOptions, interpret: bool,
             tiles: GpuTiles):
    lay = GridLayout(q, v, dfinal.shape[0], tiles)
    opts = on_hardware(opts, interpret)
    acc = opts.state_dtype
    rq, rk = norm_rows(q, opts), norm_rows(k, opts)
    q, k = lay.pad_keys(q), lay.pad_keys(k)
    v, do = lay.pad_values(v), lay.pad_values(do)
    states, dfinal = lay.pad_state(states.astype(acc)), lay.pad_state(dfinal)
    u, w, _ = _prepare(lay, k, rk, v, g, beta, tinv, opts, tiles, interpret)

    c, bv, obv, kp, vp, bk = lay.c, lay.bv, lay.obv, lay.kp, lay.vp, lay.bk
    sbv = lay.sbv
    shape = (lay.nc, lay.rows, lay.hk, lay.grp)
    heads, f, exps = _costs(lay)
    mm = matmul_flops
    cv, ck, cc = (jax.ShapeDtypeStruct(shape + dims, acc) for dims in ((c, vp), (c, kp), (c, c)))
    keys = [lay.block_spec(c, kp, key=True)] * 2 + [lay.block_spec(1, c, key=True)] * 2
    dvl, vn = launch(functools.partial(_dv_local_kernel, opts=opts, bk=bk), grid=lay.block_grid,
                    in_specs=keys + [lay.block_spec(1, c, v_blocked=False), lay.block_spec(c, obv),
                                     lay.block_spec(c, obv), lay.block_spec(c, kp, v_blocked=False),
                                     lay.block_spec(kp, obv)],
                    out_specs=[lay.block_spec(c, obv)] * 2, out_shape=[cv, cv], tiles=tiles, interpret=interpret,
                    flops=heads * (mm(c, c, vp) + mm(c, kp, vp) + lay.nob * f["key_products"] // 2),
                    exps=heads * lay.nob * exps, args=(q, k, rq, rk, g, do, u, w, states))
    dvn, dstates, dh0 = launch(
        functools.partial(_dstate_kernel, num_chunks=lay.nc, opts=opts, bk=lay.sbk), grid=lay.seq_grid,
        in_specs=[lay.flag_spec()] * 3 + [lay.seq_spec(c, kp, key=True)] * 2 + [lay.seq_spec(1, c, key=True)] * 2
        + [lay.seq_spec(c, kp, v_blocked=False), lay.seq_spec(1, c, v_blocked=False), lay.seq_spec(c, sbv),
           lay.seq_spec(c, sbv), lay.seq_state_spec()],
        out_specs=[lay.seq_spec(c, sbv), lay.seq_spec(kp, sbv), lay.seq_state_spec()],
        out_shape=[cv, jax.ShapeDtypeStruct(shape + (kp, vp), acc), jax.ShapeDtypeStruct(dfinal.shape, acc)],
        tiles=tiles, interpret=interpret, flops=heads * 3 * mm(c, kp, vp), exps=heads * lay.snvb * exps,
        args=(*flags, q, k, rq, rk, w, g, do, dvl, dfinal))

    keys = [lay.head_spec(c, kp, key=True)] * 2 + [lay.head_spec(1, c, key=True)] * 2
    rows = [lay.head_spec(1, c)] * 2
    row_shape = jax.ShapeDtypeStruct(g.shape, acc)
    dqv, dkv, dv, da, dp, dbeta_part, dgcum = launch(
        functools.partial(_grads_kernel, opts=opts, bk=bk, bv=bv), grid=lay.head_grid,
        in_specs=keys + [lay.head_spec(c, vp)] + rows
        + [lay.head_spec(c, c), lay.head_spec(c, vp), lay.head_spec(c, kp), lay.head_spec(c, vp),
           lay.head_spec(kp, vp), lay.head_spec(kp, vp), lay.head_spec(c, vp), lay.head_spec(c, vp)],
        out_specs=[lay.head_spec(c, kp)] * 2 + [lay.head_spec(c, vp)] + [lay.head_spec(c, c)] * 2 + rows,
        out_shape=[ck, ck, jax.ShapeDtypeStruct(shape + (c, vp), v.dtype), cc, cc, row_shape, row_shape],
        tiles=tiles, interpret=interpret, flops=heads * (3 * mm(c, c, vp) + 3 * mm(c, vp, kp) + 2 * mm(c, c, kp)),
        exps=heads * exps, args=(q, k, rq, rk, v, g, beta, tinv, u, w, vn, states, dstates, do, dvn),
        num_warps=tiles.grads_num_warps)
    dq, dk, dg, dbeta = launch(
        functools.partial(_gate_grads_kernel, opts=opts, bk=bk), grid=lay.head_grid,
        in_specs=keys + rows + [lay.head_spec(c, c)] * 2 + rows + [lay.head_spec(c, kp)] * 2,
        out_specs=[lay.head_spec(c, kp)] * 2 + rows,
        out_shape=[ck, ck, jax.ShapeDtypeStruct(g.shape, g.dtype), jax.ShapeDtypeStruct(beta.shape, beta.dtype)],
        tiles=tiles, interpret=interpret, flops=heads * (f["key_products"] + f["key_grads"]), exps=heads * exps,
        args=(q, k, rq, rk, g, beta, da, dp, dbeta_part, dgcum, dqv, dkv))
    k_dim, v_dim = lay.k_dim, lay.v_dim
    return (dq.sum(3)[..., :k_dim], dk.sum(3)[..., :k_dim], dv[..., :v_dim], dg, dbeta, dh0[..., :k_dim, :v_dim])


BACKEND = Backend("pallas_gpu", variant=chunk_math.VARIANT, platform="gpu", forward=forward, backward=backward,
                  tiles=GpuTiles,
                  check_shapes=functools.partial(pallas.check_dims, "pallas_gpu"), fold_batch=True)
