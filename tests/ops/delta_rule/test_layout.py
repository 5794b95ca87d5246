import jax.numpy as jnp
import numpy as np

from gdnx.ops.delta_rule.layout import from_slots, make_plan, to_slots


def test_plain_plan_pads_the_end():
    plan = make_plan(2, 10, 4)
    assert plan.num_chunks == 3
    x = jnp.arange(20.0).reshape(2, 10)
    y = to_slots(x, plan)
    assert y.shape == (2, 12) and np.all(np.asarray(y[:, 10:]) == 0)
    np.testing.assert_array_equal(from_slots(y, plan), x)
    assert np.asarray(plan.reset)[:, 0].tolist() == [True, False, False]
    assert np.asarray(plan.last)[:, 1].tolist() == [False, False, True]


def test_packed_plan_starts_each_sequence_on_a_chunk():
    # lengths 5, 0 (empty), 9, 2 with chunks of 4 -> 2 + 0 + 3 + 1 chunks
    cu = jnp.array([0, 5, 5, 14, 16])
    plan = make_plan(1, 16, 4, cu)
    x = jnp.arange(1.0, 17.0)[None]
    slots = np.asarray(to_slots(x, plan))[0]
    assert slots[:8].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert slots[8:20].tolist() == [6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0, 0]
    assert slots[20:24].tolist() == [15, 16, 0, 0]
    np.testing.assert_array_equal(from_slots(to_slots(x, plan), plan), x)
    used = 6
    assert np.asarray(plan.reset)[:used, 0].tolist() == [True, False, True, False, False, True]
    assert np.asarray(plan.last)[:used, 0].tolist() == [False, True, False, False, True, True]
    assert np.asarray(plan.seq)[:used, 0].tolist() == [0, 0, 2, 2, 2, 3]
    assert np.asarray(plan.nonempty).tolist() == [True, False, True, True]
    # chunks past the last sequence carry nothing
    assert not np.asarray(plan.reset)[used:].any() and not np.asarray(plan.last)[used:].any()
