"""A chunked delta-rule op in plain JAX: a scan over chunks, hand-written VJP.

Forward: one scan over chunks; each step does the chunk's state-free algebra
(gate cumsums, QK^T, KK^T, the inverse, U, W) and the state update, carrying
the float32 state. Keeping a step's work together keeps it in cache
(docs/benchmarks.md compares it with batching the state-free part over all
chunks).

Backward (`custom_vjp`): a reverse scan carries dS and produces each chunk's
input gradients in the same step. Residuals are the inputs
(in their own dtype, already live in a model), the incoming state of every
chunk (sequential, expensive to recompute) and the chunk inverse (C floats
per token and value head, saves the substitution). Everything else (gates,
QK^T, KK^T, U, W, Vn) is recomputed with a few batched matmuls.

It runs behind the custom VJP of `chunked` that every chunked
implementation shares (residual policies, l2norm, packed sequences), and
walks any Variant's chunk algebra (variant.py): the gated delta rule's
shares QK^T and KK^T over a key head's group, KDA's (gate blocks [C, K]
per value head) forms every product per value head.
Residual bytes per token beyond the inputs, float32 state:
    save:      HV * (K * V / C + C) * 4   (HV=32, K=V=128, C=64: 40 KiB)
    recompute: 0
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdnx.ops.delta_rule import chunked
from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.chunked import ChunkFlags, ChunkOptions, select
from gdnx.ops.delta_rule.options import DEFAULTS
from gdnx.ops.delta_rule.variant import Variant


def _keys(fn):
    """Map a per-key-head block function over rows and key heads."""
    return jax.vmap(jax.vmap(fn))


def _values(fn, in_axes):
    """Map a per-value-head block function over rows, key heads and value
    heads; arguments with in_axes None are the key head's, shared by its group."""
    return jax.vmap(jax.vmap(jax.vmap(fn, in_axes=in_axes)))


def _shared(variant: Variant, opts: ChunkOptions, qa, ka):
    """The products a key head's group shares (none for some variants)."""
    if variant.key_products is None:
        return ()
    return _keys(functools.partial(variant.key_products, matmul_dtype=opts.matmul_dtype))(qa, ka)


def _head_forward(variant: Variant, opts: ChunkOptions):
    """fn(q, k, v, g, beta, state) -> (o, new state, tinv) of a chunk, over rows,
    key heads and value heads."""
    fwd = _values(functools.partial(variant.value_head_forward, looped=False, **opts.algebra()),
                  (None, None, 0, 0, 0, None, 0))

    def run(qa, ka, v, g, beta, state):
        return fwd(qa, ka, v, g, beta, _shared(variant, opts, qa, ka), state)

    return run


def _head_backward(variant: Variant, opts: ChunkOptions):
    """fn(q, k, v, g, beta, tinv, state, do, dstate_out) -> (dq, dk, dv, dg,
    dbeta, dstate_in) of a chunk, dq and dk summed over each key head's group."""
    bwd = _values(functools.partial(variant.value_head_backward, looped=False, **opts.algebra()),
                  (None, None, 0, 0, 0, None, 0, 0, 0, 0))

    def run(qa, ka, v, g, beta, tinv, state, do, dstate_out):
        vg, dshared = bwd(qa, ka, v, g, beta, _shared(variant, opts, qa, ka), tinv, state, do, dstate_out)
        dq, dk = vg.dq.sum(2), vg.dk.sum(2)
        if variant.key_products_bwd is not None:
            key_bwd = functools.partial(variant.key_products_bwd, matmul_dtype=opts.matmul_dtype)
            dq_k, dk_k = _keys(key_bwd)(qa, ka, *(d.sum(2) for d in dshared))
            dq, dk = dq + dq_k, dk + dk_k
        return dq, dk, vg.dv, vg.dg, vg.dbeta, vg.dstate_in

    return run


def forward(q, k, v, g, beta, h0, flags: ChunkFlags, *, variant: Variant, opts: ChunkOptions,
            save_residuals: bool):
    """Forward over chunk blocks: (o, final), plus the incoming state of every
    chunk and the chunk inverses when `save_residuals`."""
    reset, seq, last = flags.reset != 0, flags.seq, flags.last != 0
    acc = opts.state_dtype
    head_forward = _head_forward(variant, opts)

    def body(carry, xs):
        state, final = carry
        qc, kc, vc, gc, bc, rs, sq, ls = xs
        state = select(rs, h0 if opts.batched else h0[sq], state)
        o, new_state, tinv = head_forward(opts.keys(qc), opts.keys(kc), vc.astype(acc), gc, bc, state)
        if opts.batched:  # each row its own sequence: no gather or scatter by sequence (a decode step's state is
            final = select(ls, new_state, final)  # then updated where it lies)
        else:
            final = final.at[sq].set(select(ls, new_state, final[sq]))
        return (new_state, final), (o.astype(q.dtype),) + ((state, tinv) if save_residuals else ())

    init = (jnp.zeros((q.shape[1],) + h0.shape[1:], acc), h0)
    (_, final), ys = jax.lax.scan(body, init, (q, k, v, g, beta, reset, seq, last))
    return (ys[0], final) + tuple(ys[1:])


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags: ChunkFlags, *, variant: Variant,
             opts: ChunkOptions):
    """Reverse scan carrying dS; each chunk's input gradients in the same step."""
    reset, seq, last = flags.reset != 0, flags.seq, flags.last != 0
    acc = opts.state_dtype
    dfinal = dfinal.astype(acc)
    head_backward = _head_backward(variant, opts)

    def body(carry, xs):
        dstate, dh0 = carry
        qc, kc, vc, gc, bc, tc, state, do_c, rs, sq, ls = xs
        dstate_out = dstate + select(ls, dfinal if opts.batched else dfinal[sq], jnp.zeros_like(dstate))
        *dx, dstate_in = head_backward(opts.keys(qc), opts.keys(kc), vc.astype(acc), gc, bc, tc, state,
                                       do_c.astype(acc), dstate_out)
        entering = select(rs, dstate_in, jnp.zeros_like(dstate_in))
        dh0 = dh0 + entering if opts.batched else dh0.at[sq].add(entering)
        dstate = select(rs, jnp.zeros_like(dstate_in), dstate_in)
        return (dstate, dh0), tuple(dx)

    init = (jnp.zeros_like(states[0]), jnp.zeros_like(dfinal))
    xs = (q, k, v, g, beta, tinv, states, do, reset, seq, last)
    (_, dh0), (dq, dk, dv, dg, dbeta) = jax.lax.scan(body, init, xs, reverse=True)
    return dq, dk, dv, dg, dbeta, dh0


def backend(variant: Variant) -> Backend:
    """The XLA implementation of `variant`'s op."""
    return Backend("xla", variant=variant, forward=functools.partial(forward, variant=variant),
                   backward=functools.partial(backward, variant=variant))


def run(variant: Variant, q, k, v, g, beta, h0, *, cu_seqlens, chunk_size, scale, state_dtype, decay_dtype,
        use_qk_l2norm=False, residuals=DEFAULTS.residuals, matmul_dtype=None, hand_written_vjp=True):
    """Validated inputs in, (o [B, T, HV, V] in q's dtype, final [N, HV, K, V]) out.

    hand_written_vjp=False differentiates the same forward with plain
    autodiff: the baseline the benchmark and the gradient tests compare with.
    """
    return chunked.run(backend(variant), q, k, v, g, beta, h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                       scale=scale, state_dtype=state_dtype, decay_dtype=decay_dtype, use_qk_l2norm=use_qk_l2norm,
                       residuals=residuals, matmul_dtype=matmul_dtype, hand_written_vjp=hand_written_vjp)
