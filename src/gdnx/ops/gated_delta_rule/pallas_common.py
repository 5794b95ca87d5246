"""What the Pallas implementations share: limits, interpret mode and
cost estimates. Their custom VJP, block layout and batching rule are every
chunked implementation's (`chunked`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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


def kda_chunk_flops(c: int, dk: int, dv: int) -> dict[str, int]:
    """`chunk_flops` of KDA's chunk algebra (kda_math), all per value head:

    decays         the 0/1 matmuls of the gate segment sums (2 per bit of
                   the chunk position but the lowest, G and the suffix)
    pairs          KK^T and QK^T with the decays, one masked matmul per bit each
    pairs_bwd      their adjoints (4 per bit) and KK^T again
    and GDN's prepare, state, output, state_bwd and grads (the same products
    on the value side); no key-head parts.
    """
    mm, bits = matmul_flops, max(1, (c - 1).bit_length())
    f = chunk_flops(c, dk, dv)
    f.update(key_products=0, key_grads=0, decays=2 * bits * mm(c, c, dk), pairs=2 * bits * mm(c, dk, c),
             pairs_bwd=5 * bits * mm(c, dk, c))
    return f


def op_flops(b: int, t: int, hk: int, hv: int, dk: int, dv: int, chunk: int = 64,
             per_channel: bool = False) -> tuple[int, int]:
    """(forward, backward) analytic FLOPs of the op on [B, T] tokens with HK
    key and HV value heads: `chunk_flops` (KDA: `kda_chunk_flops`) over
    every chunk and head."""
    chunks, grp = b * (-(-t // chunk)) * hk, hv // hk
    if per_channel:
        f = kda_chunk_flops(chunk, dk, dv)
        fwd = chunks * grp * (f["decays"] + f["pairs"] + f["prepare"] + f["state"] + f["output"])
        bwd = chunks * grp * (f["decays"] + f["pairs_bwd"] + f["prepare"] + f["state_bwd"] + f["grads"])
        return fwd, bwd
    f = chunk_flops(chunk, dk, dv)
    fwd = chunks * (f["key_products"] + grp * (f["prepare"] + f["state"] + f["output"]))
    bwd = chunks * (f["key_products"] + f["key_grads"] + grp * (f["prepare"] + f["state_bwd"] + f["grads"]))
    return fwd, bwd


def transcendentals(c: int) -> int:
    """exp of the decays per chunk and value head: C x C pairwise, 2 C, 1."""
    return c * c + 2 * c + 1


def kda_transcendentals(c: int, dk: int) -> int:
    """exp of KDA's decay factors per chunk and value head: two [C, K] per
    bit of the chunk position, exp(G), exp(G_last - G), exp(G_last)."""
    return (2 * max(1, (c - 1).bit_length()) + 2) * c * dk + dk


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
