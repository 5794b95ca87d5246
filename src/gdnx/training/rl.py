"""Reinforcement learning in `gdnx train` (data.source=rl, train.rl):
each rollout, gdnx's engine draws train.rl.group_size completions of each
of its prompts on the trainer's current weights (in this process, the
weights handed over as they are placed), the verifier scores them, the
trainer recomputes their log-probabilities, and train.rl.updates_per_rollout
optimizer steps follow on the objective of gdnx.rl.objective.

Rollout r takes the prompts of (seed, r) and draws each completion with a
seed of (seed, r, its row), so a run resumed from a checkpoint (always at
a rollout's start) draws what the uninterrupted run drew. Every step's
metrics hold the rewards, the completions' lengths, the gap between the
sampler's and the trainer's log-probabilities of the drawn tokens
(rl/logp_diff_max, rl/logp_diff_mean) and the time split into rollout,
scoring and update.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdnx.config.schema import RL_ENGINE_SLOTS, Config
from gdnx.data.prepare import Encoder
from gdnx.data.text import make_tokenizer
from gdnx.loss import target_logprobs
from gdnx.rl.objective import Array, Scored, advantages, policy_loss
from gdnx.rl.replay import ReplayBatch, ReplayShapes, replay_batch, replay_logprobs
from gdnx.rl.prompts import Prompt, read_prompts, step_prompts
from gdnx.rl.rewards import answer_problem, make_reward, score
from gdnx.serving.config import EngineConfig
from gdnx.serving.engine import Engine
from gdnx.serving.params import SamplingParams
from gdnx.training.init_from import check_source, initial_params
from gdnx.training.loop import Trainer
from gdnx.training.step import accumulated_gradients, aux_loss_coef, finite_update

# most held-out prompts an evaluation completes (greedily)
EVAL_PROMPTS = 64


class Rows(NamedTuple):
    """The completions as the trainer's rows (prompt + completion, padded),
    [rows, data.seq_len] each: one pass scores every position."""
    inputs: Array
    targets: Array


class BitwiseRows(NamedTuple):
    """bitwise mode's completions: the engine's computation to replay (the
    log-probabilities' values) and the trainer's rows (their gradient)."""
    replay: ReplayBatch
    rows: Rows
    positions: Array  # int32 [rows, max_new_tokens]: the row position predicting each completion token


class RLTotals(NamedTuple):
    """The denominators of a whole batch (its rows and completion tokens
    that count), so that micro-batches' losses and metrics add up."""
    rows: jax.Array
    tokens: jax.Array


def rl_totals(batch: Scored) -> RLTotals:
    return RLTotals(jnp.maximum(jnp.any(batch.kept, axis=1).sum(), 1).astype(jnp.float32),
                    jnp.maximum((batch.mask & batch.kept).sum(), 1).astype(jnp.float32))


def rl_engine(config: Config) -> EngineConfig:
    """The rollout engine's settings: a step's completions beyond its slots
    wait for a free one; bitwise, batch-invariant, its prompts prefilled a
    block at a time, padded to it."""
    rl = config.train.rl
    assert rl is not None
    return EngineConfig(max_slots=min(config.train.batch_size, RL_ENGINE_SLOTS), max_length=config.data.seq_len + 1,
                        max_logprobs=1, batch_invariant=rl.bitwise, seed=config.train.seed,
                        prefix_cache_bytes=rl.prefix_cache_mb * 2 ** 20,
                        block_size=config.model.gdn_chunk_size if rl.bitwise else None)


def replay_shapes(config: Config) -> ReplayShapes:
    """The rollout engine's shapes that bitwise mode replays."""
    engine = rl_engine(config)
    shapes = engine.shapes(config.model)
    return ReplayShapes(engine.max_slots, engine.prefill_rows, shapes.block_size, shapes.capacity)


def rl_programs(config: Config, graphdef: Any, tx: Any, shapes: ReplayShapes) -> tuple[Callable, Callable]:
    """The RL step's two functions (to be jitted): scores(params, frozen,
    reference, reference_frozen, tokens, scored), the trainer's
    log-probabilities of the drawn tokens and their gap to the sampler's;
    and update(params, opt_state, tokens, scored, first, frozen), one
    optimizer step on train.rl.loss. shapes: the rollout engine's, which
    bitwise mode replays."""
    rl = config.train.rl
    assert rl is not None
    aux = aux_loss_coef(config)
    vocab, max_new = config.model.vocab_size, rl.max_new_tokens

    def one_pass(params, frozen, rows):
        """Each position's log-probability of its target, one pass over
        the rows (and the MoE balancing loss)."""
        model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)
        out = model.hidden_states(rows.inputs)
        return target_logprobs(out.hidden, model.logits, rows.targets, vocab=vocab), out.aux_loss

    def replayed(params, frozen, replay):
        """The completion tokens' log-probabilities as the engine computed them."""
        model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)
        return replay_logprobs(model, replay, shapes)

    def logprobs(params, frozen, tokens):
        return replayed(params, frozen, tokens.replay) if rl.bitwise else one_pass(params, frozen, tokens)[0]

    def scores(params, frozen, reference, reference_frozen, tokens, scored: Scored):
        """The trainer's log-probabilities of the drawn tokens (and the
        reference's), and their gap to the sampler's."""
        old = logprobs(params, frozen, tokens)
        ref = jnp.zeros_like(old) if reference is None else logprobs(reference, reference_frozen, tokens)
        gap = jnp.where(scored.mask, jnp.abs(old - scored.sampler), 0.0)
        count = jnp.maximum(scored.mask.sum(), 1)
        return scored._replace(old=old, reference=ref), {"rl/logp_diff_max": gap.max(),
                                                         "rl/logp_diff_mean": gap.sum() / count}

    def update(params, opt_state, tokens, scored: Scored, first, frozen):
        """The log-probabilities' values: at the rollout's first update
        (ratio 1 exactly) the scoring pass's; after it, one pass over the
        rows, or bitwise a replay of the engine's computation on these
        weights. Their gradient: one pass over the rows in both modes
        (the replay's scan of decode steps would cost 2.5-4x as much to
        differentiate, for the same gradient to float rounding)."""
        if rl.bitwise:
            values = jax.lax.cond(first, lambda: scored.old,
                                  lambda: replayed(jax.lax.stop_gradient(params), frozen, tokens.replay))
            micro = (tokens.rows, tokens.positions, scored, values)
        else:
            micro = (tokens, None, scored, scored.old)

        def loss_fn(p, micro, totals: RLTotals, share):
            rows, positions, micro_scored, values = micro
            logp, aux_loss = one_pass(p, frozen, rows)
            if rl.bitwise:  # the completion tokens' columns
                logp = jnp.take_along_axis(logp, positions, axis=1)
            else:
                values = jnp.where(first, values, jax.lax.stop_gradient(logp))
            logp = values + (logp - jax.lax.stop_gradient(logp))  # those values, this pass's gradient
            total, metrics = policy_loss(logp, micro_scored, loss=rl.loss, clip=rl.clip,
                                         importance_cap=rl.importance_cap, kl_coef=rl.kl_coef,
                                         max_new_tokens=max_new, rows=totals.rows, tokens=totals.tokens)
            return total + aux * share * aux_loss, metrics

        (loss, metrics), grads = accumulated_gradients(loss_fn, params, micro, config.train.grad_accum_steps,
                                                       totals=rl_totals(scored))
        metrics["loss"] = loss
        return finite_update(tx, params, opt_state, loss, grads, metrics)

    return scores, update


class RLTrainer(Trainer):
    """A Trainer whose step draws, scores and learns from completions."""

    def __init__(self, config: Config, *, mesh: jax.sharding.Mesh | None = None, platform: str | None = None):
        self._read_inputs(config)  # the prompts and the reward, refused before anything is built or compiled
        super().__init__(config, mesh=mesh, platform=platform)

    def _read_inputs(self, config: Config) -> None:
        rl, data = config.train.rl, config.data
        assert rl is not None and data.path is not None  # Config requires both with data.source=rl
        if jax.process_count() > 1:
            raise ValueError("train.rl: reinforcement learning runs in one process (one device or a mesh of its "
                             f"devices); this run has {jax.process_count()}")
        self.rl = rl
        self.detokenizer = make_tokenizer(data.tokenizer)
        eos = config.model.eos_token_id
        self.eos_ids = [Encoder(data.tokenizer, data.eos_token).eos] if eos is None else \
            [eos] if isinstance(eos, int) else list(eos)
        self.reward = make_reward(rl, tokenizer=data.tokenizer, vocab_size=config.model.vocab_size,
                                  eos_id=self.eos_ids[0])
        self.prompts = read_prompts(data.path, tokenizer=data.tokenizer, longest=data.seq_len + 1 - rl.max_new_tokens,
                                    answer=functools.partial(answer_problem, rl),
                                    vocab_size=config.model.vocab_size, val_fraction=data.val_fraction if
                                    config.train.eval_every else 0.0, seed=config.train.seed)
        if config.train.eval_every and not self.prompts.evaluation:
            raise ValueError("data.val_fraction: no prompt is held out to evaluate on; raise it (or give more "
                             "prompts), or set train.eval_every=0")
        self.notes = (f"data: {len(self.prompts.train)} prompts to learn from, {len(self.prompts.evaluation)} "
                      f"held out; {config.train.batch_size // rl.group_size} prompts x {rl.group_size} completions "
                      "per rollout",)

    def _compile(self) -> None:
        config, rl = self.config, self.rl
        model = nnx.merge(self.graphdef, self.params) if self.frozen is None else \
            nnx.merge(self.graphdef, self.params, self.frozen)
        self.engine = Engine(model, rl_engine(config), mesh=self.mesh, tokenizer=self.detokenizer,
                             eos_token_ids=self.eos_ids)
        # the reference of the KL term: train.rl.reference's weights, else the initial weights (under LoRA the
        # base, or the reference's weights, with the adapters at zero)
        self.reference, self.reference_frozen = None, self.frozen
        if rl.kl_coef:
            loaded = None if rl.reference is None else self._read_reference()
            if self.frozen is not None:
                self.reference = jax.tree.map(jnp.zeros_like, self.params)
                self.reference_frozen = self.frozen if loaded is None else loaded
            else:
                self.reference = jax.tree.map(jnp.copy, self.params) if loaded is None else loaded
        self._rollout: tuple[int, Any, dict[str, float]] | None = None
        self.replay_shapes = replay_shapes(config)
        scores, update = rl_programs(config, self.graphdef, self.tx, self.replay_shapes)
        self.scores = jax.jit(scores)
        self.update = jax.jit(update, donate_argnums=(0, 1))

    def _read_reference(self) -> Any:
        """train.rl.reference's weights, laid out and placed as the
        trainer's own (under LoRA, as its base)."""
        path = self.rl.reference
        cfg = self.config.model.model_copy(update={"init_from": path})
        check_source(cfg, "train.rl.reference")
        own = self.params if self.frozen is None else self.frozen
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), own)
        placement = None if self.mesh is None else jax.tree.map(lambda x: x.sharding, own)
        return initial_params(cfg, abstract, placement, "train.rl.reference")

    # ---- rollouts ----------------------------------------------------------------------------------------------

    def _weights(self, params: Any) -> Any:
        """The model's whole state from the trainer's parameters."""
        if self.frozen is None:
            return params
        return nnx.state(nnx.merge(self.graphdef, params, self.frozen))

    def complete(self, params: Any, prompts: list[Prompt], seeds: list[int] | None) -> list[Any]:
        """Completions of `prompts` on these weights: drawn with these
        seeds, or greedy (None)."""
        self.engine.set_weights(self._weights(params))
        rl = self.rl
        sampling = [SamplingParams(max_tokens=rl.max_new_tokens, temperature=1.0 if seeds else 0.0,
                                   seed=None if seeds is None else seeds[i], logprobs=0)
                    for i in range(len(prompts))]
        return self.engine.generate([p.tokens for p in prompts], sampling)

    def _rewards(self, prompts: list[Prompt], done: list[Any], where: Callable[[int, Prompt], str]) -> np.ndarray:
        """float32 [n]: each completion's reward, its text decoded without the
        end-of-sequence tokens; where(i, prompt) names it in an error."""
        return np.asarray([score(self.reward, self.rl.reward,
                                 self.detokenizer.decode([t for t in c.tokens if t not in self.eos_ids]), c.tokens,
                                 p.example, where(i, p), self.rl.reward_timeout_s)
                           for i, (p, c) in enumerate(zip(prompts, done, strict=True))], np.float32)

    def rollout(self, params: Any, index: int) -> tuple[tuple[Any, Scored], dict[str, float]]:
        """Rollout `index`: its completions, rewards and advantages, laid
        out as rows, with the trainer's log-probabilities of them."""
        config, rl = self.config, self.rl
        t0 = time.perf_counter()
        groups = step_prompts(self.prompts.train, config.train.seed, index, config.train.batch_size // rl.group_size)
        prompts = [p for p in groups for _ in range(rl.group_size)]
        seeds = [int(s) for s in np.random.default_rng([config.train.seed, index]).integers(0, 2 ** 62,
                                                                                           len(prompts))]
        done = self.complete(params, prompts, seeds)
        t1 = time.perf_counter()
        rewards = self._rewards(prompts, done, lambda i, p: f"the completion {i % rl.group_size} of {p.where}")
        adv, kept = advantages(rewards, rl.group_size, rl.loss)
        tokens, scored = self._layout(prompts, done, adv, kept)
        with self.on_mesh():
            scored, gaps = self.scores(params, self.frozen, self.reference, self.reference_frozen, tokens, scored)
        lengths = np.asarray([len(c.tokens) for c in done])
        metrics = {k: float(v) for k, v in jax.device_get(gaps).items()}
        t2 = time.perf_counter()
        metrics |= {"rl/reward_mean": float(rewards.mean()), "rl/reward_std": float(rewards.std()),
                    "rl/groups_kept": float(kept.reshape(-1, rl.group_size)[:, 0].mean()),
                    "rl/completion_length_mean": float(lengths.mean()),
                    "rl/completion_length_max": float(lengths.max()),
                    "rl/stopped_fraction": float(np.mean([c.finish_reason == "stop" for c in done])),
                    "rl/cached_prompt_tokens": float(sum(c.cached_tokens for c in done)),
                    "rl/time_rollout_s": t1 - t0, "rl/time_score_s": t2 - t1}
        return (tokens, scored), metrics

    def _layout(self, prompts: list[Prompt], done: list[Any], adv: np.ndarray, kept: np.ndarray,
                ) -> tuple[Any, Scored]:
        """The completions on the device, as the trainer reads them: rows of
        prompt + completion whose positions before each completion token
        count (Rows), or, bitwise, the same rows with the engine's prefill
        blocks and the drawn tokens (BitwiseRows), whose columns are the
        completion tokens."""
        rows, t = len(prompts), self.config.data.seq_len
        full = np.zeros((rows, t + 1), np.int32)
        for i, (p, c) in enumerate(zip(prompts, done, strict=True)):
            full[i, :len(p.tokens) + len(c.tokens)] = p.tokens + c.tokens
        tokens: Any = Rows(full[:, :-1], full[:, 1:])
        start = [len(p.tokens) - 1 for p in prompts]
        if self.rl.bitwise:
            new = self.rl.max_new_tokens
            positions = np.minimum(np.asarray(start)[:, None] + np.arange(new), t - 1).astype(np.int32)
            tokens = BitwiseRows(replay_batch([p.tokens for p in prompts], [c.tokens for c in done],
                                              self.replay_shapes, new), tokens, positions)
            t, start = new, [0] * rows
        mask = np.zeros((rows, t), bool)
        sampler = np.zeros((rows, t), np.float32)
        for i, c in enumerate(done):
            mask[i, start[i]:start[i] + len(c.tokens)] = True
            sampler[i, start[i]:start[i] + len(c.tokens)] = [lp for lp, _ in c.logprobs]
        wide = lambda x: np.broadcast_to(x[:, None], (rows, t)).copy()  # noqa: E731
        scored = Scored(mask, sampler, np.zeros_like(sampler), np.zeros_like(sampler), wide(adv), wide(kept))
        return self.place(tokens), self.place(scored)

    def place(self, host: Any) -> Any:
        """Host arrays as device arrays (rows split over the mesh's batch axes)."""
        sharding = self._batch_sharding()
        if sharding is None or self.rl.bitwise:
            return jax.tree.map(jnp.asarray, host)
        return jax.tree.map(lambda x: jax.device_put(x, sharding), host)

    # ---- the loop's interface ------------------------------------------------------------------------------------

    def step(self, params: Any, opt_state: Any, step: jax.Array) -> tuple[Any, Any, dict[str, Any]]:
        index, offset = divmod(int(step), self.rl.updates_per_rollout)
        if self._rollout is None or self._rollout[0] != index:
            batch, metrics = self.rollout(params, index)
            self._rollout = (index, batch, metrics)
        _, (tokens, scored), rollout_metrics = self._rollout
        t0 = time.perf_counter()
        with self.on_mesh():
            params, opt_state, metrics = self.update(params, opt_state, tokens, scored, jnp.asarray(offset == 0),
                                                     self.frozen)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics |= rollout_metrics | {"rl/time_update_s": time.perf_counter() - t0}
        return params, opt_state, metrics

    def evaluate(self, params: Any) -> dict[str, float]:
        """The held-out prompts' greedy completions (EVAL_PROMPTS at most):
        their mean reward, and the share that earn 1 or more (accuracy)."""
        prompts = self.prompts.evaluation[:EVAL_PROMPTS]
        done = self.complete(params, prompts, None)
        rewards = self._rewards(prompts, done, lambda i, p: f"the greedy completion of {p.where}")
        return {"reward": float(rewards.mean()), "accuracy": float(np.mean(rewards >= 1.0))}

    def close(self) -> None:
        self._rollout = None

