"""A decode step in a stack of states (delta_rule/decode_step.py): the TPU
kernel (interpreted here) and the token recurrence on the slice both equal
the float64 oracle and write only the indexed entry (test_compile.py
compiles the kernel for a TPU: in place, no temporaries)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.measure import relative_error
from gdnx.ops.delta_rule.decode_step import StateStack, decode_step, head_tile
from tests.ops.delta_rule.oracle import oracle

pytestmark = pytest.mark.usefixtures("x64")


def _inputs(b, hk, hv, dk, dv, per_channel, repeats=3, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(1), 6)
    q, k = (jax.random.normal(x, (b, 1, hk, dk), dtype) for x in keys[:2])
    v = jax.random.normal(keys[2], (b, 1, hv, dv), dtype)
    g = -jax.random.uniform(keys[3], (b, 1, hv, dk) if per_channel else (b, 1, hv), jnp.float32)
    beta = jax.random.uniform(keys[4], (b, 1, hv), dtype)
    stack = jax.random.normal(keys[5], (repeats, b, hv, dk, dv), jnp.float32)
    return q, k, v, g, beta, stack


@pytest.mark.parametrize("kernel", [False, True], ids=["recurrence", "kernel"])
@pytest.mark.parametrize("shape", [(3, 2, 4, 16, 32, False),
                                   pytest.param((2, 2, 2, 32, 16, True), marks=pytest.mark.slow),
                                   pytest.param((2, 1, 24, 8, 8, False), marks=pytest.mark.slow)],
                         ids=["gdn_gva2", "kda", "gdn_24_heads"])
def test_step_equals_the_oracle_and_writes_only_its_entry(shape, kernel):
    *dims, per_channel = shape
    q, k, v, g, beta, stack = _inputs(*dims, per_channel)
    o, new = decode_step(q, k, v, g, beta, StateStack(stack, jnp.int32(1)), use_qk_l2norm=True, kernel=kernel,
                         interpret=True)
    ref_o, ref_s = oracle(*(np.asarray(x, np.float64) for x in (q, k, v, g, beta, stack[1])), use_qk_l2norm=True)
    # float32 arithmetic against float64: a few roundings of O(1) values
    assert relative_error(o, ref_o) < 1e-5 and relative_error(new.stack[1], ref_s) < 1e-5
    np.testing.assert_array_equal(new.stack[0], stack[0])
    np.testing.assert_array_equal(new.stack[2], stack[2])


@pytest.mark.slow
def test_kernel_equals_the_recurrence_with_bfloat16_inputs():
    q, k, v, g, beta, stack = _inputs(4, 2, 4, 16, 16, False, dtype=jnp.bfloat16)
    run = lambda kernel: decode_step(q, k, v, g, beta, StateStack(stack, jnp.int32(2)), use_qk_l2norm=True,
                                     kernel=kernel, interpret=True)
    (o1, s1), (o2, s2) = run(False), run(True)
    assert o2.dtype == jnp.bfloat16 and s2.stack.dtype == jnp.float32
    assert relative_error(s2.stack, s1.stack) < 1e-6
    assert relative_error(o2, o1) < 1e-2  # each a bfloat16 rounding of the same float32 output


def test_refusals_name_the_argument():
    q, k, v, g, beta, stack = _inputs(2, 2, 4, 16, 16, False)
    with pytest.raises(ValueError, match="states.stack"):
        decode_step(q, k, v, g, beta, StateStack(stack[:, :1], jnp.int32(0)))
    with pytest.raises(ValueError, match="^g:"):
        decode_step(q, k, v, g[..., None], beta, StateStack(stack, jnp.int32(0)))
    with pytest.raises(ValueError, match="one token"):
        decode_step(*(jnp.concatenate([x, x], 1) for x in (q, k, v, g, beta)), StateStack(stack, jnp.int32(0)))


def test_head_tile_bounds_a_blocks_state():
    assert head_tile(16, 128, 128, 4) == 16   # 1 MiB of float32 state
    assert head_tile(32, 128, 128, 4) == 16
    assert head_tile(24, 128, 128, 4) == 12
    assert head_tile(7, 256, 256, 4) == 1
