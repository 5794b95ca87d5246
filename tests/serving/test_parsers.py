"""Reasoning and Hermes tool calls split from a chat output: a stream fed
in any pieces splits as the whole text does."""

import json

import numpy as np
import pytest

from gdnx.serving.parsers import Splitter, split_whole

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    ("<think>\nfirst this</think>\n\nIt is sunny. " + CALL + "\n" + CALL.replace("Paris", "Rome"), "maybe", True),
    ("thinking on</think>answer < and <tool_ not a call", "open", True),
    ("no reasoning here " + CALL.replace('{"name"', '{broken'), "maybe", True),
    ("plain text <think>kept</think> as it is", None, False),
    ("<thi", "maybe", False),
]


@pytest.mark.parametrize("text,reasoning,tools", TEXTS)
def test_a_stream_in_any_pieces_splits_as_the_whole_text(text, reasoning, tools):
    thought, content, calls = split_whole(text, reasoning, tools)
    rng = np.random.default_rng(0)
    for _ in range(5):
        cuts = sorted(set(rng.integers(0, len(text), 6).tolist()))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = Splitter(reasoning, tools)
        parts = [p for piece in pieces for p in s.feed(piece)] + s.finish()
        assert "".join(p.text for p in parts if p.kind == "reasoning") == (thought or "")
        streamed = "".join(p.text for p in parts if p.kind == "content")
        assert streamed == (content or "") or (calls and not streamed.strip() and content is None)
        assert [p.call["function"] for p in parts if p.call] == [c["function"] for c in calls]


def test_what_each_text_holds():
    thought, content, calls = split_whole(*TEXTS[0])
    assert thought == "\nfirst this" and content == "It is sunny. \n"
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert split_whole(*TEXTS[1]) == ("thinking on", "answer < and <tool_ not a call", [])
    assert split_whole(*TEXTS[2])[1:] == ("no reasoning here " + CALL.replace('{"name"', '{broken'), [])
    assert split_whole(*TEXTS[3]) == (None, TEXTS[3][0], [])
    assert split_whole(*TEXTS[4]) == (None, "<thi", [])
