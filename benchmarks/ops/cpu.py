"""Gated delta rule on the CPU: hand-written VJP vs plain autodiff vs the token recurrence.

    python -m benchmarks.ops.cpu [--length 2048] [--repeats 5]

Prints a markdown table for docs/benchmarks.md: forward and forward+backward
median wall time, and peak memory as XLA's buffer assignment reports it for the
compiled program (arguments + outputs + temporaries; static, so not noisy).
All rows come from one run, so compare them as ratios.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.measure import compiled_peak_bytes, median_ms
from gdnx.ops.delta_rule import xla
from gdnx.ops.delta_rule.reference import recurrent_reference
from gdnx.ops.gated_delta_rule.math import VARIANT

from benchmarks.harness import machine


def make_inputs(b, t, hk, hv, dk, dv, dtype, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, t, hk, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    xs = (rng.standard_normal((b, t, hk, dk)) / np.sqrt(dk), k, rng.standard_normal((b, t, hv, dv)),
          np.log(rng.uniform(0.7, 1.0, (b, t, hv))), rng.uniform(0, 1, (b, t, hv)))
    return tuple(jnp.asarray(x, dtype) for x in xs)


def variants(b, hv, dk, dv, chunk):
    h0 = jnp.zeros((b, hv, dk, dv), jnp.float32)
    common = dict(cu_seqlens=None, scale=dk ** -0.5, state_dtype=jnp.float32, decay_dtype=jnp.float32)
    return {
        "xla (hand-written VJP)": lambda *xs: xla.run(VARIANT, *xs, h0, chunk_size=chunk, **common)[0],
        "xla forward, plain autodiff": lambda *xs: xla.run(VARIANT, 
            *xs, h0, chunk_size=chunk, hand_written_vjp=False, **common)[0],
        "token recurrence, autodiff": lambda *xs: recurrent_reference(*xs, h0, **common)[0],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    b, t, hk, hv, d = a.batch, a.length, a.key_heads, a.value_heads, a.dim
    print(f"# gated delta rule, CPU: B={b} T={t} HK={hk} HV={hv} K=V={d} chunk={a.chunk_size}")
    print(f"{machine()}; `python -m benchmarks.ops.cpu --length {t} --repeats {a.repeats}`")
    print("| inputs | implementation | forward ms | fwd+bwd ms | fwd+bwd peak MiB |")
    print("|---|---|---:|---:|---:|")
    for dtype in (jnp.float32, jnp.bfloat16):
        args = make_inputs(b, t, hk, hv, d, d, dtype)
        rows = {}
        for name, f in variants(b, hv, d, d, a.chunk_size).items():
            fwd = jax.jit(f)
            grad = jax.jit(jax.grad(lambda *xs, f=f: jnp.sum(f(*xs).astype(jnp.float32) ** 2), argnums=range(5)))
            rows[name] = (median_ms(fwd, args, a.repeats), median_ms(grad, args, a.repeats),
                          compiled_peak_bytes(grad, args) / 2**20)
            print(f"| {jnp.dtype(dtype).name} | {name} | {rows[name][0]:.1f} | {rows[name][1]:.1f} | "
                  f"{rows[name][2]:.0f} |", flush=True)
        hw, ad = rows["xla (hand-written VJP)"], rows["xla forward, plain autodiff"]
        print(f"| {jnp.dtype(dtype).name} | autodiff / hand-written | | {ad[1] / hw[1]:.2f}x | "
              f"{ad[2] / hw[2]:.2f}x |")


if __name__ == "__main__":
    main()
