"""Chat templates rendered as transformers renders them, and the spans of
the assistant's turns."""

import json

import pytest
from transformers import AutoTokenizer

from gdnx.data.chat import ChatTemplate
from tests.helpers.hf_models import write_chat_tokenizer

CONVERSATION = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w20 w21 w22"},
                {"role": "assistant", "content": "w30 w31"}, {"role": "user", "content": "w40"},
                {"role": "assistant", "content": "w50 w51 w52"}]


def test_rendering_equals_transformers(tmp_path):
    write_chat_tokenizer(tmp_path)
    theirs, ours = AutoTokenizer.from_pretrained(tmp_path), ChatTemplate(tmp_path)
    for upto in (2, 3, 5):
        for prompt in (False, True):
            assert ours.render(CONVERSATION[:upto], add_generation_prompt=prompt) == theirs.apply_chat_template(
                CONVERSATION[:upto], tokenize=False, add_generation_prompt=prompt)


def test_assistant_spans_are_the_turns_and_their_end_marker(tmp_path):
    write_chat_tokenizer(tmp_path)
    text, spans = ChatTemplate(tmp_path).assistant_spans(CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["w30 w31<|im_end|>\n", "w50 w51 w52<|im_end|>\n"]


def test_a_template_file_wins_and_errors_name_what_is_wrong(tmp_path):
    write_chat_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="the chat template refused the messages: unknown role tool"):
        ChatTemplate(tmp_path).render([{"role": "tool", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert ChatTemplate(tmp_path).render(CONVERSATION[:2]) == "[w10 w11][w20 w21 w22]"
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not valid jinja2"):
        ChatTemplate(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(tmp_path)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    """A template that renders an assistant turn differently once a later
    turn follows (as thinking-stripping templates do) leaves no span."""
    write_chat_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[old]{% else %}"
        "{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="renders message 3 \\(assistant\\) differently"):
        ChatTemplate(tmp_path).assistant_spans(CONVERSATION)
