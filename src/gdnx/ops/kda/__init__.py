"""Kimi Delta Attention (KDA): the delta rule with one log decay per key
channel, g [B, T, HV, K].

Its chunk algebra and Variant (math.py), its gate functions (gates.py), its
Triton kernels (pallas_gpu.py) and its public ops (api.py), which load on
first use; everything else is the delta-rule family's (gdnx.ops.delta_rule).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gdnx.ops.kda.api import chunk_kda, recurrent_kda
    from gdnx.ops.kda.gates import kda_gate

_LAZY = {"chunk_kda": "api", "recurrent_kda": "api", "kda_gate": "gates"}

__all__ = ["chunk_kda", "kda_gate", "recurrent_kda"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
