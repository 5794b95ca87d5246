"""causal_conv1d against a float64 loop written from the definition.

Tolerances: float64 inputs 1e-12 (the same sums in another order); float32
inputs 1e-6 (a W-term sum and a SiLU in float32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from gdnx.measure import relative_error
from tests.helpers.tiers import fast_only

pytestmark = pytest.mark.usefixtures("x64")  # float64 references


def naive(x, w, b, state, cu, silu=True):
    """x [T, D] of one packed row, state [N, D, W-1]; python loops in float64."""
    x, w, b, state = (np.asarray(a, np.float64) for a in (x, w, b, state))
    width = w.shape[1]
    y = np.zeros_like(x)
    finals = []
    for n in range(len(cu) - 1):
        hist = state[n].T  # [W-1, D], oldest first
        seq = np.concatenate([hist, x[cu[n]:cu[n + 1]]])
        for p in range(cu[n + 1] - cu[n]):
            z = (seq[p:p + width] * w.T).sum(0) + b
            y[cu[n] + p] = z / (1 + np.exp(-z)) if silu else z
        finals.append(seq[len(seq) - (width - 1):].T)
    return y, np.stack(finals)


def inputs(t, d, width, n, seed=0, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((1, t, d)), dtype), jnp.asarray(rng.standard_normal((d, width)), dtype),
            jnp.asarray(rng.standard_normal(d), dtype), jnp.asarray(rng.standard_normal((n, d, width - 1)), dtype))


@pytest.mark.parametrize("cu", fast_only([(0, 13), (0, 2, 2, 9, 20), (0, 1, 30)], lambda cu: len(cu) == 5,
                                   one_argument=True),
                         ids=["one", "packed_with_short", "len1"])
@pytest.mark.parametrize("width", fast_only([2, 4], lambda w: w == 4))
def test_matches_loop_and_grads(cu, width):
    x, w, b, s = inputs(cu[-1], 6, width, len(cu) - 1)
    cu_arr = jnp.asarray(cu, jnp.int32)
    y, f = causal_conv1d(x, w, b, initial_state=s, output_final_state=True, cu_seqlens=cu_arr)
    ref_y, ref_f = naive(x[0], w, b, s, cu)
    assert relative_error(y[0], ref_y) < 1e-12 and relative_error(f, ref_f) < 1e-12

    # the hand-written backward against autodiff of a plain-JAX version of the same loop
    def plain(x, w, b, s):
        outs, finals = [], []
        for n in range(len(cu) - 1):
            seq = jnp.concatenate([s[n].T, x[0, cu[n]:cu[n + 1]]])
            for p in range(cu[n + 1] - cu[n]):
                outs.append(jax.nn.silu((seq[p:p + width] * w.T).sum(0) + b))
            finals.append(seq[len(seq) - (width - 1):].T)
        return jnp.stack(outs), jnp.stack(finals)

    _assert_grads_match(lambda *a: (lambda y, f: (y[0], f))(
        *causal_conv1d(a[0], a[1], a[2], initial_state=a[3], output_final_state=True, cu_seqlens=cu_arr)),
        plain, (x, w, b, s), np.random.default_rng(1))


def _assert_grads_match(ours, plain, args, rng):
    """The gradients of x, weight, bias and state under random cotangents of
    (y, final state): the hand-written backward against autodiff of `plain`."""
    shapes = [o.shape for o in plain(*args)]
    cy, cf = (jnp.asarray(rng.standard_normal(shape)) for shape in shapes)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] * cy) + jnp.sum(fn(*a)[1] * cf)

    got = jax.grad(loss(ours), argnums=range(4))(*args)
    want = jax.grad(loss(plain), argnums=range(4))(*args)
    for name, g1, g2 in zip(("x", "weight", "bias", "state"), got, want):
        assert relative_error(g1, g2) < 1e-12, name


@pytest.mark.parametrize("t", [1, 2, 13], ids=lambda t: f"t{t}")
@pytest.mark.parametrize("width", [2, 4])
def test_rows_match_loop_and_grads(t, width):
    """Rows without cu_seqlens (two of them, each from its own state; T
    shorter than the state too): outputs, final states and the hand-written
    backward's gradients of x, weight, bias and state."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, t, 6)))
    w, b = jnp.asarray(rng.standard_normal((6, width))), jnp.asarray(rng.standard_normal(6))
    s = jnp.asarray(rng.standard_normal((2, 6, width - 1)))
    y, f = causal_conv1d(x, w, b, initial_state=s, output_final_state=True)
    for r in range(2):
        ref_y, ref_f = naive(x[r], w, b, s[r:r + 1], (0, t))
        assert relative_error(y[r], ref_y) < 1e-12 and relative_error(f[r], ref_f[0]) < 1e-12

    def plain(x, w, b, s):
        seq = jnp.concatenate([jnp.swapaxes(s, 1, 2), x], axis=1)
        y = jnp.stack([jax.nn.silu((seq[:, p:p + width] * w.T).sum(1) + b) for p in range(t)], axis=1)
        return y, jnp.swapaxes(seq[:, t:], 1, 2)

    _assert_grads_match(lambda *a: causal_conv1d(a[0], a[1], a[2], initial_state=a[3], output_final_state=True),
                        plain, (x, w, b, s), rng)


def test_a_wider_state_is_not_rounded_to_the_input():
    """bfloat16 x with a float32 conv state: the state's values enter the
    products as they are. dweight (float32, a sum of inputs times dz, most
    of them the state's at T=3, W=4) matches float64 to float32 rounding;
    the state rounded to bfloat16 was off by 7.9e-4."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 8)).astype(jnp.bfloat16)
    state = rng.standard_normal((1, 8, 3)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    ct = rng.standard_normal((1, 3, 8)).astype(jnp.bfloat16).astype(np.float32)  # y's cotangent is bfloat16

    def loss(weight):
        y, _ = causal_conv1d(jnp.asarray(x), weight, initial_state=jnp.asarray(state), activation=None)
        return jnp.sum(y.astype(jnp.float32) * ct)

    dweight = np.asarray(jax.grad(loss)(jnp.asarray(w)), np.float64)
    xx = np.concatenate([np.swapaxes(state, 1, 2).astype(np.float64), np.asarray(x, np.float64)], axis=1)
    want = np.stack([np.sum(xx[:, j:j + 3] * ct, axis=(0, 1)) for j in range(4)], axis=1)
    assert relative_error(dweight, want) < 1e-5


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_the_backward_keeps_only_the_inputs(packed, activation):
    """Neither form keeps its float32 pre-activation [B, T, D] for the
    backward (0.75 GiB a GDN layer at 32,768 tokens): it is formed again
    from the inputs where the activation needs it."""
    t, d = 16, 8
    x = jnp.ones((1, t, d), jnp.bfloat16)
    w = jnp.ones((d, 4), jnp.float32)
    cu = jnp.array([0, 5, t], jnp.int32) if packed else None
    _, vjp = jax.vjp(lambda x, w: causal_conv1d(x, w, cu_seqlens=cu, activation=activation)[0], x, w)
    kept = [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(vjp)]
    assert ((1, t, d), jnp.bfloat16) in kept  # x itself
    assert not any(dtype == jnp.float32 and shape[-2:] == (t, d) for shape, dtype in kept), kept


def test_batch_rows_and_no_activation():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 7, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
    y, f = causal_conv1d(x, w, activation=None, output_final_state=True)
    for r in range(2):
        ref_y, ref_f = naive(x[r], w, np.zeros(5), np.zeros((1, 5, 3)), (0, 7), silu=False)
        assert relative_error(y[r], ref_y) < 1e-6 and relative_error(f[r], ref_f[0]) < 1e-6
    assert y.dtype == jnp.float32 and f.shape == (2, 5, 3)


def test_decode_steps_continue_the_prefill():
    x, w, b, s = inputs(12, 6, 4, 1)
    y, _ = causal_conv1d(x, w, b, initial_state=s)
    y8, state = causal_conv1d(x[:, :8], w, b, initial_state=s, output_final_state=True)
    steps = []
    for t in range(8, 12):
        yt, state = causal_conv1d_update(x[:, t], state, w, b)
        steps.append(yt)
    assert relative_error(jnp.concatenate([y8, jnp.stack(steps, 1)], 1), y) < 1e-12


def test_packed_sequences_do_not_leak():
    x, w, b, s = inputs(20, 4, 4, 2)
    cu = jnp.asarray([0, 9, 20], jnp.int32)
    y1, _ = causal_conv1d(x, w, b, initial_state=s, cu_seqlens=cu)
    y2, _ = causal_conv1d(x.at[:, :9].multiply(5.0), w, b, initial_state=s, cu_seqlens=cu)
    np.testing.assert_array_equal(np.asarray(y1[:, 9:]), np.asarray(y2[:, 9:]))


@pytest.mark.parametrize("kw, err, match", [
    (dict(weight=jnp.ones((5, 4))), ValueError, r"weight: expected \[D=6, W\]"),
    (dict(weight=jnp.ones((6, 1))), ValueError, "kernel width W must be >= 2"),
    (dict(bias=jnp.ones(3)), ValueError, r"bias: expected \[D=6\]"),
    (dict(activation="gelu"), ValueError, "activation: expected one of"),
    (dict(initial_state=jnp.ones((1, 6, 2))), ValueError, r"initial_state: expected \[N, D, W - 1\]"),
    (dict(cu_seqlens=jnp.asarray([0, 5, 4, 10])), ValueError, "cu_seqlens: must be non-decreasing"),
    (dict(x=jnp.ones((1, 10, 6), jnp.int32)), TypeError, "x: expected a floating array"),
])
def test_bad_input_is_named(kw, err, match):
    args = dict(x=jnp.ones((1, 10, 6)), weight=jnp.ones((6, 4)))
    args.update(kw)
    x, w = args.pop("x"), args.pop("weight")
    with pytest.raises(err, match=match):
        causal_conv1d(x, w, **args)
