"""Fine-tuning costs on this machine: LoRA against full fine-tuning on the
same model, and SFT packing against one example per row.

    python -m benchmarks.training.finetune [--steps 4]

LoRA vs full: the ~600 MB float32 model of benchmarks/training/hf_loading.py
(Qwen3.5 family, width 1024, 8 layers, 32,000-token vocabulary) saved as a
Hugging Face directory, fine-tuned from it (model.init_from) on SFT
examples, batch 2 x 128 tokens; each run in a fresh process: the bytes of
the trainable parameters and of the optimizer state (from the arrays),
the peak resident memory (ru_maxrss: parameters, gradients, optimizer
state and activations all live in host memory here), and the median step
time after the first (compiling) step.

Packing: a small model (width 256, 4 layers) on SFT examples of 20 to 400
bytes (prompt and completion, byte tokens) in rows of 512: the padding
fraction and the tokens of examples trained per second, packed and one per
row, in one process (the same compiled step; the rows differ only in how
full they are). Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import machine

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, resource, statistics, sys, time
import jax, jax.numpy as jnp
from gdnx.training import build_trainer
from gdnx.training.init_from import load_train_config

config = load_train_config("finetune", json.loads(sys.argv[1]))
trainer = build_trainer(config)
params, opt = trainer.params, trainer.init_opt_state(trainer.params)
size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
trainable, frozen, opt_bytes = size(params), size(trainer.frozen), size(opt)
times = []
for step in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    params, opt, metrics = trainer.step(params, opt, jnp.int32(step))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
trainer.close()
print(json.dumps(dict(trainable=trainable, frozen=frozen, opt=opt_bytes, seconds=statistics.median(times[1:]),
                      maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, loss=float(metrics["loss"]))))
"""


def _run(overrides: list[str], steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(overrides), str(steps)],
                         capture_output=True, text=True, cwd=ROOT, timeout=3600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _examples(path: Path, count: int, low: int, high: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    with path.open("w") as f:
        for _ in range(count):
            n = int(rng.integers(low, high))
            text = bytes(rng.choice(letters, n)).decode()
            cut = int(rng.integers(1, n))
            f.write(json.dumps({"prompt": text[:cut], "completion": text[cut:]}) + "\n")


def lora_vs_full(work: Path, steps: int) -> None:
    from benchmarks.training.hf_loading import MODEL

    from gdnx.config.schema import ModelConfig
    from gdnx.models import CausalLM

    CausalLM(ModelConfig(**MODEL)).save_pretrained(work / "base")
    _examples(work / "sft.jsonl", 400, 40, 120)
    common = [f"model.init_from={work / 'base'}", f"data.path={work / 'sft.jsonl'}", "data.seq_len=128",
              "train.batch_size=2", "train.eval_every=0", "train.warmup_steps=1", f"train.steps={steps}"]
    mib = 2 ** 20
    print("| fine-tuning | trainable (MiB) | optimizer state (MiB) | peak resident (MiB) | step (s) |")
    print("|---|---|---|---|---|")
    rows = {}
    for name, extra in (("full", []), ("LoRA rank 16, every projection", ["train.lora.rank=16"])):
        r = _run(common + extra + [f"train.out_dir={work / name.split()[0]}"], steps)
        rows[name] = r
        print(f"| {name} | {r['trainable'] / mib:,.1f} | {r['opt'] / mib:,.1f} | {r['maxrss'] / mib:,.0f} | "
              f"{r['seconds']:.2f} |")
    full, lora = rows["full"], rows["LoRA rank 16, every projection"]
    print(f"\nLoRA / full: optimizer state {lora['opt'] / full['opt']:.4f}x, peak resident "
          f"{lora['maxrss'] / full['maxrss']:.2f}x, step time {lora['seconds'] / full['seconds']:.2f}x\n")


def packing(work: Path, steps: int) -> None:
    import statistics
    import time

    import jax
    import jax.numpy as jnp

    from gdnx.training import build_trainer
    from gdnx.training.init_from import load_train_config
    from gdnx.config.schema import ModelConfig
    from gdnx.models import CausalLM

    small = dict(family="qwen3_5", vocab_size=256, hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                 linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=0)
    CausalLM(ModelConfig(**small)).save_pretrained(work / "small")
    _examples(work / "packing.jsonl", 2000, 20, 400)
    print("| rows of 512 | padding | example tokens per step | step (s) | example tokens/s |")
    print("|---|---|---|---|---|")
    rate = {}
    for packed in (True, False):
        config = load_train_config("finetune", [
            f"model.init_from={work / 'small'}", f"data.path={work / 'packing.jsonl'}", "data.seq_len=511",
            "train.batch_size=8", "train.eval_every=0", "train.warmup_steps=1", f"train.steps={steps}",
            f"data.sft_packing={str(packed).lower()}", f"train.out_dir={work / f'packing_{packed}'}"])
        trainer = build_trainer(config)
        params, opt = trainer.params, trainer.init_opt_state(trainer.params)
        times, tokens = [], []
        rows, seed = trainer.source.train(config.train.seed)
        for step in range(steps):
            # the inputs that are examples' tokens, not padding
            tokens.append(sum(int(rows.row(seed, step, r).valid[:-1].sum()) for r in range(config.train.batch_size)))
            t0 = time.perf_counter()
            params, opt, metrics = trainer.step(params, opt, jnp.int32(step))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        trainer.close()
        fit = rows.fit
        seconds = statistics.median(times[1:])
        per_step = statistics.median(tokens)
        rate[packed] = per_step / seconds
        print(f"| {'packed' if packed else 'one example per row'} | {100 * fit.padding:.1f}% | {per_step:,.0f} | "
              f"{seconds:.2f} | {per_step / seconds:,.0f} |")
    print(f"\npacked / one per row: {rate[True] / rate[False]:.2f}x the example tokens per second\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"{machine()}, `python -m benchmarks.training.finetune --steps {args.steps}`; step times are medians "
          "after the first step\n")
    with tempfile.TemporaryDirectory() as tmp:
        lora_vs_full(Path(tmp), args.steps)
        packing(Path(tmp), args.steps)


if __name__ == "__main__":
    main()
