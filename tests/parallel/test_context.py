"""Context parallelism at the op level: the sequence split over 4 devices
gives the single-device op's outputs, final states and gradients (relative
error <= 1e-5 in float32; measured ~1e-6), from given initial states, for
batches of sequences and for sequences packed in one row."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from gdnx.ops import causal_conv1d, chunk_gated_delta_rule, chunk_kda
from gdnx.parallel.context import context_causal_conv1d, context_delta_rule
from gdnx.measure import relative_error
from tests.parallel.helpers import mesh, worst_relative_error

TOL = 1e-5
B, T, HK, HV, K, V, D, W = 2, 64, 2, 4, 16, 16, 12, 4
SEQ, ROWS = P("data", "context"), P("data")
# packed sequences: a boundary inside a shard, one exactly at a shard start (16), an empty
# sequence, and one starting a token before shard 2 (31) that runs through the last shard
CU = jnp.array([0, 5, 16, 18, 18, 31, 64], jnp.int32)
PACKED = P(None, "context")


def _delta_rule_inputs(batch, states, per_channel=False):
    ks = jax.random.split(jax.random.key(0), 6)
    f32 = jnp.float32
    gate = (batch, T, HV, K) if per_channel else (batch, T, HV)
    return (jax.random.normal(ks[0], (batch, T, HK, K), f32), jax.random.normal(ks[1], (batch, T, HK, K), f32),
            jax.random.normal(ks[2], (batch, T, HV, V), f32),
            -jax.nn.softplus(jax.random.normal(ks[3], gate, f32)),
            jax.nn.sigmoid(jax.random.normal(ks[4], (batch, T, HV), f32)),
            0.1 * jax.random.normal(ks[5], (states, HV, K, V), f32))


def _conv_inputs(batch, states):
    ks = jax.random.split(jax.random.key(1), 3)
    return (jax.random.normal(ks[0], (batch, T, D), jnp.float32), jax.random.normal(ks[1], (D, W), jnp.float32),
            jax.random.normal(ks[2], (states, D, W - 1), jnp.float32))


def _check(split, single, args, names):
    """Outputs, final state and the gradient of every argument agree."""
    (y, s), (ry, rs) = jax.jit(split)(*args), jax.jit(single)(*args)
    assert relative_error(y, ry) <= TOL and relative_error(s, rs) <= TOL

    def loss(fn, *a):
        y, s = fn(*a)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(s * s)

    argnums = tuple(range(len(args)))
    grads = jax.jit(jax.grad(functools.partial(loss, split), argnums=argnums))(*args)
    ref = jax.jit(jax.grad(functools.partial(loss, single), argnums=argnums))(*args)
    err, where = worst_relative_error(grads, ref)
    assert err <= TOL, f"gradient {where} ({names}): rel. error {err:.2e}"


def _on_context(body, in_specs, out_specs):
    """body(*args) with the sequence split over context=4 (x data=2), as the
    model runs it (check_vma=False)."""
    return jax.shard_map(body, mesh=mesh("auto", data=2, context=4), in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("implementation", ["xla", "pallas_tpu", "kda_xla"])
def test_delta_rule_over_context_matches_one_device(implementation, packed):
    """GDN on each implementation, and KDA (per-channel gates) on xla."""
    cu = CU if packed else None
    per_channel = implementation.startswith("kda_")
    args = _delta_rule_inputs(1 if packed else B, CU.shape[0] - 1 if packed else B, per_channel)
    kw = dict(use_qk_l2norm=True, chunk_size=16, implementation=implementation.removeprefix("kda_"),
              output_final_state=True, cu_seqlens=cu)
    seq, rows = (PACKED, P()) if packed else (SEQ, ROWS)
    op = chunk_kda if per_channel else chunk_gated_delta_rule

    def single(q, k, v, g, beta, h0):
        return op(q, k, v, g, beta, initial_state=h0, **kw)

    def body(q, k, v, g, beta, h0):
        return context_delta_rule(op, q, k, v, g, beta, axis="context", initial_state=h0, **kw)

    _check(_on_context(body, (seq,) * 5 + (rows,), (seq, rows)), single, args, "q, k, v, g, beta, h0")


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_conv_halo_over_context_matches_one_device(packed):
    cu = CU if packed else None
    args = _conv_inputs(1 if packed else B, CU.shape[0] - 1 if packed else B)
    seq, rows = (PACKED, P()) if packed else (SEQ, ROWS)

    def single(x, w, s0):
        return causal_conv1d(x, w, initial_state=s0, output_final_state=True, cu_seqlens=cu)

    def body(x, w, s0):
        return context_causal_conv1d(x, w, axis="context", initial_state=s0, output_final_state=True, cu_seqlens=cu)

    # with packing, the halo must stop at sequence starts (31 is one token before shard 2)
    _check(_on_context(body, (seq, P(), rows), (seq, rows)), single, args, "x, weight, state")
