"""Checkpoints: Hugging Face safetensors directories in and out."""
