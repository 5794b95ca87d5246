"""The model runner: what the engine runs its programs with, apart from
what it decides to run.

`ModelRunner` holds the device state (the weights, placed on the mesh if
there is one), the compiled programs (shared by engines on one model with
the same settings), the slot state every program donates to the next, the
warm-up and the guard against the host's limit of memory maps. Each
program takes one batch record (`PrefillBatch`, `DecodeBatch`,
`VerifyBatch`; a prefix-cache hit goes through `restore`) and returns its
results fetched to the host. The same records, built `idle`, are what the
warm-up runs and what `gdnx plan --serve` compiles for another machine, so
each program's signature is written once, here.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdnx.distributed import fetch
from gdnx.layers.attention import RingCache
from gdnx.layers.gated_deltanet import DeltaRuleState
from gdnx.models.cache import row_axes
from gdnx.parallel.params import shard
from gdnx.serving import grammar, programs
from gdnx.serving.config import EngineConfig, EngineShapes
from gdnx.serving.params import SamplingParams
from gdnx.serving.prefix_cache import CacheEntries
from gdnx.serving.sampling import SlotParams

# XLA:CPU maps each compiled kernel's code into the process (maps per program: docs/benchmarks.md); past
# Linux's vm.max_map_count it aborts. Warming up stops with this many maps left.
MAPS_MARGIN = 8000

_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TooManyPrograms(RuntimeError):
    """Compiling another program could pass the host's limit of memory maps."""


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the host's limit) on Linux, else None."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps), limit
    except (OSError, ValueError):
        return None


class PrefillBatch(NamedTuple):
    """One prefill call: P prompts' tokens from their starts, right-padded
    to a length bucket L (the prefill program's arguments, in order)."""
    rows: np.ndarray            # int32 [P]: each row's slot (max_slots: a padding row, it writes nowhere)
    tokens: np.ndarray          # int32 [P, L]
    starts: np.ndarray          # int32 [P]: where each row's tokens start in its prompt
    lengths: np.ndarray         # int32 [P]: each row's real tokens
    params: SlotParams          # [P] each
    seen: np.ndarray            # bool [P, V]: each row's prompt tokens
    targets: np.ndarray | None  # int32 [P, L]: the next prompt token, when some row scores its prompt
    allowed: np.ndarray         # int32 [P, W]: the first token each row may draw (sampling.allow)
    follows: np.ndarray         # int32 [P]: the prompt's token after the row's (-1: the prompt ends in this call)

    @classmethod
    def idle(cls, rows: int, length: int, *, max_slots: int, vocab: int, targets: bool = False) -> PrefillBatch:
        """A batch of padding rows (they write nowhere), for the warm-up and the plan."""
        return cls(np.full(rows, max_slots, np.int32), np.zeros((rows, length), np.int32), np.zeros(rows, np.int32),
                   np.ones(rows, np.int32), SlotParams.rows([SamplingParams()] * rows, [0] * rows),
                   np.zeros((rows, vocab), bool), np.zeros((rows, length), np.int32) if targets else None,
                   grammar.masks([None] * rows, vocab), np.full(rows, -1, np.int32))


class DecodeBatch(NamedTuple):
    """One decode call over the first `rows` slots: `draws` tokens each (one
    when a row is constrained), in the program of up to `steps`."""
    active: np.ndarray          # bool [S]: the slots decoding (the others keep their state)
    allowed: np.ndarray         # int32 [S, W]: the tokens each slot may draw (grammar.masks)
    rows: int
    steps: int
    draws: int

    @classmethod
    def idle(cls, rows: int, *, max_slots: int, steps: int, vocab: int) -> DecodeBatch:
        """No slot decoding."""
        return cls(np.zeros(max_slots, bool), grammar.masks([None] * max_slots, vocab), rows, steps, steps)


class VerifyBatch(NamedTuple):
    """One speculative pass over the first `rows` slots: the last token and K drafts."""
    active: np.ndarray          # bool [S]
    drafts: np.ndarray          # int32 [S, K]
    counts: np.ndarray          # int32 [S]: each slot's real drafts
    rows: int

    @classmethod
    def idle(cls, rows: int, *, max_slots: int, draft: int) -> VerifyBatch:
        return cls(np.zeros(max_slots, bool), np.zeros((max_slots, draft), np.int32), np.zeros(max_slots, np.int32),
                   rows)


def lower(compiled: programs.Programs, state: Any, slots: Any, batch: PrefillBatch | DecodeBatch | VerifyBatch,
          history_every: int | None = None, host: Any = None) -> Any:
    """compiled's program for `batch`, lowered (for another machine: `host`
    turns each array into the abstract one that machine gets)."""
    host = host or (lambda x: x)
    if isinstance(batch, PrefillBatch):
        return compiled.prefill.lower(state, slots, *jax.tree.map(host, tuple(batch)), history_every=history_every)
    if isinstance(batch, DecodeBatch):
        return compiled.decode.lower(state, slots, host(batch.active), host(batch.allowed),
                                     host(np.int32(batch.draws)), steps=batch.steps, rows=batch.rows)
    return compiled.verify.lower(state, slots, host(batch.active), host(batch.drafts), host(batch.counts),
                                 rows=batch.rows)


def new_slots(static: programs.Static, model: Any, config: EngineConfig, shapes: EngineShapes,
              rollback: int) -> programs.Slots:
    """Empty slot state for these settings, placed on the ambient mesh (under
    jit it is created in place)."""
    return programs.place(static, programs.empty_slots(model, config.max_slots, shapes.capacity, rollback,
                                                       mtp=static.mtp_drafts > 0))


class ModelRunner:
    """Runs an engine's programs on its device state.

    model: a gdnx CausalLM; config: the engine's settings; shapes: what they
    fix for the model (EngineConfig.shapes); mesh: a Mesh with gdnx's axes
    (context 1) or None; eos_token_ids: the tokens that end a request;
    rollback: a sliding window's extra room for drafts a verify pass takes
    back; prefix_cache: the prefill also returns the states at block ends;
    mtp_drafts: drafts per pass from the model's multi-token prediction
    module (0: it does not draft); draft_rows: the most decode rows that
    draft.
    """

    def __init__(self, model: Any, config: EngineConfig, shapes: EngineShapes, *, mesh: jax.sharding.Mesh | None,
                 eos_token_ids: tuple[int, ...], rollback: int, prefix_cache: bool, mtp_drafts: int = 0,
                 draft_rows: int = 0):
        cfg = model.config
        self.model, self.config, self.shapes, self.mesh = model, config, shapes, mesh
        self.rollback, self.prefix_cache = rollback, prefix_cache
        self.vocab = cfg.vocab_size
        graphdef, self.state = nnx.split(model)
        if mesh is not None:
            self.state = shard(self.state, cfg, mesh)
        # engines on one model with the same settings share compiled programs
        shared = _PROGRAMS.setdefault(model, {})
        key = (eos_token_ids, config.max_logprobs, config.keep_logits, mtp_drafts, draft_rows if mtp_drafts else 0)
        if key not in shared:
            static = programs.Static(graphdef, cfg, row_axes(model), *key)
            shared[key] = (static, programs.compile_programs(static))
        self.static, self.programs = shared[key]
        self.slots = self.empty_slots()

    # ---- the programs ---------------------------------------------------------------------------------------

    def on_mesh(self) -> contextlib.AbstractContextManager:
        """The context the programs run in: the runner's mesh, if any."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def set_weights(self, state: Any) -> None:
        """Run on these weights from now on: a state of the same structure
        and shapes as the model's (nnx.state); on a mesh, placed where the
        runner's are (no copy where they already are). On one device they
        are taken as they are: a jit keys its programs on whether an array
        is committed to its device, so weights as the engine's (both a
        model's, or both a program's outputs) compile nothing again."""
        def paths(tree):
            return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
        have, given = paths(self.state), paths(state)
        if have != given:
            missing = sorted(set(have) - set(given))
            raise ValueError(f"weights: expected the model's state ({len(have)} arrays), got another structure "
                             f"({len(given)} arrays{f'; no {missing[0]}' if missing else ''})")
        bad = [(jax.tree_util.keystr(path), a.shape, b.shape)
               for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(self.state), jax.tree.leaves(state))
               if a.shape != b.shape or a.dtype != b.dtype]
        if bad:
            raise ValueError(f"weights: {bad[0][0]} is {bad[0][2]}, the model's {bad[0][1]} (or another dtype)")
        if self.mesh is None:
            self.state = state
        else:
            self.state = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), state, self.state)

    def empty_slots(self) -> programs.Slots:
        def make():
            return new_slots(self.static, self.model, self.config, self.shapes, self.rollback)
        if self.mesh is None:
            return make()
        with self.on_mesh():  # created in place, each array in its layout
            return jax.jit(make)()

    def cache_entries(self) -> CacheEntries:
        """How the model's cache entries sit in the slot state (the
        multi-token prediction drafter's last: its keys and values, then
        its final hidden state at a block's end)."""
        layers = self.slots.cache.layers
        drafter = self.static.mtp_drafts > 0
        return CacheEntries(self.static.row_axes + (0, 0) * drafter,
                            tuple(isinstance(entry, DeltaRuleState) for entry in layers) + (False, True) * drafter,
                            tuple(entry.ring if isinstance(entry, RingCache) else None for entry in layers)
                            + (None, None) * drafter, self.shapes.capacity)

    def reset(self) -> None:
        """Fresh slot state (after a failed call, whose buffers it may have consumed)."""
        self.slots = self.empty_slots()

    def _prefill(self, batch: PrefillBatch) -> Any:
        every = self.shapes.history_every(batch.tokens.shape[1], self.prefix_cache)
        with self.on_mesh():
            self.slots, out = self.programs.prefill(self.state, self.slots, *batch, history_every=every)
        return out

    def _decode(self, batch: DecodeBatch) -> Any:
        with self.on_mesh():
            self.slots, step = self.programs.decode(self.state, self.slots, batch.active, batch.allowed,
                                                    np.int32(batch.draws), steps=batch.steps, rows=batch.rows)
        return step

    def _verify(self, batch: VerifyBatch) -> Any:
        with self.on_mesh():
            self.slots, out = self.programs.verify(self.state, self.slots, batch.active, batch.drafts, batch.counts,
                                                   rows=batch.rows)
        return out

    def prefill(self, batch: PrefillBatch) -> programs.PrefillOut:
        return fetch(self._prefill(batch))

    def decode(self, batch: DecodeBatch) -> programs.Step:
        return fetch(self._decode(batch))

    def verify(self, batch: VerifyBatch) -> programs.Verified:
        return fetch(self._verify(batch))

    def restore(self, slot: int, layers: tuple) -> None:
        """Write a prefix-cache hit's states into `slot`."""
        with self.on_mesh():
            self.slots = self.programs.restore(self.slots, jnp.int32(slot), layers)

    # ---- warm-up --------------------------------------------------------------------------------------------

    def warm_up(self, *, prefill: bool, draft: int, draft_rows: int = 0) -> list[tuple[str, tuple]]:
        """Compile and run every program on idle slots (rows that write
        nowhere): each decode batch size (plain and constrained calls share
        it), the verify pass with `draft` tokens at each decode batch size up
        to `draft_rows` (EngineConfig.draft_rows), and with `prefill` every
        prefill shape with and without prompt targets and the prefix
        cache's restore. Returns once they have run (dispatch is
        asynchronous): (name, shape) of each program run, as the engine's
        stats name them."""
        c, s = self.config, self.shapes
        ran: list[tuple[str, tuple]] = []
        for rows in s.decode_rows:
            self.room_for_code(len(ran))
            self._decode(DecodeBatch.idle(rows, max_slots=c.max_slots, steps=c.decode_steps, vocab=self.vocab))
            ran.append(("decode", (rows, c.decode_steps)))
        for rows in s.decode_rows if draft else ():
            if rows <= draft_rows:
                self.room_for_code(len(ran))
                self._verify(VerifyBatch.idle(rows, max_slots=c.max_slots, draft=draft))
                ran.append(("verify", (rows, draft)))
        if prefill:
            lengths = (s.block_size,) if c.batch_invariant else s.buckets
            # a prompt that scores itself is prefilled alone (the scheduler's rule), or in the one fixed shape
            scoring = s.prefill_batches if c.batch_invariant else (1,)
            for length in lengths:
                for rows, targets in [(rows, False) for rows in s.prefill_batches] + [(rows, True) for rows in scoring]:
                    self.room_for_code(len(ran))
                    self._prefill(PrefillBatch.idle(rows, length, max_slots=c.max_slots, vocab=self.vocab,
                                                    targets=targets))
                    ran.append(("prefill", (rows, length) + (("prompt logprobs",) if targets else ())))
            if self.prefix_cache:  # a hit's states written into an idle slot
                entries = list(zip(self.slots.cache.layers, self.static.row_axes, strict=True))
                if self.slots.mtp is not None:
                    entries += [(self.slots.mtp.cache, 0), ((self.slots.mtp.hidden,), 0)]
                parts = tuple(tuple(np.zeros(np.delete(x.shape, axis), x.dtype) for x in entry[:2])
                              for entry, axis in entries)
                self.restore(0, parts)
                ran.append(("restore", ()))
        jax.block_until_ready(self.slots)  # dispatch is asynchronous: done means run, not queued
        return ran

    def room_for_code(self, ran: int) -> None:
        """Raise TooManyPrograms, on CPU, when the process nears the host's
        limit of memory maps (XLA would abort mid-compile)."""
        if jax.default_backend() != "cpu" or (maps := memory_maps()) is None:
            return
        used, limit = maps
        if limit - used < MAPS_MARGIN:
            raise TooManyPrograms(
                f"after {ran} programs this process holds {used:,} of the host's {limit:,} memory maps "
                "(vm.max_map_count; XLA:CPU maps each compiled kernel and aborts past the limit): compile fewer "
                "programs (warm_up(prefill=False), gdnx serve --warm-up decode; a smaller max_slots or "
                "max_length) or raise vm.max_map_count")
