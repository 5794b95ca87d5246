"""Gated delta rule: the public ops and their implementations."""

from gdnx.ops.gated_delta_rule.api import (
    CHUNK_IMPLEMENTATIONS,
    CHUNK_SIZES,
    DeltaRuleOptions,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from gdnx.ops.gated_delta_rule.chunked import RESIDUAL_NAMES, RESIDUAL_POLICIES
from gdnx.ops.gated_delta_rule.tiles import GpuTiles, TpuTiles, tiles_for

__all__ = ["CHUNK_IMPLEMENTATIONS", "CHUNK_SIZES", "RESIDUAL_NAMES", "RESIDUAL_POLICIES", "DeltaRuleOptions",
           "GpuTiles", "TpuTiles",
           "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "tiles_for"]
