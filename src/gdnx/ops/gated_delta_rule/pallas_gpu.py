"""Chunked gated delta rule as Pallas GPU kernels (Triton lowering), in phases.

Only the state recursion is sequential; everything else runs chunk-parallel,
so a single long sequence still fills the GPU:

    forward   prepare  (chunk, row, value head)        decays, (I + A)^-1, U, W
              state    (row, value head, V block)       sequential: Vn, chunk states
              output   (chunk, row, value head x V block)   O = eq q S + P Vn
    backward  prepare  again, with the saved inverse       U, W
              dv_local (chunk, row, value head x V block)   P^T dO
              dstate   (row, value head, V block)       reverse sequential: dS, dVn
              grads    (chunk, row, value head)         dq, dk, dv, dg, dbeta

The sequential kernels walk the chunks of one row in a loop and carry one
float32 state block [K, BV] in registers; packed sequences arrive re-laid by
the chunk plan, with per-chunk flags (reset, seq, last) read from int32
arrays. dq and dk come out per value head and are summed over each key
head's group outside the kernel.

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

from gdnx.ops.gated_delta_rule import chunk_math, chunked, pallas_common
from gdnx.ops.gated_delta_rule.tiles import GpuTiles, check_tiles

# Custom-call targets of a Triton kernel (the name moved between JAX
# versions). jax.export refuses them unless told: they carry no
# compatibility guarantee, so export for the GPU you will run on.
TRITON_CUSTOM_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _pad(x, axis, to):
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, pads)


class _Layout:
    """Padded sizes and the block specs of the three grid shapes."""

    def __init__(self, q, v, num_seqs, block_v):
        self.nc, self.rows, self.hk, self.c, self.dk = q.shape
        self.grp, self.dv = v.shape[3], v.shape[5]
        self.kp, self.vp = _pow2(self.dk), _pow2(self.dv)
        self.bv = min(block_v, self.vp)
        self.nvb = self.vp // self.bv
        self.num_seqs = num_seqs

    # chunk-parallel, one program per (chunk, row, value head)
    @property
    def head_grid(self):
        return (self.nc, self.rows, self.hk * self.grp)

    def head_spec(self, *tail):
        g = self.grp
        if len(tail) == 2 and tail[0] is None:  # a key head's block
            return pl.BlockSpec((1, 1, 1, self.c, tail[1]), lambda c, r, h: (c, r, h // g, 0, 0))
        return pl.BlockSpec((1, 1, 1, 1) + tail, lambda c, r, h: (c, r, h // g, h % g, 0, 0))

    # chunk-parallel, one program per (chunk, row, value head, V block)
    @property
    def block_grid(self):
        return (self.nc, self.rows, self.hk * self.grp * self.nvb)

    def block_spec(self, rows, cols, v_blocked=True):
        g, n = self.grp, self.nvb
        if cols is None:  # a key head's [C, K] block
            return pl.BlockSpec((1, 1, 1, rows, self.kp), lambda c, r, x: (c, r, x // n // g, 0, 0))
        return pl.BlockSpec((1, 1, 1, 1, rows, cols),
                            lambda c, r, x: (c, r, x // n // g, x // n % g, 0, x % n if v_blocked else 0))

    # sequential, one program per (row, value head, V block), all chunks of the row
    @property
    def seq_grid(self):
        return (self.rows, self.hk * self.grp, self.nvb)

    def seq_spec(self, rows, cols, v_blocked=True):
        g, nc = self.grp, self.nc
        if cols is None:
            return pl.BlockSpec((nc, 1, 1, rows, self.kp), lambda r, h, vb: (0, r, h // g, 0, 0))
        return pl.BlockSpec((nc, 1, 1, 1, rows, cols),
                            lambda r, h, vb: (0, r, h // g, h % g, 0, vb if v_blocked else 0))

    def seq_state_spec(self):
        g = self.grp
        return pl.BlockSpec((self.num_seqs, 1, 1, self.kp, self.bv), lambda r, h, vb: (0, h // g, h % g, 0, vb))

    def flag_spec(self):
        return pl.BlockSpec((self.nc, 1), lambda r, h, vb: (0, r))

    def pad_keys(self, x):
        return _pad(x, -1, self.kp)

    def pad_values(self, x):
        return _pad(x, -1, self.vp)

    def pad_state(self, x):
        return _pad(_pad(x, -1, self.vp), -2, self.kp)


# Float32 products on the GPU: three TF32 tensor-core passes per product
# (a = hi + lo, a b ~ hi hi + hi lo + lo hi), relative error ~2^-22, instead
# of Triton's "ieee" FMA loops, whose code made one backward take 100 s to
# compile. Interpret mode keeps exact float32 (the CPU has no TF32).
FLOAT32_PRODUCTS = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _hardware(opts, interpret: bool):
    if interpret or opts.operands is not None or opts.acc_dtype != jnp.float32:
        return opts
    return opts._replace(operands=FLOAT32_PRODUCTS)


def _call(kernel, grid, in_specs, out_specs, out_shape, tiles: GpuTiles, interpret, flops, exps, *args):
    outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, cost_estimate=pallas_common.cost(flops, exps, list(args) + list(outs)),
    )(*args)


def _costs(lay) -> tuple[int, dict[str, int], int]:
    """(value head chunks, chunk_flops at the padded dims, exps per decay pass)."""
    heads = lay.nc * lay.rows * lay.hk * lay.grp
    return heads, pallas_common.chunk_flops(lay.c, lay.kp, lay.vp), pallas_common.transcendentals(lay.c)


def _output_mix(q_ref, k_ref, g_ref, opts):
    """(P = scale tril(QK^T * D), decays) of one value head's chunk."""
    key, head = (0, 0, 0), (0, 0, 0, 0)
    q, k = opts.keys(q_ref[key]), opts.keys(k_ref[key])
    dec = _decays(g_ref, head, opts)
    return chunk_math.output_mix(chunk_math.mm_nt(q, k, operands=opts.operands), dec, scale=opts.scale), dec, q


def _decays(g_ref, idx, opts):
    return chunk_math.decays(g_ref[idx], acc_dtype=opts.acc_dtype, decay_dtype=opts.decay_dtype)


# --- forward ---------------------------------------------------------------

def _prepare_kernel(k_ref, v_ref, g_ref, b_ref, *refs, opts, given_inverse):
    """U, W (and the inverse, unless given) of one value head's chunk."""
    acc = opts.acc_dtype
    head = (0, 0, 0, 0)
    k = opts.keys(k_ref[0, 0, 0])
    dec = _decays(g_ref, head, opts)
    beta = chunk_math.row_to_col(b_ref[head].astype(acc))
    if given_inverse:
        tinv_ref, u_ref, w_ref = refs
        tinv = tinv_ref[head]
    else:
        u_ref, w_ref, tinv_ref = refs
        kk = chunk_math.mm_nt(k, k, operands=opts.operands)
        tinv = chunk_math.chunk_inverse(kk, beta, dec, inverse=chunk_math.unit_lower_inverse_loop)
        tinv_ref[head] = tinv
    u, w = chunk_math.wy(tinv, k, v_ref[head].astype(acc), beta, dec, operands=opts.operands)
    u_ref[head] = u
    w_ref[head] = w


def _state_kernel(reset_ref, seq_ref, last_ref, k_ref, w_ref, u_ref, g_ref, h0_ref, vn_ref, states_ref, final_ref,
                  *, num_chunks, opts):
    """Walk a row's chunks: Vn = U - W S, S' = gamma S + k^T (ek Vn)."""
    acc = opts.acc_dtype

    def chunk(c, state):
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        state = jnp.where(reset, h0_ref[seq, 0, 0].astype(acc), state)
        states_ref[c, 0, 0, 0] = state
        k = opts.keys(k_ref[c, 0, 0])
        dec = _decays(g_ref, (c, 0, 0, 0), opts)
        vn = u_ref[c, 0, 0, 0] - chunk_math.mm(w_ref[c, 0, 0, 0], state, operands=opts.operands)
        vn_ref[c, 0, 0, 0] = vn
        state = dec.gamma * state + chunk_math.mm_tn(k, dec.ek * vn, operands=opts.operands)

        @pl.when(last)
        def _():
            final_ref[seq, 0, 0] = state.astype(final_ref.dtype)

        return state

    jax.lax.fori_loop(0, num_chunks, chunk, jnp.zeros(h0_ref.shape[-2:], acc))


def _output_kernel(q_ref, k_ref, g_ref, states_ref, vn_ref, o_ref, *, opts):
    """O = scale exp(G) q S + P Vn for one (chunk, value head, V block)."""
    head = (0, 0, 0, 0)
    p, dec, q = _output_mix(q_ref, k_ref, g_ref, opts)
    o = (opts.scale * dec.eg) * chunk_math.mm(q, states_ref[head], operands=opts.operands) \
        + chunk_math.mm(p, vn_ref[head], operands=opts.operands)
    o_ref[head] = o.astype(o_ref.dtype)


def _prepare(lay, k, v, g, beta, tinv, opts, tiles, interpret):
    """(u, w, tinv): U [.., C, Vp] and W [.., C, Kp] per value head, chunk-parallel."""
    acc = opts.acc_dtype
    c = lay.c
    shape = lay.head_grid[:2] + (lay.hk, lay.grp)
    u_shape = jax.ShapeDtypeStruct(shape + (c, lay.vp), acc)
    w_shape = jax.ShapeDtypeStruct(shape + (c, lay.kp), acc)
    in_specs = [lay.head_spec(None, lay.kp), lay.head_spec(c, lay.vp), lay.head_spec(1, c), lay.head_spec(1, c)]
    kernel = functools.partial(_prepare_kernel, opts=opts, given_inverse=tinv is not None)
    heads, f, exps = _costs(lay)
    flops = heads * (f["key_products"] // 2 + f["prepare"])
    if tinv is not None:
        u, w = _call(kernel, lay.head_grid, in_specs + [lay.head_spec(c, c)],
                     [lay.head_spec(c, lay.vp), lay.head_spec(c, lay.kp)], [u_shape, w_shape], tiles, interpret,
                     flops, heads * exps, k, v, g, beta, tinv)
        return u, w, tinv
    return _call(kernel, lay.head_grid, in_specs,
                 [lay.head_spec(c, lay.vp), lay.head_spec(c, lay.kp), lay.head_spec(c, c)],
                 [u_shape, w_shape, jax.ShapeDtypeStruct(shape + (c, c), acc)], tiles, interpret,
                 flops, heads * exps, k, v, g, beta)


def forward(q, k, v, g, beta, h0, flags, *, opts, save_residuals, interpret, tiles: GpuTiles):
    lay = _Layout(q, v, h0.shape[0], tiles.block_v)
    opts = _hardware(opts, interpret)
    acc = opts.acc_dtype
    q, k, v, h0 = lay.pad_keys(q), lay.pad_keys(k), lay.pad_values(v), lay.pad_state(h0)
    u, w, tinv = _prepare(lay, k, v, g, beta, None, opts, tiles, interpret)

    c, bv = lay.c, lay.bv
    shape = (lay.nc, lay.rows, lay.hk, lay.grp)
    heads, f, exps = _costs(lay)
    vn, states, final = _call(
        functools.partial(_state_kernel, num_chunks=lay.nc, opts=opts), lay.seq_grid,
        [lay.flag_spec()] * 3 + [lay.seq_spec(c, None), lay.seq_spec(c, lay.kp, False), lay.seq_spec(c, bv),
                                 lay.seq_spec(1, c, False), lay.seq_state_spec()],
        [lay.seq_spec(c, bv), lay.seq_spec(lay.kp, bv), lay.seq_state_spec()],
        [jax.ShapeDtypeStruct(shape + (c, lay.vp), acc), jax.ShapeDtypeStruct(shape + (lay.kp, lay.vp), acc),
         jax.ShapeDtypeStruct(h0.shape, h0.dtype)],
        tiles, interpret, heads * f["state"], heads * lay.nvb * exps, *flags, k, w, u, g, h0)

    o = _call(functools.partial(_output_kernel, opts=opts), lay.block_grid,
              [lay.block_spec(c, None), lay.block_spec(c, None), lay.block_spec(1, c, False),
               lay.block_spec(lay.kp, bv), lay.block_spec(c, bv)],
              lay.block_spec(c, bv), jax.ShapeDtypeStruct(shape + (c, lay.vp), q.dtype), tiles, interpret,
              heads * (f["output"] + lay.nvb * f["key_products"] // 2), heads * lay.nvb * exps, q, k, g, states, vn)
    o, final = o[..., :lay.dv], final[..., :lay.dk, :lay.dv]
    if save_residuals:
        return o, final, states[..., :lay.dk, :lay.dv].astype(h0.dtype), tinv
    return o, final


# --- backward --------------------------------------------------------------

def _dv_local_kernel(q_ref, k_ref, g_ref, do_ref, dvl_ref, *, opts):
    """P^T dO: the part of dVn that needs no state."""
    head = (0, 0, 0, 0)
    p, _, _ = _output_mix(q_ref, k_ref, g_ref, opts)
    dvl_ref[head] = chunk_math.mm_tn(p, do_ref[head].astype(opts.acc_dtype), operands=opts.operands)


def _dstate_kernel(reset_ref, seq_ref, last_ref, q_ref, k_ref, w_ref, g_ref, do_ref, dvl_ref, dfinal_ref,
                   dvn_ref, dstates_ref, dh0_ref, *, num_chunks, opts):
    """Walk a row's chunks in reverse carrying dS: dVn = P^T dO + ek (k dS'),
    dS = gamma dS' + q^T (eq dO) - W^T dVn."""
    acc = opts.acc_dtype

    def chunk(step, dstate):
        c = num_chunks - 1 - step
        reset, seq, last = reset_ref[c, 0] != 0, seq_ref[c, 0], last_ref[c, 0] != 0
        dstate = dstate + jnp.where(last, dfinal_ref[seq, 0, 0].astype(acc), 0.0)
        dstates_ref[c, 0, 0, 0] = dstate
        q, k = opts.keys(q_ref[c, 0, 0]), opts.keys(k_ref[c, 0, 0])
        dec = _decays(g_ref, (c, 0, 0, 0), opts)
        do = do_ref[c, 0, 0, 0].astype(acc)
        dvn = dvl_ref[c, 0, 0, 0] + dec.ek * chunk_math.mm(k, dstate, operands=opts.operands)
        dvn_ref[c, 0, 0, 0] = dvn
        dstate_in = (chunk_math.mm_tn(q, (opts.scale * dec.eg) * do, operands=opts.operands) + dec.gamma * dstate
                     - chunk_math.mm_tn(w_ref[c, 0, 0, 0], dvn, operands=opts.operands))

        @pl.when(reset)
        def _():
            dh0_ref[seq, 0, 0] = dstate_in.astype(dh0_ref.dtype)

        return jnp.where(reset, 0.0, dstate_in)

    jax.lax.fori_loop(0, num_chunks, chunk, jnp.zeros(dh0_ref.shape[-2:], acc))


def _grads_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, tinv_ref, u_ref, w_ref, states_ref, dstates_ref, do_ref,
                  dvn_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, *, opts, block_v):
    """Every input gradient of one value head's chunk; the V sums are added
    up block by block."""
    acc = opts.acc_dtype
    key, head = (0, 0, 0), (0, 0, 0, 0)
    q, k = opts.keys(q_ref[key]), opts.keys(k_ref[key])
    dec = _decays(g_ref, head, opts)
    beta = chunk_math.row_to_col(b_ref[head].astype(acc))
    tinv, w = tinv_ref[head], w_ref[head]
    def v_block(vb, sums):
        # a loop, not unrolled: the kernel holds one block's matmuls
        cols = head + (slice(None), pl.ds(pl.multiple_of(vb * block_v, block_v), block_v))
        part, dv = chunk_math.value_sums(
            states_ref[cols], dstates_ref[cols], do_ref[cols].astype(acc), dvn_ref[cols], u_ref[cols],
            v_ref[cols].astype(acc), w, tinv, beta, operands=opts.operands)
        dv_ref[cols] = dv.astype(dv_ref.dtype)
        return chunk_math.add_sums(sums, part)

    c, kp = k.shape
    zeros = chunk_math.ValueSums(
        dw=jnp.zeros((c, kp), acc), dp=jnp.zeros((c, c), acc), dqs=jnp.zeros((c, kp), acc),
        dks=jnp.zeros((c, kp), acc), dgamma=jnp.zeros((1, 1), acc), dbv_u=jnp.zeros((c, c), acc),
        v_dbv=jnp.zeros((c, 1), acc))
    sums = jax.lax.fori_loop(0, v_ref.shape[-1] // block_v, v_block, zeros)
    qk, kk = chunk_math.key_products(q, k, operands=opts.operands)
    pg = chunk_math.prepare_bwd(q, k, qk, kk, dec, beta, tinv, w, sums, scale=opts.scale, operands=opts.operands)
    dq_k, dk_k = chunk_math.key_products_bwd(q, k, pg.dqk, pg.dkk, operands=opts.operands)
    dq_ref[head] = pg.dq + dq_k
    dk_ref[head] = pg.dk + dk_k
    dg_ref[head] = pg.dg.astype(dg_ref.dtype)
    db_ref[head] = pg.dbeta.astype(db_ref.dtype)


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags, *, opts, interpret, tiles: GpuTiles):
    lay = _Layout(q, v, dfinal.shape[0], tiles.block_v)
    opts = _hardware(opts, interpret)
    acc = opts.acc_dtype
    if opts.l2norm:
        # Normalised once here, in float32, not in each kernel: the grads
        # kernel that normalised its own q, k asked Triton for 256 KiB of
        # shared memory (over the H100's 227 KiB) with float32 products.
        q, k = opts.keys(q), opts.keys(k)
        opts = opts._replace(l2norm=False)
    q, k = lay.pad_keys(q), lay.pad_keys(k)
    v, do = lay.pad_values(v), lay.pad_values(do)
    states, dfinal = lay.pad_state(states.astype(acc)), lay.pad_state(dfinal)
    u, w, _ = _prepare(lay, k, v, g, beta, tinv, opts, tiles, interpret)

    c, bv = lay.c, lay.bv
    shape = (lay.nc, lay.rows, lay.hk, lay.grp)
    heads, f, exps = _costs(lay)
    mm = pallas_common.matmul_flops
    dvl = _call(functools.partial(_dv_local_kernel, opts=opts), lay.block_grid,
                [lay.block_spec(c, None), lay.block_spec(c, None), lay.block_spec(1, c, False),
                 lay.block_spec(c, bv)],
                lay.block_spec(c, bv), jax.ShapeDtypeStruct(shape + (c, lay.vp), acc), tiles, interpret,
                heads * (mm(c, c, lay.vp) + lay.nvb * f["key_products"] // 2), heads * lay.nvb * exps, q, k, g, do)
    dvn, dstates, dh0 = _call(
        functools.partial(_dstate_kernel, num_chunks=lay.nc, opts=opts), lay.seq_grid,
        [lay.flag_spec()] * 3 + [lay.seq_spec(c, None), lay.seq_spec(c, None), lay.seq_spec(c, lay.kp, False),
                                 lay.seq_spec(1, c, False), lay.seq_spec(c, bv), lay.seq_spec(c, bv),
                                 lay.seq_state_spec()],
        [lay.seq_spec(c, bv), lay.seq_spec(lay.kp, bv), lay.seq_state_spec()],
        [jax.ShapeDtypeStruct(shape + (c, lay.vp), acc), jax.ShapeDtypeStruct(shape + (lay.kp, lay.vp), acc),
         jax.ShapeDtypeStruct(dfinal.shape, acc)],
        tiles, interpret, heads * 3 * mm(c, lay.kp, lay.vp), heads * lay.nvb * exps, *flags, q, k, w, g, do, dvl,
        dfinal)

    vp, kp = lay.vp, lay.kp
    dq, dk, dv, dg, dbeta = _call(
        functools.partial(_grads_kernel, opts=opts, block_v=bv), lay.head_grid,
        [lay.head_spec(None, kp), lay.head_spec(None, kp), lay.head_spec(c, vp), lay.head_spec(1, c),
         lay.head_spec(1, c), lay.head_spec(c, c), lay.head_spec(c, vp), lay.head_spec(c, kp),
         lay.head_spec(kp, vp), lay.head_spec(kp, vp), lay.head_spec(c, vp), lay.head_spec(c, vp)],
        [lay.head_spec(c, kp), lay.head_spec(c, kp), lay.head_spec(c, vp), lay.head_spec(1, c),
         lay.head_spec(1, c)],
        [jax.ShapeDtypeStruct(shape + (c, kp), acc), jax.ShapeDtypeStruct(shape + (c, kp), acc),
         jax.ShapeDtypeStruct(shape + (c, vp), v.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
         jax.ShapeDtypeStruct(beta.shape, beta.dtype)],
        tiles, interpret, heads * (f["grads"] + f["key_grads"] + f["key_products"]), heads * exps,
        q, k, v, g, beta, tinv, u, w, states, dstates, do, dvn)
    kd, vd = lay.dk, lay.dv
    return (dq.sum(3)[..., :kd], dk.sum(3)[..., :kd], dv[..., :vd], dg, dbeta, dh0[..., :kd, :vd])


def chunk_gated_delta_rule_pallas_gpu(q, k, v, g, beta, h0, *, interpret: bool | None = None,
                                      tiles: GpuTiles | None = None, **kw):
    """Validated [B, T, H, D] inputs in, (o, final) out; `chunked.run`'s
    keywords. tiles None: the table's entry for the device (`tiles.py`)."""
    pallas_common.check_dims("pallas_gpu", q.shape[-1], v.shape[-1])
    knobs = dict(interpret=pallas_common.resolve_interpret(interpret), tiles=check_tiles("pallas_gpu", tiles))
    backend = chunked.Backend(functools.partial(forward, **knobs), functools.partial(backward, **knobs),
                              fold_batch=True)
    return chunked.run(backend, q, k, v, g, beta, h0, **kw)
