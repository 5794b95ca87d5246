"""A model's train step on an accelerator at Qwen3-Next's layer shapes: the
GDN hybrid with the platform's Pallas kernel against the same model with
the xla path, and against an attention-only model of the same width and
depth, in one run.

    python -m benchmarks.device.train [--layers 4] [--tokens 4096 8192] [--repeats 5] [--out FILE]

The model: width 2048, GDN layers with Qwen3-Next's heads (16 key heads,
32 value heads, K=V=128), attention layers with 16 query heads and 2
key-value heads of 256 (Qwen3-Next's attention, its output gate included),
three GDN layers to one attention layer; a dense SwiGLU MLP of 5120 in
place of Qwen3-Next's experts (the MoE is not what this compares);
vocabulary 32,768; float32 parameters and AdamW state, bfloat16
activations. Each row: one sequence of T tokens per step (batch 1), the
median step time after compilation, tokens per second, MFU (the model's
FLOPs as `gdnx plan` counts them over the chip's bfloat16 peak), and the
compiled program's peak memory (XLA's buffer assignment).
"""

from __future__ import annotations

import argparse

import jax

from benchmarks.harness import Table, machine, write

from gdnx.bench import COMPILED_KERNEL, train_step_row
from gdnx.config.schema import ModelConfig


def model_config(layers: int, attention_only: bool, implementation: str, remat: str = "none") -> ModelConfig:
    types = ["full_attention" if attention_only or i % 4 == 3 else "linear_attention" for i in range(layers)]
    return ModelConfig(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=layers, layer_types=types,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        intermediate_size=5120, num_experts=0, dtype="bfloat16", gdn_implementation=implementation,
        remat_policy=remat)


# bfloat16 peak FLOP/s per chip, by device kind (published), for MFU
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The model's training FLOPs per token, as `gdnx plan` counts them
    (gdnx.train_plan.model_flops: 6 per matmul parameter, attention's
    scores, the delta rule's state work; no recomputation)."""
    from flax import nnx

    from gdnx.config.schema import Config
    from gdnx.models import CausalLM
    from gdnx.train_plan import model_flops

    config = Config.model_validate({"model": cfg.model_dump(), "train": {"batch_size": 1},
                                    "data": {"seq_len": seq_len, "source": "tokens", "path": "."}})
    params = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg)), nnx.Param)
    return model_flops(config, params) / seq_len


def train_table(layers: int, tokens: list[int], repeats: int, remat: str = "none") -> Table:
    """The hybrid with xla, with the platform's kernel, and attention only,
    at each length: one row each."""
    kernel = COMPILED_KERNEL.get(jax.default_backend())
    rows = [("GDN hybrid (3:1), xla", False, "xla")]
    if kernel:
        rows.append((f"GDN hybrid (3:1), {kernel}", False, kernel))
    rows.append(("attention only", True, "auto"))
    peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)
    table = Table(f"A train step at Qwen3-Next's layer shapes ({layers} layers, width 2048, batch 1, medians of "
                  f"{repeats}, remat {remat}); MFU over the chip's bfloat16 peak; {machine()}",
                  ["tokens", "model", "params", "step ms", "tokens/s", "MFU", "peak GiB"],
                  numeric=[True, False, True, True, True, True, True])
    for t in tokens:
        for name, attention_only, impl in rows:
            cfg = model_config(layers, attention_only, impl, remat)
            try:
                n, ms, mem = train_step_row(cfg, 1, t, repeats)
            except Exception as e:  # one shape that does not fit should not cost the rest of the run
                table.row(t, name, "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", "", "", "")
                continue
            mfu = f"{flops_per_token(cfg, t) * t / (ms / 1e3) / peak:.1%}" if peak else "-"
            table.row(t, name, f"{n:,}", f"{ms:.1f}", f"{t / ms * 1e3:,.0f}", mfu, f"{mem / 2 ** 30:.2f}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--remat", choices=("none", "full", "save_gdn_residuals"), default="none",
                    help="model.remat_policy (full: what a 32,768-token step needs to fit a v5e)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    write(args.out, train_table(args.layers, args.tokens, args.repeats, args.remat))


if __name__ == "__main__":
    main()
