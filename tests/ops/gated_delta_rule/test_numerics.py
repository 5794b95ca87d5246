"""The xla implementation and the token recurrence against the float64
oracle (the shared contract, contract.py), and what only the chunked
algebra has to show: chunk sizes, float64 exactness, the hand-written VJP,
padding, packing, traced offsets (metric and tolerances: helpers.py)."""

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.measure import relative_error
from gdnx.ops import chunk_gated_delta_rule
from tests.ops.delta_rule.cases import CASES, Case, by_name, make_inputs
from tests.ops.delta_rule.contract import ImplementationContract
from tests.ops.delta_rule.helpers import NAMES, check_against_oracle, run_op, run_oracle

pytestmark = pytest.mark.usefixtures("x64")


class TestXla(ImplementationContract):
    implementation = "xla"
    cases = CASES
    recompute_cases = by_name(CASES, "gva2_T63_c16", "packed", "bf16")
    matmul_bf16 = True  # its backward is checked against autodiff below


class TestReference(ImplementationContract):
    implementation = "reference"
    cases = CASES


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_decays_of_exactly_zero(per_channel):
    """g = -inf (a decay of exactly zero, valid: g <= 0) and gates whose chunk
    sums overflow float32 give the recurrence's outputs, final states and
    gradients (the chunked forms once turned them into NaN from that chunk on)."""
    check_against_oracle(Case("zeros", b=1, t=40, chunk=16, gates="zeros", per_channel=per_channel), "xla")


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 32, 64, 128])
def test_strong_decays_every_chunk_size(chunk):
    """Gates in [-69, -31] mixed with zeros keep float32 at 1e-5 at any chunk
    size: pairwise decays come from segment sums, not differences of large
    cumulative sums (which measured 1e-4 at chunk 64)."""
    check_against_oracle(Case(f"strong_c{chunk}", b=1, t=2 * chunk, chunk=chunk, gates="strong"), "xla")


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 32, 64, 128])
def test_float64_algebra_is_exact(chunk):
    """In float64 the chunked algebra agrees with the recurrence to ~1e-14."""
    case = Case(f"f64_c{chunk}", t=150, chunk=chunk, cu_seqlens=(0, 20, 21, 150), b=1, l2norm=True)
    check_against_oracle(case, "xla", state_dtype="float64", decay_dtype="float64")


@pytest.mark.slow
def test_hand_written_vjp_matches_autodiff():
    """The custom VJP against plain autodiff of the very same forward."""
    from gdnx.ops.delta_rule import xla
    from gdnx.ops.gated_delta_rule.math import VARIANT

    case = Case("vjp", b=1, t=90, chunk=32, cu_seqlens=(0, 30, 30, 90))
    q, k, v, g, beta, h0 = (x.astype(jnp.float64) for x in make_inputs(case))
    cu = jnp.asarray(case.cu_seqlens, jnp.int32)

    def loss(hand_written, *xs):
        o, f = xla.run(
            VARIANT, *xs, cu_seqlens=cu, chunk_size=32, scale=0.3, state_dtype=jnp.float64,
            decay_dtype=jnp.float64, hand_written_vjp=hand_written)
        return jnp.sum(jnp.sin(o)) + jnp.sum(f * f)

    a = jax.grad(lambda *xs: loss(True, *xs), argnums=range(6))(q, k, v, g, beta, h0)
    b = jax.grad(lambda *xs: loss(False, *xs), argnums=range(6))(q, k, v, g, beta, h0)
    for name, x, y in zip(NAMES, a, b):
        assert relative_error(x, y) < 1e-12, name


@pytest.mark.slow
def test_check_grads_tiny():
    """Finite differences on a tiny float64 case (reverse mode only)."""
    case = Case("tiny", b=1, t=20, hk=1, hv=2, dk=8, dv=4, chunk=16)
    q, k, v, g, beta, h0 = (x.astype(jnp.float64) for x in make_inputs(case))

    def f(q, k, v, g, beta, h0):
        o, fs = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       chunk_size=16, state_dtype="float64", decay_dtype="float64")
        return o, fs

    jax.test_util.check_grads(f, (q, k, v, g, beta, h0), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_padding_is_inert():
    """T not a multiple of the chunk: 50 tokens padded to 64 give what 4 chunks
    of 16 minus 14 padded tokens give, to float64 rounding."""
    case = Case("pad", b=2, t=50, chunk=64)
    args = tuple(x.astype(jnp.float64) for x in make_inputs(case))
    o64, f64 = run_op(case, "xla", args, "float64", "float64")
    o16, f16 = run_op(Case("pad16", b=2, t=50, chunk=16), "xla", args, "float64", "float64")
    assert relative_error(o64, o16) < 1e-12 and relative_error(f64, f16) < 1e-12


@pytest.mark.slow
def test_packed_sequences_do_not_leak():
    """Changing one packed sequence leaves the others' outputs and states alone."""
    case = Case("leak", b=1, t=96, chunk=32, cu_seqlens=(0, 40, 96))
    q, k, v, g, beta, h0 = make_inputs(case)
    o1, f1 = run_op(case, "xla", (q, k, v, g, beta, h0))
    v2 = v.at[:, 40:].multiply(-3.0)
    o2, f2 = run_op(case, "xla", (q, k, v2, g, beta, h0))
    np.testing.assert_array_equal(np.asarray(o1[:, :40]), np.asarray(o2[:, :40]))
    np.testing.assert_array_equal(np.asarray(f1[0]), np.asarray(f2[0]))
    assert relative_error(o1[:, 40:], o2[:, 40:]) > 0.5


@pytest.mark.slow
def test_jit_with_traced_cu_seqlens():
    case = Case("jit", b=1, t=70, chunk=16, cu_seqlens=(0, 33, 70))
    args = make_inputs(case)

    @jax.jit
    def f(cu, *a):
        q, k, v, g, beta, h0 = a
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                      output_final_state=True, chunk_size=16)

    o, final = f(jnp.asarray(case.cu_seqlens, jnp.int32), *args)
    ref_o, ref_f = run_oracle(case, args)
    assert relative_error(o, ref_o) < 1e-5 and relative_error(final, ref_f) < 1e-5


@pytest.mark.slow
def test_recurrent_op_matches_chunk_op():
    from gdnx.ops import recurrent_gated_delta_rule

    case = Case("rec", t=37, chunk=16, l2norm=True)
    q, k, v, g, beta, h0 = make_inputs(case)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o1, f1 = recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o2, f2 = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **kw)
    assert relative_error(o1, o2) < 1e-5 and relative_error(f1, f2) < 1e-5
    # decode: one token at a time carries the state across calls
    state = h0
    outs = []
    for i in range(q.shape[1]):
        sl = slice(i, i + 1)
        o, state = recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                              initial_state=state, output_final_state=True, use_qk_l2norm=True)
        outs.append(o)
    assert relative_error(jnp.concatenate(outs, 1), o1) < 1e-6 and relative_error(state, f1) < 1e-6
