"""The verifiers and a user's reward function, and what they refuse."""

import json
import re
import sys

import pytest

from gdnx.config.schema import RLConfig
from gdnx.rl.rewards import last_number, make_reward, score


def _reward(**fields):
    return make_reward(RLConfig(**fields), tokenizer=None, vocab_size=256, eos_id=0)


def test_builtin_verifiers():
    exact = _reward(reward="exact")
    assert exact(" 42 \n", [], {"answer": "42"}) == 1.0 and exact("42.", [], {"answer": "42"}) == 0.0
    numeric = _reward(reward="numeric")
    assert numeric("so the total is 1,250.0 apples", [], {"answer": 1250}) == 1.0
    assert numeric("12 then 13", [], {"answer": "12"}) == 0.0 and numeric("none", [], {"answer": "1"}) == 0.0
    assert last_number("x = -3.5e2!") == -350.0
    regex = _reward(reward="regex", reward_pattern=r"<answer>\d+</answer>")
    assert regex("so <answer>7</answer>", [], {}) == 1.0 and regex("<answer>x</answer>", [], {}) == 0.0


def test_json_reward_through_the_grammar_engine(tmp_path):
    from tests.helpers.hf_models import write_bpe_tokenizer

    vocab = write_bpe_tokenizer(tmp_path)  # byte-level BPE: every string can be written; <|endoftext|> is 0
    path = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                         "additionalProperties": False})
    reward = make_reward(RLConfig(reward="json", reward_schema=schema), tokenizer=str(path), vocab_size=vocab,
                         eos_id=0)
    ids = lambda text: tok.encode(text).ids + [0]  # noqa: E731
    assert reward('{"n": 3}', ids('{"n": 3}'), {}) == 1.0
    assert reward('{"n": "3"}', ids('{"n": "3"}'), {}) == 0.0
    assert reward('{"n": 3', ids('{"n": 3'), {}) == 0.0  # not finished


def test_user_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(completion, example):\n    return len(completion) / example['scale']\n"
        "def bad(completion, example):\n    return float('nan')\n"
        "def text(completion, example):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = _reward(reward="my_rewards:length")
    assert score(reward, "my_rewards:length", "abcd", [], {"scale": 2}, "line 1") == 2.0
    for name in ("bad", "text"):
        with pytest.raises(ValueError, match=f"train.rl.reward: my_rewards:{name} returned .* for line 1; expected "
                                             "a number float32 holds finite"):
            score(_reward(reward=f"my_rewards:{name}"), f"my_rewards:{name}", "x", [], {}, "line 1")
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("body,says", [
    ("return 1e39", "returned 1e+39 for line 7; expected a number float32 holds finite"),  # inf once cast
    ("return None", "returned None for line 7"),
    ("return [1.0]", "returned [1.0] for line 7"),
    ("raise ValueError('no answer field')", "raised ValueError: no answer field for line 7"),
    ("raise SystemExit(0)", "raised SystemExit: 0 for line 7"),
    ("raise KeyError('answer')", "raised KeyError: 'answer' for line 7"),
    ("import time; time.sleep(30)", "did not return within 0.5 s for line 7 (train.rl.reward_timeout_s)"),
])
def test_a_users_reward_runs_bounded(tmp_path, monkeypatch, body, says):
    """Every way a user's reward can fail on one completion, a hang
    included, is one ValueError naming train.rl.reward and the prompt:
    the run stops with that line (status 2), not a traceback, an exit 0
    or a run that never ends."""
    (tmp_path / "bounded_rewards.py").write_text(f"def f(completion, example):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bounded_rewards", raising=False)
    with pytest.raises(ValueError, match=re.escape(f"train.rl.reward: bounded_rewards:f {says}")):
        score(_reward(reward="bounded_rewards:f"), "bounded_rewards:f", "x", [], {}, "line 7", timeout_s=0.5)


@pytest.mark.parametrize("source,says", [
    ("def f(completion, example:\n    return 1\n", "cannot import bounded_bad (SyntaxError: "),
    ("raise RuntimeError('needs a GPU')\n", "cannot import bounded_bad (RuntimeError: needs a GPU)"),
    ("def f(text):\n    return 1\n", "bounded_bad:f cannot be called as f(completion=..., example=...)"),
    ("f = 3\n", "bounded_bad:f is not callable"),
])
def test_a_reward_that_cannot_run_is_refused_before_the_first_rollout(tmp_path, monkeypatch, source, says):
    (tmp_path / "bounded_bad.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bounded_bad", raising=False)
    with pytest.raises(ValueError, match=re.escape(f"train.rl.reward: {says}")):
        _reward(reward="bounded_bad:f")


@pytest.mark.parametrize("fields,message", [
    (dict(reward="no_such_module_x:f"), "train.rl.reward: cannot import no_such_module_x"),
    (dict(reward="json:nothing_there"), "train.rl.reward: json has no nothing_there"),
    (dict(reward="regex", reward_pattern="("), "train.rl.reward_pattern: not a regular expression"),
    (dict(reward="json", reward_schema="{not json"), "train.rl.reward_schema: neither a JSON schema"),
    (dict(reward="json", reward_schema="{}"), "train.rl.reward: json validity is checked by the grammar engine"),
])
def test_refused_rewards(fields, message):
    with pytest.raises(ValueError, match=message):
        _reward(**fields)
