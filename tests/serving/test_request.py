"""The request state graph: every move the engine makes, and none other."""

import pytest

from gdnx.serving.output import Output
from gdnx.serving.params import SamplingParams
from gdnx.serving.request import Request, RequestStatus, TransitionError

S = RequestStatus


def _request() -> Request:
    params = SamplingParams(max_tokens=2)
    return Request(0, [1, 2], params, 0, Output(params, None, ()))


def test_the_path_of_a_finished_request():
    r = _request()
    assert r.status is S.WAITING and r.slot is None
    r.transition(S.PREFILLING, slot=3)
    assert r.slot == r.held_slot == 3
    r.transition(S.RUNNING)
    r.output.add(5)
    r.transition(S.FINISHED, reason="length")
    assert r.slot is None and r.finish_reason == "length"
    assert r.completion is not None and r.completion.tokens == [5] and r.completion.finish_reason == "length"


@pytest.mark.parametrize("path", [[], [S.PREFILLING], [S.PREFILLING, S.RUNNING]])
@pytest.mark.parametrize("end", [S.ABORTED, S.FAILED])
def test_abort_or_fail_from_every_live_state(path, end):
    r = _request()
    for status in path:
        r.transition(status, slot=0)
    r.transition(end, error="boom")
    assert r.status is end and r.slot is None and r.completion is None
    assert r.error == ("boom" if end is S.FAILED else None)


@pytest.mark.parametrize("path,to", [
    ([], S.RUNNING), ([], S.FINISHED), ([S.PREFILLING], S.FINISHED), ([S.PREFILLING, S.RUNNING], S.WAITING),
    ([S.ABORTED], S.PREFILLING), ([S.FAILED], S.ABORTED), ([S.PREFILLING, S.RUNNING, S.FINISHED], S.ABORTED),
])
def test_moves_outside_the_graph_are_refused(path, to):
    r = _request()
    for status in path:
        r.transition(status, slot=0, reason="stop")
    with pytest.raises(TransitionError):
        r.transition(to, slot=0, reason="stop")


def test_a_move_missing_its_slot_or_reason_is_refused():
    r = _request()
    with pytest.raises(TransitionError, match="without a slot"):
        r.transition(S.PREFILLING)
    r.transition(S.PREFILLING, slot=1)
    r.transition(S.RUNNING)
    with pytest.raises(TransitionError, match="without a reason"):
        r.transition(S.FINISHED)
    r.transition(S.ABORTED)
    with pytest.raises(TransitionError, match="holds no slot"):
        r.held_slot
