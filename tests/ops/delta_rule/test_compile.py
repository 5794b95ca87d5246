"""The kernels compile for the hardware they are written for, from this host.

Deviceless ahead-of-time compilation (gdnx.aot): libtpu compiles the Mosaic
kernels for TPU v5e, v6e and v5p, the CUDA plugin the Triton kernels for
H100/H200 (sm_90) and A100 (sm_80), through ptxas. Unlike lowering, this
catches VMEM and shared-memory overflows and operand types a compiler
refuses. Runs in `.venv-aot` (`make test` installs it), marked `deviceless`.

Programs: the forward alone, and the gradient program (the forward writing
its residuals, then the backward), at Qwen3-Next's GDN shape (B=2, T=4096,
HK=16, HV=32, K=V=128, bfloat16, l2norm); each knob varied once from there
(matmul operands bfloat16, residuals recomputed, K=V=64, packed sequences,
value-head groups of 3 and 4 as in Qwen3.5), and one long sequence
(B=1, T=32768) with bfloat16 operands, the packed-training shape. Each
target compiles with its entry of the tiles table (TPU v4 too, at the base
shape), so every entry is compiled.

KDA (`chunk_kda`, per-channel gates) compiles its kernels at Kimi Linear's
shape (B=2, T=4096, HK=HV=32, K=V=128, bfloat16 inputs, float32 gates,
l2norm): the forward and the gradient program on every target, TPU v4
included, and each knob varied once on TPU v5e and H100 (bfloat16 matmul
operands, recomputed residuals, packed sequences, value-head groups of 2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from gdnx import aot
from gdnx.ops import chunk_gated_delta_rule, chunk_kda
from gdnx.ops.delta_rule import tiles_for

pytestmark = pytest.mark.deviceless

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
    matmul_dtype: str | None = None
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


@pytest.mark.parametrize("program", PROGRAMS, ids=str)
@pytest.mark.parametrize("target", COMPILE_TARGETS)
def test_compiles(target, program):
    fn, args = build(program, target)
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    assert mem is not None and mem.argument_size_in_bytes > 0


@pytest.mark.parametrize("program", KDA_PROGRAMS[:2], ids=str)
@pytest.mark.parametrize("target", COMPILE_TARGETS)
def test_kda_compiles(target, program):
    fn, args = build(program, target)
    assert jax.jit(fn).lower(*args).compile().memory_analysis() is not None


@pytest.mark.parametrize("program", KDA_PROGRAMS[2:], ids=str)
@pytest.mark.parametrize("target", ["tpu_v5e", "h100"])
def test_kda_knobs_compile(target, program):
    fn, args = build(program, target)
    assert jax.jit(fn).lower(*args).compile().memory_analysis() is not None


@pytest.mark.parametrize("program", [p for p in PROGRAMS + KDA_PROGRAMS if p.name.endswith(("forward", "grad"))],
                         ids=str)
def test_compiles_for_tpu_v4(program):
    """The fourth TPU generation of the tiles table, at the base shape."""
    fn, args = build(program, "tpu_v4")
    assert jax.jit(fn).lower(*args).compile().memory_analysis() is not None


@pytest.mark.parametrize("name", ["forward", "grad", "kda_forward", "kda_grad"])
def test_tpu_cost_analysis_sees_the_kernels(name):
    """XLA's cost analysis of the compiled program counts the kernels' declared
    FLOPs: within 10% of the analytic count of the chunk algebra (GDN's, KDA's)."""
    from gdnx.ops.delta_rule.costs import op_flops
    from gdnx.ops.gated_delta_rule.math import VARIANT as GDN
    from gdnx.ops.kda.math import VARIANT as KDA_VARIANT

    p = next(x for x in PROGRAMS + KDA_PROGRAMS if x.name == name)
    fn, args = build(p, "tpu_v5e")
    flops = jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]
    fwd, bwd = op_flops(KDA_VARIANT if p.per_channel else GDN, p.b, p.t, p.hk, p.hv, p.dim, p.dim)
    expected = fwd + bwd if p.grad else fwd  # with grad, the forward kernel runs as well
    assert abs(flops - expected) <= 0.1 * expected, (flops, expected)
