"""What the Pallas implementations share: layout, limits and the VJP.

Both kernels read the XLA path's chunk blocks ([NC, R, HK, (G,) C, D], gate
rows [NC, R, HK, G, 1, C], packed sequences already re-laid by the chunk
plan) and write their outputs in the same layout. An implementation is a
pair of kernel functions:

    forward(q, k, v, g, beta, h0, flags, *, cfg, save_residuals)
        -> (o, final[, states, tinv])
    backward(q, k, v, g, beta, tinv, states, do, dfinal, flags, *, cfg)
        -> (dq, dk, dv, dg, dbeta, dh0)

with cfg the call's static `xla.Config`;

q and k come raw (the kernels apply l2norm themselves when asked, and their
dq, dk are with respect to the normalised q, k, in the accumulation dtype);
flags are the plan's (reset, seq, last) as int32 [NC, R]; states are the
incoming state of every chunk, tinv the chunk inverses.

Residual policy: "save" keeps states and tinv from the forward (named
gdn_chunk_states and gdn_chunk_inverse); "recompute" keeps only the inputs
and reruns the forward kernel in the backward.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdnx.ops.gated_delta_rule import chunk_math
from gdnx.ops.gated_delta_rule.xla import Config, run_in_blocks, save_residuals, select

MAX_HEAD_DIM = 256


def matmul_flops(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def chunk_flops(c: int, dk: int, dv: int) -> dict[str, int]:
    """Analytic FLOPs of the chunk algebra per chunk and value head, by part
    (matmuls and the C^3 terms; the O(C^2) elementwise work is left out).

    key_products   QK^T and KK^T, once per key head
    prepare        segment sums, inverse (C rows of C x C), U, W
    state          Vn = U - W S, S' = gamma S + K^T (ek Vn)
    output         (eq Q) S + P Vn
    state_bwd      P^T dO, K dS', Q^T (eq dO), W^T dVn
    grads          the V sums (7 matmuls), the rest of the prepare adjoint,
                   U and W again
    key_grads      through QK^T and KK^T, once per key head
    """
    mm = matmul_flops
    return {
        "key_products": 2 * mm(c, dk, c),
        "prepare": 2 * mm(c, c, c) + mm(c, c, dv) + mm(c, c, dk),
        "state": 2 * mm(c, dk, dv),
        "output": mm(c, dk, dv) + mm(c, c, dv),
        "state_bwd": mm(c, c, dv) + 3 * mm(c, dk, dv),
        "grads": 5 * mm(c, dk, dv) + 3 * mm(c, c, dv) + 2 * mm(c, c, dk) + mm(c, c, c) + mm(c, c, dv) + mm(c, c, dk),
        "key_grads": 4 * mm(c, c, dk),
    }


def transcendentals(c: int) -> int:
    """exp of the decays per chunk and value head: C x C pairwise, 2 C, 1."""
    return c * c + 2 * c + 1


def cost(flops: int, exps: int, arrays) -> pl.CostEstimate:
    """A kernel's cost estimate: bytes are every input and output once."""
    nbytes = sum(int(math.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)
    return pl.CostEstimate(flops=int(flops), transcendentals=int(exps), bytes_accessed=nbytes)


def check_dims(name: str, dk: int, dv: int):
    for what, d in (("K", dk), ("V", dv)):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"implementation={name!r}: head dim {what}={d} exceeds the kernel limit of "
                             f"{MAX_HEAD_DIM}; use implementation='xla'")


def resolve_interpret(interpret: bool | None) -> bool:
    """None: interpret exactly when the default backend is the CPU."""
    return jax.default_backend() == "cpu" if interpret is None else interpret


class Kernels(NamedTuple):
    forward: Callable
    backward: Callable


# How a kernel argument or result is laid out: chunk blocks with rows on axis
# 1, per-sequence states on axis 0, or the flags (rows on axis 1; the
# sequence flag holds indices into the per-sequence axis).
ROWS, SEQS, FLAG, SEQ_FLAG = "rows", "seqs", "flag", "seq_flag"
FORWARD_ARGS = (ROWS,) * 5 + (SEQS, FLAG, SEQ_FLAG, FLAG)
FORWARD_OUTS = (ROWS, SEQS, ROWS, ROWS)
BACKWARD_ARGS = (ROWS,) * 8 + (SEQS, FLAG, SEQ_FLAG, FLAG)
BACKWARD_OUTS = (ROWS,) * 5 + (SEQS,)


def batchable(fn, arg_kinds, out_kinds):
    """fn(*arrays) with a vmap rule that folds the mapped axis into the rows
    (and the sequences), so one kernel launch serves the whole batch.

    pallas_call's own batching rule adds a grid axis without extending the
    kernel's dimension semantics, which Mosaic then rejects.
    """

    @jax.custom_batching.custom_vmap
    def call(*args):
        return tuple(fn(*args))

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape) for x, b in zip(args, in_batched)]
        nseq = next(x.shape[1] for x, kind in zip(args, arg_kinds) if kind == SEQS)

        def fold(x, kind):
            if kind == SEQS:
                return x.reshape((-1,) + x.shape[2:])
            if kind == SEQ_FLAG:
                x = x + (jnp.arange(axis_size, dtype=x.dtype) * nseq).reshape((-1,) + (1,) * (x.ndim - 1))
            x = jnp.moveaxis(x, 0, 1)
            return x.reshape(x.shape[:1] + (-1,) + x.shape[3:])

        def unfold(y, kind):
            if kind == SEQS:
                return y.reshape((axis_size, -1) + y.shape[1:])
            return jnp.moveaxis(y.reshape(y.shape[:1] + (axis_size, -1) + y.shape[2:]), 1, 0)

        outs = call(*(fold(x, kind) for x, kind in zip(args, arg_kinds)))
        return tuple(unfold(y, kind) for y, kind in zip(outs, out_kinds)), (True,) * len(outs)

    return call


def _int_flags(flags):
    return tuple(f.astype(jnp.int32) for f in flags[:3])


def _forward(kernels, q, k, v, g, beta, h0, flags, cfg: Config, save):
    def fn(*args):
        return kernels.forward(*args[:6], args[6:], cfg=cfg, save_residuals=save)

    out = batchable(fn, FORWARD_ARGS, FORWARD_OUTS)(q, k, v, g, beta, h0, *_int_flags(flags))
    # A kernel never visits an empty packed sequence: its final state is h0.
    return (out[0], select(flags[3], out[1], h0)) + tuple(out[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel_scan(q, k, v, g, beta, h0, flags, kernels, cfg: Config):
    return _forward(kernels, q, k, v, g, beta, h0, flags, cfg, False)


def _kernel_scan_fwd(q, k, v, g, beta, h0, flags, kernels, cfg: Config):
    save = cfg.residuals == "save"
    o, final, *saved = _forward(kernels, q, k, v, g, beta, h0, flags, cfg, save)
    return (o, final), (q, k, v, g, beta, flags, save_residuals(*saved) if save else (h0,))


def _kernel_scan_bwd(kernels, cfg: Config, res, cts):
    q, k, v, g, beta, flags, saved = res
    if cfg.residuals == "recompute":
        _, _, *saved = _forward(kernels, q, k, v, g, beta, saved[0], flags, cfg, True)
    states, tinv = saved
    do, dfinal = cts

    def fn(*args):
        return kernels.backward(*args[:9], args[9:], cfg=cfg)

    dq, dk, dv, dg, dbeta, dh0 = batchable(fn, BACKWARD_ARGS, BACKWARD_OUTS)(
        q, k, v, g, beta, tinv, states, do, dfinal, *_int_flags(flags))
    if cfg.l2norm:
        def l2(a, b):
            return chunk_math.l2norm(a.astype(cfg.acc_dtype)), chunk_math.l2norm(b.astype(cfg.acc_dtype))

        dq, dk = jax.vjp(l2, q, k)[1]((dq, dk))
    # An empty packed sequence passes h0 straight to its final state.
    dh0 = select(flags[3], dh0, dfinal.astype(dh0.dtype))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv, dg, dbeta, dh0, None)


_kernel_scan.defvjp(_kernel_scan_fwd, _kernel_scan_bwd)


def run(kernels: Kernels, q, k, v, g, beta, h0, *, cu_seqlens, chunk_size, scale, state_dtype, decay_dtype,
        use_qk_l2norm, residuals, matmul_dtype=None):
    """Validated [B, T, H, D] inputs in, (o, final [N, HV, K, V]) out."""
    cfg = Config(scale, jnp.dtype(state_dtype), jnp.dtype(decay_dtype), residuals, matmul_dtype, use_qk_l2norm)

    def scan(*args):
        return _kernel_scan(*args, kernels, cfg)

    return run_in_blocks(scan, q, k, v, g, beta, h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                         state_dtype=cfg.acc_dtype)
