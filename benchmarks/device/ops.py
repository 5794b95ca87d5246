"""Gated delta rule and KDA on an accelerator: the platform's Pallas kernel
(pallas_tpu on a TPU, pallas_gpu on a GPU) against xla, and on a GPU
against flash-linear-attention, in one run.

    python -m benchmarks.device.ops [--op gdn|kda|both] [--batch 1] [--length 32768 ...] [--out FILE] [--skip-checks]

First the checks: small cases that cover what the kernels add (a ragged
tail, packed sequences with an empty one, an initial state, grouped value
heads, K != V, beta up to 2, strong gates, both residual policies, float32
and bfloat16 inputs), each run on the device by the kernel and by xla, the
output, the final state and the gradient of every input (random
cotangents) compared with the float64 token recurrence run on the host's
CPU. Tolerances as the interpreted tests' (float32 1e-5, bfloat16 2e-2);
a row above it says so.

Then the timings, by default at the published anchors' shape, one sequence
of 32,768 tokens: GDN at Qwen3-Next's heads (HK=16, HV=32, K=V=128), KDA at
Kimi Linear's (HK=HV=32, K=V=128; per-channel gates log U(0.7, 1)),
bfloat16 inputs, float32 state, use_qk_l2norm, chunk 64. For each
implementation (xla, the kernel with its default bfloat16 products, and
with float32 products) it prints the relative error of the output and
final state against the float64 recurrence (on a shorter prefix,
--check-length), the compile time of the forward+backward program, the
median forward and forward+backward times, the peak memory of the
forward+backward program (XLA's buffer assignment), TFLOP/s from the
analytic FLOPs of the chunk algebra (delta_rule.costs.op_flops, the same
count for every row, so they compare as time does) and GB/s of the op's
own inputs and outputs (what it must move at least: q, k, v, g, beta and
the state in, o and the state out; the backward also their gradients);
then, on a GPU, flash-linear-attention's Triton kernels (`fla-core` with
torch, its q and k repeated to the value heads) at the same shape, timed
with CUDA events. A variant that fails prints its error and the run goes
on, so one bad configuration does not cost the whole device slot. Both ops
with their compiles take about 2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Table, machine, write
from gdnx.measure import compiled_peak_bytes, median_ms, relative_error as rel
from gdnx.ops import chunk_gated_delta_rule, chunk_kda, recurrent_gated_delta_rule, recurrent_kda
from gdnx.ops.delta_rule.costs import op_flops
from gdnx.ops.gated_delta_rule.math import VARIANT as GDN
from gdnx.ops.kda.math import VARIANT as KDA


def analytic_tflop(b, t, hk, hv, d, chunk=64, per_channel=False):
    """(forward, backward) TFLOP of the chunk algebra at this shape."""
    fwd, bwd = op_flops(KDA if per_channel else GDN, b, t, hk, hv, d, d, chunk)
    return fwd / 1e12, bwd / 1e12


def time_fla(args, hk, hv, repeats):
    """(forward ms, fwd+bwd ms) of fla's chunk_gated_delta_rule (chunk_kda for
    a per-channel gate), CUDA events, medians."""
    import torch
    if args[3].ndim == 4:
        from fla.ops.kda import chunk_kda as fla_chunk
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    def to_torch(x):
        return torch.from_dlpack(x).clone()

    q, k, v, g, beta = (to_torch(x) for x in args)
    q, k = q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2)
    for x in (q, k, v, g, beta):
        x.requires_grad_(True)

    def fwd():
        return fla_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)

    def fwd_bwd():
        o, s = fwd()
        (o.float().pow(2).sum() + s.pow(2).sum()).backward()

    def median(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return float(np.median(times))

    with torch.no_grad():
        f_ms = median(fwd)
    return f_ms, median(fwd_bwd)


def make_inputs(b, t, hk, hv, dk, dv=None, *, rng=None, per_channel=False, dtype="bfloat16", gate_low=0.7,
                beta_max=1.0):
    """q, k, v and beta in `dtype`, g (log U(gate_low, 1)) in float32, drawn
    from `rng` (seed 0 when None) in that order."""
    rng = np.random.default_rng(0) if rng is None else rng
    dv = dk if dv is None else dv
    gate = (b, t, hv, dk) if per_channel else (b, t, hv)
    xs = (rng.standard_normal((b, t, hk, dk)), rng.standard_normal((b, t, hk, dk)),
          rng.standard_normal((b, t, hv, dv)), np.log(rng.uniform(gate_low, 1.0, gate)),
          rng.uniform(0, beta_max, (b, t, hv)))
    return tuple(jnp.asarray(x, jnp.float32 if i == 3 else dtype) for i, x in enumerate(xs))


KERNEL = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


def variants(kernel: str) -> dict[str, dict]:
    return {"xla": dict(implementation="xla"),
            f"{kernel} (bf16 products, the default for bf16 inputs)": dict(implementation=kernel),
            f"{kernel}, matmul_dtype=float32": dict(implementation=kernel, matmul_dtype="float32")}


def host_reference(recurrent_op, xs, h0=None, cu=None, cts=None):
    """The float64 token recurrence on the host's CPU: (o, final state), and
    with cotangents also the gradients of q, k, v, g, beta and h0."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.enable_x64(True):
        def put(x):
            return None if x is None else jax.device_put(np.asarray(jnp.asarray(x, jnp.float32), np.float64), cpu)

        def f(q, k, v, g, beta, h):
            return recurrent_op(q, k, v, g, beta, initial_state=h, output_final_state=True, use_qk_l2norm=True,
                                cu_seqlens=None if cu is None else jnp.asarray(cu, jnp.int32),
                                state_dtype="float64", decay_dtype="float64")

        args = tuple(put(x) for x in xs) + (put(h0),)
        if cts is None:
            return tuple(np.asarray(x) for x in jax.jit(f)(*args)), None
        live = [i for i, a in enumerate(args) if a is not None]

        def g_live(*ys):
            full = list(args)
            for i, y in zip(live, ys):
                full[i] = y
            return f(*full)

        out, pull = jax.vjp(g_live, *(args[i] for i in live))
        grads = pull(tuple(put(c) for c in cts))
        return tuple(np.asarray(x) for x in out), {GRAD_NAMES[i]: np.asarray(d) for i, d in zip(live, grads)}


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    b: int
    t: int
    hk: int
    hv: int
    dk: int
    dv: int
    dtype: str
    chunk: int
    cu: tuple[int, ...] | None = None
    h0: bool = False
    beta_max: float = 1.0
    gate_low: float = 0.7  # gates log U(gate_low, 1): 1e-3 for decays that empty the state within a chunk
    residuals: str = "save"


CHECKS = (
    Check("bf16, grouped values, ragged tail, initial state", b=2, t=1000, hk=2, hv=4, dk=128, dv=128,
          dtype="bfloat16", chunk=64, h0=True),
    Check("f32, packed with an empty sequence, K=64 V=128", b=1, t=1000, hk=2, hv=2, dk=64, dv=128,
          dtype="float32", chunk=32, cu=(0, 5, 5, 400, 1000)),
    Check("f32, beta up to 2, strong gates, K=128 V=64, recompute", b=1, t=512, hk=2, hv=4, dk=128, dv=64,
          dtype="float32", chunk=64, h0=True, beta_max=2.0, gate_low=1e-3, residuals="recompute"),
    Check("bf16, chunk 16, K=V=64", b=1, t=300, hk=1, hv=2, dk=64, dv=64, dtype="bfloat16", chunk=16),
)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # as the interpreted tests' (tests/ops/delta_rule/helpers.py)


def check_table(op: str, kernel: str) -> Table:
    """Each check case by the kernel and by xla on the device against the
    float64 recurrence on the host: one row each."""
    kda = op == "kda"
    table = Table(f"{'KDA' if kda else 'Gated delta rule'}: {kernel} and xla against the float64 recurrence on the "
                  f"host's CPU, relative errors; {machine()}",
                  ["case", "implementation", "o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0", "tolerance"],
                  numeric=[False, False] + [True] * 8 + [False])
    chunk_op, recurrent_op = (chunk_kda, recurrent_kda) if kda else (chunk_gated_delta_rule, recurrent_gated_delta_rule)
    for c in CHECKS:
        rng = np.random.default_rng(0)
        n = c.b if c.cu is None else len(c.cu) - 1
        xs = make_inputs(c.b, c.t, c.hk, c.hv, c.dk, c.dv, rng=rng, per_channel=kda, dtype=c.dtype,
                         gate_low=c.gate_low, beta_max=c.beta_max)
        h0 = jnp.asarray(rng.standard_normal((n, c.hv, c.dk, c.dv)), jnp.float32) if c.h0 else None
        cts = (rng.standard_normal(xs[2].shape), rng.standard_normal((n, c.hv, c.dk, c.dv)))  # o like v; the state
        ref_out, ref_grads = host_reference(recurrent_op, xs, h0, c.cu, cts)
        for impl in ("xla", kernel):
            try:
                def f(*ys, impl=impl):
                    h = ys[5] if c.h0 else None
                    return chunk_op(*ys[:5], initial_state=h, output_final_state=True, use_qk_l2norm=True,
                                    cu_seqlens=None if c.cu is None else jnp.asarray(c.cu, jnp.int32),
                                    chunk_size=c.chunk, implementation=impl, residuals=c.residuals)

                @jax.jit
                def run(*ys, f=f):
                    out, pull = jax.vjp(f, *ys)
                    return out, pull((cts[0].astype(out[0].dtype), cts[1].astype(out[1].dtype)))

                (o, s), grads = run(*xs, *((h0,) if c.h0 else ()))
                errs = [rel(o, ref_out[0]), rel(s, ref_out[1])] + [
                    rel(d, ref_grads[name]) for name, d in zip(GRAD_NAMES, grads)]
                worst = max(errs)
                verdict = "within" if worst <= TOLERANCE[c.dtype] else "ABOVE"
                cells = [f"{e:.1e}" for e in errs] + (["-"] if not c.h0 else [])
                table.row(c.name, impl, *cells, f"{verdict} {TOLERANCE[c.dtype]:.0e}")
            except Exception as e:  # report and keep going: device time is scarce
                traceback.print_exc()
                table.row(c.name, impl, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return table


def io_bytes(args, grad: bool) -> int:
    """Bytes of the op's inputs and outputs (o like v; the float32 state
    [B, HV, K, V] out, and in as the backward's cotangent); the backward
    adds the gradients of every input (like the inputs) and reads o's
    cotangent."""
    q, k, v, g, beta = args
    b, _, hv, d = v.shape
    inputs = sum(x.size * x.dtype.itemsize for x in args)
    state = b * hv * d * d * 4
    fwd = inputs + v.size * v.dtype.itemsize + state
    return fwd + inputs + v.size * v.dtype.itemsize + state if grad else fwd


def timing_table(op: str, b: int, t: int, check_length: int, repeats: int, kernel: str) -> Table:
    kda = op == "kda"
    hk, hv, d = 32 if kda else 16, 32, 128
    chunk_op, recurrent_op = (chunk_kda, recurrent_kda) if kda else (chunk_gated_delta_rule, recurrent_gated_delta_rule)
    table = Table(f"{'KDA' if kda else 'Gated delta rule'}: B={b} T={t} HK={hk} HV={hv} K=V={d} bfloat16, chunk 64, "
                  f"l2norm; {machine()}; `{' '.join(['python -m benchmarks.device.ops', *sys.argv[1:]])}`",
                  ["implementation", "rel err o", "rel err state", "compile s", "forward ms", "fwd+bwd ms",
                   "fwd+bwd peak GiB", "fwd TFLOP/s", "bwd TFLOP/s", "fwd GB/s", "fwd+bwd GB/s"])
    tf_fwd, tf_bwd = analytic_tflop(b, t, hk, hv, d, per_channel=kda)
    args = make_inputs(b, t, hk, hv, d, per_channel=kda)
    gb_fwd, gb_all = io_bytes(args, False) / 1e9, io_bytes(args, True) / 1e9

    def rates(f_ms, fb_ms):
        return (f"{tf_fwd / (f_ms / 1e3):.1f}", f"{tf_bwd / (max(fb_ms - f_ms, 1e-9) / 1e3):.1f}",
                f"{gb_fwd / (f_ms / 1e3):.0f}", f"{gb_all / (fb_ms / 1e3):.0f}")
    short = tuple(x[:1, :check_length] for x in args)
    (ref_o, ref_s), _ = host_reference(recurrent_op, short)
    rows = {}
    for name, kw in variants(kernel).items():
        try:
            op_fn = jax.jit(lambda *xs, kw=kw: chunk_op(*xs, use_qk_l2norm=True, output_final_state=True, **kw))
            o, s = op_fn(*short)
            err_o, err_s = rel(o, ref_o), rel(s, ref_s)

            def loss(*xs, kw=kw):
                o, s = chunk_op(*xs, use_qk_l2norm=True, output_final_state=True, **kw)
                return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s ** 2)

            grad = jax.jit(jax.grad(loss, argnums=range(5)))
            t0 = time.perf_counter()
            grad.lower(*args).compile()
            compile_s = time.perf_counter() - t0
            fwd_ms = median_ms(op_fn, args, repeats)
            bwd_ms = median_ms(grad, args, repeats)
            peak = compiled_peak_bytes(grad, args) / 2**30
            rows[name] = (fwd_ms, bwd_ms, peak)
            table.row(name, f"{err_o:.1e}", f"{err_s:.1e}", f"{compile_s:.1f}", f"{fwd_ms:.2f}", f"{bwd_ms:.2f}",
                      f"{peak:.2f}", *rates(fwd_ms, bwd_ms))
        except Exception as e:  # report and keep going: device time is scarce
            traceback.print_exc()
            table.row(name, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if kernel == "pallas_gpu":
        try:
            f_ms, fb_ms = time_fla(args, hk, hv, repeats)
            rows["fla"] = (f_ms, fb_ms, float("nan"))
            table.row("fla (Triton, torch)", "", "", "", f"{f_ms:.2f}", f"{fb_ms:.2f}", "", *rates(f_ms, fb_ms))
        except Exception as e:  # fla is carried as a wheel; say so if it is missing
            traceback.print_exc()
            table.row("fla", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if "xla" in rows:
        x = rows["xla"]
        for name, (f, fb, m) in rows.items():
            if name != "xla":
                table.row(f"{name} / xla", "", "", "", f"{x[0] / f:.2f}x faster", f"{x[1] / fb:.2f}x faster",
                          f"{m / x[2]:.2f}x memory", "", "", "", "")
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=("gdn", "kda", "both"), default="both")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, nargs="+", default=[32768], help="sequence lengths timed (default 32768)")
    p.add_argument("--check-length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--skip-checks", action="store_true", help="timings only")
    a = p.parse_args()
    platform = jax.default_backend()
    if platform not in KERNEL:
        p.error(f"the default JAX backend is {platform!r}: this benchmark needs a TPU or a GPU")
    kernel = KERNEL[platform]
    ops = ("gdn", "kda") if a.op == "both" else (a.op,)
    tables = [] if a.skip_checks else [check_table(op, kernel) for op in ops]
    tables += [timing_table(op, a.batch, t, a.check_length, a.repeats, kernel) for t in a.length for op in ops]
    write(a.out, *tables)


if __name__ == "__main__":
    main()
