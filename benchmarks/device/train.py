"""A model's train step on an accelerator at Qwen3-Next's layer shapes: the
GDN hybrid with the platform's Pallas kernel against the same model with
the xla path, and against an attention-only model of the same width and
depth, in one run.

    python benchmarks/train_device.py [--layers 4] [--tokens 4096 8192] [--repeats 5]

The model: width 2048, GDN layers with Qwen3-Next's heads (16 key heads,
32 value heads, K=V=128), attention layers with 16 query heads and 2
key-value heads of 256 (Qwen3-Next's attention, its output gate included),
three GDN layers to one attention layer; a dense SwiGLU MLP of 5120 in
place of Qwen3-Next's experts (the MoE is not what this compares);
vocabulary 32,768; float32 parameters and AdamW state, bfloat16
activations. Each row: one sequence of T tokens per step (batch 1), the
median step time after compilation, tokens per second, and the compiled
program's peak memory (XLA's buffer assignment). Prints markdown for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime

import jax

from gdnx.bench import COMPILED_KERNEL, train_step_row
from gdnx.config.schema import ModelConfig


def model_config(layers: int, attention_only: bool, implementation: str) -> ModelConfig:
    types = ["full_attention" if attention_only or i % 4 == 3 else "linear_attention" for i in range(layers)]
    return ModelConfig(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=layers, layer_types=types,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        intermediate_size=5120, num_experts=0, dtype="bfloat16", gdn_implementation=implementation)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    platform = jax.default_backend()
    kernel = COMPILED_KERNEL.get(platform)
    rows = [("GDN hybrid (3:1), xla", False, "xla")]
    if kernel:
        rows.append((f"GDN hybrid (3:1), {kernel}", False, kernel))
    rows.append(("attention only", True, "auto"))
    print(f"{datetime.date.today()}, {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"{args.layers} layers, width 2048, batch 1, medians of {args.repeats}\n")
    print("| tokens | model | params | step ms | tokens/s | peak GiB |")
    print("|---:|---|---:|---:|---:|---:|")
    for t in args.tokens:
        for name, attention_only, impl in rows:
            try:
                n, ms, peak = train_step_row(model_config(args.layers, attention_only, impl), 1, t, args.repeats)
            except Exception as e:  # one shape that does not fit should not cost the rest of the run
                print(f"| {t} | {name} | | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | |")
                continue
            print(f"| {t} | {name} | {n:,} | {ms:.1f} | {t / ms * 1e3:,.0f} | {peak / 2 ** 30:.2f} |", flush=True)


if __name__ == "__main__":
    main()
