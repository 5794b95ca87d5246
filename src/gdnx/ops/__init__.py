"""Public ops."""

from gdnx.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from gdnx.ops.gated_delta_rule import CHUNK_IMPLEMENTATIONS, chunk_gated_delta_rule, recurrent_gated_delta_rule
from gdnx.ops.gated_rmsnorm import gated_rmsnorm

__all__ = [
    "CHUNK_IMPLEMENTATIONS",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "gated_rmsnorm",
    "recurrent_gated_delta_rule",
]
