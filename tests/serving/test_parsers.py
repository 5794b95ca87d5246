"""Reasoning and tool calls split from a chat output: a stream fed in any
pieces splits as the whole text does, in each tool-call format; and each
format's grammar for a forced call, walked with random allowed tokens,
gives text its own parser reads back as calls of the listed tools whose
arguments validate against their parameters."""

import json

import jsonschema
import numpy as np
import pytest

from gdnx.data.text import HFTokenizer
from gdnx.serving.grammar import Grammars, words
from gdnx.serving.parsers import TOOL_FORMATS, Splitter, split_whole
from tests.helpers.hf_models import write_bpe_tokenizer

HERMES, KIMI, OLMO = (TOOL_FORMATS[n] for n in ("hermes", "kimi_k2", "olmo3"))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KIMI_CALLS = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
              '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
              '<|tool_call_argument_begin|>{"zone": "CET"}<|tool_call_end|><|tool_calls_section_end|>')
OLMO_CALLS = ('<function_calls>\nget_weather(city="Paris", days=3, hourly=true, units=null)\n'
              'get_time(zone="CET", at=[1, -2.5], opts={"a": false})\n</function_calls>')
TEXTS = [
    ("<think>\nfirst this</think>\n\nIt is sunny. " + CALL + "\n" + CALL.replace("Paris", "Rome"), "maybe", HERMES),
    ("thinking on</think>answer < and <tool_ not a call", "open", HERMES),
    ("no reasoning here " + CALL.replace('{"name"', '{broken'), "maybe", HERMES),
    ("plain text <think>kept</think> as it is", None, None),
    ("<thi", "maybe", None),
    ("Let me look. " + KIMI_CALLS + " done", None, KIMI),
    ("<think>hm</think>" + KIMI_CALLS.replace('{"zone"', '{zone'), "maybe", KIMI),
    ("Checking.\n" + OLMO_CALLS, None, OLMO),
    ("<function_calls>\nnot a call at all\n</function_calls> <function_", None, OLMO),
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


def test_kimi_calls_carry_their_function_ids():
    _, content, calls = split_whole(*TEXTS[5])
    assert content == "Let me look.  done"
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"}), ("functions.get_time:1", "get_time",
                                                                         {"zone": "CET"})]
    # a section whose call is not JSON is content, whole
    assert split_whole(*TEXTS[6]) == ("hm", KIMI_CALLS.replace('{"zone"', '{zone'), [])


def test_olmo3_calls_read_json_and_python_literals():
    _, content, calls = split_whole(*TEXTS[7])
    assert content == "Checking.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "hourly": True, "units": None}),
        ("get_time", {"zone": "CET", "at": [1, -2.5], "opts": {"a": False}})]
    assert split_whole(*TEXTS[8]) == (None, TEXTS[8][0], [])


# Parameters of kinds a client may send: nested objects, arrays, enums, bounded numbers, optional and
# nullable fields, no parameters at all.
FUNCTIONS = [
    ("book_flight", {"type": "object", "additionalProperties": False, "required": ["to", "seats"],
                     "properties": {"to": {"type": "string", "maxLength": 5},
                                    "seats": {"type": "integer", "minimum": 1, "maximum": 9},
                                    "window": {"type": "boolean"},
                                    "meal": {"enum": ["veg", "fish", None]}}}),
    ("plot", {"type": "object", "additionalProperties": False, "required": ["points", "style"],
              "properties": {"points": {"type": "array", "maxItems": 3,
                                        "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                  "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
                             "style": {"type": "object", "additionalProperties": False, "required": ["color"],
                                       "properties": {"color": {"enum": ["red", "blue"]}}}}}),
    ("ping", {"type": "object", "additionalProperties": False, "properties": {}}),
    # as pydantic writes a nested model (the openai client's pydantic_function_tool): $defs and $ref
    ("move", {"type": "object", "additionalProperties": False, "required": ["to"],
              "$defs": {"Point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                  "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                 "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
              "properties": {"to": {"$ref": "#/$defs/Point"}}}),
]
KIMI_TAGS = list(KIMI.tags)


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    """Grammars over a byte-level BPE vocabulary with Kimi's tags as special tokens (as its tokenizer has them)."""
    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in KIMI_TAGS])
    tok.save(str(path / "tokenizer.json"))
    text = HFTokenizer(str(path / "tokenizer.json"))
    assert text.keep([*KIMI_TAGS, "<tool_call>"]) == frozenset(KIMI_TAGS)
    return Grammars((path / "tokenizer.json").read_text(), text.vocab_size, eos_id=0), text


def _walk(grammars: Grammars, lark: str, seed: int, limit: int = 600) -> list[int]:
    """Tokens drawn at random among those the grammar allows, until it ends."""
    from gdnx.serving.params import Structured

    g = grammars.grammar(Structured("grammar", lark))
    import llguidance

    m = llguidance.LLMatcher(grammars.tokenizer, g, log_level=0)
    rng = np.random.default_rng(seed)
    mask = np.zeros(words(grammars.vocab_size), np.int32)
    out: list[int] = []
    for _ in range(limit):
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:grammars.vocab_size]
        allowed = np.flatnonzero(bits)
        if m.is_accepting() and (len(allowed) == 1 or rng.random() < 0.5):
            return out
        token = int(rng.choice(allowed[allowed != grammars.eos_id]))
        assert m.consume_token(token), m.get_error()
        out.append(token)
    raise AssertionError(f"the grammar did not end within {limit} tokens: {out[:80]}")


@pytest.mark.parametrize("name", list(TOOL_FORMATS))
@pytest.mark.parametrize("many", [False, True])
def test_a_forced_call_parses_back_into_valid_calls(grammars, name, many):
    g, tok = grammars
    fmt = TOOL_FORMATS[name]
    special = frozenset(KIMI_TAGS)  # the tokenizer's special tokens (only Kimi's format uses them)
    lark = fmt.lark(FUNCTIONS, many, special)
    schemas = dict(FUNCTIONS)
    seen = set()
    for seed in range(8):
        text = tok.decode(_walk(g, lark, seed))
        thought, content, calls = split_whole(text, None, fmt)
        assert calls and content is None, text
        assert many or len(calls) == 1
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])
            seen.add(c["function"]["name"])
    assert len(seen) >= 2  # the walk reaches several tools
    named = fmt.lark([FUNCTIONS[1]], False, special)
    calls = split_whole(tok.decode(_walk(g, named, 0)), None, fmt)[2]
    assert [c["function"]["name"] for c in calls] == ["plot"]
