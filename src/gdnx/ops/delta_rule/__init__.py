"""What the delta-rule ops share: the settings, the chunk layout, the one
custom VJP, the XLA and TPU implementations over a `Variant`, the token
recurrence, the tile primitives, Triton helpers, tiles and the dispatch.

The gated delta rule (gdnx.ops.gated_delta_rule) and KDA (gdnx.ops.kda)
each give a Variant, their GPU kernels and their public ops, and import
only this package. The vocabulary below loads without any kernel, so
`import gdnx.config` stays free of Pallas; tiles load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gdnx.ops.delta_rule.options import (
    CHUNK_IMPLEMENTATIONS,
    CHUNK_SIZES,
    RESIDUAL_NAMES,
    RESIDUAL_POLICIES,
    DeltaRuleOptions,
)

if TYPE_CHECKING:
    from gdnx.ops.delta_rule.tiles import GpuTiles, TpuTiles, compile_target, tiles_for

_LAZY = {"GpuTiles": "tiles", "TpuTiles": "tiles", "tiles_for": "tiles", "compile_target": "tiles"}

__all__ = ["CHUNK_IMPLEMENTATIONS", "CHUNK_SIZES", "RESIDUAL_NAMES", "RESIDUAL_POLICIES", "DeltaRuleOptions",
           "GpuTiles", "TpuTiles", "compile_target", "tiles_for"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
