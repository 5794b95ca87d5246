"""Deviceless compilation of the gated delta rule kernels for real targets.

    JAX_PLATFORMS=cpu .venv-aot/bin/python -m benchmarks.ops.compile [--targets h100 tpu_v5e ...]
        [--programs grad forward_long ...] [--out FILE]

For every target and program of tests/ops/delta_rule/test_compile.py
(GDN's, then KDA's):
compile seconds (this host), and per kernel what the compiler reports: on
GPU its grid, the shared memory each launch requests, registers, spill
bytes and tensor-core instructions (gdnx.gpu_kernels); on TPU the head tile and
the VMEM limit the kernels declare. Prints a
markdown table; `--out` also writes it to a file.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

from benchmarks.harness import machine

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def tpu_kernels(program, target: str) -> str:
    """The head tile the target's tiles give the program's heads, and the
    scoped VMEM limit the kernels declare."""
    from gdnx import aot
    from gdnx.ops.delta_rule import tiles_for

    tiles = tiles_for("pallas_tpu", aot.device(target))
    ht = tiles.key_heads_per_step(program.hk, program.hv // program.hk, 64, program.dim, program.dim)
    heads = ht * program.hv // program.hk
    return f"head tile {ht} ({heads} value heads a step); VMEM limit {tiles.vmem_limit_mib} MiB"


def phase_table(t: int = 4096, hk: int = 16, hv: int = 32, d: int = 128) -> list[str]:
    """FLOPs and HBM bytes per token and value head of each pallas_gpu kernel,
    read from the cost estimates the kernels declare (one gradient step:
    forward with residuals, then backward)."""
    import jax
    import jax.numpy as jnp

    from gdnx.gpu_kernels import declared_costs
    from gdnx.ops import chunk_gated_delta_rule
    from gdnx.ops.delta_rule import GpuTiles

    sd = jax.ShapeDtypeStruct
    args = [sd((1, t, hk, d), jnp.bfloat16)] * 2 + [sd((1, t, hv, d), jnp.bfloat16), sd((1, t, hv), jnp.float32),
                                                     sd((1, t, hv), jnp.bfloat16)]

    def loss(*xs):
        o, _ = chunk_gated_delta_rule(*xs, use_qk_l2norm=True, implementation="pallas_gpu", interpret=False,
                                      tiles=GpuTiles())
        return jnp.sum(o.astype(jnp.float32))

    per = t * hv
    rows = [f"pallas_gpu kernels of one gradient step, per token and value head (K=V={d}, chunk 64, bf16 inputs, "
            f"default GpuTiles; from the kernels' declared cost estimates):", "",
            "| kernel | FLOPs / token | HBM bytes / token | FLOPs / byte |", "|---|---:|---:|---:|"]
    for cost in declared_costs(jax.grad(loss, argnums=range(5)), *args):
        rows.append(f"| {cost.name} | {cost.flops / per:,.0f} | {cost.bytes_accessed / per:,.0f} | "
                    f"{cost.flops / cost.bytes_accessed:.1f} |")
    return rows


def main():
    import jax

    from gdnx import aot
    from gdnx.gpu_kernels import compile_and_read
    from tests.ops.delta_rule.programs import COMPILE_TARGETS, KDA_PROGRAMS, PROGRAMS, build

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="*", default=list(COMPILE_TARGETS))
    p.add_argument("--programs", nargs="*", default=[x.name for x in PROGRAMS + KDA_PROGRAMS])
    p.add_argument("--out", default=None)
    p.add_argument("--phases", action="store_true", help="print the per-phase FLOPs and bytes table and stop")
    a = p.parse_args()
    if a.phases:
        print("\n".join(phase_table()))
        return
    lines = [f"Deviceless compilation, {machine()}; command: "
             "`JAX_PLATFORMS=cpu .venv-aot/bin/python -m benchmarks.ops.compile`",
             "", "| target | program | compile s | kernels (grid: shared memory, registers, spills / VMEM) |",
             "|---|---|---:|---|"]
    print("\n".join(lines), flush=True)
    programs = {x.name: x for x in PROGRAMS + KDA_PROGRAMS}
    for target in a.targets:
        for name in a.programs:
            fn, args = build(programs[name], target)
            t0 = time.perf_counter()
            if aot.platform(target) == "cuda":
                try:
                    _, kernels = compile_and_read(jax.jit(fn).lower(*args), target)
                except Exception as e:  # report the compiler's refusal as the row
                    row = f"| {target} | {name} | failed | {str(e).splitlines()[0][:200]} |"
                else:
                    row = f"| {target} | {name} | {time.perf_counter() - t0:.1f} | {'; '.join(map(str, kernels))} |"
            else:
                jax.jit(fn).lower(*args).compile()
                secs = time.perf_counter() - t0
                row = f"| {target} | {name} | {secs:.1f} | {tpu_kernels(programs[name], target)} |"
            print(row, flush=True)
            lines.append(row)
    if a.out:
        pathlib.Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
