"""KDA's Pallas kernels (forward and backward) in interpret mode against the
float64 oracle and the xla implementation: the shared kernel contract
(tests/ops/delta_rule/contract.py) with KDA's cases, hard gates per token
and per channel among them. Small arrays, as for the gated delta rule's
kernels (tests/ops/gated_delta_rule/test_kernels.py)."""

import pytest

from gdnx.ops.delta_rule import GpuTiles, TpuTiles
from gdnx.ops.delta_rule.dispatch import default_implementation
from gdnx.ops.kda.api import IMPLEMENTATIONS
from tests.ops.delta_rule.cases import Case, by_name
from tests.ops.delta_rule.contract import KernelContract

pytestmark = pytest.mark.usefixtures("x64")  # float64 references

KDA_KERNEL_CASES = [
    Case("kda_k64_T100_c32", t=100, dk=64, dv=64, chunk=32, per_channel=True),
    Case("kda_k64_v128_packed_l2", b=1, t=130, dk=64, dv=128, chunk=32, cu_seqlens=(0, 5, 5, 70, 130), l2norm=True,
         per_channel=True),
    Case("kda_k128_v64_bf16_l2", b=1, t=128, dk=128, dv=64, chunk=64, dtype="bfloat16", l2norm=True,
         per_channel=True),
    Case("kda_bursts_c64", b=1, t=128, dk=64, dv=64, chunk=64, gates="bursts", per_channel=True),
    Case("kda_channels_c16", b=1, t=48, dk=64, dv=64, chunk=16, gates="channels", h0=False, beta_max=2.0,
         per_channel=True),
]


class TestKdaPallasTpu(KernelContract):
    implementation = "pallas_tpu"
    per_channel = True
    cases = KDA_KERNEL_CASES
    recompute_cases = by_name(KDA_KERNEL_CASES, "kda_k64_v128_packed_l2", "kda_k128_v64_bf16_l2")
    tiles = [TpuTiles(head_tile=2)]


class TestKdaPallasGpu(TestKdaPallasTpu):
    """The TPU class's cases but the plain one (its algebra is the same
    kda/math.py; these cover the GPU kernels' padding, K blocks and phases)."""
    implementation = "pallas_gpu"
    cases = by_name(KDA_KERNEL_CASES, "kda_k64_v128_packed_l2", "kda_k128_v64_bf16_l2", "kda_bursts_c64",
                    "kda_channels_c16")
    recompute_cases = by_name(KDA_KERNEL_CASES, "kda_k64_v128_packed_l2")
    tiles = [GpuTiles(block_k=32, block_v=32, output_block_v=16, state_block_k=16, state_block_v=32, num_warps=4)]


def test_auto_selection_by_platform():
    assert default_implementation(IMPLEMENTATIONS, "tpu") == "pallas_tpu"
    assert default_implementation(IMPLEMENTATIONS, "gpu") == "pallas_gpu"
    assert default_implementation(IMPLEMENTATIONS, "cpu") == "xla"
