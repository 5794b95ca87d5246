"""The server's Prometheus metrics (text format at GET /metrics), in a
registry of their own so two servers in one process do not share them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds; a tiny model's token on a CPU takes milliseconds, a large one's prompt on a slow host seconds
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """requests (admitted, finished, aborted by their client, failed by the
    engine, rejected over the queue limit), prompt / cached / generated
    tokens, queue depth and running slots, time to first token and
    inter-token latency (the tokens of one decode round trip arrive
    together: each is counted at their mean gap), the prefix cache's hit
    rate (cached prompt tokens / prompt tokens) and speculative acceptance
    (accepted / drafted tokens)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gdnx_requests", "engine requests admitted (one per choice)", registry=r)
        self.finished = Counter("gdnx_requests_finished", "requests that ran to their stop condition", registry=r)
        self.aborted = Counter("gdnx_requests_aborted", "requests dropped when their client went away", registry=r)
        self.failed = Counter("gdnx_requests_failed", "requests failed by an engine error", registry=r)
        self.rejected = Counter("gdnx_requests_rejected", "requests refused over the queue limit", registry=r)
        self.prompt_tokens = Counter("gdnx_prompt_tokens", "prompt tokens admitted", registry=r)
        self.cached_tokens = Counter("gdnx_prefix_cache_hit_tokens", "prompt tokens restored from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("gdnx_generated_tokens", "tokens generated", registry=r)
        self.drafted_tokens = Counter("gdnx_speculative_drafted_tokens", "draft tokens verified", registry=r)
        self.accepted_tokens = Counter("gdnx_speculative_accepted_tokens", "draft tokens accepted", registry=r)
        self.queue_depth = Gauge("gdnx_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("gdnx_running_slots", "slots holding a request", registry=r)
        self.hit_rate = Gauge("gdnx_prefix_cache_hit_rate", "cached prompt tokens / prompt tokens", registry=r)
        self.hit_rate.set_function(lambda: self._ratio("gdnx_prefix_cache_hit_tokens", "gdnx_prompt_tokens"))
        self.acceptance = Gauge("gdnx_speculative_acceptance", "accepted / drafted tokens", registry=r)
        self.acceptance.set_function(lambda: self._ratio("gdnx_speculative_accepted_tokens",
                                                         "gdnx_speculative_drafted_tokens"))
        self.time_to_first_token = Histogram("gdnx_time_to_first_token_seconds", "request arrival to its first token",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("gdnx_inter_token_latency_seconds", "time between a request's tokens",
                                             buckets=_ITL_BUCKETS, registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str) -> float:
        """A sample's current value (a counter's name ends in _total)."""
        return self.registry.get_sample_value(name) or 0.0

    def _ratio(self, num: str, den: str) -> float:
        d = self.value(f"{den}_total")
        return self.value(f"{num}_total") / d if d else 0.0
