"""RL prompts: text and chat messages encoded as a serving request's,
the held-out share, each rollout's prompts a function of (seed, rollout),
and the files refused naming the line."""

import json

import pytest

from gdnx.config.schema import RLConfig
from gdnx.rl.prompts import read_prompts, step_prompts
from gdnx.rl.rewards import answer_problem
from tests.helpers.hf_models import write_chat_tokenizer

EXACT = dict(answer=lambda example: answer_problem(RLConfig(reward="exact"), example))
ANY = dict(answer=lambda example: None)


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_text_and_messages(tmp_path):
    write_chat_tokenizer(tmp_path)
    from gdnx.data.chat import ChatTemplate
    from tokenizers import Tokenizer

    messages = [{"role": "user", "content": "w40 w41"}]
    path = _write(tmp_path / "p.jsonl", [{"messages": messages, "answer": "w42"}, {"prompt": "w43", "answer": "x"}])
    got = read_prompts(path, tokenizer=str(tmp_path / "tokenizer.json"), longest=100, **EXACT, vocab_size=4096,
                       val_fraction=0.0, seed=0)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rendered = ChatTemplate(tmp_path).render(messages, add_generation_prompt=True)
    by_answer = {p.example["answer"]: p.tokens for p in got.train}
    assert by_answer["w42"] == tok.encode(rendered, add_special_tokens=False).ids
    assert by_answer["x"] == tok.encode("w43").ids and got.evaluation == []
    assert read_prompts(_write(tmp_path / "b.jsonl", [{"prompt": "hé"}]), tokenizer=None, longest=9, **ANY,
                        vocab_size=256, val_fraction=0.0, seed=0).train[0].tokens == list("hé".encode())


def test_held_out_share_and_rollout_order(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    got = read_prompts(path, tokenizer=None, longest=9, **ANY, vocab_size=256, val_fraction=0.2, seed=1)
    assert len(got.train) == 8 and len(got.evaluation) == 2
    assert not {p.where for p in got.train} & {p.where for p in got.evaluation}
    first = [p.where for p in step_prompts(got.train, 3, 0, 4)] + [p.where for p in step_prompts(got.train, 3, 1, 4)]
    assert sorted(first) == sorted(p.where for p in got.train)  # an epoch: each prompt once
    assert [p.where for p in step_prompts(got.train, 3, 1, 4)] == first[4:]  # a function of (seed, rollout)
    assert [p.where for p in step_prompts(got.train, 4, 0, 4)] != first[:4]


@pytest.mark.parametrize("lines,kwargs,message", [
    (["{not json"], {}, r"data.path: .*p.jsonl line 1: not a JSON object"),
    ([{"prompt": "abc"}], EXACT, r"p.jsonl line 1: no \"answer\""),
    # answers a built-in reward would score 0 every time, with no word
    ([{"prompt": "abc", "answer": None}], EXACT, r"line 1: \"answer\" is null; train.rl.reward=exact compares it"),
    ([{"prompt": "abc", "answer": "many"}], dict(answer=lambda e: answer_problem(RLConfig(reward="numeric"), e)),
     r"line 1: \"answer\" \"many\" holds no number, which train.rl.reward=numeric compares"),
    # a prompt past the model's vocabulary ("c" is byte 99)
    ([{"prompt": "abc"}], {"vocab_size": 99}, r"model.vocab_size: the prompt at .*line 1 holds token 99, past the "
                                              r"model's 99 \(the tokenizer, raw bytes, has 256\)"),
    ([{"prompt": "a" * 20}], {}, r"data.seq_len: the prompt at .*line 1 is 20 tokens"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], {}, "raw bytes have none"),
    ([{"text": "hi"}], {}, r"expected \{\"messages\": \[...\]\} or a non-empty string \"prompt\""),
])
def test_refused_prompts(tmp_path, lines, kwargs, message):
    path = _write(tmp_path / "p.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        read_prompts(path, **{"tokenizer": None, "longest": 9, **ANY, "vocab_size": 256, "val_fraction": 0.0,
                              "seed": 0, **kwargs})
