"""What a chat model's output holds besides its answer: the reasoning of a
thinking model (`<think>...</think>`, Qwen3's: --reasoning-parser qwen3)
and tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
the Hermes format Qwen's templates ask for: --tool-call-parser hermes).

A Splitter takes an output's text as it comes and gives back its parts in
order: reasoning, content and whole tool calls, holding back text that may
be the start of a tag, so a stream and a whole response split alike.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

TOOL_PARSERS = ("hermes",)
REASONING_PARSERS = ("qwen3",)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Part:
    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    call: dict[str, Any] | None = None   # {"id", "type", "function": {"name", "arguments"}}


def tool_call(body: str) -> dict[str, Any] | None:
    """A Hermes call's JSON as an OpenAI tool call, or None when it is not
    one ({"name": str, "arguments": object or string})."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of text may begin one of the tags."""
    return max((k for tag in tags for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


@dataclass
class Splitter:
    """reasoning: None (no reasoning parser), "open" (the prompt ends inside
    a reasoning block: the template opened <think>) or "maybe" (reasoning
    only if the output opens <think> itself); tools: parse tool calls."""
    reasoning: Literal["open", "maybe"] | None = None
    tools: bool = False
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
            start = self._buffer.find(CALL_OPEN) if self.tools else -1
            if start >= 0:
                end = self._buffer.find(CALL_CLOSE, start)
                out.append(Part("content", self._buffer[:start]))
                if end < 0 and not final:  # a call under way: given whole once it closes
                    self._buffer = self._buffer[start:]
                    break
                stop = end + len(CALL_CLOSE) if end >= 0 else len(self._buffer)
                call = tool_call(self._buffer[start + len(CALL_OPEN):end if end >= 0 else stop].strip())
                if call is not None:
                    self._calls += 1
                    out.append(Part("tool_call", call=call))
                else:  # not a call after all: its text is content
                    out.append(Part("content", self._buffer[start:stop]))
                self._buffer = self._buffer[stop:]
                continue
            keep = 0 if final or not self.tools else _held(self._buffer, (CALL_OPEN,))
            out.append(Part("content", self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return [p for p in out if p.kind == "tool_call" or p.text]


def split_whole(text: str, reasoning: Literal["open", "maybe"] | None, tools: bool,
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
