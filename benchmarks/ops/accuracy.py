"""Relative error of each gated delta rule implementation against float64.

    python -m benchmarks.ops.accuracy [--length 1024] [--op gdn|kda] [--gates random|bursts|channels]

For float32 and bfloat16 inputs (float32 state and decay), prints
||x - ref|| / ||ref|| for the output, the final state and every gradient,
where ref is the token recurrence run in float64 on the same (rounded) inputs.
Each chunked implementation runs twice: with float32 matmul operands (the
default) and with matmul_dtype=bfloat16 (operands rounded to bfloat16,
float32 accumulation).

--op kda runs chunk_kda (g [B, T, HV, K]) and adds transformers' torch KDA
(`chunk_kimi_delta_attention`, float32, forward only) as a row. --gates:
random (log U(0.7, 1)), bursts (-30 .. -60 at 15% of the tokens, per
channel, barely decaying gates of -1e-3 .. 0 between) or channels (half
the channels -30 per step, the others -1e-3 .. 0).
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_enable_x64", True)  # the float64 reference

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gdnx.measure import relative_error as rel  # noqa: E402
from gdnx.ops import CHUNK_IMPLEMENTATIONS, chunk_gated_delta_rule, chunk_kda  # noqa: E402

from benchmarks.harness import machine

NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def run(impl, args, chunk, state_dtype, cts, **kw):
    op = chunk_kda if args[3].ndim == 4 else chunk_gated_delta_rule

    def f(*xs):
        return op(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=True,
                                      chunk_size=chunk, implementation=impl, state_dtype=state_dtype,
                                      decay_dtype=state_dtype, **kw)

    out, pull = jax.vjp(f, *args)
    grads = pull(tuple(c.astype(o.dtype) for c, o in zip(cts, out)))
    return (*out, *grads)


def gates(kind, shape, rng):
    if kind == "random":
        return np.log(rng.uniform(0.7, 1.0, shape))
    g = -rng.uniform(0.0, 1e-3, shape)
    if kind == "bursts":
        return np.where(rng.random(shape) < 0.15, rng.uniform(-60.0, -30.0, shape), g)
    return np.where(rng.random((shape[0], 1) + shape[2:]) < 0.5, -30.0, g)


def torch_kda(args, chunk):
    """transformers' torch KDA on the same inputs (float32), forward only."""
    import torch
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    q, k, v, g, beta, h0 = (torch.tensor(np.asarray(x, np.float32)) for x in args)
    rep = v.shape[2] // q.shape[2]
    o, s = chunk_kimi_delta_attention(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
                                      chunk_size=chunk, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    return jnp.asarray(o.numpy()), jnp.asarray(s.numpy())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--op", choices=("gdn", "kda"), default="gdn")
    p.add_argument("--gates", choices=("random", "bursts", "channels"), default="random")
    a = p.parse_args()
    b, t, hk, hv, d = 1, a.length, 2, 4, 128
    rng = np.random.default_rng(0)
    gshape = (b, t, hv, d) if a.op == "kda" else (b, t, hv)
    raw = (rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hv, d)),
           gates(a.gates, gshape, rng), rng.uniform(0, 1, (b, t, hv)), 0.5 * rng.standard_normal((b, hv, d, d)))
    impls = CHUNK_IMPLEMENTATIONS
    print(f"# relative error vs float64 recurrence: {a.op}, {a.gates} gates, B={b} T={t} HK={hk} HV={hv} K=V={d} "
          f"chunk={a.chunk_size}, l2norm on, initial state on; {machine()}")
    print("| inputs | implementation | " + " | ".join(NAMES) + " |")
    print("|---|---|" + "---:|" * len(NAMES))
    for dtype in ("float32", "bfloat16"):
        args = tuple(jnp.asarray(x, dtype) for x in raw[:5]) + (jnp.asarray(raw[5], jnp.float32),)
        ref_args = tuple(x.astype(jnp.float64) for x in args)
        cts = (jnp.asarray(rng.standard_normal((b, t, hv, d))), jnp.asarray(rng.standard_normal((b, hv, d, d))))
        ref = run("reference", ref_args, a.chunk_size, "float64", cts)
        for impl in sorted(impls):
            for matmul in ((None,) if impl == "reference" else (None, "bfloat16")):
                kw = {} if matmul is None else dict(matmul_dtype=matmul)
                got = run(impl, args, a.chunk_size, "float32", cts, **kw)
                name = impl if matmul is None else f"{impl}, matmul_dtype={matmul}"
                print(f"| {dtype} | {name} | " + " | ".join(f"{rel(x, r):.1e}" for x, r in zip(got, ref)) + " |",
                      flush=True)
        if a.op == "kda" and dtype == "float32":
            got = torch_kda(args, a.chunk_size)
            print(f"| {dtype} | transformers torch (forward) | " + " | ".join(f"{rel(x, r):.1e}" for x, r in
                                                                              zip(got, ref[:2])) + " |" +
                  " |" * (len(NAMES) - 2), flush=True)


if __name__ == "__main__":
    main()
