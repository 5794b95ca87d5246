"""Structured outputs through the server, driven by the official openai
client (in process: the client's HTTP goes to the app through Starlette's
TestClient): response_format json_schema and json_object on chat
completions, vLLM's structured_outputs extension on completions, streamed
and whole alike, and each mistake a 400 naming its field. A random tiny
model with a byte-level BPE vocabulary: only the constraint makes an
output valid."""

import contextlib
import json
import re

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from gdnx.config import ModelConfig
from gdnx.data.chat import ChatTemplate
from gdnx.data.text import HFTokenizer
from gdnx.models import CausalLM
from gdnx.serving import Engine
from gdnx.serving.async_engine import AsyncEngine
from gdnx.serving.grammar import Grammars
from gdnx.serving.metrics import Metrics
from gdnx.serving.parsers import TOOL_FORMATS
from gdnx.serving.server import Served, create_app
from tests.helpers.configs import TINY_HYBRID
from tests.helpers.hf_models import BPE_VOCAB, write_bpe_tokenizer
from tests.helpers.serving import SCHEMA

pytestmark = pytest.mark.xdist_group("grammar")

# lists the tools, renders assistant tool calls and tool results, opens a reasoning block when asked
TEMPLATE = ("{% if tools %}{% for t in tools %}{{ 'tool: ' + t['function']['name'] + '\\n' }}{% endfor %}{% endif %}"
            "{% for m in messages %}{{ m['role'] + ': ' + (m['content'] or '') }}"
            "{% for c in m.get('tool_calls', []) %}{{ '<tool_call>' + c['function']['name'] + '</tool_call>' }}"
            "{% endfor %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% if enable_thinking %}{{ '<think>' }}{% endif %}"
            "{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"type": "string",
                                                                                   "maxLength": 8}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "additionalProperties": False,
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


KIMI_TAGS = list(TOOL_FORMATS["kimi_k2"].tags)


# Qwen's published tokenizers: the chat tokens added and special, the tool-call and reasoning tags added as one
# token each but not special (decoded as text)
QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The checkpoint's files (a byte-level BPE tokenizer laid out as Qwen's, <|endoftext|> special too, with
    Kimi's tool-call tags as special tokens, as its tokenizer has them; the chat template) and the model."""
    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(path, BPE_VOCAB - len(KIMI_TAGS + QWEN_SPECIAL + QWEN_ADDED))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in KIMI_TAGS + QWEN_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    assert all(tok.encode(t, add_special_tokens=False).ids == [tok.token_to_id(t)] for t in QWEN_ADDED)
    assert tok.get_vocab_size() <= BPE_VOCAB
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    return path, CausalLM(ModelConfig(**{**TINY_HYBRID, "vocab_size": BPE_VOCAB}), seed=3)


@contextlib.contextmanager
def _client(files, tool_parser: str):
    path, model = files
    tok = HFTokenizer(str(path / "tokenizer.json"))
    # engines on one model with the same settings share their compiled programs
    engine = Engine(model, max_slots=4, max_length=256, block_size=16, decode_steps=4, tokenizer=tok,
                    eos_token_ids=[0], max_logprobs=5, speculative=None,
                    grammars=Grammars((path / "tokenizer.json").read_text(), BPE_VOCAB, eos_id=0))
    served = Served(AsyncEngine(engine, Metrics(), max_queue=8), tok, "tiny", 256, ChatTemplate(path),
                    tool_parser=tool_parser, reasoning_parser="qwen3")
    with TestClient(create_app(served)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def client(files):
    with _client(files, "hermes") as c:
        yield c


def test_chat_json_schema_outputs_validate(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a person"}], n=3, temperature=1.0, seed=4,
        max_tokens=80, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                              "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_object(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=1.0,
                                       seed=2, max_tokens=80, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an object the random model keeps open to max_tokens: a JSON prefix
        assert r.choices[0].message.content.startswith("{")


def test_completions_structured_outputs_stream_as_they_finish_whole(client):
    body = dict(model="tiny", prompt="code:", temperature=1.0, seed=7, max_tokens=20, logprobs=2,
                extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    whole = client.completions.create(**body)
    text = whole.choices[0].text
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text) and whole.choices[0].finish_reason == "stop"
    assert all(len(top) >= 1 for top in whole.choices[0].logprobs.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
    assert streamed == text
    pick = client.completions.create(model="tiny", prompt="?", max_tokens=10, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert pick.choices[0].text in ("yes", "no", "maybe")


@pytest.mark.parametrize("body,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "response_format"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (dict(structured_outputs={"regex": "("}), "structured_outputs.regex"),
    (dict(structured_outputs={"grammar": "start: nothing_here"}), "structured_outputs.grammar"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools.0.function.name"),
    # OpenAI's rule for names: a tool format's closing tag in one ended its call early (no tool_calls, "stop")
    *((dict(tools=[WEATHER, {"type": "function", "function": {"name": name}}], tool_choice="required"),
       "tools.1.function.name") for name in ("get</tool_call>", "a b", "x" * 65)),
    # an invalid parameters schema, whatever tool_choice is (the template shows it to the model)
    *((dict(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            **choice), "tools.1.function.parameters") for choice in ({}, {"tool_choice": "auto"},
                                                                      {"tool_choice": "none"},
                                                                      {"tool_choice": "required"})),
    (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"raise_exception": "not a function"}), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"eos_token": "<x>"}), "chat_template_kwargs"),
])
def test_each_mistake_is_a_400_naming_its_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert r.choices[0].message.content is not None  # and it keeps serving


def _validate_call(call, tools, id_prefix="call_"):
    spec = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    assert call.type == "function" and call.id.startswith(id_prefix)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_names_a_listed_tool_with_valid_arguments(client, tool_choice):
    tools = [WEATHER, TIME]
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                           tools=tools, tool_choice=tool_choice, temperature=1.0, seed=seed,
                                           max_tokens=150, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert len(choice.message.tool_calls) == 1
        _validate_call(choice.message.tool_calls[0], tools)
        if isinstance(tool_choice, dict):
            assert choice.message.tool_calls[0].function.name == "get_time"


def _streamed_calls(client, body) -> tuple[list[tuple[str, object]], str | None]:
    """The (name, arguments) of the calls a streamed response's deltas assemble into, as the openai client
    assembles them, and its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


def test_tool_call_deltas_assemble_into_the_whole_responses_calls(client):
    body = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME],
                tool_choice="required", temperature=1.0, seed=5, max_tokens=150)
    whole = client.chat.completions.create(**body).choices[0]
    calls, finish = _streamed_calls(client, body)
    assert finish == "tool_calls"
    assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


@pytest.mark.parametrize("parser", ["kimi_k2", "olmo3"])
def test_forced_calls_in_the_other_formats_parse_whole_and_streamed(files, parser):
    """Kimi Linear's format (its tags special tokens: kept in the text, named
    as special tokens in the grammar) and OLMo 3's Python-style calls."""
    tools = [WEATHER, TIME]
    body = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=tools,
                tool_choice="required", temperature=1.0, max_tokens=150)
    with _client(files, parser) as client:
        for seed in range(2):
            # several calls: this random model may write calls until max_tokens ("length")
            many = dict(seed=seed, parallel_tool_calls=seed == 1)
            whole = client.chat.completions.create(**body, **many).choices[0]
            assert whole.finish_reason == "tool_calls" or many["parallel_tool_calls"], whole.message
            assert len(whole.message.tool_calls) == 1 or many["parallel_tool_calls"]
            for call in whole.message.tool_calls:
                _validate_call(call, tools, f"functions.{call.function.name}:" if parser == "kimi_k2" else "call_")
            assert _streamed_calls(client, {**body, **many})[0] == \
                [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_auto_parses_calls_from_free_text_and_tool_messages_render(client):
    """auto: the output is parsed; a structured_outputs grammar makes this
    random model write a call, so there is one to parse."""
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{3}"\}\}\n</tool_call>'
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                       tools=[WEATHER], tool_choice="auto", temperature=1.0, seed=1, max_tokens=150,
                                       extra_body={"structured_outputs": {"regex": call}})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    _validate_call(m.tool_calls[0], [WEATHER])
    follow = [{"role": "user", "content": "weather?"},
              {"role": "assistant", "content": None, "tool_calls": [m.tool_calls[0].model_dump()]},
              {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"}]
    again = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], max_tokens=3)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result in the prompt
    none = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                          tool_choice="none", max_tokens=150, temperature=1.0, seed=1,
                                          extra_body={"structured_outputs": {"regex": call}})
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content


def test_reasoning_is_split_whole_and_streamed(client):
    body = dict(model="tiny", messages=[{"role": "user", "content": "think"}], temperature=1.0, seed=3,
                max_tokens=40, extra_body={"structured_outputs": {"regex": "[a-z]{4}</think>[a-z]{2}"},
                                           "chat_template_kwargs": {"enable_thinking": True}})
    m = client.chat.completions.create(**body).choices[0].message
    assert len(m.reasoning_content) == 4 and len(m.content) == 2, m
    thought = content = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (thought, content) == (m.reasoning_content, m.content)
    plain = dict(body, extra_body={"structured_outputs": {"regex": "<think>[a-z]{2}</think>\n\n[a-z]{3}"}})
    m = client.chat.completions.create(**plain).choices[0].message  # the model opens the block itself
    assert len(m.reasoning_content) == 2 and len(m.content) == 3, m


def test_forced_calls_greedy_and_several_choices_on_qwens_tokenizer_layout(client):
    """<tool_call> is one added token that is not special (Qwen's layout): a
    forced call drawn greedily and each of n = 3 sampled choices names a
    listed tool with valid arguments, whole and streamed alike."""
    tools = [WEATHER, TIME]
    body = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=tools,
                tool_choice="required", max_tokens=150, parallel_tool_calls=False)
    greedy = client.chat.completions.create(**body, temperature=0.0).choices[0]
    assert greedy.finish_reason == "tool_calls" and len(greedy.message.tool_calls) == 1, greedy.message
    _validate_call(greedy.message.tool_calls[0], tools)
    assert _streamed_calls(client, {**body, "temperature": 0.0}) == \
        ([(c.function.name, json.loads(c.function.arguments)) for c in greedy.message.tool_calls], "tool_calls")
    several = client.chat.completions.create(**body, temperature=1.0, seed=9, n=3)
    assert len(several.choices) == 3
    for choice in several.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message
        _validate_call(choice.message.tool_calls[0], tools)


def test_a_token_the_grammar_refuses_after_its_mask_allowed_it_fails_that_request_alone(client, monkeypatch,
                                                                                         caplog):
    """The mask and the grammar disagreeing is a bug, not the client's: that
    request alone is a 500 whose one line names the token and the constraint
    (its field and kind); the details are logged once; the server goes on."""
    from gdnx.serving.grammar import Matcher

    real, calls = Matcher.consume, []

    def refuses_once(self, token):
        calls.append(token)
        if len(calls) == 1:
            return "Parser Error: token doesn't satisfy the grammar\n<state>\nTokens: x\n</state>"
        return real(self, token)

    monkeypatch.setattr(Matcher, "consume", refuses_once)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                       response_format={"type": "json_object"})
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert "\n" not in message, message
    assert f"the output constraint (response_format, json) refused token {calls[0]}: Parser Error" in message
    assert sum("<state>" in r.getMessage() for r in caplog.records) == 1
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                       temperature=1.0, seed=1, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


def test_a_constraint_the_grammar_engine_fails_on_mid_output_is_a_422_naming_its_field(client, monkeypatch):
    """The grammar engine in error (a limit passed mid-output) allows only
    the end: the request is answered 422 naming the constraint's field,
    streamed or not, never a "stop"; the server goes on."""
    from gdnx.serving.grammar import Matcher

    calls: list = []
    monkeypatch.setattr(Matcher, "error", lambda self: "lexer error: too many expressions constructed"
                        if calls.append(self) or len(calls) > 1 else None)
    body = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=20,
                response_format={"type": "json_object"})
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(**body)
    assert e.value.body["param"] == "response_format", e.value.body
    assert "could not be honoured: the grammar engine failed" in e.value.body["message"]
    calls.clear()
    with pytest.raises(openai.APIError, match="could not be honoured: the grammar engine failed"):
        list(client.chat.completions.create(**body, stream=True))  # the stream's error event, not a "stop"
    monkeypatch.undo()
    r = client.chat.completions.create(**{**body, "max_tokens": 40})
    assert r.choices[0].message.content.startswith("{")


def test_a_constraint_compiling_holds_up_no_other_request(client, monkeypatch):
    """A request's constraint compiles off the event loop and off the
    engine's thread: while one compiles (held here until released), a
    plain request is answered; then the constrained one is too."""
    import threading

    from gdnx.serving.grammar import Grammars

    started, release = threading.Event(), threading.Event()
    real = Grammars._compile

    def held(self, s, tokenizer):
        if s.value == "[0-9]{5}":
            started.set()
            release.wait(120)
        return real(self, s, tokenizer)

    monkeypatch.setattr(Grammars, "_compile", held)
    got: dict = {}

    def constrained():
        got["text"] = client.completions.create(model="tiny", prompt="n:", max_tokens=10, temperature=1.0, seed=2,
                                                extra_body={"structured_outputs": {"regex": "[0-9]{5}"}}
                                                ).choices[0].text

    waiting = threading.Thread(target=constrained)
    waiting.start()
    try:
        assert started.wait(120)
        plain = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0.0)
        assert plain.choices[0].text is not None and "text" not in got  # answered while the other compiles
    finally:
        release.set()
        waiting.join(120)
    assert re.fullmatch("[0-9]{5}", got["text"])


@pytest.mark.parametrize("regex", [
    r'hello <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "abc"\}\}\n</tool_call>',
    r' <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "abc"\}\}\n</tool_call>\n ',
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "abc"\}\}\n</tool_call> bye',
    r'<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>',
    r' \n ',  # only whitespace, no call: the content is that whitespace
])
def test_streamed_content_joins_to_the_whole_responses_content(client, regex):
    """With tools parsed, the content deltas of a stream join to the whole
    response's content: whitespace beside calls is none (None) in both, text
    around them the same text."""
    body = dict(model="tiny", messages=[{"role": "user", "content": "w"}], tools=[WEATHER, TIME],
                tool_choice="auto", temperature=1.0, seed=1, max_tokens=150,
                extra_body={"structured_outputs": {"regex": regex}})
    whole = client.chat.completions.create(**body).choices[0].message
    parts = [c.delta.content for chunk in client.chat.completions.create(**body, stream=True)
             for c in chunk.choices if c.delta.content is not None]
    assert whole.content == ("".join(parts) if parts else None), (whole.content, parts)
