"""Prompts for reinforcement learning (data.source=rl): a .jsonl file of
examples, each {"messages": [...]} (rendered with the tokenizer's chat
template and its generation prompt) or {"prompt": "..."} (text as it is),
with the reference "answer" the built-in verifiers read and any other
fields a user's reward function reads. A share of them (data.val_fraction)
is held out for evaluation; the order of the rest is a function of the
seed alone, so a resumed run draws the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gdnx.data.chat import ChatTemplate
from gdnx.data.sft import jsonl_objects
from gdnx.data.text import HFTokenizer


class Prompt(NamedTuple):
    tokens: list[int]
    example: dict   # the JSONL object (the reward reads its answer)
    where: str      # file and line, for messages that name it


class Prompts(NamedTuple):
    train: list[Prompt]
    evaluation: list[Prompt]


def _read(path: Path) -> list[tuple[str, dict]]:
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"data.path: no .jsonl file at {path}")
    try:
        return [(f"{f} line {n}", example) for f in files for n, example in jsonl_objects(f)]
    except ValueError as e:
        raise ValueError(f"data.path: {e}") from None


class PromptEncoder:
    """An example's prompt -> token ids (bytes without data.tokenizer)."""

    def __init__(self, tokenizer: str | None):
        self.hf = None if tokenizer is None else HFTokenizer(tokenizer)
        self.directory = None if tokenizer is None else Path(tokenizer).parent
        self._template: ChatTemplate | None = None

    def encode(self, example: dict, where: str) -> list[int]:
        if "messages" in example:
            messages = example["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise ValueError(f"data.path: {where}: \"messages\" must be a non-empty list of "
                                 "{\"role\", \"content\"} objects")
            if self.hf is None or self.directory is None:
                raise ValueError(f"data.path: {where}: \"messages\" are rendered with a chat template, which raw "
                                 "bytes have none of; set data.tokenizer to a tokenizer.json beside its template")
            if self._template is None:
                self._template = ChatTemplate(self.directory)
            try:
                text = self._template.render(messages, add_generation_prompt=True)
            except ValueError as e:
                raise ValueError(f"data.path: {where}: {e}") from None
            return list(self.hf.tok.encode(text, add_special_tokens=False).ids)
        if isinstance(example.get("prompt"), str) and example["prompt"]:
            if self.hf is None:
                return list(example["prompt"].encode("utf-8"))
            return list(self.hf.tok.encode(example["prompt"], add_special_tokens=True).ids)
        raise ValueError(f"data.path: {where}: expected {{\"messages\": [...]}} or a non-empty string \"prompt\", "
                         f"got the keys {sorted(example)}")


def read_prompts(path: str, *, tokenizer: str | None, longest: int, answer: Callable[[dict], str | None],
                 vocab_size: int, val_fraction: float, seed: int) -> Prompts:
    """The run's prompts, each checked before the run starts: a prompt
    longer than `longest` tokens (data.seq_len less
    train.rl.max_new_tokens) is refused, as is an example whose answer the
    reward cannot score (`answer`: why, or None), and a prompt holding a
    token past the model's `vocab_size` (its embedding would be read out of
    range). A tokenizer larger than the model is not refused itself: the
    model then never draws its last tokens (raw bytes over a small
    vocabulary of ASCII prompts). The held-out share is drawn by `seed`, at
    least one prompt when val_fraction > 0."""
    encoder = PromptEncoder(tokenizer)
    tokens_held = 256 if encoder.hf is None else encoder.hf.tok.get_vocab_size(with_added_tokens=True)
    prompts = []
    for where, example in _read(Path(path)):
        if (problem := answer(example)) is not None:
            raise ValueError(f"data.path: {where}: {problem}")
        tokens = encoder.encode(example, where)
        if tokens and max(tokens) >= vocab_size:
            raise ValueError(f"model.vocab_size: the prompt at {where} holds token {max(tokens)}, past the model's "
                             f"{vocab_size} (the tokenizer, {tokenizer or 'raw bytes'}, has {tokens_held})")
        if len(tokens) > longest:
            raise ValueError(f"data.seq_len: the prompt at {where} is {len(tokens)} tokens, and with "
                             f"train.rl.max_new_tokens a row holds {longest}; raise data.seq_len or shorten it")
        prompts.append(Prompt(tokens, example, where))
    if not prompts:
        raise ValueError(f"data.path: {path} holds no examples")
    order = np.random.default_rng(seed).permutation(len(prompts))
    held = min(len(prompts) - 1, int(np.ceil(val_fraction * len(prompts)))) if val_fraction > 0 else 0
    return Prompts([prompts[i] for i in order[held:]], [prompts[i] for i in order[:held]])


def step_prompts(prompts: list[Prompt], seed: int, rollout: int, count: int) -> list[Prompt]:
    """The prompts of rollout `rollout`: epochs of `prompts` each shuffled
    by (seed, epoch), read `count` at a time."""
    out = []
    for k in range(rollout * count, (rollout + 1) * count):
        epoch, i = divmod(k, len(prompts))
        order = np.random.default_rng([seed, epoch]).permutation(len(prompts))
        out.append(prompts[order[i]])
    return out
