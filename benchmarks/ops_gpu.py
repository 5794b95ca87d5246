"""Gated delta rule on a GPU: pallas_gpu against xla, in one run.

    python benchmarks/ops_gpu.py [--batch 4] [--length 4096] [--out FILE]

Shape of the issue's target: B=4, T=4096, HK=16, HV=32, K=V=128, bfloat16
inputs, float32 state, use_qk_l2norm. For each implementation prints the
relative error of the output and final state against the float64 token
recurrence (on a shorter prefix, --check-length, to keep it quick), and the
median forward and forward+backward times and the peak memory of the
forward+backward program (XLA's buffer assignment), for xla, pallas_gpu, and
pallas_gpu with bfloat16 matmul operands or recomputed residuals. A variant that fails prints its error and the run
goes on, so one bad configuration does not cost the whole device slot.
"""

from __future__ import annotations

import argparse
import datetime
import traceback

import jax

jax.config.update("jax_enable_x64", True)  # the float64 reference only

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gdnx.measure import compiled_peak_bytes, median_ms, relative_error as rel  # noqa: E402
from gdnx.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402


def make_inputs(b, t, hk, hv, d, seed=0):
    rng = np.random.default_rng(seed)
    xs = (rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hk, d)), rng.standard_normal((b, t, hv, d)),
          np.log(rng.uniform(0.7, 1.0, (b, t, hv))), rng.uniform(0, 1, (b, t, hv)))
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in xs[:3]) + (jnp.asarray(xs[3], jnp.float32),
                                                                  jnp.asarray(xs[4], jnp.bfloat16))


VARIANTS = {
    "xla": dict(implementation="xla"),
    "pallas_gpu": dict(implementation="pallas_gpu"),
    "pallas_gpu, matmul_dtype=bfloat16": dict(implementation="pallas_gpu", matmul_dtype="bfloat16"),
    "pallas_gpu, residuals=recompute": dict(implementation="pallas_gpu", residuals="recompute"),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--check-length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    b, t, hk, hv, d = a.batch, a.length, 16, 32, 128
    dev = jax.devices()[0]
    lines = [f"# gated delta rule on {dev.device_kind}: B={b} T={t} HK={hk} HV={hv} K=V={d} bf16, chunk 64, "
             f"l2norm; {datetime.date.today()}, jax {jax.__version__}",
             "| implementation | rel err o | rel err state | forward ms | fwd+bwd ms | fwd+bwd peak GiB |",
             "|---|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    args = make_inputs(b, t, hk, hv, d)
    short = tuple(x[:1, :a.check_length] for x in args)
    ref_o, ref_s = recurrent_gated_delta_rule(*(x.astype(jnp.float64) for x in short), use_qk_l2norm=True,
                                              output_final_state=True, state_dtype="float64", decay_dtype="float64")
    rows = {}
    for name, kw in VARIANTS.items():
        try:
            op = jax.jit(lambda *xs, kw=kw: chunk_gated_delta_rule(*xs, use_qk_l2norm=True, output_final_state=True, **kw))
            o, s = op(*short)
            err_o, err_s = rel(o, ref_o), rel(s, ref_s)

            def loss(*xs, kw=kw):
                o, s = chunk_gated_delta_rule(*xs, use_qk_l2norm=True, output_final_state=True, **kw)
                return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)

            grad = jax.jit(jax.grad(loss, argnums=range(5)))
            fwd_ms = median_ms(op, args, a.repeats)
            bwd_ms = median_ms(grad, args, a.repeats)
            peak = compiled_peak_bytes(grad, args) / 2**30
            rows[name] = (fwd_ms, bwd_ms, peak)
            line = f"| {name} | {err_o:.1e} | {err_s:.1e} | {fwd_ms:.2f} | {bwd_ms:.2f} | {peak:.2f} |"
        except Exception as e:  # report and keep going: device time is scarce
            traceback.print_exc()
            line = f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | | |"
        lines.append(line)
        print(line, flush=True)
    if "xla" in rows:
        for name, (f, fb, m) in rows.items():
            if name != "xla":
                x = rows["xla"]
                line = f"| {name} / xla | | | {x[0] / f:.2f}x faster | {x[1] / fb:.2f}x faster | {m / x[2]:.2f}x memory |"
                lines.append(line)
                print(line, flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
