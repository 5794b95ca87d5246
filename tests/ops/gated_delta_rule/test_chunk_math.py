import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.ops.gated_delta_rule import chunk_math


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
    prep = chunk_math.prepare(q, q, jnp.zeros((c, 4)), g, jnp.ones((1, c)), qk, kk, scale=1.0,
                              decay_dtype=jnp.float32)
    assert np.all(np.isfinite(prep.dec.dm)) and np.all(np.triu(np.asarray(prep.dec.dm), 1) == 0)
    np.testing.assert_allclose(np.diagonal(np.asarray(prep.dec.dm)), 1.0)
    np.testing.assert_allclose(prep.dec.gcum[:, 0], -100.0 * np.arange(1, c + 1))


@pytest.mark.parametrize("c", [16, 64])
def test_segment_sums_do_not_cancel(c):
    """Entry (i, j) is sum_{j < l <= i} g_l to float32 rounding of that sum
    itself, however large the cumulative sums before the segment."""
    rng = np.random.default_rng(c)
    g = rng.uniform(-69.0, -31.0, size=(1, c))
    g[rng.random(g.shape) < 0.5] = 0.0
    seg = np.asarray(chunk_math.segment_sums(jnp.asarray(g, jnp.float32)), np.float64)
    cum = np.concatenate([[0.0], np.cumsum(g[0])])
    ref = np.tril(cum[1:, None] - cum[None, 1:])
    scale = np.maximum(np.abs(ref), 1.0)
    assert np.max(np.abs(seg - ref) / scale) < 1e-6
