"""Public ops. The gated delta rule's load on first use, so that a leaf such
as gdnx.ops.checks or gdnx.ops.gated_delta_rule.options imports no kernel."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# bound after their modules' import, so the names are the functions, not the modules
from gdnx.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from gdnx.ops.gated_delta_rule.options import CHUNK_IMPLEMENTATIONS
from gdnx.ops.gated_rmsnorm import gated_rmsnorm

if TYPE_CHECKING:
    from gdnx.ops.gated_delta_rule.api import chunk_gated_delta_rule, recurrent_gated_delta_rule

_LAZY = {"chunk_gated_delta_rule": "gated_delta_rule.api", "recurrent_gated_delta_rule": "gated_delta_rule.api"}

__all__ = [
    "CHUNK_IMPLEMENTATIONS",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "gated_rmsnorm",
    "recurrent_gated_delta_rule",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
