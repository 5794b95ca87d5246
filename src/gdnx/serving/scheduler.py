"""Which requests run where: the queue, the slots, prefill batches and the
prefix cache. The Scheduler alone holds the engine's requests; it moves
them through their states (gdnx.serving.request) and hands the engine
what to run: restores to write, prefill groups, the decoding slots.

Requests take the lowest free slot, so a decode batch (the first 1, 4,
16, ... slots) stays as small as the running requests allow. Prompts are
prefilled whole, grouped by length bucket in batches of 1, 4, 16, ... (a
group padded up to the next), or in
batch-invariant mode one block at a time in batches of one fixed shape.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from collections.abc import Sequence

import numpy as np

from gdnx.serving.config import EngineConfig, EngineShapes
from gdnx.serving.params import FinishReason
from gdnx.serving.prefix_cache import CacheEntries, PrefixCache
from gdnx.serving.request import Request, RequestStatus


Restore = tuple[Request, tuple]   # a request and the per-entry arrays its slot gets from the prefix cache
PrefillGroup = tuple[list[tuple[Request, int]], int]   # (request, start) pairs and the padded length


class Scheduler:
    """config and shapes: the engine's settings and the shapes they fix;
    entries: how the model's cache entries sit in the slot state (what the
    prefix cache keeps of them)."""

    def __init__(self, config: EngineConfig, shapes: EngineShapes, entries: CacheEntries):
        self.config, self.shapes = config, shapes
        self.prefix_cache = (PrefixCache(config.prefix_cache_bytes, shapes.block_size, entries)
                             if config.prefix_cache_bytes else None)
        self._waiting: collections.deque[Request] = collections.deque()
        self._free = list(range(config.max_slots))   # a heap
        self._slots: dict[int, Request] = {}           # PREFILLING and RUNNING requests by slot
        self._requests: dict[int, Request] = {}        # every request not yet done, by id
        self._prefill_only = False                      # the last step chosen by `step_decodes` was prefill only

    # ---- what is where ------------------------------------------------------------------------------------

    def get(self, request_id: int) -> Request | None:
        return self._requests.get(request_id)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return len(self._slots)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._slots)

    @property
    def can_admit(self) -> bool:
        """A slot is free and some waiting request may take it."""
        return bool(self._free) and any(not self._follows(r) for r in self._waiting)

    def digest(self) -> str:
        """A short digest of what the next step will run from: the waiting
        requests and, per slot, its request, state, prompt progress and
        tokens so far (two schedulers that agree on it make the same step)."""
        state = ([r.id for r in self._waiting],
                 [(slot, r.id, r.status.value, r.progress, len(r.tokens)) for slot, r in sorted(self._slots.items())])
        return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()

    def step_decodes(self) -> bool:
        """A server's choice for its next step: whether it decodes after
        admitting. While requests wait for a free slot, a step may stop
        after their prefill, so their first tokens go out before the
        running requests' next round trip; never two such steps in a row,
        so arrivals cannot stall the running requests."""
        self._prefill_only = self.can_admit and not self._prefill_only
        return not self._prefill_only

    def in_slots(self, status: RequestStatus | None = None) -> list[Request]:
        """The requests holding slots (of one status), by slot."""
        return [r for _, r in sorted(self._slots.items()) if status is None or r.status is status]

    def decoding(self) -> list[Request]:
        return self.in_slots(RequestStatus.RUNNING)

    def active(self) -> np.ndarray:
        """bool [max_slots]: the slots whose request decodes."""
        mask = np.zeros(self.config.max_slots, bool)
        for r in self.decoding():
            mask[r.held_slot] = True
        return mask

    # ---- requests in and out ------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._waiting.append(request)
        self._requests[request.id] = request

    def admit(self) -> list[Restore]:
        """Give waiting requests the free slots; returns the prefix-cache
        states to write into the slots of those that hit."""
        restores, later = [], []
        while self._waiting and self._free:
            req = self._waiting.popleft()
            if self._follows(req):
                later.append(req)
                continue
            req.transition(RequestStatus.PREFILLING, slot=heapq.heappop(self._free))
            self._slots[req.held_slot] = req
            hit = self._match(req)
            if hit is not None:
                restores.append((req, hit))
        self._waiting.extendleft(reversed(later))
        return restores

    def finish(self, req: Request, reason: FinishReason) -> None:
        self._leave(req, RequestStatus.FINISHED, reason=reason)

    def abort(self, request_id: int) -> Request | None:
        """Drop a request in any state not yet done (its slot is free at
        once); returns it, or None for an id the scheduler does not hold."""
        req = self._requests.get(request_id)
        if req is not None:
            self._leave(req, RequestStatus.ABORTED)
        return req

    def fail(self, requests: Sequence[Request], error: str) -> None:
        for req in requests:
            self._leave(req, RequestStatus.FAILED, error=error)

    def reset(self, error: str) -> list[Request]:
        """Fail every request holding a slot (their slots' states are lost
        with a failed step); waiting requests stay."""
        dropped = self.in_slots()
        self.fail(dropped, error)
        return dropped

    def _leave(self, req: Request, to: RequestStatus, **how) -> None:
        """End a request: out of the queue or its slot, then into `to`."""
        if req.status is RequestStatus.WAITING:
            self._waiting.remove(req)
        if req.slot is not None:
            del self._slots[req.slot]
            heapq.heappush(self._free, req.slot)
        req.transition(to, **how)
        del self._requests[req.id]

    # ---- prefill ------------------------------------------------------------------------------------------

    def prefill_groups(self) -> list[PrefillGroup]:
        """The prefill calls of this step: in batch-invariant mode one block
        of up to max_prefill_batch prompts (a fixed shape), else every
        prompt whole, grouped by length bucket into the smallest prefill
        batch that holds them (the engine pads the rest of its rows); a
        prompt that asks for its own logprobs is prefilled alone (the
        scoring program is compiled for one row per bucket only)."""
        config, shapes = self.config, self.shapes
        pending = self.in_slots(RequestStatus.PREFILLING)
        if not pending:
            return []
        if config.batch_invariant:
            return [([(r, r.progress) for r in pending[:config.prefill_rows]], shapes.block_size)]
        groups: dict[tuple[int, bool], list[tuple[Request, int]]] = collections.defaultdict(list)
        for req in pending:
            scores = req.params.prompt_logprobs is not None
            groups[(shapes.bucket(len(req.prompt) - req.progress), scores)].append((req, req.progress))
        out = []
        for (length, scores), group in sorted(groups.items()):
            while group:  # the smallest batch that holds them (padded), or the largest
                size = 1 if scores else shapes.prefill_batch(min(len(group), config.prefill_rows))
                out.append((group[:size], length))
                group = group[size:]
        return out

    def prefilled(self, req: Request, tokens: int) -> bool:
        """Count `tokens` more of the request's prompt as through; True once
        it all is (the request then decodes)."""
        req.progress += tokens
        if req.progress < len(req.prompt):
            return False
        req.transition(RequestStatus.RUNNING)
        return True

    # ---- the prefix cache ---------------------------------------------------------------------------------

    def _follows(self, req: Request) -> bool:
        """Whether a prefilling request is computing the blocks `req` could
        take from the prefix cache: `req` waits for them (the n completions
        of one prompt share its prefill) rather than compute them again."""
        if self.prefix_cache is None or req.params.prompt_logprobs is not None:
            return False
        shared = (len(req.prompt) - 1) // self.shapes.block_size * self.shapes.block_size
        return shared > 0 and any(r.progress < shared and r.prompt[:shared] == req.prompt[:shared]
                                  for r in self.in_slots(RequestStatus.PREFILLING))

    def _match(self, req: Request) -> tuple | None:
        """The arrays a request's slot gets from its cached prefix, or None
        (sets the request's progress and cached count)."""
        shapes, cache = self.shapes, self.prefix_cache
        if cache is None or req.params.prompt_logprobs is not None:  # every prompt token's logits are wanted
            return None
        # at least one prompt token is prefilled (its logits draw the first token)
        block = shapes.block_size
        blocks = cache.match(req.prompt, (len(req.prompt) - 1) // block)
        # the rest's bucket must fit in the cache: past its end, recompute some cached blocks instead
        while blocks and not self.config.batch_invariant and (
                len(blocks) * block + shapes.bucket(len(req.prompt) - len(blocks) * block) > shapes.buckets[-1]):
            blocks.pop()
        if not blocks:
            return None
        req.progress = req.cached = len(blocks) * block
        return cache.slot_layers(blocks)

    def store(self, group: list[tuple[Request, int]], snapshot: tuple, lengths: np.ndarray) -> None:
        """Put the blocks a prefill call completed into the prefix cache
        (snapshot: per cache entry, the call's per-block states or keys and
        values, rows in the group's order)."""
        if self.prefix_cache is None:
            return
        for i, (req, start) in enumerate(group):
            self.prefix_cache.store(req.prompt, i, start, int(lengths[i]), snapshot)
