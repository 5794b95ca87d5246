"""The delta-rule layers' decode step in a scanned cycle's stack of states:
the layer reads its entry of the stack, steps it and writes it back; with
the TPU kernel (pallas_tpu, interpreted here) in place, else with the token
recurrence. Both equal the plain step on the entry alone, for GDN and KDA,
with and without padded rows; outside a scan the kernel steps the layer's
own state."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdnx.layers.gated_deltanet import DeltaRuleState, GatedDeltaNet
from gdnx.layers.kimi_delta_attention import KimiDeltaAttention
from gdnx.measure import relative_error
from gdnx.ops.delta_rule.decode_step import StateStack
from gdnx.ops.delta_rule.options import DeltaRuleOptions

HIDDEN, REPEATS, ROWS = 32, 3, 2


def _layer(kind: str, implementation: str):
    op = DeltaRuleOptions(implementation=implementation, interpret=True if implementation == "pallas_tpu" else None)
    common = dict(conv_kernel_size=4, norm_eps=1e-6, op=op, init_std=0.1, dtype=jnp.float32,
                  param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    if kind == "gdn":
        return GatedDeltaNet(HIDDEN, num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8,
                             **common)
    return KimiDeltaAttention(HIDDEN, num_heads=2, head_dim=16, **common)


# make test: GDN through the kernel; the recurrence, KDA and the rest in make test-all
@pytest.mark.parametrize("kind", ["gdn", pytest.param("kda", marks=pytest.mark.slow)])
@pytest.mark.parametrize("implementation", [pytest.param("xla", marks=pytest.mark.slow), "pallas_tpu"])
def test_decode_step_in_a_stack_equals_the_step_on_its_entry(kind, implementation):
    layer = _layer(kind, implementation)
    plain = _layer(kind, "xla")
    nnx.update(plain, nnx.state(layer))
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (ROWS, 1, HIDDEN))
    zero = layer.zero_state(ROWS, jnp.float32)
    conv = jax.random.normal(keys[1], zero.conv.shape)
    stack = jax.random.normal(keys[2], (REPEATS, *zero.recurrent.shape)) * 0.3
    for lengths in (None, jnp.array([1, 0], jnp.int32)):
        y, new = layer(x, DeltaRuleState(conv, StateStack(stack, jnp.int32(1))), lengths=lengths)
        y_ref, ref = plain(x, DeltaRuleState(conv, stack[1]), lengths=lengths)
        assert isinstance(new.recurrent, StateStack)
        # one float32 step each, summed in another order by the kernel
        assert relative_error(y, y_ref) < 1e-5
        assert relative_error(new.recurrent.stack[1], ref.recurrent) < 1e-5
        np.testing.assert_array_equal(new.conv, ref.conv)
        np.testing.assert_array_equal(new.recurrent.stack[0], stack[0])
        np.testing.assert_array_equal(new.recurrent.stack[2], stack[2])
        if lengths is not None:  # the padded row's state passes through
            np.testing.assert_allclose(new.recurrent.stack[1, 1], stack[1, 1], rtol=1e-6)


@pytest.mark.slow
def test_the_kernel_steps_a_layers_own_state():
    """Outside a scanned cycle the state is the layer's own array: the
    kernel takes it as a stack of one."""
    layer, plain = _layer("gdn", "pallas_tpu"), _layer("gdn", "xla")
    nnx.update(plain, nnx.state(layer))
    keys = jax.random.split(jax.random.key(4), 2)
    x = jax.random.normal(keys[0], (ROWS, 1, HIDDEN))
    zero = layer.zero_state(ROWS, jnp.float32)
    state = DeltaRuleState(zero.conv, jax.random.normal(keys[1], zero.recurrent.shape) * 0.3)
    (y, new), (y_ref, ref) = layer(x, state), plain(x, state)
    assert new.recurrent.shape == ref.recurrent.shape
    assert relative_error(y, y_ref) < 1e-5 and relative_error(new.recurrent, ref.recurrent) < 1e-5


@pytest.mark.slow
def test_a_longer_call_writes_its_entry_back():
    layer = _layer("gdn", "xla")
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (ROWS, 5, HIDDEN))
    zero = layer.zero_state(ROWS, jnp.float32)
    stack = jax.random.normal(keys[1], (REPEATS, *zero.recurrent.shape)) * 0.3
    y, new = layer(x, DeltaRuleState(zero.conv, StateStack(stack, jnp.int32(2))))
    y_ref, ref = layer(x, DeltaRuleState(zero.conv, stack[2]))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(new.recurrent.stack[2], ref.recurrent)
    np.testing.assert_array_equal(new.recurrent.stack[:2], stack[:2])
