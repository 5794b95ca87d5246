"""Bad input gets a clear error naming the argument; good input options work."""

import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tests.ops.delta_rule.cases import Case, make_inputs


@pytest.fixture
def args():
    q, k, v, g, beta, _ = make_inputs(Case("api", b=1, t=20, dk=16, dv=16))
    return q, k, v, g, beta


def call(args, **kw):
    return chunk_gated_delta_rule(*args, **kw)


@pytest.mark.parametrize(
    "change, kw, err, match",
    [
        (None, dict(implementation="cuda"), ValueError, "implementation: expected None or one of"),
        (None, dict(chunk_size=48), ValueError, "chunk_size: expected one of"),
        (None, dict(state_dtype="float33"), ValueError, "state_dtype: unknown dtype"),
        (None, dict(decay_dtype="int32"), ValueError, "decay_dtype: expected a floating dtype"),
        (None, dict(scale="0.1"), TypeError, "scale: expected a Python float"),
        (None, dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm: expected a bool"),
        (None, dict(initial_state=jnp.zeros((2, 4, 16, 16))), ValueError, r"initial_state: expected \[N, HV, K, V\]"),
        (None, dict(cu_seqlens=jnp.array([0, 5, 3, 20])), ValueError, "cu_seqlens: must be non-decreasing"),
        (None, dict(cu_seqlens=jnp.array([0, 5, 19])), ValueError, "cu_seqlens: must end at T=20"),
        (None, dict(cu_seqlens=jnp.array([1, 5, 20])), ValueError, "cu_seqlens: must start at 0"),
        (None, dict(cu_seqlens=jnp.array([0.0, 20.0])), TypeError, "cu_seqlens: expected an integer array"),
        (None, dict(cu_seqlens=jnp.array([[0, 20]])), ValueError, r"cu_seqlens: expected shape \[N \+ 1\]"),
        (lambda a: (a[0][..., 0],) + a[1:], {}, ValueError, r"q: expected rank 4"),
        (lambda a: (a[0], a[1][:, :10]) + a[2:], {}, ValueError, "k: expected the shape of q"),
        (lambda a: a[:2] + (a[2][:, :, :3],) + a[3:], {}, ValueError, "HV=3 must be a multiple of key heads HK=2"),
        (lambda a: a[:3] + (a[3][:, :, :2],) + a[4:], {}, ValueError, r"g: expected \[B, T, HV\]"),
        (lambda a: a[:4] + (a[4][..., None],), {}, ValueError, "beta: expected rank 3"),
        (lambda a: (a[0].astype(jnp.int32),) + a[1:], {}, TypeError, "q: expected a floating dtype"),
        (lambda a: (a[0].tolist(),) + a[1:], {}, TypeError, "q: expected an array"),
        (lambda a: tuple(x[:, :0] for x in a), {}, ValueError, "T >= 1"),
    ],
)
def test_bad_input_is_named(args, change, kw, err, match):
    if change is not None:
        args = change(args)
    with pytest.raises(err, match=match):
        call(args, **kw)


def test_packed_needs_batch_one(args):
    two = tuple(jnp.concatenate([x, x]) for x in args)
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need batch size 1, got B=2"):
        call(two, cu_seqlens=jnp.array([0, 20]))


def test_recurrent_rejects_chunk_implementations(args):
    with pytest.raises(ValueError, match="implementation: expected None or one of"):
        recurrent_gated_delta_rule(*args, implementation="xla")


def test_dtypes_and_outputs(args):
    q, k, v, g, beta = (x.astype(jnp.bfloat16) for x in args)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, state_dtype="float32", decay_dtype=np.float32)
    assert o.dtype == jnp.bfloat16 and o.shape == v.shape and final is None
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, state_dtype="bfloat16")
    assert final.dtype == jnp.bfloat16 and final.shape == (1, 4, 16, 16)


def test_numpy_inputs_are_accepted(args):
    o, _ = chunk_gated_delta_rule(*(np.asarray(x) for x in args), cu_seqlens=np.array([0, 7, 20]))
    assert o.shape == args[2].shape


def test_residual_policy_is_checked(args):
    with pytest.raises(ValueError, match="residuals: expected one of"):
        call(args, residuals="offload")
    with pytest.raises(ValueError, match="residuals: applies to the chunked implementations"):
        call(args, implementation="reference", residuals="recompute")
    with pytest.raises(ValueError, match="matmul_dtype: applies to the chunked implementations"):
        call(args, implementation="reference", matmul_dtype="bfloat16")
    with pytest.raises(ValueError, match="matmul_dtype: unknown dtype"):
        call(args, matmul_dtype="bf17")


def test_options_object_is_the_keywords(args):
    """DeltaRuleOptions carries the keywords' settings (the same program and
    result); given with a changed keyword it is refused, naming both; every
    implementation the options name has an entry in the op's table."""
    from gdnx.ops.delta_rule import DeltaRuleOptions
    from gdnx.ops.gated_delta_rule.api import IMPLEMENTATIONS
    from gdnx.ops.delta_rule.options import CHUNK_IMPLEMENTATIONS, DEFAULTS, KERNEL_PLATFORMS

    opts = DeltaRuleOptions(implementation="xla", chunk_size=16, residuals="recompute")
    o_opts, _ = call(args, options=opts)
    o_kw, _ = call(args, implementation="xla", chunk_size=16, residuals="recompute")
    np.testing.assert_array_equal(np.asarray(o_opts), np.asarray(o_kw))
    with pytest.raises(ValueError, match="options: given together with chunk_size, residuals"):
        call(args, options=opts, chunk_size=32, residuals="recompute", state_dtype=DEFAULTS.state_dtype)
    with pytest.raises(TypeError, match="options: expected a DeltaRuleOptions or None, got dict"):
        call(args, options={"chunk_size": 16})
    assert set(IMPLEMENTATIONS) == set(CHUNK_IMPLEMENTATIONS)
    # the kernels' platforms as the options module (which the config reads) states them
    assert {n: b.platform for n, b in IMPLEMENTATIONS.items() if b.kernel} == KERNEL_PLATFORMS


def test_recurrent_token_states_are_each_prefix_final_state():
    """output_token_states: entry t is the final state of the same call over
    tokens [0, t] (the same recurrence, stopped there: bit-identical)."""
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 6, 4, 8)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 0.5, (1, 6, 4)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (1, 6, 4)), jnp.float32)
    _, final, states = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True,
                                                  output_token_states=True)
    assert states.shape == (1, 6, 4, 8, 8)
    for t in (0, 3, 5):
        _, ref = recurrent_gated_delta_rule(q[:, :t + 1], k[:, :t + 1], v[:, :t + 1], g[:, :t + 1],
                                            beta[:, :t + 1], output_final_state=True, use_qk_l2norm=True)
        np.testing.assert_array_equal(states[:, t], ref)


def test_states_along_the_sequence_refuse_packed_sequences():
    x = jnp.zeros((1, 8, 1, 4))
    gb = jnp.zeros((1, 8, 1))
    with pytest.raises(ValueError, match="output_chunk_states"):
        chunk_gated_delta_rule(x, x, x, gb, gb, cu_seqlens=jnp.asarray([0, 3, 8]), output_chunk_states=True)
    with pytest.raises(ValueError, match="output_token_states"):
        recurrent_gated_delta_rule(x, x, x, gb, gb, cu_seqlens=jnp.asarray([0, 3, 8]), output_token_states=True)
