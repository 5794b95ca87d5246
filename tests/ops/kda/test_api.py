"""KDA (chunk_kda, recurrent_kda): the xla implementation and the token
recurrence (the kernels: test_kernels.py here) against the float64 oracle through the shared contract
(tests/ops/delta_rule/contract.py), and what the per-channel gate adds: exactness for any
g <= 0 at every chunk size, the hand-written VJP against autodiff of the
same forward, GDN as the case of a gate equal across K, the gate functions
and their gradients, decode, and the errors (metric and tolerances:
helpers.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.measure import relative_error
from gdnx.ops import chunk_gated_delta_rule, chunk_kda, kda_gate, recurrent_kda
from tests.helpers.tiers import fast_only
from tests.ops.delta_rule.cases import KDA_CASES, Case, by_name, make_inputs
from tests.ops.delta_rule.contract import ImplementationContract
from tests.ops.delta_rule.helpers import NAMES, check_against_oracle

pytestmark = pytest.mark.usefixtures("x64")


class TestKdaXla(ImplementationContract):
    implementation = "xla"
    per_channel = True
    cases = KDA_CASES
    recompute_cases = by_name(KDA_CASES, "kda_packed_c32", "kda_bf16_c64")
    matmul_bf16 = True
    gradient_peer = "reference"


class TestKdaReference(ImplementationContract):
    implementation = "reference"
    per_channel = True
    cases = by_name(KDA_CASES, "kda_gva2_T63_c16", "kda_packed_c32", "kda_bursts_c128")


@pytest.mark.parametrize("chunk, gates", fast_only([(16, "bursts"), (32, "strong"), (64, "bursts"), (128, "channels")],
                                              lambda case: case == (64, "bursts")))
def test_any_gate_at_every_chunk_size(chunk, gates):
    """Hard gates (-30 .. -69 per step) between barely decaying ones, per
    token and per channel, keep float32 within 1e-5 of the oracle at every
    chunk size, every gradient included."""
    check_against_oracle(Case(f"{gates}_c{chunk}", b=1, t=2 * chunk, chunk=chunk, gates=gates, per_channel=True),
                         "xla")


def test_float64_algebra_is_exact():
    """In float64 the chunked algebra agrees with the recurrence to ~1e-14."""
    case = Case("f64", t=150, chunk=64, cu_seqlens=(0, 20, 21, 150), b=1, l2norm=True, per_channel=True)
    check_against_oracle(case, "xla", state_dtype="float64", decay_dtype="float64")


def test_hand_written_vjp_matches_autodiff():
    """The custom VJP against plain autodiff of the very same forward."""
    from gdnx.ops.delta_rule import xla
    from gdnx.ops.kda.math import VARIANT

    case = Case("vjp", b=1, t=90, chunk=32, cu_seqlens=(0, 30, 30, 90), per_channel=True)
    q, k, v, g, beta, h0 = (x.astype(jnp.float64) for x in make_inputs(case))
    cu = jnp.asarray(case.cu_seqlens, jnp.int32)

    def loss(hand_written, *xs):
        o, f = xla.run(VARIANT, *xs, cu_seqlens=cu, chunk_size=32, scale=0.3, state_dtype=jnp.float64,
                       decay_dtype=jnp.float64, use_qk_l2norm=False, hand_written_vjp=hand_written)
        return jnp.sum(jnp.sin(o)) + jnp.sum(f * f)

    a = jax.grad(lambda *xs: loss(True, *xs), argnums=range(6))(q, k, v, g, beta, h0)
    b = jax.grad(lambda *xs: loss(False, *xs), argnums=range(6))(q, k, v, g, beta, h0)
    for name, x, y in zip(NAMES, a, b):
        assert relative_error(x, y) < 1e-12, name


def test_gdn_is_kda_with_a_gate_equal_across_channels():
    """A per-head gate broadcast over K gives GDN's outputs, state and
    gradients (the gate's gradient summed over K), to float32 rounding."""
    case = Case("gdn", b=1, t=70, chunk=32, cu_seqlens=(0, 30, 70), l2norm=True)
    q, k, v, g, beta, h0 = make_inputs(case)
    cu = jnp.asarray(case.cu_seqlens, jnp.int32)

    def loss(op, q, k, v, g, beta, h0):
        o, f = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=32, cu_seqlens=cu,
                  use_qk_l2norm=True)
        return jnp.sum(jnp.sin(o)) + jnp.sum(f * f), (o, f)

    args = (q, k, v, g, beta, h0)
    (_, gdn), gdn_grads = jax.value_and_grad(lambda *a: loss(chunk_gated_delta_rule, *a), argnums=range(6),
                                             has_aux=True)(*args)
    def wide(q, k, v, g, beta, h0):
        return loss(chunk_kda, q, k, v, jnp.broadcast_to(g[..., None], g.shape + (case.dk,)), beta, h0)

    (_, kda), kda_grads = jax.value_and_grad(wide, argnums=range(6), has_aux=True)(*args)
    for x, y in zip(kda, gdn):
        assert relative_error(x, y) < 1e-6
    for name, x, y in zip(NAMES, kda_grads, gdn_grads):
        assert relative_error(x, y) < 1e-5, name


def _gate64(f, a_log, dt_bias, lower_bound):
    """The gate functions in float64 numpy, by their definitions, with their
    gradients by hand: (g, dg/df, dg/dA_log) elementwise."""
    x = f + dt_bias
    rate = np.exp(a_log)[:, None]
    if lower_bound is None:
        soft = np.logaddexp(0.0, x)
        sig = 1 / (1 + np.exp(-x))
        return -rate * soft, -rate * sig, -rate * soft
    s = 1 / (1 + np.exp(-rate * x))
    return lower_bound * s, lower_bound * s * (1 - s) * rate, lower_bound * s * (1 - s) * rate * x


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_functions_and_their_gradients(lower_bound):
    """kda_gate against its definition (float64): values and the gradients
    of f, A_log and dt_bias, including inputs where softplus is linear
    (x > 20) and the sigmoid saturates."""
    rng = np.random.default_rng(0)
    h, kd = 3, 8
    f = rng.standard_normal((2, 5, h, kd)) * 10
    a_log = np.log(rng.uniform(1.0, 16.0, h))
    dt_bias = rng.standard_normal(h * kd)
    ct = rng.standard_normal(f.shape)
    want, dfx, dax = _gate64(f, a_log, dt_bias.reshape(h, kd), lower_bound)

    def loss(f, a_log, dt_bias):
        return jnp.sum(kda_gate(f, a_log, dt_bias, lower_bound=lower_bound, dtype=jnp.float64) * ct)

    got = kda_gate(jnp.asarray(f), jnp.asarray(a_log), jnp.asarray(dt_bias), lower_bound=lower_bound,
                   dtype=jnp.float64)
    assert relative_error(got, want) < 1e-12
    df, da, db = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x) for x in (f, a_log, dt_bias)))
    assert relative_error(df, ct * dfx) < 1e-12
    assert relative_error(db, (ct * dfx).sum((0, 1)).reshape(-1)) < 1e-12
    assert relative_error(da, (ct * dax).sum((0, 1, 3))) < 1e-12
    if lower_bound is not None:
        assert float(got.min()) >= lower_bound


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_in_the_op(lower_bound):
    """A_log given: the op applies the gate to the raw input it takes as g,
    with the values and gradients of applying kda_gate first."""
    case = Case("gate", b=1, t=40, chunk=16, per_channel=True)
    q, k, v, _, beta, h0 = make_inputs(case)
    rng = np.random.default_rng(2)
    f = jnp.asarray(rng.standard_normal((1, 40, case.hv, case.dk)), jnp.float32)
    a_log = jnp.asarray(np.log(rng.uniform(1.0, 16.0, case.hv)), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(case.hv * case.dk), jnp.float32)

    def inside(f, a_log, dt_bias):
        o, s = chunk_kda(q, k, v, f, beta, initial_state=h0, output_final_state=True, chunk_size=16, A_log=a_log,
                         dt_bias=dt_bias, lower_bound=lower_bound)
        return jnp.sum(jnp.sin(o)) + jnp.sum(s * s)

    def outside(f, a_log, dt_bias):
        g = kda_gate(f, a_log, dt_bias, lower_bound=lower_bound)
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
        return jnp.sum(jnp.sin(o)) + jnp.sum(s * s)

    a = jax.value_and_grad(inside, argnums=(0, 1, 2))(f, a_log, dt_bias)
    b = jax.value_and_grad(outside, argnums=(0, 1, 2))(f, a_log, dt_bias)
    assert relative_error(a[0], b[0]) < 1e-6
    for x, y in zip(a[1], b[1]):
        assert relative_error(x, y) < 1e-6


def test_recurrent_and_decode_match_chunk():
    """recurrent_kda over the sequence, and one token per call carrying the
    state, give chunk_kda's output and state; output_token_states holds the
    state after every token."""
    case = Case("rec", t=37, chunk=16, l2norm=True, per_channel=True)
    q, k, v, g, beta, h0 = make_inputs(case)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o1, f1, states = recurrent_kda(q, k, v, g, beta, output_token_states=True, **kw)
    o2, f2 = chunk_kda(q, k, v, g, beta, chunk_size=16, **kw)
    assert relative_error(o1, o2) < 1e-5 and relative_error(f1, f2) < 1e-5
    assert relative_error(states[:, -1], f1) < 1e-7
    state, outs = h0, []
    for i in range(6):
        sl = slice(i, i + 1)
        o, state = recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state,
                                 output_final_state=True, use_qk_l2norm=True)
        outs.append(o)
    assert relative_error(jnp.concatenate(outs, 1), o1[:, :6]) < 1e-6
    assert relative_error(state, states[:, 5]) < 1e-6


@pytest.fixture
def args():
    q, k, v, g, beta, _ = make_inputs(Case("api", b=1, t=20, dk=16, dv=16, per_channel=True))
    return q, k, v, g, beta


@pytest.mark.parametrize(
    "change, kw, err, match",
    [
        (lambda a: a[:3] + (a[3][..., 0],) + a[4:], {}, ValueError,
         r"g: expected \[B, T, HV, K\] = \(1, 20, 4, 16\), got shape \(1, 20, 4\); a per-head gate"),
        (lambda a: a[:3] + (a[3][..., :8],) + a[4:], {}, ValueError, "its last dimension must be K"),
        (None, dict(implementation="triton"), ValueError, r"implementation: expected None or one of \["),
        (None, dict(implementation="xla", interpret=True), ValueError, "interpret: applies to the Pallas"),
        (None, dict(recurrent=True, implementation="xla"), ValueError, r"implementation: expected None or one of \['reference'\]"),
        (None, dict(dt_bias=jnp.zeros(64)), ValueError, "dt_bias: given without A_log"),
        (None, dict(A_log=jnp.zeros(3)), ValueError, r"A_log: expected H = 4 values"),
        (None, dict(A_log=jnp.zeros(4), dt_bias=jnp.zeros(16)), ValueError, r"dt_bias: expected H \* K = 64"),
        (None, dict(A_log=jnp.zeros(4), lower_bound=5.0), ValueError, "lower_bound: expected a negative float"),
        (None, dict(chunk_size=8), ValueError, "chunk_size: expected one of"),
    ],
)
def test_bad_input_is_named(args, change, kw, err, match):
    if change is not None:
        args = change(args)
    op = recurrent_kda if kw.pop("recurrent", False) else chunk_kda
    with pytest.raises(err, match=match):
        op(*args, **kw)


def test_gdn_rejects_a_per_channel_gate(args):
    q, k, v, g, beta = args
    with pytest.raises(ValueError, match=r"g: expected \[B, T, HV\] .* a per-channel gate \[B, T, HV, K\] is chunk_kda"):
        chunk_gated_delta_rule(q, k, v, g, beta)
