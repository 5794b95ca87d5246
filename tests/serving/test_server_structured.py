"""Structured outputs through the server, driven by the official openai
client (in process: the client's HTTP goes to the app through Starlette's
TestClient): response_format json_schema and json_object on chat
completions, vLLM's structured_outputs extension on completions, streamed
and whole alike, and each mistake a 400 naming its field. A random tiny
model with a byte-level BPE vocabulary: only the constraint makes an
output valid."""

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
from gdnx.serving.server import Served, create_app
from tests.helpers.configs import TINY_HYBRID
from tests.hf_models import BPE_VOCAB, write_bpe_tokenizer
from tests.serving.test_grammar import SCHEMA

pytestmark = pytest.mark.xdist_group("grammar")

TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    tok = HFTokenizer(str(path / "tokenizer.json"))
    model = CausalLM(ModelConfig(**{**TINY_HYBRID, "vocab_size": BPE_VOCAB}), seed=3)
    engine = Engine(model, max_slots=4, max_length=128, block_size=16, decode_steps=4, tokenizer=tok,
                    eos_token_ids=[0], max_logprobs=5, speculative=None,
                    grammars=Grammars((path / "tokenizer.json").read_text(), BPE_VOCAB, eos_id=0))
    served = Served(AsyncEngine(engine, Metrics(), max_queue=8), tok, "tiny", 128, ChatTemplate(path))
    with TestClient(create_app(served)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


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
])
def test_each_mistake_is_a_400_naming_its_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert r.choices[0].message.content is not None  # and it keeps serving
