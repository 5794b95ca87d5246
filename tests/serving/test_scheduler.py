"""The Scheduler alone (no model): slots taken lowest first, prefill
groups, abort in every state, reset, and the prefix cache's chain keys."""

import builtins

import numpy as np
import pytest

from gdnx.serving.config import EngineConfig, EngineShapes
from gdnx.serving.output import Output
from gdnx.serving.params import SamplingParams
from gdnx.serving.prefix_cache import Block, CacheEntries, PrefixCache
from gdnx.serving.request import Request, RequestStatus
from gdnx.serving.scheduler import Scheduler

S = RequestStatus


def _scheduler(slots=2, batch_invariant=False) -> Scheduler:
    config = EngineConfig(max_slots=slots, max_length=16, block_size=4, max_prefill_batch=slots,
                          batch_invariant=batch_invariant)
    shapes = EngineShapes(block_size=4, padded_length=16, capacity=17, buckets=(4, 8, 16), decode_rows=(1, slots),
                          prefill_batches=(1, slots))
    return Scheduler(config, shapes, CacheEntries(row_axes=(0,), is_state=(True,), rings=(None,), capacity=17))


def _request(i: int, length: int = 3) -> Request:
    params = SamplingParams(max_tokens=4)
    return Request(i, list(range(1, length + 1)), params, 0, Output(params, None, ()))


def test_requests_take_the_lowest_free_slot_and_wait_for_one():
    s = _scheduler()
    reqs = [_request(i) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert s.admit() == []
    assert [r.slot for r in reqs] == [0, 1, None] and reqs[2].status is S.WAITING
    assert s.running == 2 and s.waiting == 1 and not s.can_admit
    s.abort(0)
    assert s.can_admit
    s.admit()
    assert reqs[2].slot == 0 and reqs[2].status is S.PREFILLING


def test_prefill_groups_by_bucket_in_the_smallest_batch_that_holds_them():
    s = _scheduler(slots=4)
    for i, n in enumerate((3, 6, 2, 4)):
        s.add(_request(i, n))
    s.admit()
    groups = [([r.id for r, _ in g], length) for g, length in s.prefill_groups()]
    assert groups == [([0, 2, 3], 4), ([1], 8)]  # three prompts in a batch of 4 (one row padding)
    invariant = _scheduler(slots=4, batch_invariant=True)
    for i, n in enumerate((3, 6)):
        invariant.add(_request(i, n))
    invariant.admit()
    assert [([r.id for r, _ in g], n) for g, n in invariant.prefill_groups()] == [([0, 1], 4)]


def test_abort_in_every_state():
    s = _scheduler(slots=3)
    reqs = [_request(i) for i in range(4)]
    for r in reqs:
        s.add(r)
    s.admit()
    assert s.prefilled(reqs[1], 3) and reqs[1].status is S.RUNNING     # its prompt is through
    assert not s.prefilled(reqs[2], 1) and reqs[2].status is S.PREFILLING
    s.prefilled(reqs[0], 3)
    reqs[0].output.add(7)
    s.finish(reqs[0], "length")
    for r in reqs:  # finished, running, prefilling, waiting
        before = r.status
        got = s.abort(r.id)
        assert (got is None) == before.done
        assert r.status is (before if before.done else S.ABORTED) and r.slot is None
    assert s.running == s.waiting == 0 and not s.has_unfinished()
    assert s.abort(99) is None
    again = [_request(i) for i in range(10, 13)]
    for r in again:
        s.add(r)
    s.admit()
    assert sorted(r.slot for r in again) == [0, 1, 2]  # every slot back


def test_reset_fails_the_slot_holders_and_keeps_the_queue():
    s = _scheduler()
    reqs = [_request(i) for i in range(3)]
    for r in reqs:
        s.add(r)
    s.admit()
    dropped = s.reset("boom")
    assert dropped == reqs[:2] and all(r.status is S.FAILED and r.error == "boom" for r in dropped)
    assert reqs[2].status is S.WAITING and s.waiting == 1 and s.running == 0
    s.admit()
    assert reqs[2].slot == 0


def test_prefix_keys_chain_the_whole_prefix_with_a_digest(monkeypatch):
    """Python's hash of integers is unkeyed (a client could craft a
    collision): keys must not depend on it. With every Python hash equal,
    a prompt sharing only its second block with a cached one gets no hit."""
    cache = PrefixCache(1 << 20, 2)
    monkeypatch.setattr(builtins, "hash", lambda x: 0)
    a, b = [1, 2, 3, 4], [9, 9, 3, 4]
    for key, j in zip(cache.keys(a, 2), range(2)):
        cache.put(key, Block(tuple(a[2 * j:2 * j + 2]), [(np.zeros(1), np.zeros(1))]))
    assert [blk.tokens for blk in cache.match(a, 2)] == [(1, 2), (3, 4)]
    assert cache.match(b, 2) == [] and cache.match([1, 2, 9, 9], 2)[0].tokens == (1, 2)
    assert len(set(cache.keys(a, 2) + cache.keys(b, 2))) == 4


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_finish_frees_the_slot(reason):
    s = _scheduler(slots=1)
    r = _request(0)
    s.add(r)
    s.admit()
    s.prefilled(r, 3)
    r.output.add(1)
    s.finish(r, reason)
    assert r.status is S.FINISHED and r.completion.finish_reason == reason and s.running == 0 and s.can_admit is False


def test_a_server_step_stops_after_the_prefill_of_arrivals_but_never_twice_in_a_row():
    s = _scheduler(slots=2)
    assert s.step_decodes()                  # nothing waits: decode
    s.add(_request(0))
    assert not s.step_decodes()              # an arrival and a free slot: prefill only
    s.admit()
    s.add(_request(1))
    assert s.step_decodes()                  # another arrival: the running one decodes first
    assert not s.step_decodes()              # then the arrival's prefill alone
    s.admit()
    assert s.step_decodes() and s.step_decodes()   # every slot taken: decode
