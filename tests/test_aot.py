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


def test_the_largest_temporaries_are_named_with_what_holds_them():
    """compile_reporting reads XLA's buffer assignment: a program whose one
    large temporary is an outer product names it (its shape, its size and
    the JAX operation in its metadata); a refusal for memory carries the
    same list."""
    import jax
    import jax.numpy as jnp

    def f(x):
        outer = jnp.tanh(x[:, None] * x[None, :])  # [2048, 2048] float32, 16 MiB: the matrix product reads it whole
        return outer @ outer

    jnp.ones(3).sum()  # a compile before: JAX has decided whether the persistent cache is in use
    compiled, largest = aot.compile_reporting(jax.jit(f).lower(jnp.ones(2048)), "refused ({})")
    assert compiled is not None and largest
    # the same program again, with the persistent cache holding it: still compiled and dumped
    assert aot.compile_reporting(jax.jit(f).lower(jnp.ones(2048)), "refused ({})")[1] == largest
    top = largest[0]
    assert top.bytes == 2048 * 2048 * 4 and top.shape.startswith("f32[2048,2048]"), largest
    assert "jit(f)" in top.made_by, top
    assert aot.describe_buffers(largest).startswith("0.02 GiB f32[2048,2048]")
    assert aot.describe_buffers([]) == "none reported"
