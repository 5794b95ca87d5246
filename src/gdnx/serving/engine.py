"""The batched generation engine: continuous batching over decode slots,
prompts prefilled in length buckets, a prefix cache of GDN states and
attention keys/values at block ends, and speculative decoding.

A request waits until a slot is free; it is then prefilled (its prompt
after any cached prefix, right-padded to the smallest length bucket that
holds it, together with the other prompts of that bucket), its first
token drawn, and it joins the decode batch: one compiled step for the
first slots up to the highest one in use (requests take the lowest free
slot), `decode_steps` tokens per host round trip. It leaves on its stop
condition and its slot takes the next request. Every shape a program sees
is fixed by the engine's settings (docs/serving.md counts them).

The work is split by job: the Scheduler (gdnx.serving.scheduler) holds the
requests and decides what runs where; the compiled programs
(gdnx.serving.programs) run it; each request's Output
(gdnx.serving.output) takes its tokens, detokenizes them and checks its
stop conditions. Engine.step joins the three.

Batch invariance: a row's computation never mixes with another row's,
every slot runs the same program, a prompt's bucket (and so its padding)
depends only on its own length, padding leaves every state as it was, and
a prefix-cache hit continues from the very states the full prefill would
carry across that block boundary: a request's tokens and logits are
bit-identical whatever shares the engine with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdnx.distributed import fetch
from gdnx.errors import FieldError
from gdnx.layers.attention import RingCache
from gdnx.layers.gated_deltanet import DeltaRuleState
from gdnx.models.cache import row_axes
from gdnx.parallel.params import shard
from gdnx.parallel.rules import MESH_AXES
from gdnx.serving import grammar, offline, programs
from gdnx.serving.drafter import Drafter
from gdnx.serving.grammar import Grammars
from gdnx.serving.offline import RequestFailed
from gdnx.serving.output import Output
from gdnx.serving.params import Completion, SamplingParams
from gdnx.serving.prefix_cache import PrefixCache
from gdnx.serving.request import Request, RequestStatus
from gdnx.serving.sampling import MAX_STOP_IDS, SlotParams
from gdnx.serving.scheduler import Layout, Scheduler


_log = logging.getLogger(__name__)


class Detokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started."""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens restored from the prefix cache
    generated_tokens: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0           # host round trips of the decode loop
    verify_calls: int = 0           # speculative forward passes
    verified_requests: int = 0      # requests advanced by them, summed over the passes
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    programs: set = dataclasses.field(default_factory=set)  # (name, shape) of each compiled program

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens / drafted ones."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens a request gains per speculative forward pass (1 + its accepted drafts)."""
        return 1.0 + self.accepted_tokens / self.verified_requests if self.verified_requests else 1.0


@dataclasses.dataclass(frozen=True)
class Event:
    """What one engine step gave a request: its new tokens (with their
    logprobs when it asked for them), the text they add that is safe to
    show (with a tokenizer: held back while a character is incomplete or a
    tail may begin a stop string; a request's texts join to its
    Completion.text), and its Completion when it finished in that step, or
    `error` when it failed (host work of its own raised: the tokenizer on
    its tokens, the drafter on its context; the other requests go on)."""
    request_id: int
    tokens: list[int]
    completion: Completion | None = None
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    text: str | None = None
    error: str | None = None


class _StepResults:
    """The tokens each request gains in one step, in the order they came."""

    def __init__(self) -> None:
        self.new: dict[Request, list[int]] = {}
        self._logprobs_from: dict[Request, int] = {}

    def tokens(self, req: Request) -> list[int]:
        if req not in self.new:
            self.new[req] = []
            self._logprobs_from[req] = len(req.logprobs)
        return self.new[req]

    def events(self) -> list[Event]:
        out = []
        for req, toks in self.new.items():
            if req.status is RequestStatus.FAILED:
                out.append(Event(req.id, toks, error=req.error))
                continue
            lp = req.logprobs[self._logprobs_from[req]:] if req.params.logprobs is not None else None
            out.append(Event(req.id, toks, req.completion, lp,
                             req.output.new_text(finished=req.status is RequestStatus.FINISHED)))
        return out


class EngineShapes(NamedTuple):
    block_size: int       # tokens per prefix-cache block
    padded_length: int    # max_length rounded up to a block: the longest prefill bucket
    capacity: int         # tokens each slot's cache holds


def engine_shapes(cfg: Any, max_length: int, block_size: int | None, draft: int) -> EngineShapes:
    """The shapes an engine's settings fix (block_size None: 4 of the model's chunks)."""
    block = 4 * cfg.gdn_chunk_size if block_size is None else block_size
    padded = -(-max_length // block) * block
    # the cache holds a padded prompt's last bucket and a verify pass's drafts past max_length
    return EngineShapes(block, padded, padded + draft + 1)


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# XLA:CPU maps each compiled kernel's code into the process (maps per program: docs/benchmarks.md); past
# Linux's vm.max_map_count it aborts. Warming up stops with this many maps left.
MAPS_MARGIN = 8000


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


def _buckets(block: int, limit: int, smallest: int | None = None) -> tuple[int, ...]:
    """Doubling from `smallest` while under `block`, then from `block`, up to `limit`."""
    out, n = [], block if smallest is None else smallest
    while n < min(block, limit):
        out.append(n)
        n *= 2
    n = block
    while n < limit:
        out.append(n)
        n *= 2
    return (*out, limit)


class Engine:
    """Generate for many requests at once with one model.

    model: a gdnx CausalLM (any family).
    mesh: a jax.sharding.Mesh with gdnx's axes (gdnx.parallel.make_mesh):
      the weights placed as training places them, each slot's state split
      with its layer's heads over `tensor` and the slots over `data` and
      `fsdp`, every program run on it (as an Auto mesh: XLA places what
      the programs do not state; `context` must be 1). None: the model's
      own placement.
    max_slots: requests decoded together (the decode batch).
    max_length: prompt + generated tokens per request (the cache per slot).
    prefix_cache_bytes: host memory for the prefix cache (0: off).
    speculative: a Drafter (e.g. NgramDrafter) to propose tokens verified
      in one pass; None decodes plainly.
    block_size: tokens per prefix-cache block (a multiple of the model's
      gdn_chunk_size; default 4 chunks). Prefill buckets double from the
      chunk size up to a block, then from the block up to max_length.
    decode_steps: tokens per slot per host round trip of the decode loop.
    max_prefill_batch: prompts of one bucket prefilled together, at most
      (power-of-two batches up to it; default max_slots).
    max_logprobs: the most top-N log-probabilities a request may ask for.
    tokenizer: anything with decode(ids) -> str; needed for stop strings
      and Completion.text.
    eos_token_ids: end-of-sequence tokens (default: the model config's).
    keep_logits: also return every generated token's logits
      (Completion.logits; for checks, it moves [slots, steps, vocab] per
      round trip).
    batch_invariant: a request's tokens and logits are bit-identical
      whatever else runs, whichever slot it gets and whether its prefix was
      cached. XLA picks a matmul's and a reduction's blocking by the whole
      operand's shape, so a row's bits can change with the number of rows
      beside it; in this mode every program keeps one shape: prompts are
      prefilled one block at a time, max_prefill_batch rows per call
      (padded). The cost: ceil(prompt / block_size) prefill calls per prompt
      (docs/benchmarks.md measures it); with a drafter, every step is a
      verify pass, drafts or not. Off: prompts are prefilled whole in
      length buckets (same tokens; logits equal to float rounding).
    seed: the generator of the seeds of requests that give none.
    grammars: gdnx.serving.grammar.Grammars for the tokenizer, needed by
      requests with a `structured` constraint (each constrained token is
      drawn in a decode call of its own, the host computing the allowed
      tokens from the last one; no drafts for them; not in batch-invariant
      mode).
    """

    def __init__(self, model: Any, *, max_slots: int = 8, max_length: int = 2048, prefix_cache_bytes: int = 0,
                 speculative: Drafter | None = None, block_size: int | None = None, decode_steps: int = 8,
                 max_prefill_batch: int | None = None, max_logprobs: int = 5, tokenizer: Detokenizer | None = None,
                 eos_token_ids: Sequence[int] | None = None, keep_logits: bool = False, batch_invariant: bool = False,
                 seed: int = 0, mesh: jax.sharding.Mesh | None = None, grammars: Grammars | None = None):
        cfg = model.config
        chunk = cfg.gdn_chunk_size
        block_size = 4 * chunk if block_size is None else block_size
        for name, value, low in (("max_slots", max_slots, 1), ("max_length", max_length, 2),
                                 ("prefix_cache_bytes", prefix_cache_bytes, 0), ("block_size", block_size, 1),
                                 ("decode_steps", decode_steps, 1), ("max_logprobs", max_logprobs, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise FieldError(name, f"expected an integer >= {low}, got {value!r}")
        if block_size % chunk:
            raise FieldError("block_size", f"expected a multiple of the model's gdn_chunk_size {chunk}, "
                             f"got {block_size}")
        max_prefill_batch = max_slots if max_prefill_batch is None else max_prefill_batch
        if not isinstance(max_prefill_batch, int) or not 1 <= max_prefill_batch <= max_slots:
            raise FieldError("max_prefill_batch", f"expected an integer in [1, max_slots={max_slots}], "
                             f"got {max_prefill_batch!r}")
        if speculative is not None and not isinstance(speculative, Drafter):
            raise FieldError("speculative", "expected a Drafter (propose(tokens), num_tokens) or None, "
                             f"got {type(speculative).__name__}")
        if mesh is not None and (not isinstance(mesh, jax.sharding.Mesh)
                                 or not set(mesh.axis_names) <= set(MESH_AXES)):
            raise FieldError("mesh", f"expected a jax.sharding.Mesh over axes among {MESH_AXES} "
                             f"(gdnx.parallel.make_mesh), got {mesh!r}")
        if mesh is not None:
            if dict(mesh.shape).get("context", 1) > 1:
                raise FieldError("mesh", "the engine splits heads and slots, not sequences: expected context=1, "
                                 f"got context={dict(mesh.shape)['context']}")
            # the programs' state layout is stated once (programs.place) and XLA places the rest: the
            # same devices and axes as an Auto mesh, whichever mode the caller's mesh has
            mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
        if eos_token_ids is None:
            eos = cfg.eos_token_id
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.model, self.mesh = model, mesh
        self.max_slots, self.max_length = max_slots, max_length
        self.block_size, self.decode_steps = block_size, decode_steps
        self.max_prefill_batch, self.max_logprobs = max_prefill_batch, max_logprobs
        self.tokenizer, self.speculative = tokenizer, speculative
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.keep_logits, self.batch_invariant = keep_logits, batch_invariant
        self.grammars = grammars
        draft = speculative.num_tokens if speculative is not None else 0
        shapes = engine_shapes(cfg, max_length, block_size, draft)
        self.padded_length, self.capacity = shapes.padded_length, shapes.capacity
        # prefill buckets: the chunk size doubling up to a block, then block_size doubling up to max_length
        # rounded up to a block (a short prompt is not padded to a whole block), none past the first that
        # holds max_length (no prompt is longer)
        every = _buckets(block_size, self.padded_length, chunk)
        self.buckets = tuple(b for i, b in enumerate(every) if i == 0 or every[i - 1] < max_length)
        # decode batches: the first 1, 2, 4, ... slots, as few as hold every running request (one shape in
        # batch-invariant mode)
        self.decode_rows = (max_slots,) if batch_invariant else _buckets(1, max_slots)
        self.stats = EngineStats()
        graphdef, self._state = nnx.split(model)
        if mesh is not None:
            self._state = shard(self._state, cfg, mesh)
        # engines on one model with the same settings share compiled programs
        shared = _PROGRAMS.setdefault(model, {})
        key = (self.eos_token_ids, max_logprobs, keep_logits)
        if key not in shared:
            static = programs.Static(graphdef, cfg, row_axes(model), *key)
            shared[key] = (static, programs.compile_programs(static))
        self._static, self._programs = shared[key]
        # a sliding window's ring keeps the drafts a verify pass may take back beyond its window
        self.rollback = draft
        self._slots = self._empty_slots()
        is_state = tuple(isinstance(entry, DeltaRuleState) for entry in self._slots.cache.layers)
        rings = tuple(entry.ring if isinstance(entry, RingCache) else None for entry in self._slots.cache.layers)
        self.scheduler = Scheduler(Layout(max_slots, block_size, self.buckets, self.capacity, max_prefill_batch,
                                          batch_invariant, self._static.row_axes, is_state, rings),
                                   prefix_cache_bytes)
        self._next_id = 0
        self._rng = np.random.default_rng(seed)

    # ---- requests -------------------------------------------------------------------------------------------

    def check(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a FieldError naming what this engine
        refuses in the request (what add_request checks)."""
        if not isinstance(params, SamplingParams):
            raise FieldError("params", f"expected SamplingParams, got {type(params).__name__}")
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise FieldError("prompt", "expected a list of token ids") from None
        vocab = self.model.config.vocab_size
        if not ids:
            raise FieldError("prompt", "expected at least one token, got an empty prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise FieldError("prompt", f"token ids must be in [0, {vocab})")
        if len(ids) >= self.max_length:
            raise FieldError("prompt", f"{len(ids)} tokens leave no room to generate within the engine's "
                             f"max_length={self.max_length}")
        if len(ids) + params.max_tokens > self.max_length:
            raise FieldError("max_tokens", f"the prompt's {len(ids)} tokens + max_tokens={params.max_tokens} "
                             f"exceed the engine's max_length={self.max_length}")
        if params.top_k > vocab:
            raise FieldError("top_k", f"expected at most the vocabulary's {vocab} tokens (0: all), got {params.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.max_logprobs:
                raise FieldError(name, f"expected at most the engine's max_logprobs={self.max_logprobs}, got {n}")
        if params.stop and self.tokenizer is None:
            raise FieldError("stop", "stop strings are matched on text; give the engine a tokenizer")
        if len(params.stop_token_ids) > MAX_STOP_IDS:
            raise FieldError("stop_token_ids", f"at most {MAX_STOP_IDS}, got {len(params.stop_token_ids)}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise FieldError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if params.structured is not None:
            field = params.structured.field
            if self.grammars is None:
                raise FieldError(field, "structured outputs need the engine's grammars (a checkpoint with a "
                                 "tokenizer.json)")
            if self.batch_invariant:
                raise FieldError(field, "structured outputs are not available in batch-invariant mode")
            self.grammars.grammar(params.structured)  # compiled and checked now, kept for the request
        return ids

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request (token ids); returns its id. Raises FieldError
        naming the field for a bad one; the engine's other requests are
        unaffected."""
        params = SamplingParams() if params is None else params
        ids = self.check(prompt, params)
        seed = params.seed if params.seed is not None else self.draw_seed()
        decode = None if self.tokenizer is None else self.tokenizer.decode
        req = Request(self._next_id, ids, params, seed, Output(params, decode, self.eos_token_ids))
        if params.structured is not None:
            assert self.grammars is not None  # check() refuses a constraint without them
            req.matcher = self.grammars.matcher(params.structured)
        self._next_id += 1
        self.scheduler.add(req)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(ids)
        return req.id

    def draw_seed(self) -> int:
        """The seed the next request that gives none would get (from the engine's seed)."""
        return int(self._rng.integers(2 ** 63))

    def abort(self, request_id: int) -> None:
        """Drop a request in any state (its slot is free at once); an id
        that is done or unknown is ignored."""
        self.scheduler.abort(request_id)

    def status(self, request_id: int) -> RequestStatus | None:
        """A request's state while the engine holds it (None once done)."""
        req = self.scheduler.get(request_id)
        return None if req is None else req.status

    def warm_up(self, prefill: bool = True) -> int:
        """Compile now, rather than when a request first needs it (a server's
        first requests would wait for the compiler), every program the engine
        calls: the decode step of every decode batch size, plain and
        constrained (one token), the verify pass with a drafter, and with
        `prefill` every prefill shape (each length bucket at each
        power-of-two batch up to max_prefill_batch, or the one block shape
        in batch-invariant mode), with and without prompt logprobs, and the
        prefix cache's restore. Runs them on idle slots (prefill rows that
        write nowhere), so only while no request runs, and returns once they
        have run (not merely been dispatched: a request would otherwise
        queue behind them). Returns how many programs ran (docs/serving.md
        counts them)."""
        if self.scheduler.running:
            raise RuntimeError("warm_up: requests are running; call it before adding any")
        vocab = self.model.config.vocab_size
        idle = np.zeros(self.max_slots, bool)
        ran = 0
        for rows in self.decode_rows:
            self._room_for_code(ran)
            self._run_decode(idle, rows)
            ran += 1
            if self.grammars is not None:  # a constrained request's one-token steps
                self._run_decode(idle, rows, grammar.masks([None] * self.max_slots, vocab))
                ran += 1
        if self.speculative is not None:
            k = self.speculative.num_tokens
            self._run_verify(idle, np.zeros((self.max_slots, k), np.int32), np.zeros(self.max_slots, np.int32))
            ran += 1
        if not prefill:
            jax.block_until_ready(self._slots)
            return ran
        if self.batch_invariant:
            shapes = [(self.max_prefill_batch, self.block_size)]
        else:
            batches = [1 << i for i in range(self.max_prefill_batch.bit_length())]
            shapes = [(b, length) for length in self.buckets for b in batches]
        for rows, length in shapes:
            for targets in (None, np.zeros((rows, length), np.int32)):
                self._room_for_code(ran)
                with self._on_mesh():
                    self._slots, _ = self._programs.prefill(
                        self._state, self._slots, np.full(rows, self.max_slots, np.int32),
                        np.zeros((rows, length), np.int32), np.zeros(rows, np.int32), np.ones(rows, np.int32),
                        SlotParams.rows([SamplingParams()] * rows, [0] * rows), np.zeros((rows, vocab), bool),
                        targets, grammar.masks([None] * rows, vocab), history_every=self._history(length))
                ran += 1
        if self.prefix_cache is not None:  # a hit's states written into an idle slot
            parts = tuple(tuple(np.zeros(np.delete(x.shape, axis), x.dtype) for x in entry[:2])
                          for entry, axis in zip(self._slots.cache.layers, self._static.row_axes, strict=True))
            with self._on_mesh():
                self._slots = self._programs.restore(self._slots, jnp.int32(0), parts)
            ran += 1
        jax.block_until_ready(self._slots)  # dispatch is asynchronous: done means run, not queued
        return ran

    def _room_for_code(self, ran: int) -> None:
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    @property
    def can_admit(self) -> bool:
        """Some request waits and a slot is free."""
        return self.scheduler.can_admit

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache

    # ---- the loop -------------------------------------------------------------------------------------------

    def step(self, decode: bool = True) -> list[Event]:
        """Admit waiting requests into free slots (prefill), then advance
        every running one (a decode round trip or a speculative pass).
        Returns what each request got. decode=False stops after the
        prefill: the new requests' first tokens come back without waiting
        for the others' round trip (a server's time to first token)."""
        results = _StepResults()
        for req, layers in self.scheduler.admit():
            self._restore(req, layers)
        for group, length in self.scheduler.prefill_groups():
            self._prefill(group, length, results)
        if decode and self.scheduler.decoding():  # not only prompts part way through a block-by-block prefill
            drafts = self._drafts(results)
            if drafts is not None:
                self._verify(*drafts, results)
            elif self.scheduler.decoding():
                self._decode(results)
        return results.events()

    def reset_running(self, error: str = "the engine failed a step") -> list[int]:
        """After a step raised: fail the requests holding slots (their ids
        are returned) and rebuild the slots' state, whose buffers the failed
        call may have consumed; waiting requests stay queued."""
        dropped = [r.id for r in self.scheduler.reset(error)]
        self._slots = self._empty_slots()
        return dropped

    def stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
               ) -> Iterator[tuple[int, list[int]]]:
        """Run these requests (and any already queued) to the end, yielding
        (request id, new tokens) as they come; ids are in prompt order from
        the first one returned by add_request."""
        for prompt, p in zip(prompts, self._params_list(prompts, params), strict=True):
            self.add_request(prompt, p)
        while self.has_unfinished():
            for event in self.step():
                if event.error is not None:
                    raise RequestFailed(f"request {event.request_id}: {event.error}")
                if event.tokens:
                    yield event.request_id, event.tokens

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Completions of these prompts, in order. Every prompt is checked
        before any runs (a FieldError names the prompt's index, e.g.
        prompts[2].max_tokens)."""
        plist = self._params_list(prompts, params)
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            try:
                self.check(prompt, p)
            except FieldError as e:
                raise e.within(f"prompts[{i}]") from None
        return offline.generate(self, list(zip(prompts, plist)))

    def _params_list(self, prompts, params) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise FieldError("params", f"expected one SamplingParams or {len(prompts)} (one per prompt), "
                             f"got {len(params)}")
        return params

    # ---- running the programs -------------------------------------------------------------------------------

    def _on_mesh(self) -> contextlib.AbstractContextManager:
        """The context the programs run in: the engine's mesh, if any."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _empty_slots(self) -> programs.Slots:
        def make():
            return programs.empty_slots(self.model, self.max_slots, self.capacity, self.rollback)
        if self.mesh is None:
            return make()
        with self._on_mesh():  # created in place, each array in its layout
            return jax.jit(lambda: programs.place(self._static, make()))()

    def _history(self, length: int) -> int | None:
        """The prefill's state snapshots for the prefix cache: every block of
        a bucket of whole blocks (a shorter bucket holds no block to keep)."""
        return self.block_size if self.prefix_cache is not None and length % self.block_size == 0 else None

    def _restore(self, req: Request, layers: tuple) -> None:
        """Write a request's cached prefix into its slot."""
        with self._on_mesh():
            self._slots = self._programs.restore(self._slots, jnp.int32(req.held_slot), layers)
        self.stats.programs.add(("restore", ()))
        self.stats.cached_tokens += req.cached

    def _prefill(self, group: list[tuple[Request, int]], length: int, results: _StepResults) -> None:
        """One prefill call: each request's prompt from its start, up to
        `length` tokens; a request whose prompt is then done draws its first
        token and starts decoding."""
        vocab = self.model.config.vocab_size
        rows = self.max_prefill_batch if self.batch_invariant else len(group)
        tokens = np.zeros((rows, length), np.int32)
        seen = np.zeros((rows, vocab), bool)
        starts = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        slots = np.full(rows, self.max_slots, np.int32)  # padding rows write nowhere
        for i, (req, start) in enumerate(group):
            n = min(length, len(req.prompt) - start)
            tokens[i, :n] = req.prompt[start:start + n]
            seen[i, req.prompt] = True
            starts[i], lengths[i], slots[i] = start, n, req.held_slot
        lengths[len(group):] = 1
        targets = None  # each position's next prompt token, for the requests that score their prompt
        if any(req.params.prompt_logprobs is not None for req, _ in group):
            targets = np.zeros((rows, length), np.int32)
            for i, (req, start) in enumerate(group):
                nxt = req.prompt[start + 1:start + 1 + length]
                targets[i, :len(nxt)] = nxt
        params = SlotParams.rows([r.params for r, _ in group] + [SamplingParams()] * (rows - len(group)),
                                 [r.seed for r, _ in group] + [0] * (rows - len(group)))
        # the first token each constrained request may draw (every token for the others: one program for both)
        allowed = grammar.masks([req.matcher for req, _ in group] + [None] * (rows - len(group)), vocab)
        with self._on_mesh():
            self._slots, out = self._programs.prefill(self._state, self._slots, slots, tokens, starts, lengths,
                                                      params, seen, targets, allowed,
                                                      history_every=self._history(length))
        self.stats.programs.add(("prefill", (rows, length)))
        self.stats.prefill_calls += 1
        got = fetch(out)
        if got.snapshot is not None:
            self.scheduler.store(group, got.snapshot, lengths)
        for i, (req, start) in enumerate(group):
            wanted = req.params.prompt_logprobs
            if wanted is not None and got.prompt is not None:  # positions whose next token is the prompt's
                for j in range(min(int(lengths[i]), len(req.prompt) - 1 - start)):
                    req.prompt_logprobs.append((float(got.prompt.chosen[i, j]), {
                        int(t): float(v) for t, v in zip(got.prompt.top_ids[i, j, :wanted],
                                                         got.prompt.top[i, j, :wanted])}))
            if self.scheduler.prefilled(req, int(lengths[i])):
                self._emit(req, [int(got.tokens[i])], got.logprobs, i,
                           None if got.logits is None else got.logits[i][None], results)

    def _run_decode(self, active: np.ndarray, rows: int, allowed: np.ndarray | None = None):
        """The decode program over the first `rows` slots (recorded among the
        compiled programs); with `allowed` (constrained rows), one token."""
        steps = self.decode_steps if allowed is None else 1
        with self._on_mesh():
            self._slots, step = self._programs.decode(self._state, self._slots, active, allowed, steps=steps,
                                                      rows=rows)
        self.stats.programs.add(("decode", (rows, steps) if allowed is None else (rows, steps, "constrained")))
        return step

    def _run_verify(self, active: np.ndarray, drafts: np.ndarray, counts: np.ndarray):
        """The verify program over every slot (recorded among the compiled programs)."""
        with self._on_mesh():
            self._slots, out = self._programs.verify(self._state, self._slots, active, drafts, counts)
        self.stats.programs.add(("verify", drafts.shape))
        return out

    def _decode(self, results: _StepResults) -> None:
        active = self.scheduler.active()
        used = int(np.flatnonzero(active)[-1]) + 1
        allowed = None
        decoding = self.scheduler.decoding()
        if any(req.matcher is not None for req in decoding):
            matchers: list = [None] * self.max_slots
            for req in decoding:
                matchers[req.held_slot] = req.matcher
            allowed = grammar.masks(matchers, self.model.config.vocab_size)
        step = self._run_decode(active, next(r for r in self.decode_rows if r >= used), allowed)
        self.stats.decode_calls += 1
        got = fetch(step)
        for req in decoding:
            slot = req.held_slot
            logits = None if got.logits is None else got.logits[slot]
            self._emit(req, [int(t) for t in got.tokens[slot]], got.logprobs, slot, logits, results)

    def _drafts(self, results: _StepResults) -> tuple[np.ndarray, np.ndarray] | None:
        if self.speculative is None or any(req.matcher is not None for req in self.scheduler.decoding()):
            return None  # a constrained request's tokens are checked one at a time: no verify pass then
        k = self.speculative.num_tokens
        drafts = np.zeros((self.max_slots, k), np.int32)
        counts = np.zeros(self.max_slots, np.int32)
        vocab = self.model.config.vocab_size
        for req in self.scheduler.decoding():
            room = req.params.max_tokens - len(req.tokens) - 1  # the pass also yields one token of its own
            try:
                proposal = [int(t) for t in self.speculative.propose(req.prompt + req.tokens)][:max(0, min(k, room))]
            except Exception as e:  # the drafter's failure on this request's context: this request alone fails
                self._fail(req, f"the drafter failed: {type(e).__name__}: {e}", results)
                continue
            proposal = [t for t in proposal if 0 <= t < vocab]  # a drafter's out-of-vocabulary token is dropped
            drafts[req.held_slot, :len(proposal)] = proposal
            counts[req.held_slot] = len(proposal)
        # batch-invariant: every token from a verify pass (a plain decode step computes in another
        # shape, and whether another slot has drafts must not change a request's program)
        if not counts.any() and not self.batch_invariant:
            return None
        return drafts, counts

    def _verify(self, drafts: np.ndarray, counts: np.ndarray, results: _StepResults) -> None:
        out = self._run_verify(self.scheduler.active(), drafts, counts)
        self.stats.verify_calls += 1
        got = fetch(out)
        self.stats.drafted_tokens += int(counts.sum())
        for req in self.scheduler.decoding():
            slot = req.held_slot
            a = int(got.accepted[slot])
            self.stats.accepted_tokens += a
            self.stats.verified_requests += 1
            logits = None if got.step.logits is None else got.step.logits[slot][:a + 1]
            self._emit(req, [int(t) for t in got.step.tokens[slot][:a + 1]], got.step.logprobs, slot, logits,
                       results)

    # ---- results --------------------------------------------------------------------------------------------

    def _emit(self, req: Request, new: list[int], lp, row: int, logits, results: _StepResults) -> None:
        """Give a request its new tokens up to its stop condition."""
        p = req.params
        if p.logprobs is not None:  # this row's: [n] and [n, N] (a prefill gives one token: [] and [N])
            chosen, ids, top = (np.asarray(x[row]) for x in lp)
            if chosen.ndim == 0:
                chosen, ids, top = chosen[None], ids[None], top[None]
        got = results.tokens(req)
        reason = None
        for j, tok in enumerate(new):
            if req.matcher is not None and (refused := req.matcher.consume(tok)) is not None:
                # the mask allowed a token the grammar then refused: gdnx's fault or the grammar engine's, never
                # the client's; the request fails alone, its one line names the token and the constraint
                s = req.params.structured
                where = f"{s.field}, {s.kind}" if s is not None else "constraint"
                first = (refused.strip().splitlines() or ["refused"])[0][:200]
                _log.error("request %d: the output constraint (%s) refused token %d:\n%s", req.id, where, tok,
                           refused)
                self._fail(req, f"the output constraint ({where}) refused token {tok}: {first}", results)
                return
            got.append(tok)
            if p.logprobs is not None:
                # a token a constraint (or min_tokens) ruled out has -inf: not a candidate, left out
                req.logprobs.append((float(chosen[j]), {int(i): float(v) for i, v in
                                                        zip(ids[j][:p.logprobs], top[j][:p.logprobs])
                                                        if v > -np.inf}))
            if logits is not None:
                req.logits.append(np.asarray(logits[j]))
            self.stats.generated_tokens += 1
            try:
                reason = req.output.add(tok)
            except Exception as e:  # the tokenizer's failure on this request's tokens: it alone fails
                self._fail(req, f"detokenizing failed: {type(e).__name__}: {e}", results)
                return
            if reason is not None:
                break
        if reason is not None:
            self.scheduler.finish(req, reason)

    def _fail(self, req: Request, error: str, results: _StepResults) -> None:
        results.tokens(req)  # it gets an event, with the error
        self.scheduler.fail([req], error)
