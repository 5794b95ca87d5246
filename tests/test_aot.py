"""gdnx.aot: the target table and the GPU target config it writes (the
compilation itself: tests/ops/delta_rule/test_compile.py)."""

import pytest

from gdnx import aot


def test_targets_name_their_platform():
    assert {aot.platform(t) for t in aot.TPU_TOPOLOGIES} == {"tpu"}
    assert {aot.platform(t) for t in aot.GPU_SPECS} == {"cuda"}
    with pytest.raises(ValueError, match="target: expected one of .*'h100'.* got 'h800'"):
        aot.platform("h800")


@pytest.mark.parametrize("name, major, smem", [("h100", 9, 232_448), ("h200", 9, 232_448), ("a100", 8, 166_912)])
def test_gpu_target_config_carries_the_limits_compilation_checks(name, major, smem):
    text = aot.gpu_target_config(aot.GPU_SPECS[name])
    assert f"cuda_compute_capability {{ major: {major} minor: 0 }}" in text
    assert f"shared_memory_per_block_optin: {smem}" in text
    assert 'platform_name: "CUDA"' in text
