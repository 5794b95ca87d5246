"""The gated delta rule: one log decay per value head, g [B, T, HV].

Its chunk algebra and Variant (math.py), its Triton kernels (pallas_gpu.py)
and its public ops (api.py), which load on first use; everything else is
the delta-rule family's (gdnx.ops.delta_rule).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gdnx.ops.gated_delta_rule.api import chunk_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
