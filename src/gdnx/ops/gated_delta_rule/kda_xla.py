"""Chunked KDA in plain JAX: a scan over chunks, hand-written VJP.

The GDN xla backend's walk (xla.py) with KDA's per-channel chunk algebra
(kda_math): the gate blocks are [C, K] per value head, so QK^T and KK^T are
no longer shared by a key head's group; every product is per value head.
Residuals as for GDN: the inputs, each chunk's incoming state and the
chunk inverse ("save"), or the inputs only ("recompute").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdnx.ops.gated_delta_rule import kda_math
from gdnx.ops.gated_delta_rule.backend import Backend
from gdnx.ops.gated_delta_rule.chunked import ChunkFlags, ChunkOptions, select


def _values(fn, in_axes):
    """Map a per-value-head block function over rows, key heads and value
    heads; arguments with in_axes None are the key head's, shared by its group."""
    return jax.vmap(jax.vmap(jax.vmap(fn, in_axes=in_axes)))


def forward(q, k, v, g, beta, h0, flags: ChunkFlags, *, opts: ChunkOptions, save_residuals: bool):
    """Forward over chunk blocks (g [NC, R, HK, G, C, K]): (o, final), plus
    the incoming state of every chunk and the chunk inverses when
    `save_residuals`."""
    reset, seq, last = flags.reset != 0, flags.seq, flags.last != 0
    acc = opts.state_dtype
    fwd = functools.partial(kda_math.value_head_forward, **opts.algebra())

    def body(carry, xs):
        state, final = carry
        qc, kc, vc, gc, bc, rs, sq, ls = xs
        qa, ka = opts.keys(qc), opts.keys(kc)
        state = select(rs, h0[sq], state)
        o, new_state, tinv = _values(fwd, (None, None, 0, 0, 0, 0))(qa, ka, vc.astype(acc), gc, bc, state)
        final = final.at[sq].set(select(ls, new_state, final[sq]))
        return (new_state, final), (o.astype(q.dtype),) + ((state, tinv) if save_residuals else ())

    init = (jnp.zeros((q.shape[1],) + h0.shape[1:], acc), h0)
    (_, final), ys = jax.lax.scan(body, init, (q, k, v, g, beta, reset, seq, last))
    return (ys[0], final) + tuple(ys[1:])


def backward(q, k, v, g, beta, tinv, states, do, dfinal, flags: ChunkFlags, *, opts: ChunkOptions):
    """Reverse scan carrying dS; each chunk's input gradients in the same step."""
    reset, seq, last = flags.reset != 0, flags.seq, flags.last != 0
    acc = opts.state_dtype
    dfinal = dfinal.astype(acc)
    bwd = functools.partial(kda_math.value_head_backward, **opts.algebra())

    def body(carry, xs):
        dstate, dh0 = carry
        qc, kc, vc, gc, bc, tc, state, do_c, rs, sq, ls = xs
        qa, ka = opts.keys(qc), opts.keys(kc)
        dstate_out = dstate + select(ls, dfinal[sq], jnp.zeros_like(dstate))
        vg = _values(bwd, (None, None, 0, 0, 0, 0, 0, 0, 0))(
            qa, ka, vc.astype(acc), gc, bc, tc, state, do_c.astype(acc), dstate_out)
        dx = (vg.dq.sum(2), vg.dk.sum(2), vg.dv, vg.dg, vg.dbeta)
        dh0 = dh0.at[sq].add(select(rs, vg.dstate_in, jnp.zeros_like(vg.dstate_in)))
        dstate = select(rs, jnp.zeros_like(vg.dstate_in), vg.dstate_in)
        return (dstate, dh0), dx

    init = (jnp.zeros_like(states[0]), jnp.zeros_like(dfinal))
    xs = (q, k, v, g, beta, tinv, states, do, reset, seq, last)
    (_, dh0), (dq, dk, dv, dg, dbeta) = jax.lax.scan(body, init, xs, reverse=True)
    return dq, dk, dv, dg, dbeta, dh0


BACKEND = Backend("xla", forward=forward, backward=backward)
