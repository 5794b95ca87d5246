"""The tile primitives every chunk algebra is written in (delta_rule/primitives.py)
against float64 references: the exact inverses, row/column moves, segment sums
that do not cancel, and bfloat16 operands with float32 ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.measure import relative_error
from gdnx.ops.delta_rule import primitives

pytestmark = pytest.mark.usefixtures("x64")  # float64 references


@pytest.mark.parametrize("inverse", [primitives.unit_lower_inverse, primitives.unit_lower_inverse_loop,
                                     primitives.unit_lower_inverse_rows])
@pytest.mark.parametrize("c", [8, 16, 32, 64, 128])
def test_unit_lower_inverse_is_exact(inverse, c):
    rng = np.random.default_rng(c)
    a = np.tril(rng.standard_normal((3, c, c)) * 0.3, -1)
    inv = np.asarray(jax.jit(jax.vmap(inverse))(jnp.asarray(a)))
    ref = np.linalg.inv(np.eye(c) + a)
    # Relative error of the inverse itself: float64 rounding only. A sign
    # error or a dropped term in any block is O(1).
    assert np.linalg.norm(inv - ref) / np.linalg.norm(ref) < 1e-12
    assert np.all(np.triu(inv, 1) == 0) and np.allclose(np.diagonal(inv, axis1=-2, axis2=-1), 1)


def test_blocked_inverse_keeps_float32_digits_when_keys_repeat():
    """The blocked inverse merges its blocks through powers of the
    off-block part; with keys that repeat (four distinct ones, nearly
    collinear rows) and beta up to 2 those powers grow. In float32 it stays
    within 4e-6 of the exact inverse (measured worst 1e-6; the row loop's
    2e-7), under the op's float32 tolerance of 1e-5."""
    rng = np.random.default_rng(0)
    c, worst = 64, 0.0
    for _ in range(8):
        k = rng.standard_normal((4, 128))[rng.integers(0, 4, c)] + 0.01 * rng.standard_normal((c, 128))
        k /= np.linalg.norm(k, axis=1, keepdims=True)
        decay = np.cumsum(np.log(rng.uniform(0.95, 1.0, c)))
        a = np.tril(rng.uniform(0, 2, c)[:, None] * (k @ k.T) * np.exp(decay[:, None] - decay[None, :]), -1)
        inv = np.asarray(jax.jit(primitives.unit_lower_inverse_rows)(jnp.asarray(a, jnp.float32)), np.float64)
        worst = max(worst, relative_error(inv, np.linalg.inv(np.eye(c) + a)))
    assert worst < 4e-6


def test_row_col_round_trip():
    x = jnp.arange(8.0)[None, :]
    col = primitives.row_to_col(x)
    assert col.shape == (8, 1)
    np.testing.assert_array_equal(col[:, 0], x[0])
    np.testing.assert_array_equal(primitives.col_to_row(col), x)


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
    seg = np.asarray(primitives.segment_sums(jnp.asarray(g, jnp.float32), split=split), np.float64)
    cum = np.concatenate([[0.0], np.cumsum(g[0])])
    ref = np.tril(cum[1:, None] - cum[None, 1:])
    scale = np.maximum(np.abs(ref), 1.0)
    assert np.max(np.abs(seg - ref) / scale) < 1e-6


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
    got = primitives.dot(a, b, ((0,), (0,)))
    assert got.dtype == jnp.float32
    assert relative_error(got, want) <= 1e-6
    # a single bfloat16 pass over the float32 factor would be ~1e-3 off
    single = jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (((0,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    assert relative_error(single, want) > 1e-4
