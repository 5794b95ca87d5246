"""The serving engine on a mesh of 8 virtual CPU devices against one device:
decode tokens per second, in one run.

    python -m benchmarks.serving.mesh [--repeats 3]

Model: Qwen3-Next's pattern (3 GDN layers, then attention), width 512, 8
layers, 8 heads everywhere (so tensor 2, 4 and 8 split every layer),
4,096-token vocabulary, float32, random weights. 8 requests of 64-token
prompts decode 64 tokens each; decode time is a 64-token run's less a
1-token run's (the prefill and first token), median of --repeats after an
untimed run that compiles.

What this CPU can tell: the 8 devices are threads sharing this host's
cores, so a sharded step does the same arithmetic plus the collectives and
the per-device dispatch; the ratio is the sharding's overhead here, not
the speed-up 8 accelerators give. Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from gdnx.config import ModelConfig  # noqa: E402
from gdnx.config.schema import ParallelConfig  # noqa: E402
from gdnx.models import CausalLM  # noqa: E402
from gdnx.parallel import make_mesh  # noqa: E402
from gdnx.serving import Engine, SamplingParams  # noqa: E402

from benchmarks.harness import machine

MODEL = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, full_attention_interval=4, num_attention_heads=8,
             num_key_value_heads=8, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=8,
             linear_key_head_dim=64, linear_value_head_dim=64, intermediate_size=1024, num_experts=0)
MESHES = [None, dict(data=1, tensor=2, fsdp=4), dict(data=2, tensor=4), dict(data=1, tensor=8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, MODEL["vocab_size"], 64).tolist() for _ in range(8)]
    rows = []
    for axes in MESHES:
        mesh = None if axes is None else make_mesh(ParallelConfig(**axes))
        engine = Engine(model, max_slots=8, max_length=256, decode_steps=16, mesh=mesh)

        def run(n: int) -> float:
            t0 = time.perf_counter()
            out = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            assert all(len(c.tokens) == n for c in out)
            return time.perf_counter() - t0
        run(64), run(1)  # compiles
        full = statistics.median(run(64) for _ in range(args.repeats))
        first = statistics.median(run(1) for _ in range(args.repeats))
        rows.append((axes, 8 * 63 / (full - first)))
    print(f"{machine()}, 8 virtual CPU devices; `python -m benchmarks.serving.mesh`\n")
    print("| mesh | decode tokens/s | vs one device |")
    print("|---|---:|---:|")
    base = rows[0][1]
    for axes, rate in rows:
        name = "one device" if axes is None else " x ".join(f"{k} {v}" for k, v in axes.items() if v > 1)
        print(f"| {name} | {rate:.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
