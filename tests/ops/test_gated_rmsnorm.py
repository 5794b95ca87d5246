import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.ops.gated_rmsnorm import gated_rmsnorm
from gdnx.measure import relative_error


def test_matches_definition():
    rng = np.random.default_rng(0)
    x, z = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 3, 16))
    w = rng.standard_normal(16)
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w * z / (1 + np.exp(-z))
    got = gated_rmsnorm(jnp.asarray(x, jnp.float32), jnp.asarray(z, jnp.float32), jnp.asarray(w, jnp.float32))
    assert got.dtype == jnp.float32 and relative_error(got, ref) < 1e-6
    got16 = gated_rmsnorm(*(jnp.asarray(a, jnp.bfloat16) for a in (x, z)), jnp.asarray(w, jnp.float32))
    assert got16.dtype == jnp.bfloat16 and relative_error(got16, ref) < 2e-2


def test_bad_shapes_are_named():
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match="z: expected the shape of x"):
        gated_rmsnorm(x, jnp.ones((2, 4)), jnp.ones(8))
    with pytest.raises(ValueError, match=r"weight: expected \[8\]"):
        gated_rmsnorm(x, x, jnp.ones(4))
