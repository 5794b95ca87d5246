"""Models built from gdnx layers."""

from gdnx.models.cache import Cache
from gdnx.models.qwen3_next import ModelOutput, Qwen3Next

__all__ = ["Cache", "ModelOutput", "Qwen3Next"]
