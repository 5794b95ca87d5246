"""The MoE layer's forward+backward on this machine's CPU, its grouped
matmuls through each way there is to run them here, side by side in one
process: a scaled-down Qwen3-Next layer (hidden 512, 64 experts of width
128, top-8, a shared expert of 128; Qwen3-Next-80B: 2,048, 512 of 512,
top-10, 512), float32, 4 x 512 tokens, jax.grad of the summed output
with respect to the input and every weight. Prints markdown for
docs/benchmarks.md.

    python -m benchmarks.ops.moe_cpu [--repeats 10]

The ways: `gdnx tiled` (gdnx.ops.grouped_matmul's default on CPU),
`jax.lax.ragged_dot` (the layer's code before the grouped-matmul seam;
XLA:CPU masks a dense product over every expert), `tokamax xla`
(tokamax.ragged_dot's own XLA implementation) and `dense per expert`
(every token copy times every expert's matrix, the rows kept by their
expert, written out: the densifying lowering, for scale).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from gdnx.layers import moe
from gdnx.layers.moe import SparseMoE

from benchmarks.harness import machine

HIDDEN, EXPERTS, WIDTH, TOP_K, SHARED, BATCH, LENGTH = 512, 64, 128, 8, 128, 4, 512


def dense(x, w, group_sizes, implementation=None):
    """Every row times every group's matrix, each row's own group kept."""
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")  # rows past the total: G (none kept)
    every = jnp.einsum("mk,gkn->gmn", x, w)
    keep = group[None, :, None] == jnp.arange(w.shape[0])[:, None, None]
    return jnp.sum(jnp.where(keep, every, 0), axis=0).astype(x.dtype)


def ways():
    from gdnx.ops.grouped_matmul import _tokamax

    tokamax = _tokamax()  # with absl's flags taken as parsed (this script's own are not absl's)

    return {
        "gdnx tiled": moe.grouped_matmul,
        "jax.lax.ragged_dot": lambda x, w, group_sizes, implementation=None:
            jax.lax.ragged_dot(x, w, group_sizes),
        "tokamax xla": lambda x, w, group_sizes, implementation=None:
            tokamax.ragged_dot(x, w, group_sizes, implementation="xla"),
        "dense per expert": dense,
    }


def measure(gmm, repeats: int) -> tuple[float, float]:
    """(compile s, median s of a forward+backward)."""
    moe.grouped_matmul = gmm
    layer = SparseMoE(HIDDEN, num_experts=EXPERTS, top_k=TOP_K, expert_size=WIDTH, shared_expert_size=SHARED,
                      norm_topk_prob=True, init_std=0.02, dtype=jnp.float32, param_dtype=jnp.float32,
                      rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, HIDDEN), jnp.float32)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(y)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, x))
    compiled = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x))
        times.append(time.perf_counter() - t0)
    return compiled, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    original = moe.grouped_matmul
    rows = {}
    for name, gmm in ways().items():
        rows[name] = measure(gmm, args.repeats)
    moe.grouped_matmul = original
    print(f"The MoE layer, {machine()}\n")
    print(f"`python -m benchmarks.ops.moe_cpu --repeats {args.repeats}`: hidden {HIDDEN}, {EXPERTS} experts of width "
          f"{WIDTH}, top-{TOP_K}, {BATCH} x {LENGTH} tokens, float32, forward+backward, median of {args.repeats}:\n")
    print("| grouped matmuls | forward+backward, ms | vs gdnx | compile, s |\n|---|---:|---:|---:|")
    base = next(iter(rows.values()))[1]
    for name, (compiled, t) in rows.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x | {compiled:.1f} |")


if __name__ == "__main__":
    main()
