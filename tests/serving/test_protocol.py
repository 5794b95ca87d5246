"""The protocol's logprob bodies: every top-N candidate is returned, even
where two candidates decode to the same text (a byte-level tokenizer's
incomplete characters, tokens that differ only in what they merge with)."""

from gdnx.serving.protocol import chat_logprobs, completion_logprobs
from gdnx.serving.server import _logprob_pieces


def test_candidates_that_decode_alike_are_all_returned():
    words = {1: "a", 2: "\ufffd", 3: "\ufffd", 4: "b"}
    decode = lambda ids: "".join(words[i] for i in ids)  # noqa: E731
    entries = [(-0.1, {1: -0.1, 2: -2.0, 3: -3.0}), (-0.5, {4: -0.5, 2: -1.0, 3: -1.5})]
    pieces, tops = _logprob_pieces(decode, [], [1, 4], entries)
    completions = completion_logprobs(pieces, tops, 0)
    assert [len(t) for t in completions["top_logprobs"]] == [3, 3]
    assert completions["top_logprobs"][0] == {"a": -0.1, "\ufffd": -2.0, "token_id:3": -3.0}
    chat = chat_logprobs(pieces, tops)
    assert [[c["logprob"] for c in e["top_logprobs"]] for e in chat["content"]] == [[-0.1, -2.0, -3.0],
                                                                                   [-0.5, -1.0, -1.5]]
    assert completions["tokens"] == ["a", "b"] and completions["text_offset"] == [0, 1]
