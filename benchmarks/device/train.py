"""A model's train step on an accelerator at Qwen3-Next's layer shapes: the
GDN hybrid with the platform's Pallas kernel against the same model with
the xla path, and against an attention-only model of the same width and
depth, in one run.

    python -m benchmarks.device.train [--layers 4] [--tokens 4096 8192] [--steps 20] [--set key=value ...] [--out FILE]

The model: width 2048, GDN layers with Qwen3-Next's heads (16 key heads,
32 value heads, K=V=128), attention layers with 16 query heads and 2
key-value heads of 256 (Qwen3-Next's attention, its output gate included),
three GDN layers to one attention layer; a dense SwiGLU MLP of 5120 in
place of Qwen3-Next's experts (the MoE is not what this compares);
vocabulary 32,768; float32 parameters and AdamW state, bfloat16
activations (the bundled base config otherwise). Each row is `gdnx
train`'s own step (its Trainer: the blocked loss, donated parameters and
optimizer state, the host loader over token shards of the Python standard
library's sources), one sequence of T tokens a step: the compiled step's
bytes (a row that does not fit the chip is refused before it runs), the
mean step after three that compile and warm up, tokens/s, and MFU (the
model's FLOPs as `gdnx plan` counts them, over the chip's bfloat16 peak).
"""

from __future__ import annotations

import argparse
import gc
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.harness import Table, machine, write
from gdnx.bench import COMPILED_KERNEL
from gdnx.config import load_config
from gdnx.config.schema import Config
from gdnx.data.prepare import prepare_corpus
from gdnx.models import CausalLM
from gdnx.models.causal_lm import parameter_count
from gdnx.train_plan import model_flops
from gdnx.training.loop import Trainer, memory_capacity

# bfloat16 peak FLOP/s per chip, by device kind (published), for MFU
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12}
GIB = 2 ** 30


def shape_overrides(layers: int, attention_only: bool, implementation: str) -> list[str]:
    """The base config at Qwen3-Next's layer shapes (the module docstring)."""
    types = ",".join("full_attention" if attention_only or i % 4 == 3 else "linear_attention" for i in range(layers))
    return ["model.vocab_size=32768", "model.hidden_size=2048", f"model.num_hidden_layers={layers}",
            f"model.layer_types=[{types}]", "model.num_attention_heads=16", "model.num_key_value_heads=2",
            "model.head_dim=256", "model.linear_num_key_heads=16", "model.linear_num_value_heads=32",
            "model.linear_key_head_dim=128", "model.linear_value_head_dim=128", "model.intermediate_size=5120",
            "model.num_experts=0", "model.dtype=bfloat16", f"model.gdn_implementation={implementation}"]


def corpus(directory: Path) -> Path:
    """Token shards of the Python standard library's sources (~20 MB of
    text, raw bytes as tokens)."""
    text = directory / "stdlib.txt"
    with text.open("w", encoding="utf-8") as f:
        size = 0
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                body = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(body + "\n")
            size += len(body)
            if size > 20e6:
                break
    out = directory / "shards"
    prepare_corpus([text], out)
    return out


def train_config(model: str, overrides: list[str], seq_len: int, data: Path, out: Path) -> Config:
    return load_config(model, overrides + [
        "data.source=tokens", f"data.path={data}", f"data.seq_len={seq_len}", "train.batch_size=1",
        "train.eval_every=0", f"train.out_dir={out}"])


def train_row(table: Table, model: str, name: str, overrides: list[str], seq_len: int, steps: int, data: Path,
              out: Path, peak: float | None) -> None:
    config = train_config(model, overrides, seq_len, data, out)
    trainer = Trainer(config)
    params, opt_state = trainer.params, trainer.init_opt_state(trainer.params)
    batch = trainer.device_batch(trainer.host_batch("train", 0))
    t0 = time.perf_counter()
    compiled = trainer.step_fn.lower(params, opt_state, jnp.asarray(0, jnp.int32), batch, trainer.frozen).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    need = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    limit = memory_capacity(jax.devices()[:1])
    n = parameter_count(config.model)
    if need > limit:
        table.row(seq_len, name, f"{n / 1e6:,.0f} M", f"{need / GIB:.2f}", f"does not fit ({limit / GIB:.2f} GiB)",
                  "", "", "")
        return
    for s in range(3):  # the first call loads the compiled step (the persistent cache) and warms up
        params, opt_state, metrics = trainer.step(params, opt_state, jnp.asarray(s, jnp.int32))
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for s in range(3, 3 + steps):
        params, opt_state, metrics = trainer.step(params, opt_state, jnp.asarray(s, jnp.int32))
    loss = float(metrics["loss"])
    ms = (time.perf_counter() - t0) / steps * 1e3
    trainer.close()
    flops = model_flops(config, nnx.state(nnx.eval_shape(lambda: CausalLM(config.model)), nnx.Param))
    mfu = f"{flops / (ms / 1e3) / peak:.1%}" if peak else "-"
    table.row(seq_len, name, f"{n / 1e6:,.0f} M", f"{need / GIB:.2f}", f"{ms:.1f} (compile {compile_s:.0f} s)",
              f"{seq_len / ms * 1e3:,.0f}", mfu, f"{loss:.3f}")


TRAIN_COLUMNS = ["tokens", "model", "params", "compiled GiB", "step ms", "tokens/s", "MFU", "loss"]


def train_rows(table: Table, model: str, models: dict[str, list[str]], lengths: list[int], steps: int,
               left: Callable[[], float] = lambda: float("inf")) -> Table:
    """A row of `table` for each length and each of `models` (a name and its
    config overrides over `model`): --steps at 4,096 tokens, fewer at longer
    rows; a row that fails, or would start with under a minute of `left()`,
    says so in its place and the rest run."""
    peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp))
        for seq_len in lengths:
            for name, overrides in models.items():
                if left() < 60:
                    table.row(seq_len, name, "", "", "not run: the time budget", "", "", "")
                    continue
                try:
                    train_row(table, model, name, overrides, seq_len, max(5, steps * 4096 // seq_len), data,
                              Path(tmp) / "run", peak)
                except Exception as e:  # noqa: BLE001  # one row that fails should not cost the rest
                    traceback.print_exc()
                    table.row(seq_len, name, "", "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                              "", "", "")
                gc.collect()
    return table


def train_table(layers: int, tokens: list[int], steps: int, common: list[str]) -> Table:
    """The hybrid with xla, with the platform's kernel, and attention only,
    at each length: one row each."""
    kernel = COMPILED_KERNEL.get(jax.default_backend())
    rows = [("GDN hybrid (3:1), xla", False, "xla")]
    if kernel:
        rows.append((f"GDN hybrid (3:1), {kernel}", False, kernel))
    rows.append(("attention only", True, "auto"))
    table = Table(f"`gdnx train`'s step at Qwen3-Next's layer shapes ({layers} layers, width 2048, batch 1; the mean "
                  f"of {steps} steps at 4,096 tokens, fewer at longer rows; {' '.join(common) or 'no overrides'}); "
                  f"MFU over the chip's bfloat16 peak; {machine()}",
                  TRAIN_COLUMNS, numeric=[True, False, True, True, True, True, True, True])
    models = {name: shape_overrides(layers, attention_only, impl) + common for name, attention_only, impl in rows}
    return train_rows(table, "base", models, tokens, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", nargs="*", default=[], metavar="key=value",
                    help="config overrides for every row, e.g. model.remat_policy=full (what a 32,768-token step "
                         "needs to fit a v5e)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # each row compiles its step once for its memory and once to run it: the second is a cache hit
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="gdnx-jax-cache-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    write(args.out, train_table(args.layers, args.tokens, args.steps, args.set))


if __name__ == "__main__":
    main()
