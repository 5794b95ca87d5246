"""The Pallas kernels (forward and backward) in interpret mode against the
float64 oracle, and against the xla implementation.

Interpret mode costs milliseconds per grid step and grows with the arrays,
so these cases stay small (T <= 130, K and V in {64, 128}, HK=2, HV=4) and
cover what the kernels add: head dims of both sizes, K != V, packed
sequences with an empty one, an initial state, fused l2norm, bfloat16
inputs, gates at the edges, beta up to 2, and both residual policies.
Tolerances as in helpers.py (bfloat16 gradients: 2e-2). The tests are the
shared kernel contract (delta_rule/contract.py) with these cases; KDA's
kernels run it with cases of their own (tests/ops/kda/test_kernels.py).
"""

import pytest

from gdnx.ops import chunk_gated_delta_rule
from gdnx.ops.delta_rule import GpuTiles, TpuTiles
from gdnx.ops.delta_rule.dispatch import default_implementation
from gdnx.ops.gated_delta_rule.api import IMPLEMENTATIONS
from tests.ops.delta_rule.cases import Case, by_name, make_inputs
from tests.ops.delta_rule.contract import KERNELS, KernelContract

pytestmark = pytest.mark.usefixtures("x64")  # float64 references

KERNEL_CASES = [
    Case("k64_T100_c32", t=100, dk=64, dv=64, chunk=32),
    Case("k64_v128_packed_l2", b=1, t=130, dk=64, dv=128, chunk=32, cu_seqlens=(0, 5, 5, 70, 130), l2norm=True),
    Case("k128_v64_bf16_l2", b=1, t=128, dk=128, dv=64, chunk=64, dtype="bfloat16", l2norm=True),
    Case("edges_c16", b=1, t=48, dk=64, dv=64, chunk=16, gates="edges", h0=False),
    Case("strong_c64", b=1, t=128, dk=64, dv=64, chunk=64, gates="strong"),
    Case("beta2_packed_l2", b=1, t=96, dk=64, dv=64, chunk=32, cu_seqlens=(0, 50, 96), l2norm=True, beta_max=2.0),
]


class GdnKernelContract(KernelContract):
    cases = KERNEL_CASES
    recompute_cases = by_name(KERNEL_CASES, "k64_v128_packed_l2", "k128_v64_bf16_l2")


class TestPallasTpu(GdnKernelContract):
    implementation = "pallas_tpu"
    tiles = [TpuTiles(head_tile=2)]  # two key heads per grid step


class TestPallasGpu(GdnKernelContract):
    implementation = "pallas_gpu"
    # every block size off its default
    tiles = [GpuTiles(block_k=32, block_v=32, output_block_v=16, state_block_k=16, state_block_v=32, num_warps=4)]


def test_auto_selection_by_platform():
    assert default_implementation(IMPLEMENTATIONS, "tpu") == "pallas_tpu"
    assert default_implementation(IMPLEMENTATIONS, "gpu") == "pallas_gpu"
    assert default_implementation(IMPLEMENTATIONS, "cpu") == "xla"


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
