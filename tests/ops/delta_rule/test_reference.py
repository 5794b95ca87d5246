"""The token-by-token delta rule (delta_rule/reference.py): a decode step
(one token a row, no packed sequences) runs the step alone; it equals the
float64 oracle and the packed-sequence scan it replaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdnx.measure import relative_error
from gdnx.ops.delta_rule.reference import recurrent_reference
from tests.ops.delta_rule.oracle import oracle


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_one_token_step_equals_the_oracle_and_the_scan(per_channel):
    r, hk, hv, dk, dv = 3, 2, 4, 16, 8
    keys = jax.random.split(jax.random.key(0), 6)
    q, k = (jax.random.normal(x, (r, 1, hk, dk)) for x in keys[:2])
    v = jax.random.normal(keys[2], (r, 1, hv, dv))
    g = -jax.random.uniform(keys[3], (r, 1, hv, dk) if per_channel else (r, 1, hv))
    beta = jax.random.uniform(keys[4], (r, 1, hv))
    h0 = jax.random.normal(keys[5], (r, hv, dk, dv))
    common = dict(scale=dk ** -0.5, state_dtype=jnp.float32, decay_dtype=jnp.float32)
    o, final, states = recurrent_reference(q, k, v, g, beta, h0, cu_seqlens=None, token_states=True, **common)
    ref_o, ref_final = oracle(*(np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0)), scale=dk ** -0.5)
    # float32 arithmetic against float64: a few roundings of O(1) values
    assert relative_error(o, ref_o) < 1e-6 and relative_error(final, ref_final) < 1e-6
    np.testing.assert_array_equal(states[:, 0], final)
    # the same rows as packed one-token sequences take the scan
    flat = lambda x: x.reshape(1, r, *x.shape[2:])
    scan_o, scan_final = recurrent_reference(flat(q), flat(k), flat(v), flat(g), flat(beta), h0,
                                             cu_seqlens=jnp.arange(r + 1, dtype=jnp.int32), **common)
    assert relative_error(o.reshape(scan_o.shape), scan_o) < 1e-6 and relative_error(final, scan_final) < 1e-6
