"""Public ops. The gated delta rule and KDA ops load on first use, so that a leaf such
as gdnx.ops.checks or gdnx.ops.delta_rule.options imports no kernel."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# bound after their modules' import, so the names are the functions, not the modules
from gdnx.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from gdnx.ops.delta_rule.options import CHUNK_IMPLEMENTATIONS, DeltaRuleOptions
from gdnx.ops.gated_rmsnorm import gated_rmsnorm

if TYPE_CHECKING:
    from gdnx.ops.delta_rule.tiles import GpuTiles, TpuTiles
    from gdnx.ops.gated_delta_rule.api import chunk_gated_delta_rule, recurrent_gated_delta_rule
    from gdnx.ops.kda.api import chunk_kda, recurrent_kda
    from gdnx.ops.kda.gates import kda_gate

_LAZY = {"chunk_gated_delta_rule": "gated_delta_rule.api", "recurrent_gated_delta_rule": "gated_delta_rule.api",
         "chunk_kda": "kda.api", "recurrent_kda": "kda.api", "kda_gate": "kda.gates",
         "GpuTiles": "delta_rule.tiles", "TpuTiles": "delta_rule.tiles"}

__all__ = [
    "CHUNK_IMPLEMENTATIONS",
    "DeltaRuleOptions",
    "GpuTiles",
    "TpuTiles",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "gated_rmsnorm",
    "kda_gate",
    "recurrent_gated_delta_rule",
    "recurrent_kda",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
