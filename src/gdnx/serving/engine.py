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

The work is split by job: the settings are one EngineConfig
(gdnx.serving.config); the Scheduler (gdnx.serving.scheduler) holds the
requests and decides what runs where; the ModelRunner
(gdnx.serving.runner) runs the compiled programs (gdnx.serving.programs)
on the device state; each Request (gdnx.serving.request) takes its tokens
through its constraint and its Output (gdnx.serving.output), which
detokenizes them and checks its stop conditions. Engine.step joins
them: it builds each program's batch from the scheduler's choice and gives
the results to the requests.

Batch invariance: a row's computation never mixes with another row's,
every slot runs the same program, a prompt's bucket (and so its padding)
depends only on its own length, padding leaves every state as it was, and
a prefix-cache hit continues from the very states the full prefill would
carry across that block boundary: a request's tokens and logits are
bit-identical whatever shares the engine with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from gdnx.errors import FieldError
from gdnx.parallel.mesh import as_auto
from gdnx.parallel.rules import MESH_AXES
from gdnx.serving import grammar, offline
from gdnx.serving.config import EngineConfig
from gdnx.serving.drafter import Drafter, NgramDrafter
from gdnx.serving.grammar import Grammars
from gdnx.serving.output import Completion, Output, unpack_logprobs
from gdnx.serving.params import SamplingParams
from gdnx.serving.prefix_cache import PrefixCache
from gdnx.serving.request import Request, RequestStatus
from gdnx.serving.runner import DecodeBatch, ModelRunner, PrefillBatch, VerifyBatch
from gdnx.serving.sampling import MAX_STOP_IDS, SlotParams
from gdnx.serving.scheduler import Scheduler



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
    drafted_at: list[int] = dataclasses.field(default_factory=list)   # drafts verified, by position in the pass
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # drafts accepted, by position
    programs: set = dataclasses.field(default_factory=set)  # (name, shape) of each compiled program

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens / drafted ones."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def acceptance_at(self) -> list[float]:
        """Per draft position (the first draft of a pass, the second, ...):
        the share of the drafts proposed there that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """One request's pass: `drafted` drafts verified, its first `accepted` kept."""
        grow = max(0, drafted - len(self.drafted_at))
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted

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
    error_field: str | None = None  # the field whose constraint could not be honoured, when that is why


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
                out.append(Event(req.id, toks, error=req.error, error_field=req.error_field))
                continue
            lp = req.logprobs[self._logprobs_from[req]:] if req.params.logprobs is not None else None
            out.append(Event(req.id, toks, req.completion, lp,
                             req.output.new_text(finished=req.status is RequestStatus.FINISHED)))
        return out


class Engine:
    """Generate for many requests at once with one model.

    model: a gdnx CausalLM (any family).
    config: the engine's settings (EngineConfig; its fields may also be
      given as keywords, which replace config's): max_slots, max_length,
      prefix_cache_bytes, block_size, decode_steps, max_prefill_batch,
      max_logprobs, draft_tokens, batch_invariant, keep_logits, seed.
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
    mesh: a jax.sharding.Mesh with gdnx's axes (gdnx.parallel.make_mesh):
      the weights placed as training places them, each slot's state split
      with its layer's heads over `tensor` and the slots over `data` and
      `fsdp`, every program run on it (as an Auto mesh: XLA places what
      the programs do not state; `context` must be 1). None: the model's
      own placement.
    speculative: a Drafter (e.g. NgramDrafter) to propose tokens verified
      in one pass; None: config.draft_method's drafter of
      config.draft_tokens (an NgramDrafter, or the model's multi-token
      prediction module), or plain decoding when that is 0. The module
      drafts on the device: each program returns every row's next drafts,
      and its own keys and values per slot follow the tokens each row
      keeps (gdnx.serving.programs).
    tokenizer: anything with decode(ids) -> str; needed for stop strings
      and Completion.text.
    eos_token_ids: end-of-sequence tokens (default: the model config's).
    grammars: gdnx.serving.grammar.Grammars for the tokenizer, needed by
      requests with a `structured` constraint (each constrained token is
      drawn in a decode call of its own, the host computing the allowed
      tokens from the last one; no drafts for them; not in batch-invariant
      mode).
    """

    def __init__(self, model: Any, config: EngineConfig | None = None, *, mesh: jax.sharding.Mesh | None = None,
                 speculative: Drafter | None = None, tokenizer: Detokenizer | None = None,
                 eos_token_ids: Sequence[int] | None = None, grammars: Grammars | None = None, **fields: Any):
        if config is not None and not isinstance(config, EngineConfig):
            raise FieldError("config", f"expected an EngineConfig or None, got {type(config).__name__}")
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(f"Engine: unknown setting {unknown[0]!r} (EngineConfig's fields)")
        config = EngineConfig(**fields) if config is None else dataclasses.replace(config, **fields)
        cfg = model.config
        if speculative is not None and not isinstance(speculative, Drafter):
            raise FieldError("speculative", "expected a Drafter (propose(tokens), num_tokens) or None, "
                             f"got {type(speculative).__name__}")
        if speculative is not None and config.draft_tokens:
            raise FieldError("draft_tokens", "given together with a drafter (speculative); give one")
        mtp = config.draft_method == "mtp"
        if mtp and getattr(model, "mtp", None) is None:
            raise FieldError("draft_method", "mtp: this model has no multi-token prediction module (its checkpoint "
                             "holds none of the module's weights; model.mtp_num_layers=0)")
        if speculative is None and config.draft_tokens and not mtp:
            speculative = NgramDrafter(config.draft_tokens)
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
            mesh = as_auto(mesh)
        if eos_token_ids is None:
            eos = cfg.eos_token_id
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        # drafts per pass from the multi-token prediction module, which proposes on the device
        self.mtp_drafts = config.draft_tokens if mtp else 0
        draft = speculative.num_tokens if speculative is not None else self.mtp_drafts
        self.draft_tokens = draft  # per verify pass (0: no verify pass)
        platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        self.draft_rows = config.drafting_rows(platform)  # the most decode rows with a verify pass
        self.config, self.shapes = config, config.shapes(cfg, draft)
        self.model, self.mesh = model, mesh
        self.tokenizer, self.speculative, self.grammars = tokenizer, speculative, grammars
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.stats = EngineStats()
        # a sliding window's ring keeps the drafts a verify pass may take back beyond its window
        self.runner = ModelRunner(model, config, self.shapes, mesh=mesh, eos_token_ids=self.eos_token_ids,
                                  rollback=draft, prefix_cache=config.prefix_cache_bytes > 0,
                                  mtp_drafts=self.mtp_drafts, draft_rows=self.draft_rows)
        # per slot: the drafts its last program returned; a slot decoded past draft_rows (the module skipped)
        # has none until its next request
        self._mtp_proposals: dict[int, list[int]] = {}
        self.scheduler = Scheduler(config, self.shapes, self.runner.cache_entries())
        self._next_id = 0
        self._rng = np.random.default_rng(config.seed)
        # an unconstrained decode call's bitmask: every token for every slot (built once, not per step)
        self._every_token = grammar.masks([None] * config.max_slots, cfg.vocab_size)

    def set_weights(self, state: Any) -> None:
        """Generate with these weights from the next step (the model's
        nnx.state, e.g. a trainer's updated parameters): on a mesh each
        array is placed where the engine's are; the prefix cache (states of
        the old weights) is emptied; weights placed as the engine's compile
        no program again (ModelRunner.set_weights). Refused while a request
        is unfinished."""
        if self.has_unfinished():
            raise RuntimeError("Engine.set_weights: requests are unfinished; finish or abort them first")
        self.runner.set_weights(state)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def max_slots(self) -> int:
        return self.config.max_slots

    @property
    def max_length(self) -> int:
        return self.config.max_length

    @property
    def buckets(self) -> tuple[int, ...]:
        """The prefill lengths."""
        return self.shapes.buckets

    @property
    def decode_rows(self) -> tuple[int, ...]:
        """The decode batch sizes."""
        return self.shapes.decode_rows

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
            if n is not None and n > self.config.max_logprobs:
                raise FieldError(name, f"expected at most the engine's max_logprobs={self.config.max_logprobs}, "
                                 f"got {n}")
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
            if self.config.batch_invariant:
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
        calls: the decode step of every decode batch size (plain and
        constrained calls share it), the verify pass with a drafter, and with
        `prefill` every prefill shape (each length bucket at each prefill
        batch, 1, 4, 16, ... and max_prefill_batch, or the one block shape
        in batch-invariant mode), with and without prompt logprobs, and the
        prefix cache's restore. Runs them on idle slots (prefill rows that
        write nowhere), so only while no request runs, and returns once they
        have run (not merely been dispatched: a request would otherwise
        queue behind them). Returns how many programs ran (docs/serving.md
        counts them)."""
        if self.scheduler.running:
            raise RuntimeError("warm_up: requests are running; call it before adding any")
        ran = self.runner.warm_up(prefill=prefill, draft=self.draft_tokens,
                                  draft_rows=self.draft_rows)
        self.stats.programs.update(ran)
        return len(ran)

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

    def step_decodes(self) -> bool:
        """A server's choice for its next step (Scheduler.step_decodes)."""
        return self.scheduler.step_decodes()

    def reset_running(self, error: str = "the engine failed a step") -> list[int]:
        """After a step raised: fail the requests holding slots (their ids
        are returned) and rebuild the slots' state, whose buffers the failed
        call may have consumed; waiting requests stay queued."""
        dropped = [r.id for r in self.scheduler.reset(error)]
        self.runner.reset()
        return dropped

    def stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
               ) -> Iterator[tuple[int, list[int]]]:
        """Run these requests (and any already queued) to the end, yielding
        (request id, new tokens) as they come; ids are in prompt order from
        the first one returned by add_request."""
        return offline.stream(self, list(zip(prompts, self._params_list(prompts, params), strict=True)))

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

    def _restore(self, req: Request, layers: tuple) -> None:
        """Write a request's cached prefix into its slot."""
        self.runner.restore(req.held_slot, layers)
        self.stats.programs.add(("restore", ()))
        self.stats.cached_tokens += req.cached

    def _prefill(self, group: list[tuple[Request, int]], length: int, results: _StepResults) -> None:
        """One prefill call: each request's prompt from its start, up to
        `length` tokens; a request whose prompt is then done draws its first
        token and starts decoding."""
        vocab = self.model.config.vocab_size
        rows = self.shapes.prefill_batch(len(group))  # padding rows write nowhere
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
        follows = np.full(rows, -1, np.int32)  # the prompt's next token after the call's, for the MTP drafter
        for i, (req, start) in enumerate(group):
            if start + lengths[i] < len(req.prompt):
                follows[i] = req.prompt[start + lengths[i]]
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
        self._check_min_tokens([(req, allowed[i]) for i, (req, _) in enumerate(group)])
        got = self.runner.prefill(PrefillBatch(slots, tokens, starts, lengths, params, seen, targets, allowed,
                                               follows))
        self.stats.programs.add(("prefill", (rows, length) + (("prompt logprobs",) if targets is not None else ())))
        self.stats.prefill_calls += 1
        if got.snapshot is not None:
            self.scheduler.store(group, got.snapshot, lengths)
        for i, (req, start) in enumerate(group):
            wanted = req.params.prompt_logprobs
            if wanted is not None and got.prompt is not None:  # positions whose next token is the prompt's
                req.prompt_logprobs += unpack_logprobs(got.prompt.chosen[i], got.prompt.top_ids[i],
                                                       got.prompt.top[i], wanted,
                                                       min(int(lengths[i]), len(req.prompt) - 1 - start))
            if self.scheduler.prefilled(req, int(lengths[i])):
                self._proposed(req, got.drafts, i, prefilled=True)
                self._emit(req, [int(got.tokens[i])], got.logprobs, i,
                           None if got.logits is None else got.logits[i][None], results)

    def _rows(self) -> int:
        """The decode batch size that holds every slot in use (the first ones)."""
        used = int(np.flatnonzero(self.scheduler.active())[-1]) + 1
        return next(r for r in self.decode_rows if r >= used)

    def _decode(self, results: _StepResults) -> None:
        active = self.scheduler.active()
        decoding = self.scheduler.decoding()
        matchers: list = [None] * self.max_slots
        for req in decoding:
            matchers[req.held_slot] = req.matcher
        constrained = any(m is not None for m in matchers)
        rows = self._rows()
        draws = 1 if constrained else self.config.decode_steps  # the host masks a constrained row's next token
        allowed = grammar.masks(matchers, self.model.config.vocab_size) if constrained else self._every_token
        if constrained:
            self._check_min_tokens([(req, allowed[req.held_slot]) for req in decoding])
        got = self.runner.decode(DecodeBatch(active, allowed, rows, self.config.decode_steps, draws))
        self.stats.programs.add(("decode", (rows, self.config.decode_steps)))
        self.stats.decode_calls += 1
        for req in decoding:
            slot = req.held_slot
            self._proposed(req, got.drafts, slot)
            logits = None if got.logits is None else got.logits[slot][:draws]
            self._emit(req, [int(t) for t in got.tokens[slot][:draws]], got.logprobs, slot, logits, results)

    def _proposed(self, req: Request, drafts: Any, row: int, prefilled: bool = False) -> None:
        """Keep the MTP drafter's next drafts for a request (row: its row of
        the call's; prefilled: its prompt is just through). A call that
        skipped the module (a decode past draft_rows) leaves the request
        without drafts from then on: the module's cache lacks its tokens."""
        if not self.mtp_drafts:
            return
        if drafts is None:
            self._mtp_proposals.pop(req.held_slot, None)
        elif prefilled or req.held_slot in self._mtp_proposals:
            self._mtp_proposals[req.held_slot] = [int(t) for t in drafts[row]]

    def _propose(self, req: Request) -> list[int]:
        if self.mtp_drafts:
            return self._mtp_proposals.get(req.held_slot, [])
        assert self.speculative is not None
        return [int(t) for t in self.speculative.propose(req.prompt + req.tokens)]

    def _drafts(self, results: _StepResults) -> tuple[np.ndarray, np.ndarray] | None:
        if not self.draft_tokens or any(req.matcher is not None for req in self.scheduler.decoding()):
            return None  # a constrained request's tokens are checked one at a time: no verify pass then
        if self._rows() > self.draft_rows:
            return None  # under load: a verify pass over this many rows costs more than its drafts gain
        k = self.draft_tokens
        drafts = np.zeros((self.max_slots, k), np.int32)
        counts = np.zeros(self.max_slots, np.int32)
        vocab = self.model.config.vocab_size
        for req in self.scheduler.decoding():
            room = req.params.max_tokens - len(req.tokens) - 1  # the pass also yields one token of its own
            try:
                proposal = self._propose(req)[:max(0, min(k, room))]
            except Exception as e:  # the drafter's failure on this request's context: this request alone fails
                self._fail(req, f"the drafter failed: {type(e).__name__}: {e}", results)
                continue
            proposal = [t for t in proposal if 0 <= t < vocab]  # a drafter's out-of-vocabulary token is dropped
            drafts[req.held_slot, :len(proposal)] = proposal
            counts[req.held_slot] = len(proposal)
        # batch-invariant: every token from a verify pass (a plain decode step computes in another
        # shape, and whether another slot has drafts must not change a request's program)
        if not counts.any() and not self.config.batch_invariant:
            return None
        return drafts, counts

    def _verify(self, drafts: np.ndarray, counts: np.ndarray, results: _StepResults) -> None:
        rows = self._rows()
        got = self.runner.verify(VerifyBatch(self.scheduler.active(), drafts, counts, rows))
        self.stats.programs.add(("verify", (rows, drafts.shape[1])))
        self.stats.verify_calls += 1
        for req in self.scheduler.decoding():
            slot = req.held_slot
            a = int(got.accepted[slot])
            self.stats.count_drafts(int(counts[slot]), a)
            self.stats.verified_requests += 1
            self._proposed(req, got.step.drafts, slot)
            logits = None if got.step.logits is None else got.step.logits[slot][:a + 1]
            self._emit(req, [int(t) for t in got.step.tokens[slot][:a + 1]], got.step.logprobs, slot, logits,
                       results)

    # ---- results --------------------------------------------------------------------------------------------

    def _check_min_tokens(self, rows: list[tuple[Request, Any]]) -> None:
        """A constrained request whose constraint allows only the end before
        min_tokens (a choice shorter than it, say) can draw nothing: it is
        marked to fail with its step's result (naming min_tokens, the
        client's to change), never left to draw a token neither allows."""
        for req, mask in rows:
            if req.matcher is not None and len(req.tokens) < req.params.min_tokens \
                    and grammar.only_ends(mask, self.eos_token_ids):
                s = req.params.structured
                req.unmeetable = (f"min_tokens: the output constraint ({s.field if s else 'constraint'}) ends the "
                                  f"output after {len(req.tokens)} tokens, fewer than min_tokens="
                                  f"{req.params.min_tokens}")

    def _emit(self, req: Request, new: list[int], lp, row: int, logits, results: _StepResults) -> None:
        """Give a request its new tokens (row: its row of the call's logprobs)."""
        if req.unmeetable is not None:
            req.error_field = "min_tokens"
            self._fail(req, req.unmeetable, results)
            return
        kept = None if req.params.logprobs is None else unpack_logprobs(lp.chosen[row], lp.top_ids[row], lp.top[row],
                                                                        req.params.logprobs, len(new))
        got = results.tokens(req)  # before take: the event's logprobs start where the request's stood
        took = req.take(new, kept, logits)
        got.extend(took.tokens)
        self.stats.generated_tokens += len(took.tokens)
        if took.error is not None:
            req.error_field = took.field
            self._fail(req, took.error, results)
        elif took.reason is not None:
            self.scheduler.finish(req, took.reason)

    def _fail(self, req: Request, error: str, results: _StepResults) -> None:
        results.tokens(req)  # it gets an event, with the error
        self.scheduler.fail([req], error)
