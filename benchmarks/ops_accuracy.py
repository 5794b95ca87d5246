"""Relative error of each gated delta rule implementation against float64.

    python benchmarks/ops_accuracy.py [--length 1024]

For float32 and bfloat16 inputs (float32 state and decay), prints
||x - ref|| / ||ref|| for the output, the final state and every gradient,
where ref is the token recurrence run in float64 on the same (rounded) inputs.
Each chunked implementation runs twice: with float32 matmul operands (the
default) and with matmul_dtype=bfloat16 (operands rounded to bfloat16,
float32 accumulation).
"""

from __future__ import annotations

import argparse
import datetime

import jax

jax.config.update("jax_enable_x64", True)  # the float64 reference

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gdnx.measure import relative_error as rel  # noqa: E402
from gdnx.ops import CHUNK_IMPLEMENTATIONS, chunk_gated_delta_rule  # noqa: E402

NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def run(impl, args, chunk, state_dtype, cts, **kw):
    def f(*xs):
        return chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=True,
                                      chunk_size=chunk, implementation=impl, state_dtype=state_dtype,
                                      decay_dtype=state_dtype, **kw)

    out, pull = jax.vjp(f, *args)
    grads = pull(tuple(c.astype(o.dtype) for c, o in zip(cts, out)))
    return (*out, *grads)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=64)
    a = p.parse_args()
    b, t, hk, hv, d = 1, a.length, 2, 4, 128
    rng = np.random.default_rng(0)
    raw = (rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hv, d)),
           np.log(rng.uniform(0.7, 1.0, (b, t, hv))), rng.uniform(0, 1, (b, t, hv)),
           0.5 * rng.standard_normal((b, hv, d, d)))
    print(f"# relative error vs float64 recurrence: B={b} T={t} HK={hk} HV={hv} K=V={d} chunk={a.chunk_size}, "
          f"l2norm on, initial state on; {datetime.date.today()}, jax {jax.__version__}, {jax.default_backend()}")
    print("| inputs | implementation | " + " | ".join(NAMES) + " |")
    print("|---|---|" + "---:|" * len(NAMES))
    for dtype in ("float32", "bfloat16"):
        args = tuple(jnp.asarray(x, dtype) for x in raw[:5]) + (jnp.asarray(raw[5], jnp.float32),)
        ref_args = tuple(x.astype(jnp.float64) for x in args)
        cts = (jnp.asarray(rng.standard_normal((b, t, hv, d))), jnp.asarray(rng.standard_normal((b, hv, d, d))))
        ref = run("reference", ref_args, a.chunk_size, "float64", cts)
        for impl in sorted(CHUNK_IMPLEMENTATIONS):
            for matmul in ((None,) if impl == "reference" else (None, "bfloat16")):
                kw = {} if matmul is None else dict(matmul_dtype=matmul)
                got = run(impl, args, a.chunk_size, "float32", cts, **kw)
                name = impl if matmul is None else f"{impl}, matmul_dtype={matmul}"
                print(f"| {dtype} | {name} | " + " | ".join(f"{rel(x, r):.1e}" for x, r in zip(got, ref)) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
