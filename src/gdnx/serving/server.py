"""An OpenAI-compatible HTTP server on the engine (FastAPI on uvicorn):
POST /v1/completions and /v1/chat/completions (streamed as server-sent
events or not), GET /v1/models, /health and /metrics.

One asyncio event loop serves every connection; the engine runs in its
own thread (AsyncEngine) and batches the requests of all clients. A
refused request gets the OpenAI error body naming the field; SIGTERM (or
Ctrl-C) stops accepting connections, lets the requests in flight finish
within the grace period, and returns."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from gdnx.serving.async_engine import AsyncEngine, EngineError, Handle, Overloaded, TooLarge
from gdnx.serving.output import Completion
from gdnx.serving.params import SamplingParams
from gdnx.serving.parsers import THINK_OPEN, TOOL_FORMATS, TOOL_PARSERS, Splitter, ToolFormat, split_whole
from gdnx.data.chat import ReservedVariable
from gdnx.errors import FieldError
from gdnx.serving.protocol import (ChatRequest, CompletionRequest, RequestError, chat_logprobs, completion_logprobs,
                                   Logprob, envelope, field_error, new_id, parse, usage)
from gdnx.signals import handled

log = logging.getLogger("gdnx.serve")

# the completions API's max_tokens when a request gives none
DEFAULT_MAX_TOKENS = 16
# a request body larger than this is refused (413) before it is read whole
DEFAULT_MAX_REQUEST_BYTES = 8 * 2 ** 20
# seconds a client has to send a whole request (headers and body) once it starts one, or to start one on a new
# connection
DEFAULT_REQUEST_TIMEOUT_S = 30.0
# threads that parse, tokenize and render requests off the event loop
PREPARE_THREADS = 4


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Template(Protocol):
    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None,
               variables: dict[str, Any] | None = None) -> str: ...


@dataclasses.dataclass
class Served:
    """What the server serves. max_length: prompt + generated tokens per
    request (the engine's). chat: the checkpoint's chat template (None:
    /v1/chat/completions is refused). api_key: required on every /v1
    route when set."""
    engine: AsyncEngine
    tokenizer: TextTokenizer
    model_name: str
    max_length: int
    chat: Template | None = None
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    tool_parser: str | None = None        # parsers.TOOL_PARSERS: tool calls parsed from chat outputs
    reasoning_parser: str | None = None   # parsers.REASONING_PARSERS: reasoning split from chat outputs
    draining: bool = False
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def tool_format(self) -> ToolFormat | None:
        return None if self.tool_parser is None else TOOL_FORMATS[self.tool_parser]

    def __post_init__(self) -> None:
        # the tool format's tags that are special tokens: decoded as text (the parser reads them), named as
        # special tokens in a forced call's grammar
        keep = getattr(self.tokenizer, "keep", None)
        self.special_tags: frozenset[str] = frozenset() if self.tool_format is None or keep is None \
            else keep(self.tool_format.tags)


def create_app(served: Served) -> FastAPI:
    """The FastAPI application; its lifespan starts and stops the engine's thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.engine.start()
        try:
            yield
        finally:
            served.engine.stop()
            prepare.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="gdnx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # parsing JSON, validating, tokenizing and rendering chat templates run here, not on the event loop: a large
    # request must not hold up the others (/health included)
    prepare = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="gdnx-prepare")

    @app.exception_handler(RequestError)
    async def refused(request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(RequestError(f"internal error: {type(e).__name__}: {e}", None, 500,
                                         "internal_server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if served.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(served.engine.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _authorize(served, request)
        return JSONResponse({"object": "list", "data": [{
            "id": served.model_name, "object": "model", "created": served.created, "owned_by": "gdnx",
            "max_model_len": served.max_length}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(served, request)
        raw = await _body(served, request)
        req, prompts = await _off_loop(prepare, _prepare_completion, served, raw)
        logprobs = req.logprobs
        return await _respond(served, prepare, request, req, prompts, logprobs, "prompt",
                              _TextChoice(served.tokenizer, logprobs, prompts if req.echo else None, req.n))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        _authorize(served, request)
        raw = await _body(served, request)
        req, prompt, reasoning = await _off_loop(prepare, _prepare_chat, served, raw)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tools = served.tool_format if req.tools and req.tool_choice != "none" else None
        return await _respond(served, prepare, request, req, [prompt], logprobs, "messages",
                              _ChatChoice(served.tokenizer, logprobs, reasoning, tools))

    return app


# ---- requests -------------------------------------------------------------------------------------------------

async def _off_loop(pool: concurrent.futures.Executor, fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("the request body is nested too deeply", None) from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON ({e})", None) from None


def _prepare_completion(served: Served, raw: bytes) -> tuple[CompletionRequest, list[list[int]]]:
    req: CompletionRequest = parse(CompletionRequest, _json(raw))
    _check_model(served, req.model)
    if req.echo and req.stream:
        raise RequestError("echo: not with stream (the prompt's log-probabilities come with the whole response)",
                           "echo")
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("max_tokens: 0 only with echo (the prompt alone)", "max_tokens")
    return req, _prompts(served, req.prompt)


def _prepare_chat(served: Served, raw: bytes) -> tuple[ChatRequest, list[int], Literal["open", "maybe"] | None]:
    """The request, its prompt's tokens, and how its output's reasoning is
    told apart (parsers.Splitter's `reasoning`)."""
    req: ChatRequest = parse(ChatRequest, _json(raw))
    _check_model(served, req.model)
    if served.chat is None:
        raise RequestError("messages: this model has no chat template (tokenizer_config.json's chat_template "
                           "or chat_template.jinja); use /v1/completions", "messages")
    if req.tools and req.tool_choice != "none" and served.tool_parser is None:
        raise RequestError("tools: this server parses no tool calls; start it with --tool-call-parser "
                           f"({', '.join(TOOL_PARSERS)})", "tools")
    if served.tool_format is not None:
        req.use_tool_format(served.tool_format, served.special_tags)
    for i, tool in enumerate(req.tools or []):  # whatever tool_choice is: the template shows them to the model
        _check_parameters(tool.function.parameters, f"tools.{i}.function.parameters")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        text = served.chat.render([m.rendered() for m in req.messages], req.add_generation_prompt, tools,
                                  req.chat_template_kwargs)
    except ReservedVariable as e:
        raise RequestError(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
    except ValueError as e:
        raise RequestError(f"messages: {e}", "messages") from None
    reasoning: Literal["open", "maybe"] | None = None
    if served.reasoning_parser is not None:  # the template may open the reasoning block itself
        reasoning = "open" if text.rstrip().endswith(THINK_OPEN) else "maybe"
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None:
            raise RequestError("max_tokens: give max_tokens or max_completion_tokens, not both", "max_tokens")
        req.max_tokens = req.max_completion_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs: only with logprobs true", "top_logprobs")
    return req, _encode(served, text, "messages"), reasoning


def _check_parameters(parameters: dict | None, field: str) -> None:
    """A tool's parameters: a JSON schema the grammar engine reads (as a
    forced call would need it), else a 400 naming the field."""
    if parameters is None:
        return
    import llguidance

    m = llguidance.LLMatcher
    try:
        error = m.validate_grammar(m.grammar_from_json_schema(json.dumps(parameters)))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        first = (error.strip().splitlines() or ["invalid"])[0][:200]
        raise RequestError(f"{field}: not a valid JSON schema ({first})", field)


def _authorize(served: Served, request: Request) -> None:
    if served.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), served.api_key.encode()):
        raise RequestError("Authorization: a valid API key is required (Authorization: Bearer KEY)",
                           None, 401, code="invalid_api_key")


async def _body(served: Served, request: Request) -> bytes:
    """The request body, at most served.max_request_bytes (413 past it,
    known from Content-Length before reading, or counted as it comes), sent
    within served.request_timeout seconds (408 for a body sent in part)."""
    limit = served.max_request_bytes
    too_large = RequestError(f"the request body exceeds the server's {limit} bytes (--max-request-bytes)", None,
                             413, code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), served.request_timeout)
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within {served.request_timeout:g} s", None, 408,
                           code="request_timeout") from None
    except ClientDisconnect:
        raise RequestError("the client left before sending its request", None, 400) from None


def _check_model(served: Served, model: str) -> None:
    if model != served.model_name:
        raise RequestError(f"model: this server serves {served.model_name!r}, not {model!r}", "model", 404,
                           code="model_not_found")


def _encode(served: Served, text: str, field: str) -> list[int]:
    try:
        ids = served.tokenizer.encode(text)
    except Exception as e:  # the tokenizer's own refusal of the text
        raise RequestError(f"{field}: cannot be encoded ({str(e).splitlines()[0][:120]})", field) from None
    if not ids:
        raise RequestError(f"{field}: encodes to no tokens", field)
    return ids


def _prompts(served: Served, prompt: str | list) -> list[list[int]]:
    """The prompts of a completions request (a string, token ids, or a batch of either)."""
    if isinstance(prompt, str):
        return [_encode(served, prompt, "prompt")]
    if not prompt:
        raise RequestError("prompt: expected a string, token ids or a list of them, got an empty list", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [_encode(served, p, "prompt") if isinstance(p, str) else list(p) for p in prompt]


def _requests(served: Served, req: Any, prompts: list[list[int]], logprobs: int | None,
              field: str) -> list[tuple[list[int], SamplingParams]]:
    """One engine request per (prompt, choice), each checked by the engine."""
    out = []
    room = served.max_length
    for p, ids in enumerate(prompts):
        where = f"{field}[{p}]" if len(prompts) > 1 else field
        max_tokens = req.max_tokens
        echo = isinstance(req, CompletionRequest) and req.echo
        if echo and max_tokens == 0:  # the prompt alone: one token is drawn and left out of the response
            max_tokens = 1
        if max_tokens is None:  # completions: 16; chat: up to the context
            max_tokens = max(1, room - len(ids))
            if isinstance(req, CompletionRequest):
                max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens)
        for i in range(req.n):
            try:
                params = req.sampling(max_tokens, logprobs, i)
                if echo and logprobs is not None:  # the prompt's own, from its prefill pass
                    params = dataclasses.replace(params, prompt_logprobs=logprobs)
                served.engine.check(ids, params)
            except FieldError as e:
                err = field_error(FieldError(where, e.detail) if e.field == "prompt" else e)
                if e.field in ("prompt", "max_tokens") and len(ids) + max_tokens > room:
                    err.code = "context_length_exceeded"
                raise err from None
            out.append((ids, params))
    return out


async def _respond(served: Served, prepare: concurrent.futures.Executor, request: Request, req: Any,
                   prompts: list[list[int]], logprobs: int | None,
                   field: str, choice: _Choice) -> Response:
    if served.draining:
        raise RequestError("the server is shutting down", None, 503, "service_unavailable")
    # the engine's checks compile a request's constraint (seconds, for some): not on the event loop
    requests = await _off_loop(prepare, _requests, served, req, prompts, logprobs, field)
    try:
        handles = served.engine.submit(requests)
    except TooLarge as e:
        raise RequestError(str(e), "n" if req.n > 1 else field) from None
    except Overloaded as e:
        raise RequestError(str(e), None, 503, "service_unavailable") from None
    rid = new_id(choice.id_prefix)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        def abort_rest() -> None:
            for h in handles:
                served.engine.release(h, False)
        return _Stream(_stream(served, rid, req.n, handles, choice, include_usage), abort_rest,
                       media_type="text/event-stream")
    done = [False] * len(handles)
    work: asyncio.Future[list[Completion]] = asyncio.ensure_future(asyncio.gather(*(_completion(h) for h in handles)))
    gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: its requests are aborted below
            work.cancel()
            return Response(status_code=499)
        results = work.result()
        done = [True] * len(handles)
    except EngineError as e:
        raise _engine_error(e) from None
    finally:
        gone.cancel()
        for h, d in zip(handles, done):
            served.engine.release(h, d)
    if isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0:
        results = [dataclasses.replace(c, tokens=[], text="", logprobs=None if c.logprobs is None else [])
                   for c in results]
    choices = [choice.whole(i, c) for i, c in enumerate(results)]
    return JSONResponse(envelope(rid, choice.kind, served.model_name, choices,
                                 {"usage": _usage(results, req.n)}))


class _Stream(StreamingResponse):
    """A stream whose requests are released however it ends: a client that
    leaves before the stream's first step cancels the response before its
    generator ever runs (so the generator's own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any], **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()  # releases what the generator did not (a release happens once)


async def _disconnected(request: Request, every: float = 0.25) -> None:
    """Returns once the client has closed its connection."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)


async def _completion(handle: Handle) -> Completion:
    async for event in handle.events():
        if event.completion is not None:
            return event.completion
    raise EngineError("the request ended without a result")


def _usage(results: Sequence[Completion], n: int) -> dict:
    firsts = results[::n]  # a prompt counts once, however many choices it has
    return usage(sum(c.prompt_tokens for c in firsts), sum(len(c.tokens) for c in results),
                 sum(c.cached_tokens for c in firsts))


def _engine_error(e: EngineError) -> RequestError:
    """A request the engine failed: 422 naming the field whose constraint
    it could not honour (the client's to change), else 500."""
    if e.field is not None:
        return RequestError(str(e), e.field, 422, "invalid_request_error", "constraint_not_honoured")
    return RequestError(str(e), None, 500, "internal_server_error")


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _stream(served: Served, rid: str, n: int, handles: list[Handle], choice: _Choice,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The chunks of every choice as their tokens come, then usage when
    asked, then [DONE]. A client that goes away cancels this generator: its
    requests are aborted in the engine at its next step."""
    merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, handle: Handle) -> None:
        try:
            async for event in handle.events():
                await merged.put((i, event))
        except EngineError as e:
            await merged.put((i, e))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    streamed: list[list[int]] = [[] for _ in handles]   # each choice's tokens so far (its logprob texts' context)
    results: list[Completion | None] = [None] * len(handles)
    model = served.model_name
    try:
        for i in range(len(handles)):
            first = choice.first_chunk(i)
            if first is not None:
                yield _sse(envelope(rid, choice.chunk_kind, model, [first]))
        while any(r is None for r in results):
            i, item = await merged.get()
            if isinstance(item, EngineError):
                yield _sse(_engine_error(item).body())
                break  # the other choices are aborted below
            text = item.text or ""
            lp = None
            if item.logprobs is not None:
                lp = _logprob_pieces(served.tokenizer.decode, streamed[i], item.tokens, item.logprobs)
            streamed[i] += item.tokens
            if text or lp is not None or item.completion is not None:
                finish = item.completion.finish_reason if item.completion is not None else None
                yield _sse(envelope(rid, choice.chunk_kind, model, [choice.chunk(i, text, lp, finish)]))
            if item.completion is not None:
                results[i] = item.completion
        else:
            if include_usage:
                yield _sse(envelope(rid, choice.chunk_kind, model, [],
                                    {"usage": _usage([c for c in results if c is not None], n)}))
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for h, r in zip(handles, results):
            served.engine.release(h, r is not None)


# ---- choices --------------------------------------------------------------------------------------------------

# tokens of context a token's text is decoded in (a tokenizer may join or space a token by its neighbours)
_CONTEXT = 4


def _logprob_pieces(decode: Callable[[Sequence[int]], str], before: Sequence[int], tokens: Sequence[int],
                    entries: Sequence[tuple[float, dict[int, float]]]) -> tuple[list[str], list[Logprob]]:
    """Each token's text, and its logprob with the top-N as (text, token
    id, logprob), every candidate kept even where two decode alike: the
    text a token adds after the tokens before it (a tokenizer may join or
    space a token by its neighbours)."""
    pieces, tops, context = [], [], list(before[-_CONTEXT:])

    def piece(head: str, window: list[int], token: int) -> str:
        text = decode(window + [token])
        return text[len(head):] if text.startswith(head) else decode([token])

    for t, (lp, top) in zip(tokens, entries):
        window = context[-_CONTEXT:]
        head = decode(window)  # once per position, for the token and each of its top-N
        pieces.append(piece(head, window, t))
        tops.append((lp, [(piece(head, window, c), c, v) for c, v in top.items()]))
        context.append(t)
    return pieces, tops


class _Choice:
    """How one endpoint writes a choice, whole or as stream chunks."""
    id_prefix = kind = chunk_kind = ""

    def __init__(self, tokenizer: TextTokenizer, logprobs: int | None):
        self.tokenizer, self.logprobs = tokenizer, logprobs

    def pieces(self, c: Completion) -> tuple[list[str], list]:
        assert c.logprobs is not None
        return _logprob_pieces(self.tokenizer.decode, [], c.tokens, c.logprobs)

    def text(self, c: Completion) -> str:
        return c.text if c.text is not None else self.tokenizer.decode(c.tokens)

    def whole(self, i: int, c: Completion) -> dict:
        raise NotImplementedError

    def first_chunk(self, i: int) -> dict | None:
        return None

    def chunk(self, i: int, text: str, lp: tuple[list[str], list] | None, finish: str | None) -> dict:
        raise NotImplementedError


class _TextChoice(_Choice):
    id_prefix, kind, chunk_kind = "cmpl", "text_completion", "text_completion"

    def __init__(self, tokenizer: TextTokenizer, logprobs: int | None, echoed: list[list[int]] | None = None,
                 n: int = 1):
        """echoed: the prompts whose text (and log-probabilities, with
        logprobs) come before each choice's own; choice i is prompt i // n's."""
        super().__init__(tokenizer, logprobs)
        self._offsets: dict[int, int] = {}
        self.echoed, self.n = echoed, n

    def whole(self, i: int, c: Completion) -> dict:
        if self.echoed is not None:
            return self._echoed(i, c, self.echoed[i // self.n])
        lp = None if c.logprobs is None else completion_logprobs(*self.pieces(c), 0)
        return {"index": i, "text": self.text(c), "logprobs": lp, "finish_reason": c.finish_reason}

    def _echoed(self, i: int, c: Completion, prompt: list[int]) -> dict:
        """The prompt's text, then the generated text as it reads after the
        prompt (a tokenizer may space a token by its neighbours); with
        logprobs, the prompt's tokens first (the first one null)."""
        decode = self.tokenizer.decode
        head, whole, alone = decode(prompt), decode(prompt + c.tokens), decode(c.tokens)
        tail = whole[len(head):] if whole.startswith(head) else alone
        text = head + tail[:len(tail) - (len(alone) - len(self.text(c)))]  # less what a stop string cut
        lp = None
        if c.logprobs is not None:
            assert c.prompt_logprobs is not None
            pieces, entries = _logprob_pieces(decode, prompt[:1], prompt[1:], c.prompt_logprobs)
            before = completion_logprobs([decode(prompt[:1]), *pieces], [None, *entries], 0)
            after = completion_logprobs(*_logprob_pieces(decode, prompt, c.tokens, c.logprobs), len(head))
            lp = {key: before[key] + after[key] for key in before}
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

    def chunk(self, i: int, text: str, lp: tuple[list[str], list] | None, finish: str | None) -> dict:
        out = None
        if lp is not None:
            at = self._offsets.get(i, 0)
            out = completion_logprobs(lp[0], lp[1], at)
            self._offsets[i] = at + sum(len(p) for p in lp[0])
        return {"index": i, "text": text, "logprobs": out, "finish_reason": finish}


class _ChatChoice(_Choice):
    """reasoning: how the output's reasoning is told apart (None: it is not);
    tools: tool calls are parsed from the output (finish_reason tool_calls
    when there are some)."""
    id_prefix, kind, chunk_kind = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer: TextTokenizer, logprobs: int | None,
                 reasoning: Literal["open", "maybe"] | None = None, tools: ToolFormat | None = None):
        super().__init__(tokenizer, logprobs)
        self.reasoning, self.tools = reasoning, tools
        self._splitters: dict[int, Splitter] = {}
        # with tools, content that is only whitespace so far is held: a whole response with calls has no content
        # then (None), so the stream shows it only once other content follows, or at the end when no call came
        self._held: dict[int, str | None] = {}

    def whole(self, i: int, c: Completion) -> dict:
        lp = None if c.logprobs is None else chat_logprobs(*self.pieces(c))
        text = self.text(c)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish: str = c.finish_reason
        if self.reasoning is not None or self.tools is not None:
            thought, message["content"], calls = split_whole(text, self.reasoning, self.tools)
            if self.reasoning is not None:
                message["reasoning_content"] = thought
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}

    def first_chunk(self, i: int) -> dict | None:
        delta: dict[str, Any] = {"role": "assistant"} if self.tools is not None else {"role": "assistant",
                                                                                       "content": ""}
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}

    def chunk(self, i: int, text: str, lp: tuple[list[str], list] | None, finish: str | None) -> dict:
        delta: dict[str, Any] = {}
        if self.reasoning is None and self.tools is None:
            if text:
                delta["content"] = text
        else:
            splitter = self._splitters.setdefault(i, Splitter(self.reasoning, self.tools))
            before = splitter.calls
            parts = splitter.feed(text) + (splitter.finish() if finish is not None else [])
            content = "".join(p.text for p in parts if p.kind == "content")
            thought = "".join(p.text for p in parts if p.kind == "reasoning")
            if thought:
                delta["reasoning_content"] = thought
            calls = [p.call for p in parts if p.call is not None]
            shown: str | None = content or None
            if self.tools is not None:
                shown = self._content(i, content, splitter.calls > 0, finish is not None)
            if shown is not None:
                delta["content"] = shown
            if calls:  # each call whole in one delta: the openai client assembles them by index
                delta["tool_calls"] = [{"index": before + k, **call} for k, call in enumerate(calls)]
            if finish == "stop" and splitter.calls:
                finish = "tool_calls"
        return {"index": i, "delta": delta, "logprobs": None if lp is None else chat_logprobs(*lp),
                "finish_reason": finish}

    def _content(self, i: int, content: str, called: bool, last: bool) -> str | None:
        """The content to stream now, so that the deltas join to the whole
        response's: whitespace held until other content follows; at the
        end, dropped if a call came (the whole content is None), else shown
        ("" too, for an empty output)."""
        held = self._held.get(i, "")
        if held is None:  # other content already shown: everything goes out as it comes
            return content
        held += content
        if held.strip():
            self._held[i] = None
            return held
        self._held[i] = held
        if not last:
            return None
        return None if called else held


# ---- running it -----------------------------------------------------------------------------------------------

def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), not yet listening;
    OSError when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


# seconds the requests still in flight when the grace period ends get to send their error event and close
END_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server with a drain: SIGTERM or SIGINT marks the server
    draining (/health 503, new requests 503) while it keeps listening;
    once no request is in flight, or `grace` seconds have passed (the
    requests still in flight then end with an error event and [DONE]), it
    stops listening and returns (uvicorn itself would re-raise a caught
    SIGTERM after shutting down, ending the process with the signal rather
    than status 0). A second SIGINT stops at once, as does the loss of
    another process of a run over several (AsyncEngine.lost)."""

    def __init__(self, config: uvicorn.Config, served: Served, grace: float):
        super().__init__(config)
        self.served, self.grace = served, grace
        self._drain_started: float | None = None
        self._ended: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def stop(sig: int, frame: Any) -> None:
            if self.served.draining and sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
            self.served.draining = True

        with handled(stop):
            yield

    async def on_tick(self, counter: int) -> bool:
        if self.served.engine.lost is not None and not self.should_exit:  # its requests have ended with the news
            self.served.draining = self.should_exit = True
        if self.served.draining and not self.should_exit:
            now = time.monotonic()
            if self._drain_started is None:
                self._drain_started = now
            if not self.served.engine.in_flight:
                self.should_exit = True
            elif self._ended is None and now - self._drain_started >= self.grace:
                self.served.engine.end_all(f"the server is shutting down (its {self.grace:g} s grace period for "
                                           "requests in flight has passed)")
                self._ended = now
            elif self._ended is not None and now - self._ended >= END_S:
                self.should_exit = True
        return await super().on_tick(counter)


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline for a request's headers:
    a connection that opens and sends nothing, or sends part of a request's
    headers, is closed after `timeout_keep_alive` seconds (uvicorn's own
    timer covers only the wait between two requests, and any byte resets
    it). A body sent in part is the handler's to time out (408)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._between_requests():
            self._arm()
        elif self._headers_deadline is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._headers_deadline is None:
            self._headers_deadline = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _expire(self) -> None:
        self._headers_deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def run_server(served: Served, sock: socket.socket, grace: int) -> None:
    """Serve on the listening socket until SIGTERM or SIGINT; requests in
    flight then get `grace` seconds to finish (docs/serving.md)."""
    config = uvicorn.Config(create_app(served), log_level="warning", access_log=False, lifespan="on", http=_Protocol,
                            timeout_keep_alive=int(served.request_timeout), timeout_graceful_shutdown=int(END_S))
    _Server(config, served, grace).run(sockets=[sock])
