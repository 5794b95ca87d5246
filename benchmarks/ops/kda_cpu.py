"""KDA on this CPU: gdnx's xla path against transformers' torch KDA, and
against GDN on the same shapes.

    python -m benchmarks.ops.kda_cpu [--batch 2] [--length 2048] [--repeats 5]

Forward + backward (every input's gradient), B=2, T=2048, HK=4, HV=8,
K=V=128, float32, chunk 64, l2norm inside the op; medians of alternating
runs in one process:

- `chunk_kda(implementation="xla")` (hand-written VJP) against
  transformers' Kimi Linear `chunk_kimi_delta_attention` with autograd
  (key heads repeated to the value heads first, as for GDN);
- GDN's xla path (`chunk_gated_delta_rule`, per-head gate) and KDA's with
  that gate broadcast over K (what one shared implementation would run for
  GDN), against KDA's with a per-channel gate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

from gdnx.ops import chunk_gated_delta_rule, chunk_kda

from benchmarks.harness import machine


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip transformers' torch KDA")
    a = p.parse_args()
    b, t, hk, hv, d = a.batch, a.length, 4, 8, 128
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((b, t, hk, d), (b, t, hk, d), (b, t, hv, d)))
    g_head = np.log(rng.uniform(0.7, 1.0, (b, t, hv))).astype(np.float32)
    g_chan = np.log(rng.uniform(0.7, 1.0, (b, t, hv, d))).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, hv)).astype(np.float32)

    def grad_of(op, widen=False):
        def loss(q, k, v, g, beta):
            if widen:
                g = jnp.broadcast_to(g[..., None], g.shape + (d,))
            o, _ = op(q, k, v, g, beta, use_qk_l2norm=True, implementation="xla")
            return jnp.sum(o * o)
        return jax.jit(jax.grad(loss, argnums=range(5)))

    runs = {}
    for name, fn, g in (("gdn", grad_of(chunk_gated_delta_rule), g_head),
                        ("kda, gate equal over K", grad_of(chunk_kda, widen=True), g_head),
                        ("kda", grad_of(chunk_kda), g_chan)):
        args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
        jax.block_until_ready(fn(*args))
        runs[name] = (lambda fn=fn, args=args: jax.block_until_ready(fn(*args)))

    if not a.no_torch:
        targs = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g_chan, beta)]

        def run_torch():
            tq, tk, tv, tg, tb = targs
            rep = hv // hk
            o, _ = chunk_kimi_delta_attention(tq.repeat_interleave(rep, 2), tk.repeat_interleave(rep, 2), tv, tg, tb,
                                              chunk_size=64, use_qk_l2norm_in_kernel=True)
            (o * o).sum().backward()
            for x in targs:
                x.grad = None

        run_torch()
        runs["torch chunk_kimi_delta_attention + autograd"] = run_torch
    times: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(a.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {n: statistics.median(x) for n, x in times.items()}
    print(f"{machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; B={b} T={t} HK={hk} HV={hv} "
          f"K=V={d} float32, chunk 64, fwd+bwd, medians of {a.repeats}")
    print("| run | ms | / gdnx kda |")
    print("|---|---:|---:|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.0f} | {ms / med['kda']:.2f} |")


if __name__ == "__main__":
    main()
