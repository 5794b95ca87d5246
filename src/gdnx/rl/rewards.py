"""Rewards for reinforcement learning (train.rl.reward): the built-in
verifiers and a user's function, each scoring one completion of one
example.

exact: the completion's text, stripped, equals the example's answer
(stripped). numeric: the last number in the completion equals the
answer's (relative tolerance 1e-6). regex: train.rl.reward_pattern is
found in the completion (re.search). json: the completion's tokens are a
document the grammar engine (llguidance) accepts under
train.rl.reward_schema, whole. module:function: the function, imported
once, called as function(completion=text, example=the JSONL object) and
returning a finite number.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gdnx.config.schema import RLConfig

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")

# (completion text, its token ids, the example) -> reward
Reward = Callable[[str, Sequence[int], dict], float]


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands commas dropped), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def exact(completion: str, tokens: Sequence[int], example: dict) -> float:
    return float(completion.strip() == str(example["answer"]).strip())


def numeric(completion: str, tokens: Sequence[int], example: dict) -> float:
    got, want = last_number(completion), last_number(str(example["answer"]))
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12))


def _regex(pattern: str) -> Reward:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"train.rl.reward_pattern: not a regular expression ({e})") from None
    return lambda completion, tokens, example: float(compiled.search(completion) is not None)


def _json(schema: str, tokenizer: str | None, vocab_size: int, eos_id: int) -> Reward:
    from gdnx.serving.grammar import Grammars
    from gdnx.serving.params import Structured

    text = Path(schema).read_text() if schema.endswith(".json") and Path(schema).is_file() else schema
    try:
        json.loads(text)
    except ValueError:
        raise ValueError("train.rl.reward_schema: neither a JSON schema nor a .json file holding one") from None
    if tokenizer is None:
        raise ValueError("train.rl.reward: json validity is checked by the grammar engine, which reads a "
                         "tokenizer.json; set data.tokenizer")
    grammars = Grammars(Path(tokenizer).read_text(), vocab_size, eos_id)
    constraint = Structured("json", text, field="train.rl.reward_schema")
    grammars.matcher(constraint)  # compiled now: a schema it refuses is named before anything runs

    def valid(completion: str, tokens: Sequence[int], example: dict) -> float:
        matcher = grammars.matcher(constraint)
        body = list(tokens)
        if body and body[-1] == eos_id:
            body = body[:-1]
        if any(matcher.consume(t) is not None for t in body):
            return 0.0
        return float(matcher.consume(eos_id) is None)  # the document is complete: only the end may follow
    return valid


def _user(name: str) -> Reward:
    module, function = name.split(":")
    try:
        fn = getattr(importlib.import_module(module), function)
    except ImportError as e:
        raise ValueError(f"train.rl.reward: cannot import {module} ({e})") from None
    except AttributeError:
        raise ValueError(f"train.rl.reward: {module} has no {function}") from None
    if not callable(fn):
        raise ValueError(f"train.rl.reward: {name} is not callable")

    def call(completion: str, tokens: Sequence[int], example: dict) -> float:
        return fn(completion=completion, example=example)
    return call


def make_reward(rl: RLConfig, *, tokenizer: str | None, vocab_size: int, eos_id: int) -> Reward:
    """train.rl.reward's scorer, checked now (ValueError naming the field)."""
    if rl.reward == "exact":
        return exact
    if rl.reward == "numeric":
        return numeric
    if rl.reward == "regex":
        assert rl.reward_pattern is not None  # RLConfig requires it
        return _regex(rl.reward_pattern)
    if rl.reward == "json":
        assert rl.reward_schema is not None
        return _json(rl.reward_schema, tokenizer, vocab_size, eos_id)
    return _user(rl.reward)


def needs_answer(rl: RLConfig) -> bool:
    """Whether the reward reads each example's answer."""
    return rl.reward in ("exact", "numeric")


def score(reward: Reward, name: str, completion: str, tokens: Sequence[int], example: dict, where: str) -> float:
    """The reward of one completion, refused unless a finite number."""
    value: Any = reward(completion, tokens, example)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"train.rl.reward: {name} returned {value!r} for {where}; expected a finite number")
    return float(value)
