import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.ops.gated_delta_rule.chunk_math import decay_matrix, unit_lower_inverse


@pytest.mark.parametrize("c", [16, 32, 64, 128])
def test_unit_lower_inverse_is_exact(c):
    rng = np.random.default_rng(c)
    a = np.tril(rng.standard_normal((3, c, c)) * 0.3, -1)
    inv = np.asarray(unit_lower_inverse(jnp.asarray(a)))
    ref = np.linalg.inv(np.eye(c) + a)
    # Relative error of the inverse itself: float64 rounding only.
    assert np.linalg.norm(inv - ref) / np.linalg.norm(ref) < 1e-12
    assert np.allclose(np.triu(inv, 1), 0) and np.allclose(np.diagonal(inv, axis1=-2, axis2=-1), 1)


def test_unit_lower_inverse_small_chunk():
    a = np.tril(np.full((8, 8), 0.5), -1)
    np.testing.assert_allclose(unit_lower_inverse(jnp.asarray(a)), np.linalg.inv(np.eye(8) + a), atol=1e-12)


def test_decay_matrix_masks_before_exp():
    # Above the diagonal G_i - G_j is large and positive; masked, no inf.
    gcum = jnp.cumsum(jnp.full((16,), -100.0))
    d = decay_matrix(gcum)
    assert np.all(np.isfinite(d)) and np.all(np.triu(np.asarray(d), 1) == 0)
    np.testing.assert_allclose(np.diagonal(np.asarray(d)), 1.0)
