"""Serving GDN hybrids: a batched generation engine (continuous batching,
length-bucket prefill, a prefix cache of recurrent states, speculative
decoding, batch invariance).

The engine and its helpers load on first use, so that the settings
(gdnx.serving.config, what the command-line flags default to) import
without JAX."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gdnx.serving.config import EngineConfig

if TYPE_CHECKING:
    from gdnx.serving.drafter import Drafter, NgramDrafter
    from gdnx.serving.engine import Engine, EngineStats, Event
    from gdnx.serving.offline import RequestFailed
    from gdnx.serving.output import Completion
    from gdnx.serving.params import SamplingParams

_LAZY = {"Drafter": "drafter", "NgramDrafter": "drafter", "Engine": "engine", "EngineStats": "engine",
         "Event": "engine", "RequestFailed": "offline", "Completion": "output", "SamplingParams": "params"}

__all__ = ["Completion", "Drafter", "Engine", "EngineConfig", "EngineStats", "Event", "NgramDrafter",
           "RequestFailed", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
