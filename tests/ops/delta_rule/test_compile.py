"""The kernels compile for the hardware they are written for, from this host.

Deviceless ahead-of-time compilation (gdnx.aot): libtpu compiles the Mosaic
kernels for TPU v5e, v6e and v5p, the CUDA plugin the Triton kernels for
H100/H200 (sm_90) and A100 (sm_80), through ptxas. Unlike lowering, this
catches VMEM and shared-memory overflows and operand types a compiler
refuses. Runs in `.venv-aot` (`make test` installs it), marked `deviceless`;
`make test` compiles each op's bfloat16 training program for TPU v5e,
`make test-all` every case.

Programs (programs.py): the forward alone, and the gradient program (the forward writing
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

The decode step's kernel (decode_step.py) compiles for a v5e at a serving
shape, updating its stack of states in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gdnx import aot
from gdnx.ops.delta_rule.decode_step import StateStack, decode_step
from tests.helpers.tiers import SLOW
from tests.ops.delta_rule.programs import COMPILE_TARGETS, KDA_PROGRAMS, PROGRAMS, build

pytestmark = pytest.mark.deviceless
# make test compiles what a bfloat16 training run on a v5e compiles, GDN's and KDA's: Mosaic accepts the kernels
FAST = {("tpu_v5e", "grad_bf16_operands"), ("tpu_v5e", "kda_grad_bf16_operands")}


def _cases(targets, programs) -> list:
    return [pytest.param(t, p, id=f"{t}-{p}", marks=() if (t, p.name) in FAST else SLOW)
            for p in programs for t in targets]


@pytest.mark.parametrize("target, program", _cases(COMPILE_TARGETS, PROGRAMS))
def test_compiles(target, program):
    fn, args = build(program, target)
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    assert mem is not None and mem.argument_size_in_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("program", KDA_PROGRAMS[:2], ids=str)
@pytest.mark.parametrize("target", COMPILE_TARGETS)
def test_kda_compiles(target, program):
    fn, args = build(program, target)
    assert jax.jit(fn).lower(*args).compile().memory_analysis() is not None


KDA_KNOBS = [p for p in KDA_PROGRAMS[2:] if not p.name.endswith("_long")]
LONG = [p for p in PROGRAMS + KDA_PROGRAMS if p.name.endswith("_long")]


@pytest.mark.parametrize("target, program", _cases(["tpu_v5e", "h100"], KDA_KNOBS))
def test_kda_knobs_compile(target, program):
    fn, args = build(program, target)
    assert jax.jit(fn).lower(*args).compile().memory_analysis() is not None


@pytest.mark.slow
@pytest.mark.parametrize("program", LONG, ids=str)
@pytest.mark.parametrize("target", ["h100"])
def test_gpu_kernels_fill_the_gpu_on_tensor_cores_without_spilling(target, program):
    """One sequence of 32,768 tokens with bfloat16 products (GDN at
    Qwen3-Next's heads, KDA at Kimi Linear's), as ptxas and XLA's launch
    plan report each Pallas kernel (gdnx.gpu_kernels): no spilled register,
    shared memory within a block's limit, a grid of at least one block per
    SM in every phase, and its products on the tensor cores (wgmma on
    Hopper)."""
    from gdnx import aot
    from gdnx.gpu_kernels import compile_and_read

    fn, args = build(program, target)
    _, kernels = compile_and_read(jax.jit(fn).lower(*args), target)
    spec = aot.GPU_SPECS[target]
    assert len(kernels) >= (5 if program.grad else 3), kernels
    # the backward's prepare is the second call of the forward's kernel function: read as a kernel of its own
    assert ("prepare#2" in {k.name for k in kernels}) == program.grad, kernels
    for k in kernels:
        assert k.registers > 0, f"{k}: ptxas did not report it"
        assert k.spill_bytes == 0, str(k)
        assert k.shared_bytes <= spec.shared_memory_per_block_optin, str(k)
        assert k.blocks >= spec.sm_count, str(k)
        assert k.tensor_core_ops > 0, str(k)


@pytest.mark.slow
@pytest.mark.parametrize("program", [p for p in PROGRAMS + KDA_PROGRAMS if p.name.endswith(("forward", "grad"))],
                         ids=str)
def test_compiles_for_tpu_v4(program):
    """The fourth TPU generation of the tiles table, at the base shape."""
    fn, args = build(program, "tpu_v4")
    assert jax.jit(fn).lower(*args).compile().memory_analysis() is not None


@pytest.mark.slow
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


def test_decode_step_compiles_for_a_tpu_in_place():
    sharding = aot.sharding("tpu_v5e")
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    r, b, hk, hv, d = 6, 32, 16, 16, 128
    args = [sd((b, 1, hk, d), jnp.bfloat16), sd((b, 1, hk, d), jnp.bfloat16), sd((b, 1, hv, d), jnp.bfloat16),
            sd((b, 1, hv), jnp.float32), sd((b, 1, hv), jnp.bfloat16), sd((r, b, hv, d, d), jnp.float32),
            sd((), jnp.int32)]

    def step(q, k, v, g, beta, stack, index):
        return decode_step(q, k, v, g, beta, StateStack(stack, index), use_qk_l2norm=True, kernel=True,
                           interpret=False)

    memory = jax.jit(step, donate_argnums=(5,)).lower(*args).compile().memory_analysis()
    # the stack (192 MiB) is the output's buffer: nothing of its size is allocated beside it
    assert memory.alias_size_in_bytes == r * b * hv * d * d * 4
    assert memory.temp_size_in_bytes < 2**20
