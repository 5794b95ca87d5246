"""What the Pallas implementations share: limits, interpret mode and the
cost estimate they hand the compiler (analytic FLOPs: costs.py). Their
custom VJP, block layout and batching rule are every chunked
implementation's (`chunked`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdnx.ops.delta_rule.tiles import target_platform

MAX_HEAD_DIM = 256


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
    """None: interpret exactly when the program is traced for the CPU (a
    TPU slice's program traced on a CPU host compiles the real kernel)."""
    return target_platform() == "cpu" if interpret is None else interpret
