"""causal_conv1d's two forms on this platform: rows (W shifted slices of the
state-padded input) against the packed form's gathered windows, the latter
reached with cu_seqlens = [0, T] (one sequence, the same outputs).

    python -m benchmarks.ops.causal_conv [--length 4096] [--channels 8192] [--repeats 10]

Shape: one row of T tokens and Qwen3-Next's conv channels (2 x 16 key heads
x 128 + 32 value heads x 128 = 8192), kernel 4, bfloat16 inputs, float32
weights, SiLU. Prints the median forward and forward+backward times and the
largest difference of the outputs.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.measure import median_ms
from gdnx.ops import causal_conv1d

from benchmarks.harness import machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    t, d = args.length, args.channels
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((d, 4)) * 0.5, jnp.float32)
    forms = {"rows (shifted slices)": None, "packed (gathered windows)": jnp.asarray([0, t], jnp.int32)}
    print(f"{machine()}; [1, {t}, {d}] bfloat16, kernel 4, "
          f"medians of {args.repeats}\n")
    print("| form | forward ms | fwd+bwd ms |")
    print("|---|---:|---:|")
    outs = []
    for name, cu in forms.items():
        def fwd(x, w, cu=cu):
            return causal_conv1d(x, w, cu_seqlens=cu)[0]

        def loss(x, w, cu=cu):
            return jnp.sum(fwd(x, w, cu).astype(jnp.float32) ** 2)

        outs.append(jax.jit(fwd)(x, w).astype(jnp.float32))
        print(f"| {name} | {median_ms(jax.jit(fwd), (x, w), args.repeats):.2f} | "
              f"{median_ms(jax.jit(jax.grad(loss, argnums=(0, 1))), (x, w), args.repeats):.2f} |", flush=True)
    print(f"\nlargest output difference: {float(jnp.max(jnp.abs(outs[0] - outs[1]))):.3g} (bfloat16 outputs)")


if __name__ == "__main__":
    main()
