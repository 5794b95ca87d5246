"""The gated delta rule's chunk algebra (gated_delta_rule/math.py) against float64
references: masked decays and the backward's parts summed over blocks."""

import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.ops.gated_delta_rule import math as chunk_math

pytestmark = pytest.mark.usefixtures("x64")  # float64 references


def test_decay_is_masked_before_exp():
    # Above the diagonal G_i - G_j is large and positive; masked first, no inf.
    c = 16
    q = jnp.zeros((c, 8))
    g = jnp.full((1, c), -100.0)
    qk, kk = chunk_math.key_products(q, q)
    prep = chunk_math.chunk_terms(q, q, jnp.zeros((c, 4)), g, jnp.ones((1, c)), qk, kk, scale=1.0,
                              decay_dtype=jnp.float32)
    assert np.all(np.isfinite(prep.dec.dm)) and np.all(np.triu(np.asarray(prep.dec.dm), 1) == 0)
    np.testing.assert_allclose(np.diagonal(np.asarray(prep.dec.dm)), 1.0)
    np.testing.assert_allclose(prep.dec.gcum[:, 0], -100.0 * np.arange(1, c + 1))


def test_backward_parts_add_up_over_blocks():
    """The backward's sums over V (`value_grads`, `state_sums`) and over K
    (`key_grads`) taken block by block, as the GPU kernels take them, equal
    the whole-tile values (float64: only rounding differs)."""
    c, dk, dv, bk, bv = 16, 32, 32, 8, 16
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s))
    q, k, w, state, dstate = arr(c, dk), arr(c, dk), arr(c, dk), arr(dk, dv), arr(dk, dv)
    do, dvn, vn, u, v, tinv = arr(c, dv), arr(c, dv), arr(c, dv), arr(c, dv), arr(c, dv), arr(c, c)
    beta = jnp.asarray(rng.uniform(0, 1, (c, 1)))
    dec = chunk_math.decays(jnp.asarray(rng.uniform(-1, 0, (1, c))), state_dtype=jnp.float64,
                            decay_dtype=jnp.float64)
    dv_all, vs_all = chunk_math.value_grads(do, dvn, vn, u, v, tinv, beta)
    parts = [chunk_math.value_grads(do[:, s], dvn[:, s], vn[:, s], u[:, s], v[:, s], tinv, beta)
             for s in (slice(i, i + bv) for i in range(0, dv, bv))]
    np.testing.assert_allclose(jnp.concatenate([p[0] for p in parts], 1), dv_all, rtol=1e-12)
    vs = parts[0][1]
    for p in parts[1:]:
        vs = chunk_math.add_sums(vs, p[1])
    for x, y in zip(vs, vs_all):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)

    ss_all = chunk_math.state_sums(state, dstate, do, dvn, vn)
    dq_all, dk_all, ks_all = chunk_math.key_grads(q, k, w, ss_all, tinv, beta, dec, scale=0.5)
    ks, dgamma, dqs, dks = None, 0.0, [], []
    for i in range(0, dk, bk):
        rows = slice(i, i + bk)
        ss = None
        for j in range(0, dv, bv):
            cols = slice(j, j + bv)
            part = chunk_math.state_sums(state[rows, cols], dstate[rows, cols], do[:, cols], dvn[:, cols], vn[:, cols])
            ss = part if ss is None else chunk_math.add_sums(ss, part)
        dq, dkb, part = chunk_math.key_grads(q[:, rows], k[:, rows], w[:, rows], ss, tinv, beta, dec, scale=0.5)
        dqs.append(dq)
        dks.append(dkb)
        ks = part if ks is None else chunk_math.add_sums(ks, part)
        dgamma = dgamma + ss.dgamma
    np.testing.assert_allclose(jnp.concatenate(dqs, 1), dq_all, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(jnp.concatenate(dks, 1), dk_all, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dgamma, ss_all.dgamma, rtol=1e-10)
    for x, y in zip(ks, ks_all):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)
