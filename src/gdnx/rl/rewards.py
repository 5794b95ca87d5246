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
import inspect
import json
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
    """The user's function, imported and its signature checked now (a module
    that does not import, for any reason, is a ValueError naming it)."""
    module, function = name.split(":")
    try:
        fn = getattr(importlib.import_module(module), function)
    except AttributeError:
        raise ValueError(f"train.rl.reward: {module} has no {function}") from None
    except (Exception, SystemExit) as e:  # ImportError, and whatever its module raises as it imports
        raise ValueError(f"train.rl.reward: cannot import {module} ({_one_line(e)})") from None
    if not callable(fn):
        raise ValueError(f"train.rl.reward: {name} is not callable")
    try:
        inspect.signature(fn).bind(completion="", example={})
    except TypeError as e:
        raise ValueError(f"train.rl.reward: {name} cannot be called as {function}(completion=..., example=...) "
                         f"({e})") from None
    except ValueError:  # a callable without a signature Python can read (a builtin): called as it is
        pass

    def call(completion: str, tokens: Sequence[int], example: dict) -> float:
        return fn(completion=completion, example=example)
    return call


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


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


def answer_problem(rl: RLConfig, example: dict) -> str | None:
    """Why an example's "answer" cannot be scored by the built-in reward that
    reads it (None: it can, or the reward reads none): a missing one, a
    null or an object for exact, one without a number for numeric (which
    would score every completion 0, with no word)."""
    if rl.reward not in ("exact", "numeric"):
        return None
    if "answer" not in example:
        return 'no "answer", which train.rl.reward reads'
    answer = example["answer"]
    if answer is None or isinstance(answer, (bool, dict, list)):
        return f'"answer" is {json.dumps(answer)[:60]}; train.rl.reward={rl.reward} compares it as text'
    if rl.reward == "numeric" and last_number(str(answer)) is None:
        return f'"answer" {json.dumps(answer)[:60]} holds no number, which train.rl.reward=numeric compares'
    return None


FLOAT32_MAX = float(np.finfo(np.float32).max)


def score(reward: Reward, name: str, completion: str, tokens: Sequence[int], example: dict, where: str,
          timeout_s: float | None = None) -> float:
    """The reward of one completion, bounded: a call past `timeout_s`
    seconds (train.rl.reward_timeout_s), one that raises (SystemExit too)
    and a value that is not a number float32 holds finite (the loss's) are
    each a ValueError naming train.rl.reward and `where`."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("value", reward(completion, tokens, example)))
        except (Exception, SystemExit) as e:
            outcome.append(("raised", e))

    if timeout_s is None:
        run()
    else:  # a daemon thread: a call that never returns does not keep the process from ending
        thread = threading.Thread(target=run, daemon=True, name="gdnx-reward")
        thread.start()
        thread.join(timeout_s)
        if not outcome:
            raise ValueError(f"train.rl.reward: {name} did not return within {timeout_s:g} s for {where} "
                             "(train.rl.reward_timeout_s)")
    kind, value = outcome[0]
    if kind == "raised":
        raise ValueError(f"train.rl.reward: {name} raised {_one_line(value)} for {where}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
            or abs(float(value)) > FLOAT32_MAX:
        raise ValueError(f"train.rl.reward: {name} returned {value!r:.80} for {where}; expected a number "
                         "float32 holds finite")
    return float(value)
