"""Chunked gated delta rule in plain JAX: a scan over chunks, hand-written VJP.

Forward: one scan over chunks; each step does the chunk's state-free algebra
(gate cumsums, QK^T, KK^T, the inverse, U, W) and the state update, carrying
the float32 state. Keeping a step's work together keeps it in cache: on CPU
this measured as fast as batching the state-free part over all chunks, and
its backward twice as fast (docs/benchmarks.md).

Backward (`custom_vjp`): a reverse scan carries dS and produces each chunk's
input gradients in the same step. Residuals are the inputs
(in their own dtype, already live in a model), the incoming state of every
chunk (sequential, expensive to recompute) and the chunk inverse (C floats
per token and value head, saves the substitution). Everything else (gates,
QK^T, KK^T, U, W, Vn) is recomputed with a few batched matmuls.

Residual policy: "save" keeps the chunk states and inverses from the forward
(named gdn_chunk_states and gdn_chunk_inverse for remat policies);
"recompute" keeps only the inputs and reruns the forward scan in the
backward. Residual bytes per token beyond the inputs, float32 state:
    save:      HV * (K * V / C + C) * 4   (HV=32, K=V=128, C=64: 40 KiB)
    recompute: 0
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gdnx.ops.gated_delta_rule import chunk_math
from gdnx.ops.gated_delta_rule.layout import ChunkPlan, from_slots, make_plan, to_slots


def to_blocks(q, k, v, g, beta, plan: ChunkPlan):
    """[R, T, H, D] inputs -> [NC, R, HK, (G,) C, D] chunk blocks."""
    r, _, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    grp = hv // hk
    nc, c = plan.num_chunks, plan.chunk

    def qk_blocks(x):
        return to_slots(x, plan).reshape(r, nc, c, hk, dk).transpose(1, 0, 3, 2, 4)

    vb = to_slots(v, plan).reshape(r, nc, c, hk, grp, dv).transpose(1, 0, 3, 4, 2, 5)

    def gate_blocks(x):  # rows [1, C], as the chunk algebra takes them
        return to_slots(x, plan).reshape(r, nc, c, hk, grp).transpose(1, 0, 3, 4, 2)[..., None, :]

    return qk_blocks(q), qk_blocks(k), vb, gate_blocks(g), gate_blocks(beta)


def from_blocks(o, plan: ChunkPlan):
    """[NC, R, HK, G, C, V] -> [R, T, HV, V]."""
    nc, r, hk, grp, c, dv = o.shape
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(r, nc * c, hk * grp, dv)
    return from_slots(o, plan)


def select(mask, a, b):
    """where(mask, a, b) with mask broadcast from the leading dims."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim)), a, b)


def _keys(fn):
    """Map a per-key-head block function over rows and key heads."""
    return jax.vmap(jax.vmap(fn))


def _values(fn, in_axes):
    """Map a per-value-head block function over rows, key heads and value
    heads; arguments with in_axes None are the key head's, shared by its group."""
    return jax.vmap(jax.vmap(jax.vmap(fn, in_axes=in_axes)))


RESIDUAL_POLICIES = ("save", "recompute")


class Config(NamedTuple):
    """Static settings of one call (hashable: custom_vjp's nondiff argument)."""

    scale: float
    acc_dtype: jnp.dtype            # state and accumulations
    decay_dtype: jnp.dtype          # gate sums and decay factors
    residuals: str = "save"         # RESIDUAL_POLICIES
    operands: jnp.dtype | None = None  # matmul operand rounding, see chunk_math
    l2norm: bool = False            # kernels only: normalise q, k inside

    def algebra(self):
        """Keyword arguments of the chunk_math value-head functions."""
        return dict(scale=self.scale, decay_dtype=self.decay_dtype, operands=self.operands)


def save_residuals(states, tinv):
    """Name the saved residuals so a remat policy can keep, drop or offload them."""
    return checkpoint_name(states, "gdn_chunk_states"), checkpoint_name(tinv, "gdn_chunk_inverse")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunk_scan(q, k, v, g, beta, h0, flags, cfg: Config):
    return chunk_scan_forward(q, k, v, g, beta, h0, flags, cfg)[:2]


def chunk_scan_forward(q, k, v, g, beta, h0, flags, cfg: Config, with_residuals=False):
    """Forward over chunk blocks: (o, final), plus the incoming state of every
    chunk and the chunk inverses when `with_residuals`."""
    reset, seq, last = flags[:3]
    acc = cfg.acc_dtype
    key_products = functools.partial(chunk_math.key_products, operands=cfg.operands)
    fwd = functools.partial(chunk_math.value_head_forward, **cfg.algebra())

    def body(carry, xs):
        state, final = carry
        qc, kc, vc, gc, bc, rs, sq, ls = xs
        qa, ka = qc.astype(acc), kc.astype(acc)
        qk, kk = _keys(key_products)(qa, ka)
        state = select(rs, h0[sq], state)
        o, new_state, tinv = _values(fwd, (None, None, 0, 0, 0, None, None, 0))(
            qa, ka, vc.astype(acc), gc, bc, qk, kk, state)
        final = final.at[sq].set(select(ls, new_state, final[sq]))
        return (new_state, final), (o.astype(q.dtype),) + ((state, tinv) if with_residuals else ())

    init = (jnp.zeros((q.shape[1],) + h0.shape[1:], acc), h0)
    (_, final), ys = jax.lax.scan(body, init, (q, k, v, g, beta, reset, seq, last))
    return (ys[0], final) + tuple(ys[1:])


def _chunk_scan_fwd(q, k, v, g, beta, h0, flags, cfg: Config):
    save = cfg.residuals == "save"
    o, final, *saved = chunk_scan_forward(q, k, v, g, beta, h0, flags, cfg, save)
    return (o, final), (q, k, v, g, beta, flags, save_residuals(*saved) if save else (h0,))


def _chunk_scan_bwd(cfg: Config, res, cts):
    q, k, v, g, beta, flags, saved = res
    if cfg.residuals == "recompute":
        _, _, *saved = chunk_scan_forward(q, k, v, g, beta, saved[0], flags, cfg, True)
    states, tinv = saved
    reset, seq, last, nonempty = flags
    do, dfinal = cts
    acc = cfg.acc_dtype
    dfinal = dfinal.astype(acc)
    key_products = functools.partial(chunk_math.key_products, operands=cfg.operands)
    key_products_bwd = functools.partial(chunk_math.key_products_bwd, operands=cfg.operands)
    bwd = functools.partial(chunk_math.value_head_backward, **cfg.algebra())

    def body(carry, xs):
        dstate, dh0 = carry
        qc, kc, vc, gc, bc, tc, state, do_c, rs, sq, ls = xs
        qa, ka = qc.astype(acc), kc.astype(acc)
        qk, kk = _keys(key_products)(qa, ka)
        dstate_out = dstate + select(ls, dfinal[sq], jnp.zeros_like(dstate))
        vg = _values(bwd, (None, None, 0, 0, 0, None, None, 0, 0, 0, 0))(
            qa, ka, vc.astype(acc), gc, bc, qk, kk, tc, state, do_c.astype(acc), dstate_out)
        dq_k, dk_k = _keys(key_products_bwd)(qa, ka, vg.dqk.sum(2), vg.dkk.sum(2))
        dx = (vg.dq.sum(2) + dq_k, vg.dk.sum(2) + dk_k, vg.dv, vg.dg, vg.dbeta)
        dx = tuple(d.astype(x.dtype) for d, x in zip(dx, (qc, kc, vc, gc, bc)))
        dh0 = dh0.at[sq].add(select(rs, vg.dstate_in, jnp.zeros_like(vg.dstate_in)))
        dstate = select(rs, jnp.zeros_like(vg.dstate_in), vg.dstate_in)
        return (dstate, dh0), dx

    init = (jnp.zeros_like(states[0]), jnp.zeros_like(dfinal))
    xs = (q, k, v, g, beta, tinv, states, do, reset, seq, last)
    (_, dh0), (dq, dk, dv, dg, dbeta) = jax.lax.scan(body, init, xs, reverse=True)
    # An empty packed sequence passes h0 straight to its final state.
    dh0 = dh0 + select(~nonempty, dfinal, jnp.zeros_like(dfinal))
    return dq, dk, dv, dg, dbeta, dh0, None


_chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)


def run_in_blocks(scan, q, k, v, g, beta, h0, *, cu_seqlens, chunk_size, state_dtype):
    """Lay [B, T, H, D] inputs out in chunk blocks, run
    scan(q, k, v, g, beta, h0 [N, HK, G, K, V], flags) -> (o, final) on them,
    and lay the results back out as (o [B, T, HV, V], final [N, HV, K, V])."""
    r, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    plan = make_plan(r, t, chunk_size, cu_seqlens)
    # The custom VJPs return dh0 in the accumulation dtype, so h0 comes in in it.
    h0b = h0.astype(state_dtype).reshape(h0.shape[0], hk, hv // hk, dk, dv)
    flags = (plan.reset, plan.seq, plan.last, plan.nonempty)
    o, final = scan(*to_blocks(q, k, v, g, beta, plan), h0b, flags)
    return from_blocks(o, plan), final.reshape(h0.shape)


def chunk_gated_delta_rule_xla(q, k, v, g, beta, h0, *, cu_seqlens, chunk_size, scale, state_dtype, decay_dtype,
                               residuals="save", matmul_dtype=None, hand_written_vjp=True):
    """Validated inputs in, (o [B, T, HV, V] in q's dtype, final [N, HV, K, V]) out.

    hand_written_vjp=False differentiates the same forward with plain
    autodiff: the baseline the benchmark and the gradient tests compare with.
    """
    cfg = Config(scale, jnp.dtype(state_dtype), jnp.dtype(decay_dtype), residuals, matmul_dtype)

    def scan(*args):
        if hand_written_vjp:
            return _chunk_scan(*args, cfg)
        return chunk_scan_forward(*args, cfg)

    return run_in_blocks(scan, q, k, v, g, beta, h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                         state_dtype=cfg.acc_dtype)
