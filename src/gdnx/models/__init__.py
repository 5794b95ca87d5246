"""Models built from gdnx layers."""

from gdnx.models.cache import Cache
from gdnx.models.causal_lm import ModelOutput, CausalLM

__all__ = ["Cache", "ModelOutput", "CausalLM"]
