"""The Pallas kernels (forward and backward) in interpret mode against the
float64 oracle, and against the xla implementation.

Interpret mode costs milliseconds per grid step and grows with the arrays,
so these cases stay small (T <= 130, K and V in {64, 128}, HK=2, HV=4) and
cover what the kernels add: head dims of both sizes, K != V, packed
sequences with an empty one, an initial state, fused l2norm, bfloat16
inputs, gates at the edges, beta up to 2, and both residual policies.
Tolerances as in helpers.py (bfloat16 gradients: 2e-2).
"""

import jax.numpy as jnp
import pytest

from gdnx.ops import chunk_gated_delta_rule
from gdnx.ops.gated_delta_rule import GpuTiles, TpuTiles
from gdnx.measure import relative_error
from gdnx.ops.gated_delta_rule.api import default_chunk_implementation
from tests.ops.gated_delta_rule.cases import Case, by_name, make_inputs
from tests.ops.gated_delta_rule.helpers import check_against_oracle, run_oracle

pytestmark = pytest.mark.usefixtures("x64")  # float64 references

KERNELS = ["pallas_tpu", "pallas_gpu"]
KERNEL_CASES = [
    Case("k64_T100_c32", t=100, dk=64, dv=64, chunk=32),
    Case("k64_v128_packed_l2", b=1, t=130, dk=64, dv=128, chunk=32, cu_seqlens=(0, 5, 5, 70, 130), l2norm=True),
    Case("k128_v64_bf16_l2", b=1, t=128, dk=128, dv=64, chunk=64, dtype="bfloat16", l2norm=True),
    Case("edges_c16", b=1, t=48, dk=64, dv=64, chunk=16, gates="edges", h0=False),
    Case("strong_c64", b=1, t=128, dk=64, dv=64, chunk=64, gates="strong"),
    Case("beta2_packed_l2", b=1, t=96, dk=64, dv=64, chunk=32, cu_seqlens=(0, 50, 96), l2norm=True, beta_max=2.0),
]


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel_matches_oracle(case, implementation):
    check_against_oracle(case, implementation)


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("case", by_name(KERNEL_CASES, "k64_v128_packed_l2", "k128_v64_bf16_l2"), ids=str)
def test_kernel_recompute_policy(case, implementation):
    check_against_oracle(case, implementation, residuals="recompute")


@pytest.mark.parametrize("implementation", KERNELS)
def test_kernel_gradients_match_xla(implementation):
    """Kernel and xla backward on the same float32 inputs: the same algebra,
    so they agree to float32 rounding."""
    import jax

    case = Case("vs_xla", b=2, t=50, dk=64, dv=64, chunk=16, l2norm=True)
    args = make_inputs(case)

    def grads(impl):
        def loss(*a):
            o, f = chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=16,
                                          use_qk_l2norm=True, implementation=impl)
            return jnp.sum(jnp.sin(o)) + jnp.sum(f * f)
        return jax.grad(loss, argnums=range(6))(*args)

    for name, x, y in zip(("q", "k", "v", "g", "beta", "h0"), grads(implementation), grads("xla")):
        assert relative_error(x, y) < 1e-5, name


@pytest.mark.parametrize("implementation", KERNELS)
def test_kernel_forward_without_grad(implementation):
    """The plain forward (no residual outputs) gives the same numbers."""
    case = Case("fwd", b=1, t=40, dk=64, dv=64, chunk=16, cu_seqlens=(0, 17, 40))
    q, k, v, g, beta, h0 = make_inputs(case)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16,
                                      cu_seqlens=jnp.asarray(case.cu_seqlens), implementation=implementation)
    ref_o, ref_f = run_oracle(case, (q, k, v, g, beta, h0))
    assert relative_error(o, ref_o) < 1e-5 and relative_error(final, ref_f) < 1e-5


def test_auto_selection_by_platform():
    assert default_chunk_implementation("tpu") == "pallas_tpu"
    assert default_chunk_implementation("gpu") == "pallas_gpu"
    assert default_chunk_implementation("cpu") == "xla"


def test_kernel_limits_are_named():
    case = Case("big", b=1, t=16, dk=320, dv=64, hk=1, hv=1)
    q, k, v, g, beta, _ = make_inputs(case)
    for impl in KERNELS:
        with pytest.raises(ValueError, match="head dim K=320 exceeds the kernel limit of 256"):
            chunk_gated_delta_rule(q, k, v, g, beta, implementation=impl)


def test_interpret_is_for_kernels_only():
    q, k, v, g, beta, _ = make_inputs(Case("i", b=1, t=16, dk=16, dv=16))
    with pytest.raises(ValueError, match="interpret: applies to the Pallas implementations"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="xla", interpret=True)
    with pytest.raises(TypeError, match="interpret: expected None or a bool"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="pallas_gpu", interpret="yes")


@pytest.mark.parametrize("implementation, tiles", [("pallas_tpu", TpuTiles(head_tile=2)),
                                                   ("pallas_gpu", GpuTiles(block_k=32, block_v=32, output_block_v=16,
                                                                           state_block_k=16, state_block_v=32,
                                                                           num_warps=4))])
def test_kernel_tiles(implementation, tiles):
    """Two key heads per TPU grid step; on the GPU every block size off its
    default (K = V = 64: two to four blocks of each kind)."""
    case = Case("tiles", b=1, t=40, dk=64, dv=64, chunk=16)
    check_against_oracle(case, implementation, tiles=tiles)


@pytest.mark.parametrize("implementation", KERNELS + ["xla"])
def test_bf16_matmul_operands(implementation):
    """matmul_dtype=bfloat16 rounds matmul operands: bfloat16-level errors
    (2e-2 tolerance, as for bfloat16 inputs), every gradient included."""
    case = Case("mm_bf16", b=1, t=64, dk=64, dv=64, chunk=32, l2norm=True, cu_seqlens=(0, 20, 64))
    errs = check_against_oracle(case, implementation, tol=2e-2, matmul_dtype="bfloat16")
    # the knob must bite: float32 inputs land near bfloat16 rounding, not at 1e-7
    assert errs["o"] > 1e-4
