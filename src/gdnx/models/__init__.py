"""Models built from gdnx layers."""

from gdnx.models.cache import Cache
from gdnx.models.causal_lm import CausalLM, HiddenOutput, ModelOutput

__all__ = ["Cache", "CausalLM", "HiddenOutput", "ModelOutput"]
