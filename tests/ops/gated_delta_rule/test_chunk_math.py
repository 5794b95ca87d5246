import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.measure import relative_error
from gdnx.ops.gated_delta_rule import chunk_math

pytestmark = pytest.mark.usefixtures("x64")  # float64 references


@pytest.mark.parametrize("inverse", [chunk_math.unit_lower_inverse, chunk_math.unit_lower_inverse_loop])
@pytest.mark.parametrize("c", [16, 32, 64, 128])
def test_unit_lower_inverse_is_exact(inverse, c):
    rng = np.random.default_rng(c)
    a = np.tril(rng.standard_normal((3, c, c)) * 0.3, -1)
    inv = np.asarray(jax.jit(jax.vmap(inverse))(jnp.asarray(a)))
    ref = np.linalg.inv(np.eye(c) + a)
    # Relative error of the inverse itself: float64 rounding only. A sign
    # error or a dropped term in any block is O(1).
    assert np.linalg.norm(inv - ref) / np.linalg.norm(ref) < 1e-12
    assert np.all(np.triu(inv, 1) == 0) and np.allclose(np.diagonal(inv, axis1=-2, axis2=-1), 1)


def test_row_col_round_trip():
    x = jnp.arange(8.0)[None, :]
    col = chunk_math.row_to_col(x)
    assert col.shape == (8, 1)
    np.testing.assert_array_equal(col[:, 0], x[0])
    np.testing.assert_array_equal(chunk_math.col_to_row(col), x)


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


@pytest.mark.parametrize("split", [False, True], ids=["float32", "bf16_parts"])
@pytest.mark.parametrize("c", [16, 64])
def test_segment_sums_do_not_cancel(c, split):
    """Entry (i, j) is sum_{j < l <= i} g_l to float32 rounding of that sum
    itself, however large the cumulative sums before the segment; also as
    three bfloat16 passes (the GPU kernels' form)."""
    rng = np.random.default_rng(c)
    g = rng.uniform(-69.0, -31.0, size=(1, c))
    g[rng.random(g.shape) < 0.5] = 0.0
    g[0, :4] = rng.uniform(-1e-3, 0.0, size=4)  # small gates keep their low bits too
    seg = np.asarray(chunk_math.segment_sums(jnp.asarray(g, jnp.float32), split=split), np.float64)
    cum = np.concatenate([[0.0], np.cumsum(g[0])])
    ref = np.tril(cum[1:, None] - cum[None, 1:])
    scale = np.maximum(np.abs(ref), 1.0)
    assert np.max(np.abs(seg - ref) / scale) < 1e-6


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


@pytest.mark.parametrize("exact", [0, 1])
def test_a_bfloat16_operand_with_a_float32_one_is_exact(exact):
    """`dot` of a raw bfloat16 block and a float32 factor (products in
    float32) takes `exact_dot`'s three bfloat16 passes: as accurate as a
    float32 product (relative error <= 1e-6 against float64, where float32
    rounding of 64-term sums measures ~1e-7), in either operand order."""
    rng = np.random.default_rng(0)
    raw = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    f32 = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    a, b = (raw, f32) if exact == 0 else (f32, raw)
    want = np.asarray(a, np.float64).T @ np.asarray(b, np.float64)
    got = chunk_math.dot(a, b, ((0,), (0,)))
    assert got.dtype == jnp.float32
    assert relative_error(got, want) <= 1e-6
    # a single bfloat16 pass over the float32 factor would be ~1e-3 off
    single = jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (((0,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    assert relative_error(single, want) > 1e-4
