"""What a chat model's output holds besides its answer: the reasoning of a
thinking model (`<think>...</think>`, Qwen3's: --reasoning-parser qwen3)
and tool calls, in the format the checkpoint's chat template asks for
(--tool-call-parser):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call (Qwen3-Next's and Qwen3.5's templates);
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`
  (Kimi Linear's template; the call's id is its `functions.NAME:I`);
- olmo3: `<function_calls>` then one Python-style call a line,
  `name(key=value, ...)` with JSON values, then `</function_calls>` (OLMo 3's
  template, OLMo Hybrid's).

A Splitter takes an output's text as it comes and gives back its parts in
order: reasoning, content and whole tool calls, holding back text that may
be the start of a tag, so a stream and a whole response split alike. A
ToolFormat also writes the Lark grammar (llguidance's, with %json) that a
required or named tool_choice puts on the output.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

REASONING_PARSERS = ("qwen3",)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Part:
    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    call: dict[str, Any] | None = None   # {"id", "type", "function": {"name", "arguments"}}


def _call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name,
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def tool_call(body: str) -> dict[str, Any] | None:
    """A Hermes call's JSON as an OpenAI tool call, or None when it is not
    one ({"name": str, "arguments": object or string})."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return _call(value["name"], value.get("arguments", value.get("parameters", {})))


# A tool the grammar allows: its name and its parameters' JSON schema.
Function = tuple[str, dict[str, Any]]


class ToolFormat:
    """A tool-call format: the tags around a block of calls, the calls in a
    block's body (none: the block is content after all), and the grammar of
    one block of calls."""
    name: str
    open: str
    close: str
    tags: tuple[str, ...]   # every tag the format writes (special tokens of some tokenizers: kept in the text)

    def parse(self, body: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def lark(self, functions: Sequence[Function], many: bool, special: frozenset[str] = frozenset()) -> str:
        raise NotImplementedError


def _spell(tag: str, special: frozenset[str]) -> str:
    """A tag in a Lark grammar: llguidance's name of a special token (a quoted
    text would be spelled in other tokens), else the quoted text."""
    return tag if tag in special else json.dumps(tag)


# JSON in a forced call as json.dumps writes it (", " and ": ", no other whitespace): what the templates show
# the model, and one way to write each value
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: Any) -> str:
    """%json over a schema, written compactly."""
    return f"%json {json.dumps({**schema, 'x-guidance': _COMPACT} if isinstance(schema, dict) else schema)}"


def _definitions(schema: Any, prefix: str = "") -> tuple[Any, dict[str, Any]]:
    """A parameters schema without its definitions ($defs or draft 7's
    definitions), its local references renamed to `#/$defs/PREFIX...`, and
    the definitions so renamed: to set at the root of the schema the
    parameters end up in (a reference resolves against the root)."""
    def rename(x: Any) -> Any:
        if isinstance(x, dict):
            out = {k: rename(v) for k, v in x.items()}
            ref = x.get("$ref")
            for root in ("#/$defs/", "#/definitions/"):
                if isinstance(ref, str) and ref.startswith(root):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
            return out
        return [rename(v) for v in x] if isinstance(x, list) else x
    if not isinstance(schema, dict):
        return schema, {}
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    body = rename(schema)
    return {k: v for k, v in body.items() if k not in ("$defs", "definitions")}, \
        {prefix + k: rename(v) for k, v in defs.items()}


def _alternatives(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else "(" + " | ".join(items) + ")"


class Hermes(ToolFormat):
    name, open, close = "hermes", "<tool_call>", "</tool_call>"
    tags = (open, close)

    def parse(self, body: str) -> list[dict[str, Any]]:
        call = tool_call(body.strip())
        return [] if call is None else [call]

    def lark(self, functions: Sequence[Function], many: bool, special: frozenset[str] = frozenset()) -> str:
        calls, defs = [], {}
        for i, (name, params) in enumerate(functions):  # each function's definitions, renamed apart, at the root
            arguments, own = _definitions(params, f"f{i}_")
            defs.update(own)
            calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                          "properties": {"name": {"const": name}, "arguments": arguments}})
        root = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = _json({**root, "$defs": defs} if defs else root)
        repeat = ' ("\\n" call)*' if many else ""
        open_, close = _spell(self.open, special), _spell(self.close, special)
        return f'start: call{repeat}\ncall: {open_} "\\n" body "\\n" {close}\nbody: {body}'


class KimiK2(ToolFormat):
    name, open, close = "kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_open, arguments, call_close = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    tags = (open, close, call_open, arguments, call_close)
    _CALL = re.compile(re.escape(call_open) + r"\s*([^\s:]+):(\d+)\s*" + re.escape(arguments) + r"(.*?)"
                       + re.escape(call_close), re.DOTALL)

    def parse(self, body: str) -> list[dict[str, Any]]:
        calls = []
        for m in self._CALL.finditer(body):
            function_id, args = f"{m.group(1)}:{m.group(2)}", m.group(3).strip()
            try:
                if not isinstance(json.loads(args), dict):
                    return []
            except ValueError:
                return []
            calls.append(_call(m.group(1).removeprefix("functions."), args, function_id))
        return calls

    def lark(self, functions: Sequence[Function], many: bool, special: frozenset[str] = frozenset()) -> str:
        begin, arguments, end = (_spell(t, special) for t in (self.call_open, self.arguments, self.call_close))
        calls = [f'{begin} {json.dumps("functions." + name + ":")} INDEX {arguments} {_json(params)} {end}'
                 for name, params in functions]
        return (f"start: {_spell(self.open, special)} call{'+' if many else ''} {_spell(self.close, special)}\n"
                f"call: {_alternatives(calls)}\nINDEX: /[0-9]{{1,3}}/")


_PY_CONSTANTS = {"null": None, "true": True, "false": False, "None": None, "True": True, "False": False}


def _literal(node: ast.expr) -> Any:
    """A Python-style call's argument value: JSON's literals or Python's."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes):
        return node.value
    if isinstance(node, ast.Name) and node.id in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, int | float):
        return -node.operand.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def _keyword(key: str, schema: Any, defs: dict[str, Any]) -> str:
    """key=VALUE, the value's schema carrying its function's definitions."""
    value = {**schema, "$defs": defs} if defs and isinstance(schema, dict) else schema
    return f'{json.dumps(key + "=")} {_json(value)}'


class Olmo3(ToolFormat):
    name, open, close = "olmo3", "<function_calls>", "</function_calls>"
    tags = (open, close)

    def parse(self, body: str) -> list[dict[str, Any]]:
        # one call a statement: a line each, or spread over lines inside its brackets
        try:
            statements = ast.parse(body.strip()).body
            calls = []
            for st in statements:
                node = st.value if isinstance(st, ast.Expr) else None
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                        or any(k.arg is None for k in node.keywords):
                    return []
                calls.append(_call(node.func.id, {str(k.arg): _literal(k.value) for k in node.keywords}))
            return calls
        except (SyntaxError, ValueError, RecursionError):
            return []

    def lark(self, functions: Sequence[Function], many: bool, special: frozenset[str] = frozenset()) -> str:
        rules = []
        for i, (name, params) in enumerate(functions):
            params, defs = _definitions(params)
            props: dict[str, Any] = params.get("properties", {}) if isinstance(params, dict) else {}
            required = [k for k in params.get("required", []) if k in props] if isinstance(params, dict) else []
            optional = [_keyword(k, props[k], defs) for k in props if k not in required]
            if required:  # the required in order, then any optional ones
                args = ' ", " '.join(_keyword(k, props[k], defs) for k in required)
                if optional:
                    args += f' (", " {_alternatives(optional)})*'
            elif optional:
                args = f'({_alternatives(optional)} (", " {_alternatives(optional)})*)?'
            else:
                args = ""
            rules.append(f'f{i}: {json.dumps(name + "(")} {args} ")"')
        repeat = ' ("\\n" call)*' if many else ""
        names = " | ".join(f"f{i}" for i in range(len(functions)))
        return "\n".join([f'start: {_spell(self.open, special)} "\\n" call{repeat} "\\n" {_spell(self.close, special)}',
                          f"call: {names}", *rules])


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), KimiK2(), Olmo3())}
TOOL_PARSERS = tuple(TOOL_FORMATS)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of text may begin one of the tags."""
    return max((k for tag in tags for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


@dataclass
class Splitter:
    """reasoning: None (no reasoning parser), "open" (the prompt ends inside
    a reasoning block: the template opened <think>) or "maybe" (reasoning
    only if the output opens <think> itself); tools: the format of the
    tool calls to parse (None: none are)."""
    reasoning: Literal["open", "maybe"] | None = None
    tools: ToolFormat | None = None
    _buffer: str = ""
    _thinking: bool = False
    _started: bool = False
    _calls: int = 0
    _after_think: bool = False   # the newlines that follow </think> are not content

    def __post_init__(self):
        self._thinking = self.reasoning == "open"
        self._started = self.reasoning != "maybe"

    @property
    def calls(self) -> int:
        """Tool calls given so far."""
        return self._calls

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Part]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Part]:
        out: list[Part] = []
        if not self._started:  # does the output open a reasoning block?
            head = self._buffer.lstrip()
            if not final and len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return out  # not yet known
            self._started = True
            if head.startswith(THINK_OPEN):
                self._buffer, self._thinking = head[len(THINK_OPEN):], True
        while self._buffer:
            if self._thinking:
                end = self._buffer.find(THINK_CLOSE)
                if end >= 0:
                    out.append(Part("reasoning", self._buffer[:end]))
                    self._buffer = self._buffer[end + len(THINK_CLOSE):]
                    self._thinking, self._after_think = False, True
                    continue
                keep = 0 if final else _held(self._buffer, (THINK_CLOSE,))
                out.append(Part("reasoning", self._buffer[:len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            if self._after_think:
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer:
                    break
                self._after_think = False
            fmt = self.tools
            start = self._buffer.find(fmt.open) if fmt is not None else -1
            if fmt is not None and start >= 0:
                end = self._buffer.find(fmt.close, start)
                out.append(Part("content", self._buffer[:start]))
                if end < 0 and not final:  # a call under way: given whole once it closes
                    self._buffer = self._buffer[start:]
                    break
                stop = end + len(fmt.close) if end >= 0 else len(self._buffer)
                calls = fmt.parse(self._buffer[start + len(fmt.open):end if end >= 0 else stop])
                if calls:
                    self._calls += len(calls)
                    out.extend(Part("tool_call", call=call) for call in calls)
                else:  # not a call after all: its text is content
                    out.append(Part("content", self._buffer[start:stop]))
                self._buffer = self._buffer[stop:]
                continue
            keep = 0 if final or fmt is None else _held(self._buffer, (fmt.open,))
            out.append(Part("content", self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return [p for p in out if p.kind == "tool_call" or p.text]


def split_whole(text: str, reasoning: Literal["open", "maybe"] | None, tools: ToolFormat | None,
                ) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """A whole output's (reasoning, content, tool calls), as a stream of it
    splits: reasoning None when there was none; with tool calls, content
    None when it is only whitespace."""
    s = Splitter(reasoning, tools)
    parts = s.feed(text) + s.finish()
    thought = "".join(p.text for p in parts if p.kind == "reasoning")
    content = "".join(p.text for p in parts if p.kind == "content")
    calls = [p.call for p in parts if p.call is not None]
    return (thought or None), (content if content.strip() else None) if calls else content, calls
