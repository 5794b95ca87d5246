"""Qwen3-Next building blocks as Flax NNX modules."""
