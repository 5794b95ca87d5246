"""gdnx's xla path against transformers' torch chunk reference, on this CPU.

    python -m benchmarks.ops.xla_vs_torch [--batch 2] [--length 2048] [--repeats 5]

Forward + backward (every input's gradient) at B=2, T=2048, HK=4, HV=8,
K=V=128, float32, chunk 64, l2norm inside the op: gdnx's
`chunk_gated_delta_rule(implementation="xla")` (hand-written VJP) against
transformers' Qwen3-Next `torch_chunk_gated_delta_rule` with autograd (its
key heads repeated to the value heads first, as the model does). Medians of
alternating runs in one process; prints a markdown row and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from gdnx.ops import chunk_gated_delta_rule

from benchmarks.harness import machine


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    b, t, hk, hv, d = a.batch, a.length, 4, 8, 128
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hv, d)),
          np.log(rng.uniform(0.7, 1.0, (b, t, hv))), rng.uniform(0, 1, (b, t, hv))]
    xs = [x.astype(np.float32) for x in xs]

    def loss(q, k, v, g, beta):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, implementation="xla")
        return jnp.sum(o * o)

    grad = jax.jit(jax.grad(loss, argnums=range(5)))
    jargs = [jnp.asarray(x) for x in xs]
    jax.block_until_ready(grad(*jargs))

    def run_jax():
        jax.block_until_ready(grad(*jargs))

    targs = [torch.tensor(x, requires_grad=True) for x in xs]

    def run_torch():
        q, k, v, g, beta = targs
        rep = hv // hk
        o, _ = torch_chunk_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
                                            chunk_size=64, use_qk_l2norm_in_kernel=True)
        (o * o).sum().backward()
        for x in targs:
            x.grad = None

    run_torch()
    times = {"jax": [], "torch": []}
    for _ in range(a.repeats):
        for name, fn in (("jax", run_jax), ("torch", run_torch)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    jx, th = statistics.median(times["jax"]), statistics.median(times["torch"])
    print(f"{machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; B={b} T={t} HK={hk} HV={hv} "
          f"K=V={d} float32, fwd+bwd")
    print("| gdnx xla (hand-written VJP) ms | torch_chunk_gated_delta_rule + autograd ms | ratio |")
    print("|---:|---:|---:|")
    print(f"| {jx:.0f} | {th:.0f} | {th / jx:.1f}x |")


if __name__ == "__main__":
    main()
