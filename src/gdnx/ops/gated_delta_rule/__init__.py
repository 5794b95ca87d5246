"""Gated delta rule: the public ops and their implementations."""

from gdnx.ops.gated_delta_rule.api import (
    CHUNK_IMPLEMENTATIONS,
    CHUNK_SIZES,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from gdnx.ops.gated_delta_rule.tiles import GpuTiles, TpuTiles, tiles_for

__all__ = ["CHUNK_IMPLEMENTATIONS", "CHUNK_SIZES", "GpuTiles", "TpuTiles", "chunk_gated_delta_rule",
           "recurrent_gated_delta_rule", "tiles_for"]
