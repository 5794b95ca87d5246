"""gdnx.serving.finite: which constraints admit no finite output, decided
from their text. Each refusal is a constraint the grammar engine accepts
and then runs to the token limit; each acceptance is one with a way out
(an optional property, a null branch, an alternative, zero repetitions),
or one this reading leaves to the engine (never refused on a guess)."""

import pytest

from gdnx.serving.finite import json_schema_error, lark_error

LOOP = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}


@pytest.mark.parametrize("schema,refused", [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
    ({"$defs": {"n": LOOP}, "$ref": "#/$defs/n"}, "#/$defs/n"),
    ({"allOf": [{"$ref": "#"}]}, "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, None),                   # a optional
    ({"type": "array", "items": {"$ref": "#"}}, None),                                 # the empty array
    ({"$defs": {"n": {**LOOP, "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}},
      "$ref": "#/$defs/n"}, None),                                                     # a null ends the chain
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, None),  # null
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, None),                  # no type: any value
    ({"$ref": "https://example.com/s.json"}, None),                                    # not followed
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}, None),
])
def test_json_schemas(schema, refused):
    got = json_schema_error(schema)
    assert (got is None) == (refused is None), got
    if refused is not None:
        assert got.startswith(f"no output satisfies it: {refused} refers back to itself"), got


@pytest.mark.parametrize("grammar,refused", [
    ('start: "a" start', True),
    ('start: a\na: "x" a\n  | "y" a', True),
    ('start: ("a" start)+', True),
    ('start: "a" start~1', True),
    ('start: x\nx: "a" x | "b"', False),
    ('start: "(" D ("+" D)* ")"\nD: /[0-9]/', False),
    ('start: "a" [start]', False),
    ('start: ("a" start)*', False),
    ('start: "a" start~0..3', False),
    ('start: a+\na: "x" | start', False),
    ('// a comment\nstart: "x"  // and another\n', False),
    ('start: x\nx: "a"\n | x "b"', False),
    ('start: undefined_rule', False),                 # the engine names the undefined rule
    ('%import common.NUMBER\nstart: NUMBER', False),  # directives: left to the engine
    ('start: "a" start\n%ignore " "', False),
    ('start.2: "a" start', False),                    # priorities: left to the engine
])
def test_lark_grammars(grammar, refused):
    got = lark_error(grammar)
    assert (got is not None) == refused, got
