"""What the Pallas implementations share: layout, limits and the VJP.

Both kernels read the XLA path's chunk blocks ([NC, R, HK, (G,) C, D], gate
rows [NC, R, HK, G, 1, C], packed sequences already re-laid by the chunk
plan) and return their outputs and residuals in the same layout, so the
residuals (each chunk's incoming state and the chunk inverse) feed the XLA
backward directly until the backward kernels land.

A kernel function has the signature

    kernel(q, k, v, g, beta, h0, flags, *, scale, acc_dtype, decay_dtype,
           l2norm, save_residuals) -> (o, final[, states, tinv])

with q, k raw (the kernel applies l2norm itself when asked) and flags the
plan's (reset, seq, last) as int32 [NC, R].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdnx.ops.gated_delta_rule import chunk_math
from gdnx.ops.gated_delta_rule.xla import chunk_scan_bwd, run_in_blocks, select

MAX_HEAD_DIM = 256


def check_dims(name: str, dk: int, dv: int):
    for what, d in (("K", dk), ("V", dv)):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"implementation={name!r}: head dim {what}={d} exceeds the kernel limit of "
                             f"{MAX_HEAD_DIM}; use implementation='xla'")


def resolve_interpret(interpret: bool | None) -> bool:
    """None: interpret exactly when the default backend is the CPU."""
    return jax.default_backend() == "cpu" if interpret is None else interpret


def _l2(x, acc_dtype):
    return chunk_math.l2norm(x.astype(acc_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _kernel_scan(q, k, v, g, beta, h0, flags, kernel, scale, acc_dtype, decay_dtype, l2norm):
    o, final = kernel(q, k, v, g, beta, h0, _int_flags(flags), scale=scale, acc_dtype=acc_dtype,
                      decay_dtype=decay_dtype, l2norm=l2norm, save_residuals=False)
    return o, _finals(final, h0, flags)


def _int_flags(flags):
    return tuple(f.astype(jnp.int32) for f in flags[:3])


def _finals(final, h0, flags):
    # A kernel never visits an empty packed sequence: its final state is h0.
    return select(flags[3], final, h0)


def _kernel_scan_fwd(q, k, v, g, beta, h0, flags, kernel, scale, acc_dtype, decay_dtype, l2norm):
    o, final, states, tinv = kernel(q, k, v, g, beta, h0, _int_flags(flags), scale=scale, acc_dtype=acc_dtype,
                                    decay_dtype=decay_dtype, l2norm=l2norm, save_residuals=True)
    return (o, _finals(final, h0, flags)), (q, k, v, g, beta, tinv, states, flags)


def _kernel_scan_bwd(kernel, scale, acc_dtype, decay_dtype, l2norm, res, cts):
    # Interim backward: the XLA reverse scan, fed with the kernel's residuals.
    q, k, v, g, beta, tinv, states, flags = res
    if l2norm:
        (qn, kn), pull = jax.vjp(lambda a, b: (_l2(a, acc_dtype), _l2(b, acc_dtype)), q, k)
    else:
        qn, kn = q, k
    dq, dk, *rest = chunk_scan_bwd(scale, acc_dtype, decay_dtype, (qn, kn, v, g, beta, tinv, states, flags), cts)
    if l2norm:
        dq, dk = pull((dq, dk))
    return (dq, dk, *rest)


_kernel_scan.defvjp(_kernel_scan_fwd, _kernel_scan_bwd)


def run(kernel, q, k, v, g, beta, h0, *, cu_seqlens, chunk_size, scale, state_dtype, decay_dtype, use_qk_l2norm):
    """Validated [B, T, H, D] inputs in, (o, final [N, HV, K, V]) out."""
    state_dtype, decay_dtype = jnp.dtype(state_dtype), jnp.dtype(decay_dtype)

    def scan(*args):
        return _kernel_scan(*args, kernel, scale, state_dtype, decay_dtype, use_qk_l2norm)

    return run_in_blocks(scan, q, k, v, g, beta, h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                         state_dtype=state_dtype)
