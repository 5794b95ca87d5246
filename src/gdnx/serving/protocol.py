"""The OpenAI completions and chat completions protocol: the request bodies
(checked, each mistake a RequestError naming the field), their mapping
onto SamplingParams, and the response and stream-chunk bodies."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from gdnx.errors import FieldError
from gdnx.serving.params import SamplingParams, Structured
from gdnx.serving.parsers import TOOL_FORMATS, ToolFormat

# the most top-N log-probabilities a request may ask for (the protocol's own bound)
MAX_LOGPROBS = 20
# the most choices per request (each takes an engine request)
MAX_N = 16


class RequestError(ValueError):
    """A request the server refuses: the HTTP status, the field (param) and
    the OpenAI error type."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any
    JSON object) or json_schema."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs extension: exactly one of a JSON schema, a
    regular expression, a list of choices or a Lark grammar."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def structured(response_format: ResponseFormat | None, outputs: StructuredOutputs | None) -> Structured | None:
    """The request's constraint, or None; a RequestError naming the field
    when the two are given together or one is incomplete."""
    if response_format is not None and response_format.type != "text" and outputs is not None:
        raise RequestError("response_format: give response_format or structured_outputs, not both",
                           "response_format")
    if outputs is not None:
        given: list[Structured] = []
        if outputs.json_ is not None:
            schema = outputs.json_ if isinstance(outputs.json_, str) else json.dumps(outputs.json_)
            given.append(Structured("json", schema, field="structured_outputs.json"))
        if outputs.regex is not None:
            given.append(Structured("regex", outputs.regex, field="structured_outputs.regex"))
        if outputs.choice is not None:
            given.append(Structured("choice", tuple(outputs.choice), field="structured_outputs.choice"))
        if outputs.grammar is not None:
            given.append(Structured("grammar", outputs.grammar, field="structured_outputs.grammar"))
        if len(given) != 1:
            raise RequestError("structured_outputs: give exactly one of json, regex, choice, grammar",
                               "structured_outputs")
        return given[0]
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Structured("json", json.dumps({"type": "object"}), field="response_format")
    if response_format.json_schema is None:
        raise RequestError("response_format.json_schema: required with type json_schema",
                           "response_format.json_schema")
    return Structured("json", json.dumps(response_format.json_schema.schema_),
                      field="response_format.json_schema.schema")


class _Request(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, then the common
    extensions top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
    stop_token_ids). `user` is accepted and has no effect."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=-1)    # -1 or 0: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def constraint(self) -> Structured | None:
        return structured(self.response_format, self.structured_outputs)

    def sampling(self, max_tokens: int, logprobs: int | None, seed_offset: int) -> SamplingParams:
        """SamplingParams for one choice (choice i of n draws with seed + i)."""
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
            top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=None if self.seed is None else self.seed + seed_offset, stop_token_ids=tuple(self.stop_token_ids),
            stop=tuple(stop), ignore_eos=self.ignore_eos, logprobs=logprobs,
            structured=self.constraint())


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_calls...: the template's business
    role: str
    content: str | list[TextPart] | None = None

    def rendered(self) -> dict:
        """The message as a chat template reads it (text parts joined)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        return out


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        # OpenAI's rule; it keeps a name from holding a tool format's tags (</tool_call>), which ended a call early
        if not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name):
            raise ValueError(f"expected 1 to 64 letters, digits, underscores or hyphens, got {name[:80]!r}")
        return name


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    logit_bias: dict[str, float] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # the server's tool-call format and which of its tags are special tokens (the server's, not the client's)
    _tool_format: tuple[ToolFormat, frozenset[str]] = PrivateAttr(default=(TOOL_FORMATS["hermes"], frozenset()))

    def use_tool_format(self, fmt: ToolFormat, special: frozenset[str] = frozenset()) -> None:
        self._tool_format = (fmt, special)

    def constraint(self) -> Structured | None:
        """A required or named tool_choice is a grammar of tool calls (the
        server's tool format), else response_format / structured_outputs."""
        forced = tool_grammar(self)
        if forced is not None:
            if self.response_format is not None and self.response_format.type != "text" \
                    or self.structured_outputs is not None:
                raise RequestError("tool_choice: a required or named tool choice is not combined with "
                                   "response_format or structured_outputs", "tool_choice")
            return forced
        return super().constraint()


def tool_grammar(req: ChatRequest) -> Structured | None:
    """The Lark grammar (llguidance's, with %json) that a required or named
    tool_choice puts on the output: calls in the server's tool format whose
    arguments follow the function's parameters (one call, or several with
    parallel_tool_calls and "required"); None for "auto", "none" or no
    tools."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    tools = req.tools or []
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
        if not tools:
            raise RequestError(f"tool_choice: no tool named {choice.function.name!r} in tools",
                               "tool_choice.function.name")
    if not tools:
        raise RequestError("tool_choice: required needs tools", "tool_choice")
    functions = [(t.function.name, t.function.parameters or {"type": "object"}) for t in tools]
    fmt, special = req._tool_format
    return Structured("grammar", fmt.lark(functions, choice == "required" and req.parallel_tool_calls, special),
                      field="tools")


# fields of the protocol gdnx does not implement: refused rather than ignored
_UNSUPPORTED = {"best_of": None, "suffix": None, "logit_bias": None}


def _loc(loc: tuple) -> str:
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in ("str", "int"))))


def parse(kind: type[_Request], body: Any) -> Any:
    """The request body as `kind`, or a RequestError naming the first wrong field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    try:
        request = kind.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = _loc(err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise RequestError(f"{field}: unknown field", field) from None
        if err["type"] == "missing":
            raise RequestError(f"{field}: required", field) from None
        message = err["msg"].removeprefix("Value error, ")  # a validator's own message, as it wrote it
        raise RequestError(f"{field}: {message}", field) from None
    for name, default in _UNSUPPORTED.items():
        if name in type(request).model_fields and getattr(request, name) != default:
            raise RequestError(f"{name}: not supported by this server", name)
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options: only with stream true", "stream_options")
    return request


def field_error(e: FieldError) -> RequestError:
    """SamplingParams' or the engine's FieldError as a 400 naming its field."""
    return RequestError(str(e), e.field)


# ---- responses -------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(rid: str, kind: str, model: str, choices: list[dict], extra: dict | None = None) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            **(extra or {})}


Logprob = tuple[float, list[tuple[str, int, float]]]   # a token's logprob, its top-N as (text, id, logprob)


def completion_logprobs(pieces: list[str], entries: Sequence[Logprob | None], offset: int) -> dict:
    """The completions API's logprobs: each token's text, its logprob, the
    top-N as {text: logprob}, and where the token starts in the text. Its
    top-N is a mapping by text: a candidate whose text an earlier one took
    is keyed "token_id:ID", so all N are there. An entry None (an echoed
    prompt's first token, which nothing precedes) gives null for both."""
    offsets, at = [], offset
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    tops: list[dict[str, float] | None] = []
    for entry in entries:
        if entry is None:
            tops.append(None)
            continue
        by_text: dict[str, float] = {}
        for text, token, lp in entry[1]:
            by_text[text if text not in by_text else f"token_id:{token}"] = lp
        tops.append(by_text)
    return {"tokens": pieces, "token_logprobs": [None if e is None else e[0] for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(pieces: list[str], entries: list[Logprob]) -> dict:
    """The chat API's logprobs: per token its text, bytes, logprob and top-N."""
    def item(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [{**item(piece, lp), "top_logprobs": [item(t, v) for t, _, v in top]}
                        for piece, (lp, top) in zip(pieces, entries)]}
