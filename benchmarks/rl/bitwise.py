"""Bitwise RL held over many steps: the sampler/trainer gap of each step on
Qwen3-Next-, Kimi Linear- and OLMo Hybrid-shaped tiny models, on one
device and on a 2 x 4 mesh (data x fsdp; eight CPU devices).

    .venv/bin/python -m benchmarks.rl.bitwise [--steps 20] [--families ...] [--out FILE]

Each run is `gdnx train tiny` with data.source=rl and train.rl.bitwise=true
on examples/rl/arithmetic.jsonl (bytes), 4 prompts x 2 completions of up to
16 tokens per step, reshaped to the family: four layers (delta-rule,
attention, delta-rule, attention), MoE for Qwen3-Next and Kimi Linear.
Prints a markdown table: per run, the largest rl/logp_diff_max over its
steps (bitwise mode's claim is exactly 0), the steps, the mean reward of
the first and last five steps, and the run's wall time.
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
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

HYBRID = ["model.hidden_size=32", "model.intermediate_size=48", "model.num_hidden_layers=4",
          "model.layer_types=[linear_attention,full_attention,linear_attention,full_attention]",
          "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16",
          "model.linear_num_key_heads=2", "model.linear_num_value_heads=4", "model.linear_key_head_dim=16",
          "model.linear_value_head_dim=16", "model.gdn_chunk_size=16", "model.tie_word_embeddings=false"]
MOE = ["model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=16",
       "model.shared_expert_intermediate_size=16"]
FAMILIES = {
    "qwen3_next": HYBRID + MOE,
    "kimi_linear": HYBRID + MOE + ["model.family=kimi_linear", "model.rope_theta=null",
                                   "model.linear_num_value_heads=2", "model.kv_lora_rank=16",
                                   "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=12",
                                   "model.n_group=2", "model.topk_group=1", "model.routed_scaling_factor=2.0"],
    "olmo_hybrid": HYBRID + ["model.family=olmo_hybrid"],
}
MESHES = {"one device": [], "2 x 4 mesh": ["parallel.data=2", "parallel.fsdp=4"]}


def run(family: str, mesh: str, steps: int, root: pathlib.Path) -> dict:
    from gdnx.config import load_config
    from gdnx.training import train
    from gdnx.training.rl import RLTrainer

    out = root / f"{family}-{mesh.replace(' ', '')}"
    config = load_config("tiny", FAMILIES[family] + MESHES[mesh] + [
        "data.source=rl", f"data.path={ROOT / 'examples/rl/arithmetic.jsonl'}", "data.seq_len=48",
        "train.batch_size=8", "train.rl.group_size=2", "train.rl.max_new_tokens=16",
        REWARD_FIELD, "train.rl.bitwise=true", f"train.steps={steps}",
        "train.warmup_steps=0", "train.eval_every=0", "train.target_accuracy=null", "train.log_every=1",
        "train.learning_rate=3e-3", f"train.out_dir={out}"])
    t0 = time.perf_counter()
    if MESHES[mesh]:
        train(config)
    else:
        RLTrainer(config, mesh=None).run()
    seconds = time.perf_counter() - t0
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    reward = [r["rl/reward_mean"] for r in rows]
    return {"gap": max(r["rl/logp_diff_max"] for r in rows), "steps": len(rows),
            "first": sum(reward[:5]) / len(reward[:5]), "last": sum(reward[-5:]) / len(reward[-5:]),
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--families", nargs="+", default=sorted(FAMILIES), choices=sorted(FAMILIES))
    parser.add_argument("--out")
    args = parser.parse_args()
    table = Table(f"bitwise RL, {args.steps} steps per run, 8 completions per step; {machine()}",
                  ["family", "devices", "max rl/logp_diff_max", "steps", "reward, first 5", "reward, last 5", "wall s"])
    with run_root() as root:
        for family in args.families:
            for mesh in MESHES:
                r = run(family, mesh, args.steps, root)
                table.row(family, mesh, f"{r['gap']:.2e}", r["steps"], f"{r['first']:.3f}", f"{r['last']:.3f}",
                          f"{r['seconds']:.0f}")
    write(args.out, table)

if __name__ == "__main__":
    main()
