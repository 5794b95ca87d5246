"""Deviceless compilation of the gated delta rule kernels for real targets.

    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/compile.py [--targets h100 tpu_v5e ...]
        [--programs grad forward_long ...] [--out FILE]

For every target and program of tests/ops/delta_rule/test_compile.py
(GDN's, then KDA's):
compile seconds (this host), and per kernel what the compiler reports: on
GPU the shared memory each launch requests (XLA's thunk sequence) and the
registers and spill bytes ptxas reports (it is rerun with -v on the PTX XLA
produced); on TPU the VMEM budget each Mosaic kernel declares. Prints a
markdown table; `--out` also writes it to a file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def _ptxas() -> str:
    import nvidia.cuda_nvcc

    return str(pathlib.Path(nvidia.cuda_nvcc.__path__[0]) / "bin" / "ptxas")


def gpu_kernels(dump: pathlib.Path, arch: str) -> list[str]:
    """'name smem B, R regs, S spill' for each Triton kernel in the dump."""
    smem = {}
    for path in dump.glob("*thunk_sequence.txt"):
        for m in re.finditer(r"kCustomKernel .*? (\w+) grid: \[([^\]]*)\].*?shared_memory: (\d+) bytes",
                             path.read_text()):
            smem[m.group(1)] = (int(m.group(3)), m.group(2).replace(" ", ""))
    regs = {}
    for path in dump.glob("*.ptx"):
        if ".entry" not in path.read_text():
            continue
        out = subprocess.run([_ptxas(), f"-arch={arch}", "-v", str(path), "-o", os.devnull],
                             capture_output=True, text=True).stderr
        for m in re.finditer(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores.*?\n.*?Used (\d+) registers",
                             out, re.S):
            regs[m.group(1)] = (int(m.group(3)), int(m.group(2)))
    rows = []
    for name in sorted(n for n in smem if n.endswith("_kernel")):  # the Pallas kernels, not XLA's fusions
        s, grid = smem[name]
        r, spill = regs.get(name, (-1, -1))
        rows.append(f"{name.removesuffix('_kernel')} [{grid}]: {s // 1024} KiB smem, {r} regs, {spill} B spilled")
    return rows


def tpu_kernels(program, target: str) -> str:
    """The VMEM budget each Mosaic kernel declares (pallas_tpu.vmem_bytes),
    at the target's head tile."""
    from gdnx import aot
    from gdnx.ops.delta_rule import tiles_for
    from gdnx.ops.delta_rule.pallas_tpu import vmem_bytes
    from gdnx.ops.gated_delta_rule.math import VARIANT as GDN
    from gdnx.ops.kda.math import VARIANT as KDA

    ht = tiles_for("pallas_tpu", aot.device(target)).head_tile
    grp, d = program.hv // program.hk, program.dim
    variant = KDA if program.per_channel else GDN
    fwd = vmem_bytes(variant, ht, grp, 64, d, d, 2, program.grad)
    text = f"head tile {ht}; forward: {fwd / 2**20:.1f} MiB VMEM"
    if program.grad:
        text += f"; backward: {2 * vmem_bytes(variant, ht, grp, 64, d, d, 4, True) / 2**20:.1f} MiB VMEM"
    return text


def _pallas_calls(jaxpr) -> list:
    """Every pallas_call equation in a jaxpr, nested jaxprs included, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _pallas_calls(inner)
    return found


def phase_table(t: int = 4096, hk: int = 16, hv: int = 32, d: int = 128) -> list[str]:
    """FLOPs and HBM bytes per token and value head of each pallas_gpu kernel,
    read from the cost estimates the kernels declare (one gradient step:
    forward with residuals, then backward)."""
    import jax
    import jax.numpy as jnp

    from gdnx.ops import chunk_gated_delta_rule
    from gdnx.ops.delta_rule import GpuTiles

    sd = jax.ShapeDtypeStruct
    args = [sd((1, t, hk, d), jnp.bfloat16)] * 2 + [sd((1, t, hv, d), jnp.bfloat16), sd((1, t, hv), jnp.float32),
                                                     sd((1, t, hv), jnp.bfloat16)]

    def loss(*xs):
        o, _ = chunk_gated_delta_rule(*xs, use_qk_l2norm=True, implementation="pallas_gpu", interpret=False,
                                      tiles=GpuTiles())
        return jnp.sum(o.astype(jnp.float32))

    calls = _pallas_calls(jax.make_jaxpr(jax.grad(loss, argnums=range(5)))(*args).jaxpr)
    per = t * hv
    rows = [f"pallas_gpu kernels of one gradient step, per token and value head (K=V={d}, chunk 64, bf16 inputs, "
            f"default GpuTiles; from the kernels' declared cost estimates):", "",
            "| kernel | FLOPs / token | HBM bytes / token | FLOPs / byte |", "|---|---:|---:|---:|"]
    for eqn in calls:
        cost = eqn.params["cost_estimate"]
        name = eqn.params["jaxpr"].debug_info.func_src_info.split()[0].removesuffix("_kernel").lstrip("_")
        rows.append(f"| {name} | {cost.flops / per:,.0f} | {cost.bytes_accessed / per:,.0f} | "
                    f"{cost.flops / cost.bytes_accessed:.1f} |")
    return rows


def main():
    import jax

    from gdnx import aot
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
    lines = [f"Deviceless compilation, {datetime.date.today()}, jax {jax.__version__}, this host "
             f"({os.cpu_count()} cores); command: `JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/compile.py`",
             "", "| target | program | compile s | kernels (grid: shared memory, registers, spills / VMEM) |",
             "|---|---|---:|---|"]
    print("\n".join(lines), flush=True)
    programs = {x.name: x for x in PROGRAMS + KDA_PROGRAMS}
    for target in a.targets:
        for name in a.programs:
            fn, args = build(programs[name], target)
            with tempfile.TemporaryDirectory() as dump:
                if aot.platform(target) == "cuda":
                    # XLA reads XLA_FLAGS once: a child process per GPU program.
                    line = subprocess.run(
                        [sys.executable, __file__, "--one", target, name, dump], capture_output=True, text=True,
                        env={**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}"}).stdout.strip().splitlines()
                    row = line[-1] if line else f"| {target} | {name} | failed | |"
                else:
                    t0 = time.perf_counter()
                    jax.jit(fn).lower(*args).compile()
                    secs = time.perf_counter() - t0
                    row = f"| {target} | {name} | {secs:.1f} | {tpu_kernels(programs[name], target)} |"
            print(row, flush=True)
            lines.append(row)
    if a.out:
        pathlib.Path(a.out).write_text("\n".join(lines) + "\n")


def one(target: str, name: str, dump: str):
    """Compile one GPU program (XLA_FLAGS set by the parent) and print its row."""
    import jax

    from gdnx import aot
    from tests.ops.delta_rule.programs import KDA_PROGRAMS, PROGRAMS, build

    fn, args = build(next(x for x in PROGRAMS + KDA_PROGRAMS if x.name == name), target)
    t0 = time.perf_counter()
    try:
        jax.jit(fn).lower(*args).compile()
    except Exception as e:  # report the compiler's refusal as the row
        print(f"| {target} | {name} | failed | {str(e).splitlines()[0][:200]} |")
        return
    secs = time.perf_counter() - t0
    major, minor = aot.GPU_SPECS[target].compute_capability
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    print(f"| {target} | {name} | {secs:.1f} | {'; '.join(gpu_kernels(pathlib.Path(dump), arch))} |")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        one(*sys.argv[2:])
    else:
        main()
