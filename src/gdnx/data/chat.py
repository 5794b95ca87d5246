"""Chat templates as transformers renders them: the jinja2 template of a
tokenizer's directory (chat_template.jinja, or tokenizer_config.json's
chat_template), in a sandboxed environment with the same settings and
helpers (trim_blocks, lstrip_blocks, loop controls, raise_exception, a
tojson that does not escape HTML, strftime_now), given the messages,
add_generation_prompt and the tokenizer's special tokens.

Which characters of a rendered conversation are the assistant's: each
assistant turn is what the conversation up to it adds to the conversation
before it rendered with add_generation_prompt (the turn's content and its
end marker, without the role header).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """{% generation %} ... {% endgeneration %} (templates that mark the
    assistant's text for transformers' assistant mask) renders its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an
    AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ReservedVariable(ValueError):
    """A template variable given to render that the template owns."""


class ChatTemplate:
    """The chat template of the tokenizer in `directory`."""

    def __init__(self, directory: Path):
        config_file = directory / "tokenizer_config.json"
        config: dict = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except ValueError:
                raise ValueError(f"{config_file}: not valid JSON") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text()
        if not isinstance(source, str) or not source:
            raise ValueError(f"{directory}: no chat template (chat_template.jinja, or chat_template in "
                             "tokenizer_config.json) to render {\"messages\": ...} with; add one, or write the "
                             "examples as {\"prompt\": ..., \"completion\": ...}")
        self.source = source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{directory}: the chat template is not valid jinja2 ({e.message}, line {e.lineno})") \
                from None
        self.special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        # what a caller's template variables may not replace: the conversation, the special tokens, the
        # template's functions (jinja2's and the ones above)
        self.reserved = frozenset({"messages", "add_generation_prompt", "tools", "documents", *self.special,
                                   *env.globals})

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None,
               variables: dict[str, Any] | None = None) -> str:
        """The conversation as text; ValueError with the template's own
        message when it refuses them (a role it does not know, say). tools:
        the functions the model may call, as the template lists them;
        variables: the template's own (enable_thinking, ...), none of
        `reserved` (ReservedVariable naming it)."""
        kwargs = variables or {}
        if taken := sorted(self.reserved & set(kwargs)):
            raise ReservedVariable(f"{taken[0]!r} is the chat template's own; it cannot be set")
        try:
            return self.template.render(**{**kwargs, **self.special}, messages=messages,
                                        add_generation_prompt=add_generation_prompt, tools=tools, documents=None)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its
        assistant turns."""
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(f"the chat template renders message {i + 1} (assistant) differently once later "
                                 "messages follow, so its tokens cannot be told apart; write the example as "
                                 "{\"prompt\": ..., \"completion\": ...}")
            spans.append((len(before), len(upto)))
        return text, spans
