"""Context parallelism at the op level: the sequence split over 4 devices
gives the single-device op's outputs, final states and gradients (relative
error <= 1e-5 in float32; measured ~1e-6), from given initial states, for
batches of sequences and for sequences packed in one row."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from gdnx.ops import causal_conv1d, chunk_gated_delta_rule
from gdnx.parallel.context import context_causal_conv1d, context_gated_delta_rule
from tests.parallel.helpers import mesh, rel_err, worst_rel_err

TOL = 1e-5
B, T, HK, HV, K, V, D, W = 2, 64, 2, 4, 16, 16, 12, 4


def _inputs():
    ks = jax.random.split(jax.random.key(0), 8)
    f32 = jnp.float32
    q = jax.random.normal(ks[0], (B, T, HK, K), f32)
    k = jax.random.normal(ks[1], (B, T, HK, K), f32)
    v = jax.random.normal(ks[2], (B, T, HV, V), f32)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV), f32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV), f32))
    h0 = 0.1 * jax.random.normal(ks[5], (B, HV, K, V), f32)
    return q, k, v, g, beta, h0


def _context_mesh():
    return mesh("auto", data=2, context=4)


SEQ = P("data", "context")
ROWS = P("data")


@pytest.mark.parametrize("implementation", ["xla", "pallas_tpu"])
def test_delta_rule_over_context_matches_one_device(implementation):
    args = _inputs()
    kw = dict(use_qk_l2norm=True, chunk_size=16, implementation=implementation)

    def single(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)

    def split(q, k, v, g, beta, h0):
        body = functools.partial(context_gated_delta_rule, axis="context", output_final_state=True, **kw)
        return jax.shard_map(lambda *a: body(*a[:5], initial_state=a[5]), mesh=_context_mesh(),
                             in_specs=(SEQ,) * 5 + (ROWS,), out_specs=(SEQ, ROWS), check_vma=False)(
            q, k, v, g, beta, h0)

    def loss(fn, *a):
        o, s = fn(*a)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * s)

    (o, s), (ro, rs) = jax.jit(split)(*args), jax.jit(single)(*args)
    assert rel_err(o, ro) <= TOL and rel_err(s, rs) <= TOL
    grads = jax.jit(jax.grad(functools.partial(loss, split), argnums=tuple(range(6))))(*args)
    ref = jax.jit(jax.grad(functools.partial(loss, single), argnums=tuple(range(6))))(*args)
    err, where = worst_rel_err(grads, ref)
    assert err <= TOL, f"gradient {where} (q, k, v, g, beta, h0): rel. error {err:.2e}"


def test_conv_halo_over_context_matches_one_device():
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (B, T, D), jnp.float32)
    w = jax.random.normal(ks[1], (D, W), jnp.float32)
    s0 = jax.random.normal(ks[2], (B, D, W - 1), jnp.float32)

    def split(x, w, s0):
        return jax.shard_map(lambda x, w, s0: context_causal_conv1d(x, w, axis="context", initial_state=s0,
                                                                    output_final_state=True),
                             mesh=_context_mesh(), in_specs=(SEQ, P(), ROWS), out_specs=(SEQ, ROWS),
                             check_vma=False)(x, w, s0)  # as the model runs it

    def single(x, w, s0):
        return causal_conv1d(x, w, initial_state=s0, output_final_state=True)

    (y, s), (ry, rs) = jax.jit(split)(x, w, s0), jax.jit(single)(x, w, s0)
    assert rel_err(y, ry) <= TOL and rel_err(s, rs) == 0.0  # the final state is a copy of inputs

    def loss(fn, *a):
        y, s = fn(*a)
        return jnp.sum(y * jnp.sin(y)) + jnp.sum(s * s)

    grads = jax.jit(jax.grad(functools.partial(loss, split), argnums=(0, 1, 2)))(x, w, s0)
    ref = jax.jit(jax.grad(functools.partial(loss, single), argnums=(0, 1, 2)))(x, w, s0)
    err, where = worst_rel_err(grads, ref)
    assert err <= TOL, f"gradient {where} (x, weight, state): rel. error {err:.2e}"


# packed sequences: a boundary inside a shard, one exactly at a shard start (16), an empty
# sequence, and one starting a token before shard 2 (31) that runs through the last shard
CU = jnp.array([0, 5, 16, 18, 18, 31, 64], jnp.int32)
PACKED = P(None, "context")


@pytest.mark.parametrize("implementation", ["xla", "pallas_tpu"])
def test_packed_delta_rule_over_context_matches_one_device(implementation):
    q, k, v, g, beta, _ = (x[:1] for x in _inputs())
    h0 = 0.1 * jax.random.normal(jax.random.key(7), (CU.shape[0] - 1, HV, K, V), jnp.float32)
    kw = dict(use_qk_l2norm=True, chunk_size=16, implementation=implementation)

    def single(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=CU,
                                      **kw)

    def split(q, k, v, g, beta, h0):
        body = functools.partial(context_gated_delta_rule, axis="context", output_final_state=True, cu_seqlens=CU,
                                 **kw)
        return jax.shard_map(lambda *a: body(*a[:5], initial_state=a[5]), mesh=_context_mesh(),
                             in_specs=(PACKED,) * 5 + (P(),), out_specs=(PACKED, P()), check_vma=False)(
            q, k, v, g, beta, h0)

    def loss(fn, *a):
        o, s = fn(*a)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * s)

    args = (q, k, v, g, beta, h0)
    (o, s), (ro, rs) = jax.jit(split)(*args), jax.jit(single)(*args)
    assert rel_err(o, ro) <= TOL and rel_err(s, rs) <= TOL
    grads = jax.jit(jax.grad(functools.partial(loss, split), argnums=tuple(range(6))))(*args)
    ref = jax.jit(jax.grad(functools.partial(loss, single), argnums=tuple(range(6))))(*args)
    err, where = worst_rel_err(grads, ref)
    assert err <= TOL, f"gradient {where} (q, k, v, g, beta, h0): rel. error {err:.2e}"


def test_packed_conv_halo_stops_at_sequence_starts():
    ks = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(ks[0], (1, T, D), jnp.float32)
    w = jax.random.normal(ks[1], (D, W), jnp.float32)
    s0 = jax.random.normal(ks[2], (CU.shape[0] - 1, D, W - 1), jnp.float32)

    def split(x, w, s0):
        return jax.shard_map(lambda x, w, s0: context_causal_conv1d(x, w, axis="context", initial_state=s0,
                                                                    output_final_state=True, cu_seqlens=CU),
                             mesh=_context_mesh(), in_specs=(PACKED, P(), P()), out_specs=(PACKED, P()),
                             check_vma=False)(x, w, s0)

    def single(x, w, s0):
        return causal_conv1d(x, w, initial_state=s0, output_final_state=True, cu_seqlens=CU)

    (y, s), (ry, rs) = jax.jit(split)(x, w, s0), jax.jit(single)(x, w, s0)
    assert rel_err(y, ry) <= TOL and rel_err(s, rs) == 0.0

    def loss(fn, *a):
        y, s = fn(*a)
        return jnp.sum(y * jnp.sin(y)) + jnp.sum(s * s)

    grads = jax.jit(jax.grad(functools.partial(loss, split), argnums=(0, 1, 2)))(x, w, s0)
    ref = jax.jit(jax.grad(functools.partial(loss, single), argnums=(0, 1, 2)))(x, w, s0)
    err, where = worst_rel_err(grads, ref)
    assert err <= TOL, f"gradient {where} (x, weight, state): rel. error {err:.2e}"
