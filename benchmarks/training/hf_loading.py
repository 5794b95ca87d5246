"""Host memory of loading a Hugging Face directory onto the 8-device CPU
mesh (fsdp=8): sharded (`CausalLM.from_pretrained(path, mesh=...)`, each
device's part read from the files' slices) against whole (load onto one
device, then place on the mesh).

    python -m benchmarks.training.hf_loading [--repeats 3]

The model: a Qwen3.5-family dense model of about 600 MB in float32 (width
1024, 8 layers, a 32,000-token vocabulary, untied), saved by gdnx in the
family's layout. Each load runs in a fresh process; a thread samples the
process's anonymous resident memory (RssAnon: what it allocates; the
files' pages that safetensors maps are page cache, shared and reclaimable)
every millisecond. On CPU devices the loaded parameters themselves live
in host memory, so the figure that matters is the peak beyond the
baseline (after jax and the mesh are up) and beyond the parameters once
loaded: the load's transient overhead, compared with the largest single
tensor. Prints markdown rows for docs/benchmarks.md (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import machine

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(family="qwen3_5", vocab_size=32000, hidden_size=1024, num_hidden_layers=8, intermediate_size=2816,
             num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
             linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=0,
             tie_word_embeddings=False, full_attention_interval=4)

_CHILD = r"""
import json, sys, threading, time
import jax
from flax import nnx
from gdnx.config.schema import ParallelConfig
from gdnx.models import CausalLM
from gdnx.parallel import make_mesh, shard

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

mode, path = sys.argv[1], sys.argv[2]
mesh = make_mesh(ParallelConfig(data=1, fsdp=8))
jax.device_put(jax.numpy.zeros(8), jax.devices()[0]).block_until_ready()
base = anon()
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
t0 = time.perf_counter()
if mode == "sharded":
    model = CausalLM.from_pretrained(path, mesh=mesh)
    params = nnx.state(model, nnx.Param)
else:
    whole = CausalLM.from_pretrained(path)
    params = shard(nnx.state(whole, nnx.Param), whole.config, mesh)
    jax.block_until_ready(params)
    del whole
jax.block_until_ready(params)
seconds = time.perf_counter() - t0
import gc; gc.collect()

final = anon()
done.set(); thread.join()
peak[0] = max(peak[0], final)
print(json.dumps(dict(base=base, peak=peak[0], final=final, seconds=seconds,
                      params=sum(x.nbytes for x in jax.tree.leaves(params)))))
"""


def _save(directory: Path) -> int:
    """The model, randomly initialised, as a Hugging Face directory; returns
    its largest tensor's bytes."""
    from gdnx.config.schema import ModelConfig
    from gdnx.models import CausalLM

    model = CausalLM(ModelConfig(**MODEL))
    model.save_pretrained(directory)
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        return max(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] * 4 for k in f.keys()
                   if len(f.get_slice(k).get_shape()) == 2)


def _load(mode: str, directory: Path) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(directory)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=900)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "model"
        largest = _save(directory)
        size = (directory / "model.safetensors").stat().st_size
        print(f"{machine()}, `python -m benchmarks.training.hf_loading --repeats {args.repeats}`: a "
              f"{size / mib:,.0f} MiB model, largest tensor {largest / mib:,.0f} MiB, fsdp=8 on 8 CPU devices; "
              f"medians of {args.repeats} fresh processes\n")
        print("| load | peak above baseline (MiB) | parameters (MiB) | overhead: peak - parameters (MiB) | "
              "overhead / largest tensor | seconds |")
        print("|---|---|---|---|---|---|")
        for mode in ("sharded", "whole"):
            runs = [_load(mode, directory) for _ in range(args.repeats)]
            above = statistics.median(r["peak"] - r["base"] for r in runs)
            params = statistics.median(r["params"] for r in runs)
            over = statistics.median(r["peak"] - r["base"] - r["params"] for r in runs)
            seconds = statistics.median(r["seconds"] for r in runs)
            print(f"| {mode} | {above / mib:,.0f} | {params / mib:,.0f} | {over / mib:,.0f} | "
                  f"{over / largest:.2f}x | {seconds:.1f} |")


if __name__ == "__main__":
    main()
