"""Public ops."""

from gdnx.ops.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"]
