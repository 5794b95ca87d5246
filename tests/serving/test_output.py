"""A request's Output alone (no model): the incremental detokenizer against
a whole decode, stop strings found only in new text and only from
min_tokens on, the text that is safe to stream, and the cost per token."""

import pytest

from gdnx.serving.output import IncrementalDetokenizer, Output, find_stop, held_back
from gdnx.serving.params import SamplingParams

WORDS = {1: "ab", 2: "c", 3: "X", 4: "Y", 5: "Z", 6: " ", 7: "end"}


def _decode(ids):
    return "".join(WORDS[i] for i in ids)


def _bytes_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def _run(params, tokens, decode=_decode, eos=()):
    out = Output(params, decode, eos)
    for t in tokens:
        reason = out.add(t)
        if reason:
            return out, reason
    return out, None


def test_incremental_text_equals_the_whole_decode_across_split_characters():
    text = "héllo wörld ✓ 𝄞 done"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(_bytes_decode)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # a character shows once complete


def test_a_space_dropped_at_a_decode_start_is_kept_by_the_context_window():
    # a SentencePiece-like decode: a leading space is dropped at the start of the decoded text
    vocab = {1: " the", 2: " cat", 3: " sat"}
    decode = lambda ids: "".join(vocab[i] for i in ids).removeprefix(" ")  # noqa: E731
    detok = IncrementalDetokenizer(decode)
    assert "".join(detok.add([i]) for i in (1, 2, 3)) == decode([1, 2, 3]) == "the cat sat"


def test_each_token_decodes_a_bounded_window():
    """Detokenizing n tokens decodes O(n) tokens in all, not O(n^2)."""
    decoded = []

    def counting(ids):
        decoded.append(len(ids))
        return _decode(ids)

    out = Output(SamplingParams(max_tokens=2000, stop=["never"]), counting, ())
    for i in range(2000):
        assert out.add(1 + i % 4) is None or i == 1999
    assert sum(decoded) < 10 * 2000, sum(decoded)


def test_a_stop_string_before_min_tokens_is_text_not_a_stop():
    """ "cX" is complete at token 3, before min_tokens=5: the request goes on
    and is cut at the next stop string, not at the earlier one."""
    out, reason = _run(SamplingParams(max_tokens=20, min_tokens=5, stop=["cX"]), [1, 2, 3, 4, 4, 2, 3, 4])
    assert reason == "stop" and len(out.tokens) == 7
    assert out.final_text() == "abcXYY"
    # the old behaviour, cutting at the first "cX" once min_tokens was reached, would give "ab"


def test_a_stop_string_straddling_min_tokens_counts():
    out, reason = _run(SamplingParams(max_tokens=20, min_tokens=3, stop=["cX"]), [1, 2, 3, 4])
    assert reason == "stop" and out.final_text() == "ab"


@pytest.mark.parametrize("params,tokens,eos,reason,n", [
    (SamplingParams(max_tokens=3), [1, 1, 1, 1], (), "length", 3),
    (SamplingParams(max_tokens=9), [1, 7, 1], (7,), "stop", 2),
    (SamplingParams(max_tokens=9, ignore_eos=True), [1, 7, 1], (7,), None, 3),
    (SamplingParams(max_tokens=9, stop_token_ids=[2]), [1, 2, 1], (), "stop", 2),
    (SamplingParams(max_tokens=9, stop=["XY"]), [1, 3, 4, 1], (), "stop", 3),
])
def test_each_finish_reason(params, tokens, eos, reason, n):
    out, got = _run(params, tokens, eos=eos)
    assert got == reason and len(out.tokens) == n


def test_find_stop_searches_only_what_the_new_text_completes():
    assert find_stop("abXYcd", 2, ["XY"]) is None       # complete before the last 2 characters
    assert find_stop("abXYcd", 3, ["XY"]) == 2           # its last character is new
    assert find_stop("aXYbZZ", 5, ["ZZ", "XY"]) == 1     # the earliest wins
    assert held_back("abcX", ["cXZ"]) == 2 and held_back("abc", ["XY"]) == 0


def test_streamed_text_holds_back_what_may_begin_a_stop_string():
    words = {**WORDS, 8: "\ufffd"}
    out = Output(SamplingParams(max_tokens=9, stop=["cXZ"]), lambda ids: "".join(words[i] for i in ids), ())
    sent = []
    for t in (1, 2, 3, 4, 8, 2):
        out.add(t)
        sent.append(out.new_text(finished=False))
    assert sent[:4] == ["ab", "", "", "cXY"]       # "c", "cX" may begin "cXZ": held; then they did not
    assert sent[4] == ""                            # what may be an incomplete character waits
    assert sent[5] == "\ufffd"                      # text followed it; "c" may begin "cXZ"
    final = out.new_text(finished=True)
    assert final == "c"
    assert "".join(sent) + final == out.final_text() == "abcXY\ufffdc"
