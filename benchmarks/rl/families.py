"""Bitwise RL on every family, from tiny Hugging Face checkpoints written by
transformers: trains, resumes and exports.

    .venv/bin/python -m benchmarks.rl.families [--steps 4] [--kinds ...] [--out FILE]

For each kind (tests/helpers/hf_models.py's tiny random checkpoints, 97
tokens of vocabulary; the prompts are examples/rl/arithmetic.jsonl as
bytes, all below 97): `gdnx train finetune` with data.source=rl,
train.rl.bitwise=true and model.init_from the checkpoint, 2 prompts x 2
completions of up to 8 tokens per step, `--steps` steps; then the same run
stopped at half its steps and resumed (a constant learning rate: the
schedule follows train.steps); then `gdnx export` of the
uninterrupted run, loaded back by transformers (text-only kinds: the
vision-language kinds' exports carry no vision tower without one in the
source) and its logits compared with gdnx's on the run's weights.
Prints a markdown table: the largest rl/logp_diff_max of the run, whether
the resumed run's metrics equal the uninterrupted run's at every step,
the export's logits' relative error, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from benchmarks.harness import Table, machine, write
from benchmarks.rl.runs import REWARD_FIELD, run_root

ROOT = pathlib.Path(__file__).resolve().parents[2]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# one per family (Qwen3-Next and Qwen3.5 with MoE; Kimi Linear's first layer dense)
KINDS = ("qwen3_next_moe", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "lara_mini", "glm5_next",
         "qwen4_exp")
COMPARED = ("loss", "grad_norm", "rl/reward_mean", "rl/logp_diff_max", "rl/completion_length_mean")


def _train(checkpoint: pathlib.Path, out: pathlib.Path, steps: int) -> list[dict]:
    from gdnx.training import train
    from gdnx.training.init_from import load_train_config

    train(load_train_config("finetune", [
        f"model.init_from={checkpoint}", "data.source=rl", f"data.path={ROOT / 'examples/rl/arithmetic.jsonl'}",
        "data.seq_len=32", "data.val_fraction=0", "train.batch_size=4", "train.rl.group_size=2",
        "train.rl.max_new_tokens=8", REWARD_FIELD, "train.rl.bitwise=true",
        f"train.steps={steps}", "train.warmup_steps=0", "train.min_lr_ratio=1.0", "train.eval_every=0",
        "train.log_every=1", "train.checkpoint_every=1", "train.learning_rate=1e-3", f"train.out_dir={out}"]))
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def check(kind: str, steps: int, root: pathlib.Path) -> dict:
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from gdnx.export import export_run
    from gdnx.measure import relative_error
    from gdnx.runs import load_run
    from tests.helpers.hf_models import KINDS as TEXT_KINDS
    from tests.helpers.hf_models import random_hf_model

    t0 = time.perf_counter()
    checkpoint = root / f"hf-{kind}"
    random_hf_model(kind).save_pretrained(checkpoint)
    whole = _train(checkpoint, root / f"{kind}-whole", steps)
    _train(checkpoint, root / f"{kind}-resumed", steps // 2)
    resumed = _train(checkpoint, root / f"{kind}-resumed", steps)
    same = [r["step"] for r in resumed] == list(range(1, steps + 1)) and all(
        a[k] == b[k] for a, b in zip(whole, resumed, strict=True) for k in COMPARED)
    error = None
    if kind in TEXT_KINDS:
        exported = root / f"{kind}-export"
        export_run(root / f"{kind}-whole", exported)
        hf = getattr(transformers, TEXT_KINDS[kind][1]).from_pretrained(exported, dtype=torch.float32).eval()
        model = load_run(root / f"{kind}-whole")[0]
        tokens = np.random.default_rng(0).integers(1, 97, (2, 24))
        with torch.no_grad():
            want = hf(torch.as_tensor(tokens)).logits.numpy()
        error = relative_error(np.asarray(model(jnp.asarray(tokens, jnp.int32))), want)
    return {"gap": max(r["rl/logp_diff_max"] for r in whole), "steps": len(whole), "resumed": same, "error": error,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--out")
    args = parser.parse_args()
    table = Table(f"bitwise RL from tiny transformers checkpoints, {args.steps} steps; {machine()}",
                  ["kind", "max rl/logp_diff_max", "steps", "resumed = uninterrupted", "export's logits vs transformers",
                   "wall s"])
    with run_root() as root:
        for kind in args.kinds:
            r = check(kind, args.steps, root)
            error = "-" if r["error"] is None else f"{r['error']:.1e}"
            table.row(kind, f"{r['gap']:.2e}", r["steps"], "yes" if r["resumed"] else "NO", error,
                      f"{r['seconds']:.0f}")
    write(args.out, table)

if __name__ == "__main__":
    main()
