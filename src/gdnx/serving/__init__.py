"""Serving GDN hybrids: a batched generation engine (continuous batching,
length-bucket prefill, a prefix cache of recurrent states, speculative
decoding, batch invariance)."""

from gdnx.serving.drafter import Drafter, NgramDrafter
from gdnx.serving.engine import Engine, EngineStats, Event, RequestFailed
from gdnx.serving.params import Completion, SamplingParams

__all__ = ["Completion", "Drafter", "Engine", "EngineStats", "Event", "NgramDrafter", "RequestFailed", "SamplingParams"]
