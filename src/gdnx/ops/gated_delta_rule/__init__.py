"""Gated delta rule: the public ops and their implementations.

The vocabulary (implementation names, chunk sizes, residual policies,
DeltaRuleOptions) loads without the kernels; the ops, which import every
implementation, load on first use, so `import gdnx.config` stays free of
Pallas.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gdnx.ops.gated_delta_rule.options import (
    CHUNK_IMPLEMENTATIONS,
    CHUNK_SIZES,
    RESIDUAL_NAMES,
    RESIDUAL_POLICIES,
    DeltaRuleOptions,
)

if TYPE_CHECKING:
    from gdnx.ops.gated_delta_rule.api import chunk_gated_delta_rule, recurrent_gated_delta_rule
    from gdnx.ops.gated_delta_rule.gates import kda_gate
    from gdnx.ops.gated_delta_rule.kda import chunk_kda, recurrent_kda
    from gdnx.ops.gated_delta_rule.tiles import GpuTiles, TpuTiles, tiles_for

_LAZY = {"chunk_gated_delta_rule": "api", "recurrent_gated_delta_rule": "api", "chunk_kda": "kda",
         "recurrent_kda": "kda", "kda_gate": "gates", "GpuTiles": "tiles",
         "TpuTiles": "tiles", "tiles_for": "tiles"}

__all__ = ["CHUNK_IMPLEMENTATIONS", "CHUNK_SIZES", "RESIDUAL_NAMES", "RESIDUAL_POLICIES", "DeltaRuleOptions",
           "GpuTiles", "TpuTiles", "chunk_gated_delta_rule", "chunk_kda", "kda_gate", "recurrent_gated_delta_rule",
           "recurrent_kda", "tiles_for"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
