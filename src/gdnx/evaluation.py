"""lm-evaluation-harness in process: a gdnx model as an lm_eval language
model, and the run `gdnx eval` makes (lm-eval's own tasks, flags and output
files).

Scoring (loglikelihood, loglikelihood_rolling) runs the model's forward pass
over rows of requests, the longest first, `batch_size` rows per call of a
power-of-two length (at least MIN_BUCKET) that holds the call's longest
request, several shorter requests packed into a row as documents are in
training (each its own segment: its states and attention start afresh), on
the model's mesh when it has one: one compiled program per length bucket.
A request's numbers follow lm-eval's `hf` backend: the context and
continuation encoded together then split, the input cut to the model's
last `max_length` positions, the log-probability of each continuation token
summed, and greedy when each is the argmax. generate_until runs through the
batched engine (stop strings, greedy or sampled)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from gdnx.distributed import fetch
from gdnx.loss import position_scores

# the shortest scored row (shorter inputs are padded to it): few compiled shapes
MIN_BUCKET = 64


def _bucket(n: int, limit: int) -> int:
    size = MIN_BUCKET
    while size < n:
        size *= 2
    return min(size, max(limit, n))


def _pack(lengths: list[int], batch: int, limit: int) -> list[tuple[int, list[list[int]]]]:
    """Requests (their input lengths) packed into calls of `batch` rows:
    (row length, each row's request indices). First fit, longest first: a
    call's rows take the bucket of its first (longest) request, each later
    request goes into the first row of any call with room for it, else a
    new row of the last call, else a new call; short requests share rows
    as documents do in training."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    calls: list[tuple[int, list[list[int]]]] = []
    used: list[list[int]] = []  # per call, per row: tokens taken
    for i in order:
        n = lengths[i]
        spot = next(((c, r) for c, (length, _) in enumerate(calls) for r, u in enumerate(used[c])
                     if u + n <= length), None)
        if spot is not None:
            c, r = spot
            calls[c][1][r].append(i)
            used[c][r] += n
        elif calls and len(calls[-1][1]) < batch:
            calls[-1][1].append([i])
            used[-1].append(n)
        else:
            calls.append((_bucket(n, limit), [[i]]))
            used.append([n])
    return calls


class GdnxLM(TemplateLM):
    """A gdnx model (gdnx.inference.Loaded: the model, its tokenizer and mesh)
    as lm-eval's language model. batch_size: rows per scoring call and
    requests generated together. chat: the checkpoint's chat template
    (gdnx.data.chat.ChatTemplate) for --apply-chat-template."""

    def __init__(self, loaded: Any, batch_size: int = 8, chat: Any = None, progress: bool = True):
        super().__init__()
        self.loaded, self.model, self.mesh = loaded, loaded.model, loaded.mesh
        self.batch_size, self.chat, self.progress = batch_size, chat, progress
        tok = getattr(loaded.tokenizer, "tok", None)  # the tokenizers.Tokenizer of a tokenizer.json
        if tok is None:
            raise ValueError("--checkpoint: gdnx eval needs a checkpoint with a tokenizer.json (lm-eval's tasks "
                             "are text)")
        self._tok: Any = tok
        self.max_length = int(self.model.config.max_position_embeddings)
        self._eot = self._eos_id()
        graphdef, state = nnx.split(self.model)

        def score(state, tokens, targets, segments):
            """tokens, targets, segments [B, T] -> each target's log-probability and whether it is the
            argmax (each request its own segment of a row; the logits a block of positions at a time)."""
            model = nnx.merge(graphdef, state)
            scores = position_scores(model.hidden_states(tokens, segments=segments).hidden, model.logits, targets,
                                     vocab=model.config.vocab_size)
            return scores.chosen, scores.greedy
        self._state, self._score = state, jax.jit(score)

    # ---- what lm-eval asks of a model ----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.description).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self._tok.encode(string, add_special_tokens=bool(add_special_tokens)).ids)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self._tok.decode([int(t) for t in tokens])

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return None if self.chat is None else self.chat.source

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat is None:
            raise ValueError("--apply-chat-template: this checkpoint has no chat template")
        return self.chat.render(chat_history, add_generation_prompt)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        # as lm-eval's hf backend: the input is the last max_length tokens before the last one
        rows = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        bar = self._bar(len(rows), "loglikelihood", disable_tqdm)
        for length, packed in _pack([len(r[0]) for r in rows], self.batch_size, self.max_length):
            tokens = np.zeros((self.batch_size, length), np.int32)
            targets = np.zeros((self.batch_size, length), np.int32)
            segments = np.zeros((self.batch_size, length), np.int32)  # 0: padding
            for r, row in enumerate(packed):
                at = 0
                for k, i in enumerate(row):
                    inp, tgt, _ = rows[i]
                    tokens[r, at:at + len(inp)], targets[r, at:at + len(tgt)] = inp, tgt
                    segments[r, at:at + len(inp)] = k + 1
                    at += len(inp)
            chosen, greedy = self._run(tokens, targets, segments)
            for r, row in enumerate(packed):
                at = 0
                for i in row:
                    n, cont = len(rows[i][0]), rows[i][2]
                    out[i] = (float(chosen[r, at + n - cont:at + n].astype(np.float64).sum()),
                              bool(greedy[r, at + n - cont:at + n].all()))
                    at += n
            bar.update(sum(len(row) for row in packed))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, req in enumerate(requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[k] += lp
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from gdnx.inference import build_engine
        from gdnx.serving import EngineConfig
        from gdnx.serving import SamplingParams
        from gdnx.serving.offline import run_to_completion

        todo = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", 256))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_gen):]
            todo.append((ids, SamplingParams(max_tokens=max_gen, temperature=temperature, stop=tuple(until),
                                             seed=0)))
        if not todo:
            return []
        need = max(len(ids) + p.max_tokens for ids, p in todo)
        engine = build_engine(self.loaded, EngineConfig(max_slots=self.batch_size,
                                                        max_length=min(need, self.max_length)))
        results: dict[int, str] = {}
        bar = self._bar(len(todo), "generate_until", disable_tqdm)
        for done in run_to_completion(engine, todo):
            if done.error is not None:
                raise RuntimeError(f"generate_until: request {done.position}: {done.error}")
            c = done.completion
            assert c is not None
            results[done.position] = c.text if c.text is not None else self.tok_decode(c.tokens)
            bar.update(1)
        bar.close()
        return [results[i] for i in range(len(todo))]

    # ---- helpers --------------------------------------------------------------------------------------------

    def _run(self, tokens: np.ndarray, targets: np.ndarray, segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.mesh is None:
            out = self._score(self._state, tokens, targets, segments)
        else:
            with jax.set_mesh(self.mesh):
                out = self._score(self._state, tokens, targets, segments)
        return tuple(np.asarray(x) for x in fetch(out))  # type: ignore[return-value]

    def _eos_id(self) -> int:
        """The tokenizer's eos token (tokenizer_config.json), as lm-eval's hf
        backend takes it; else the model config's."""
        directory = self.loaded.tokenizer_dir
        name = None
        if directory is not None and (Path(directory) / "tokenizer_config.json").is_file():
            name = json.loads((Path(directory) / "tokenizer_config.json").read_text()).get("eos_token")
            name = name.get("content") if isinstance(name, dict) else name
        found = self._tok.token_to_id(name) if isinstance(name, str) else None
        if found is not None:
            return int(found)
        eos = self.model.config.eos_token_id
        if eos is None:
            raise ValueError("--checkpoint: no end-of-sequence token (tokenizer_config.json's eos_token or the "
                             "config's eos_token_id); lm-eval conditions empty contexts on it")
        return int(eos if isinstance(eos, int) else eos[0])

    def _bar(self, total: int, what: str, disable: bool):
        from tqdm import tqdm
        return tqdm(total=total, desc=what, disable=disable or not self.progress or jax.process_index() != 0,
                    file=sys.stderr)
