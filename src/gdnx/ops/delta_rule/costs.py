"""Analytic FLOPs of the chunked op: per chunk and value head by part, and
per call (what the kernels' cost estimates and the benchmarks' achieved
FLOP rates are computed from). Matmuls and the C^3 terms count; the O(C^2)
elementwise work is left out. Each Variant adds its own parts to
`value_flops` (gated_delta_rule.math.chunk_flops, kda.math.chunk_flops).
"""

from __future__ import annotations

from gdnx.ops.delta_rule.variant import Variant


def matmul_flops(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def value_flops(c: int, dk: int, dv: int) -> dict[str, int]:
    """The parts every variant's value head runs:

    prepare        segment sums, inverse (C rows of C x C), U, W
    state          Vn = U - W S, S' = gamma S + K^T (ek Vn)
    output         (eq Q) S + P Vn
    state_bwd      P^T dO, K dS', Q^T (eq dO), W^T dVn
    grads          the V sums (7 matmuls), the rest of the prepare adjoint,
                   U and W again
    """
    mm = matmul_flops
    return {
        "prepare": 2 * mm(c, c, c) + mm(c, c, dv) + mm(c, c, dk),
        "state": 2 * mm(c, dk, dv),
        "output": mm(c, dk, dv) + mm(c, c, dv),
        "state_bwd": mm(c, c, dv) + 3 * mm(c, dk, dv),
        "grads": 5 * mm(c, dk, dv) + 3 * mm(c, c, dv) + 2 * mm(c, c, dk) + mm(c, c, c) + mm(c, c, dv) + mm(c, c, dk),
    }


def op_flops(variant: Variant, b: int, t: int, hk: int, hv: int, dk: int, dv: int,
             chunk: int = 64) -> tuple[int, int]:
    """(forward, backward) analytic FLOPs of `variant`'s op on [B, T] tokens
    with HK key and HV value heads: its chunk_flops over every chunk and
    head, the key-head parts (if any) once per key head."""
    chunks, grp = b * (-(-t // chunk)) * hk, hv // hk
    f = variant.chunk_flops(chunk, dk, dv)
    key_fwd = f.get("key_products", 0)
    fwd = chunks * (key_fwd + grp * sum(f[p] for p in variant.forward_parts))
    bwd = chunks * (key_fwd + f.get("key_grads", 0) + grp * sum(f[p] for p in variant.backward_parts))
    return fwd, bwd
