"""The contract every implementation of the op meets, as one test base.

An implementation's test class subclasses `ImplementationContract` and sets
what it is and which cases it runs (small ones for the interpreted
kernels); the base runs each against the float64 oracle (metric and
tolerances: helpers.py). A new backend is covered by one more subclass.
Class attributes name the cases a test takes (`over`), read by this
directory's conftest.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gdnx.measure import relative_error
from tests.ops.delta_rule.cases import Case, make_inputs
from tests.ops.delta_rule.helpers import NAMES, check_against_oracle, chunk_op, run_oracle


def over(attribute: str):
    """Parametrize a contract test by the subclass's `attribute` (a list of
    cases, or of other values), as `case`."""
    def mark(fn):
        fn.contract_cases = attribute
        return fn
    return mark


@pytest.mark.usefixtures("x64")  # float64 references
class ImplementationContract:
    implementation: str
    cases: list[Case] = []             # against the oracle, gradients included
    recompute_cases: list[Case] = []   # again with residuals="recompute" (chunked implementations)
    matmul_bf16 = False                # takes matmul_dtype="bfloat16"
    gradient_peer: str | None = None   # an implementation whose backward it must match to float32 rounding
    tiles: list = []                   # non-default tiles (kernels)
    per_channel = False                # KDA (chunk_kda, g [B, T, HV, K]) rather than GDN

    def case(self, name, **kw) -> Case:
        """A case of this class's op."""
        return Case(name, per_channel=self.per_channel, **kw)

    @property
    def op(self):
        return chunk_op(self.per_channel)

    @over("cases")
    def test_matches_oracle(self, case):
        check_against_oracle(case, self.implementation)

    @over("recompute_cases")
    def test_recompute_policy_matches_oracle(self, case):
        check_against_oracle(case, self.implementation, residuals="recompute")

    def test_forward_without_grad(self):
        """The plain forward (no residual outputs), packed, gives the oracle's numbers."""
        case = self.case("fwd", b=1, t=40, dk=64, dv=64, chunk=16, cu_seqlens=(0, 17, 40))
        q, k, v, g, beta, h0 = make_inputs(case)
        o, final = self.op(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          chunk_size=16, cu_seqlens=jnp.asarray(case.cu_seqlens),
                                          implementation=self.implementation)
        ref_o, ref_f = run_oracle(case, (q, k, v, g, beta, h0))
        assert relative_error(o, ref_o) < 1e-5 and relative_error(final, ref_f) < 1e-5

    def test_gradients_match_peer(self):
        """The backward against another implementation's on the same float32
        inputs: the same algebra, so they agree to float32 rounding."""
        if self.gradient_peer is None:
            pytest.skip("no peer implementation to compare the backward with")
        case = self.case("vs_peer", b=2, t=50, dk=64, dv=64, chunk=16, l2norm=True)
        args = make_inputs(case)

        def grads(impl):
            def loss(*a):
                o, f = self.op(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=16,
                                              use_qk_l2norm=True, implementation=impl)
                return jnp.sum(jnp.sin(o)) + jnp.sum(f * f)
            return jax.grad(loss, argnums=range(6))(*args)

        for name, x, y in zip(NAMES, grads(self.implementation), grads(self.gradient_peer)):
            assert relative_error(x, y) < 1e-5, name

    def test_bf16_matmul_operands(self):
        """matmul_dtype=bfloat16 rounds matmul operands: bfloat16-level errors
        (2e-2 tolerance, as for bfloat16 inputs), every gradient included."""
        if not self.matmul_bf16:
            pytest.skip("matmul_dtype applies to the chunked implementations")
        case = self.case("mm_bf16", b=1, t=64, dk=64, dv=64, chunk=32, l2norm=True, cu_seqlens=(0, 20, 64))
        errs = check_against_oracle(case, self.implementation, tol=2e-2, matmul_dtype="bfloat16")
        # the knob must bite: float32 inputs land near bfloat16 rounding, not at 1e-7
        assert errs["o"] > 1e-4

    def test_chunk_states(self):
        """output_chunk_states: the state after every chunk (T = 40 in chunks
        of 16: after tokens 16, 32 and 40) is the oracle's final state over
        the tokens up to there, to the op's float32 tolerance; the last one
        is the final state."""
        case = self.case("states", b=2, t=40, dk=32, dv=16, chunk=16, l2norm=True)
        q, k, v, g, beta, h0 = make_inputs(case)
        o, final, states = self.op(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  chunk_size=16, use_qk_l2norm=True, output_chunk_states=True,
                                                  implementation=self.implementation)
        assert states.shape == (2, 3, case.hv, case.dk, case.dv)
        for j, end in enumerate((16, 32, 40)):
            _, ref = run_oracle(self.case("prefix", b=2, t=end, dk=32, dv=16, l2norm=True),
                                (q[:, :end], k[:, :end], v[:, :end], g[:, :end], beta[:, :end], h0))
            assert relative_error(states[:, j], ref) < 1e-5, end
        assert relative_error(states[:, -1], final) < 1e-6

    @over("tiles")
    def test_tiles(self, case):
        """Tiles off the default entry (K = V = 64: several blocks of each kind)."""
        check_against_oracle(self.case("tiles", b=1, t=40, dk=64, dv=64, chunk=16), self.implementation, tiles=case)


KERNELS = ["pallas_tpu", "pallas_gpu"]


class KernelContract(ImplementationContract):
    """What both kernels of either op run: its small cases (set by the
    subclass), both residual policies, bfloat16 products, and the backward
    against xla's."""
    matmul_bf16 = True
    gradient_peer = "xla"
