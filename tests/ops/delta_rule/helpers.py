"""Running the op against the float64 oracle, for every test that does.

Metric: relative error ||x - ref|| / ||ref|| for the output, the final state
and the gradients of q, k, v, g, beta and the initial state.

Tolerances:
- float32 inputs, float32 state: 1e-5. Float32 rounding over a chunk's
  matmuls and the state recursion lands near 1e-7..1e-6; a wrong term in the
  algebra (a sign, a missing decay, a leak across a boundary) is >= 1e-2.
- bfloat16 inputs, float32 state: 2e-2. The output and the gradients are
  rounded to bfloat16 (relative step 2^-8 = 3.9e-3); the state is not.
- float64 everywhere: 1e-10, the algebra itself.

A tensor whose reference norm is below FLOOR = 1e-6 is judged by its
absolute error against tol * FLOOR (with gates <= -30 everywhere, dg is
~1e-14 and float32 leaves ~1e-14 of absolute error in it). The inputs'
gradients are O(1..100) otherwise, so the floor never loosens them.

The oracle runs in float64: a module using these needs the `x64` fixture
(tests/ops/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.measure import relative_error
from gdnx.ops import chunk_gated_delta_rule, chunk_kda
from tests.ops.delta_rule.cases import Case, make_inputs
from tests.ops.delta_rule.oracle import oracle, oracle_packed

TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float64": 1e-10}
FLOOR = 1e-6
NAMES = ("q", "k", "v", "g", "beta", "h0")


def chunk_op(per_channel: bool):
    """The chunked op of a gate: KDA's for a per-channel one, GDN's otherwise."""
    return chunk_kda if per_channel else chunk_gated_delta_rule


def run_op(case: Case, implementation: str, args, state_dtype="float32", decay_dtype="float32", **op_kw):
    q, k, v, g, beta, h0 = args
    cu = None if case.cu_seqlens is None else jnp.asarray(case.cu_seqlens, jnp.int32)
    return chunk_op(case.per_channel)(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm=case.l2norm, chunk_size=case.chunk, state_dtype=state_dtype,
        decay_dtype=decay_dtype, implementation=implementation, **op_kw)


def run_oracle(case: Case, args):
    q, k, v, g, beta, h0 = args
    if case.cu_seqlens is None:
        return oracle(q, k, v, g, beta, h0, use_qk_l2norm=case.l2norm)
    return oracle_packed(q, k, v, g, beta, h0, case.cu_seqlens, use_qk_l2norm=case.l2norm)


def vjp_all(fn, args, cotangents):
    """Gradients of <fn(args), cotangents> for every array argument."""
    idx = [i for i, a in enumerate(args) if a is not None]

    def f(*xs):
        full = list(args)
        for i, x in zip(idx, xs):
            full[i] = x
        return fn(full)

    out, pull = jax.vjp(f, *(args[i] for i in idx))
    ct = tuple(c.astype(o.dtype) for c, o in zip(cotangents, out))
    grads = pull(ct)
    return out, {NAMES[i]: gr for i, gr in zip(idx, grads)}


def check_against_oracle(case: Case, implementation: str, state_dtype="float32", decay_dtype="float32", tol=None,
                         **op_kw):
    args = make_inputs(case)
    if state_dtype == "float64":
        args = tuple(None if a is None else a.astype(jnp.float64) for a in args)
    tol = tol or TOL[str(args[0].dtype)]
    rng = np.random.default_rng(1)
    ref_out = run_oracle(case, args)
    cts = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in ref_out)

    (o, final), grads = vjp_all(
        lambda a: run_op(case, implementation, a, state_dtype, decay_dtype, **op_kw), args, cts)
    (ref_o, ref_final), ref_grads = vjp_all(
        lambda a: run_oracle(case, [None if x is None else x.astype(jnp.float64) for x in a]), args, cts)

    assert o.dtype == args[0].dtype
    assert final.dtype == jnp.dtype(state_dtype)
    errs = {"o": relative_error(o, ref_o, FLOOR), "final": relative_error(final, ref_final, FLOOR)}
    errs.update({f"d{n}": relative_error(grads[n], ref_grads[n], FLOOR) for n in grads})
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{case} {implementation}: relative errors above {tol}: {bad} (all: {errs})"
    return errs
