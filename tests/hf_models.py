"""Tiny random Hugging Face Qwen3-Next models (torch, CPU) and the same
weights loaded into gdnx, for parity tests."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from gdnx.models import Qwen3Next

VOCAB = 97


def tiny_hf_config(moe: bool, **kw) -> Qwen3NextConfig:
    """4 layers (GDN, attention, GDN, attention), HV = 2 HK, K != V,
    partial RoPE; MoE with 4 experts, 2 per token, or a dense MLP."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4 if moe else 0, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    fields.update(kw)
    return Qwen3NextConfig(**fields)


def random_hf_model(moe: bool, seed: int = 0, scale: float = 1.0, **kw) -> Qwen3NextForCausalLM:
    """HF's own init, plus noise on the parameters it initialises to
    constants (norm weights, dt_bias), so a swapped or skipped one shows."""
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(tiny_hf_config(moe, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
            elif scale != 1.0:
                p.mul_(scale)
    return model


def hf_and_gdnx(tmp_path, moe: bool, seed: int = 0, scale: float = 1.0, **overrides):
    hf = random_hf_model(moe, seed, scale)
    hf.save_pretrained(tmp_path)
    return hf, Qwen3Next.from_pretrained(tmp_path, **overrides)


def tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def hf_logits(hf, toks) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(toks)).logits.numpy()
