"""The op programs the deviceless compile tests and benchmarks/ops/compile.py
build: each at a model's shape, on a target (test_compile.py says which)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdnx import aot
from gdnx.ops import chunk_gated_delta_rule, chunk_kda
from gdnx.ops.delta_rule import tiles_for

KERNEL = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
COMPILE_TARGETS = ("tpu_v5e", "tpu_v6e", "tpu_v5p", "h100", "a100")


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    grad: bool = True
    b: int = 2
    t: int = 4096
    hk: int = 16
    hv: int = 32
    dim: int = 128
    packed: bool = False
    matmul_dtype: str = "float32"  # the kernels' default for bfloat16 inputs is bfloat16: float32 is the knob
    residuals: str = "save"
    per_channel: bool = False  # KDA

    def __str__(self):
        return self.name


PROGRAMS = [
    Program("forward", grad=False),
    Program("grad"),
    Program("grad_bf16_operands", matmul_dtype="bfloat16"),
    Program("grad_recompute", residuals="recompute"),
    Program("grad_dim64", dim=64),
    Program("grad_packed", b=1, packed=True),
    Program("grad_gva3", hv=48),
    Program("grad_gva4", hv=64),
    Program("forward_long", grad=False, b=1, t=32768, matmul_dtype="bfloat16"),
    Program("grad_long", b=1, t=32768, matmul_dtype="bfloat16"),
]
KDA = dict(hk=32, hv=32, per_channel=True)
KDA_PROGRAMS = [
    Program("kda_forward", grad=False, **KDA),
    Program("kda_grad", **KDA),
    Program("kda_grad_bf16_operands", matmul_dtype="bfloat16", **KDA),
    Program("kda_grad_recompute", residuals="recompute", **KDA),
    Program("kda_grad_packed", b=1, packed=True, **KDA),
    Program("kda_grad_gva2", **{**KDA, "hk": 16}),
    Program("kda_forward_long", grad=False, b=1, t=32768, matmul_dtype="bfloat16", **KDA),
    Program("kda_grad_long", b=1, t=32768, matmul_dtype="bfloat16", **KDA),
]


def build(program: Program, target: str):
    """(function, abstract arguments) of the program on the target."""
    sharding = aot.sharding(target)
    p = program
    n = 4 if p.packed else p.b

    def sd(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    gate = (p.b, p.t, p.hv, p.dim) if p.per_channel else (p.b, p.t, p.hv)
    args = [sd((p.b, p.t, p.hk, p.dim), jnp.bfloat16), sd((p.b, p.t, p.hk, p.dim), jnp.bfloat16),
            sd((p.b, p.t, p.hv, p.dim), jnp.bfloat16), sd(gate, jnp.float32),
            sd((p.b, p.t, p.hv), jnp.bfloat16), sd((n, p.hv, p.dim, p.dim), jnp.float32)]
    cu = sd((n + 1,), jnp.int32) if p.packed else None
    impl = KERNEL[aot.platform(target)]

    def op(q, k, v, g, beta, h0, cu_seqlens=None):
        return (chunk_kda if p.per_channel else chunk_gated_delta_rule)(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
            use_qk_l2norm=True, implementation=impl, interpret=False, tiles=tiles_for(impl, aot.device(target)),
            matmul_dtype=p.matmul_dtype, residuals=p.residuals)

    fn = op
    if p.grad:
        def loss(*xs):
            o, s = op(*xs)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s * s)

        fn = jax.grad(loss, argnums=range(6))
    return fn, args + ([cu] if cu is not None else [])
