"""Public ops."""

from gdnx.ops.gated_delta_rule import CHUNK_IMPLEMENTATIONS, chunk_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["CHUNK_IMPLEMENTATIONS", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]
