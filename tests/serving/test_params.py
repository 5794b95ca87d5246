"""SamplingParams' checks and the n-gram drafter."""

import pytest

from gdnx.serving import NgramDrafter, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("min_tokens", -1), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.1), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("seed", -1), ("stop_token_ids", [-2]),
    ("stop", [""]), ("ignore_eos", "yes"), ("logprobs", 21), ("stop_token_ids", 3)])
def test_a_bad_value_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_lists_become_tuples_and_a_stop_string_a_list_of_one():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    hash(p)


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(num_tokens=3, max_ngram=2)
    # last two tokens (2, 3) occurred at 1..2 and 5..6; the latest is followed by 9, 9
    assert d.propose([1, 2, 3, 4, 7, 2, 3, 9, 9, 2, 3]) == [9, 9, 2]
    # no bigram match: falls back to the last token alone
    assert d.propose([5, 6, 1, 5, 8]) == []
    assert d.propose([5, 6, 1, 7, 5]) == [6, 1, 7]
    assert d.propose([4]) == []


@pytest.mark.parametrize("kw", [{"num_tokens": 0}, {"max_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}])
def test_ngram_drafter_bad_settings(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        NgramDrafter(**kw)
