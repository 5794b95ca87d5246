"""What the GPU compiler made of each Pallas (Triton) kernel of a program,
read without a GPU: compile deviceless for a GPU target (gdnx.aot) with
XLA's dump on, then take from the dump each kernel's launch grid and shared
memory (XLA's thunk sequence), its tensor-core instructions (wgmma on
Hopper, mma elsewhere, counted in the PTX XLA produced) and its registers
and spilled bytes (ptxas -v rerun on that PTX). These are the proxies a
kernel change is checked against where no GPU is lent: a spill, a grid
smaller than the SM count or a product that left the tensor cores shows
here before any timing.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax

from gdnx.aot import GPU_SPECS


@dataclass(frozen=True)
class GpuKernel:
    name: str               # the Pallas kernel's function, without "_kernel"
    grid: tuple[int, ...]
    shared_bytes: int       # shared memory each block asks for
    registers: int          # per thread
    spill_bytes: int        # spill stores per thread
    tensor_core_ops: int    # wgmma / mma instructions in its PTX

    @property
    def blocks(self) -> int:
        return math.prod(self.grid)

    def __str__(self) -> str:
        return (f"{self.name} [{','.join(map(str, self.grid))}]: {self.shared_bytes // 1024} KiB smem, "
                f"{self.registers} regs, {self.spill_bytes} B spilled, {self.tensor_core_ops} mma")


def arch(target: str) -> str:
    """ptxas's name for the target's architecture (sm_90a: Hopper's wgmma)."""
    major, minor = GPU_SPECS[target].compute_capability
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _ptxas() -> str:
    try:
        import nvidia.cuda_nvcc
    except ImportError:
        raise RuntimeError("ptxas not found: pip install nvidia-cuda-nvcc-cu12 (make test installs it in "
                           ".venv-aot)") from None
    return str(Path(nvidia.cuda_nvcc.__path__[0]) / "bin" / "ptxas")


# a Pallas kernel's entry: its function's name, numbered from the second call of one function on (__1, ...)
_PALLAS = re.compile(r"_kernel(?:__(\d+))?$")


def _kernel_name(entry: str) -> str:
    """prepare for _prepare_kernel, prepare#2 for its second call (_prepare_kernel__1)."""
    m = _PALLAS.search(entry)
    assert m is not None
    base = entry[:m.start()].lstrip("_")
    return base if m.group(1) is None else f"{base}#{int(m.group(1)) + 1}"


def read_dump(dump: Path, target: str) -> list[GpuKernel]:
    """The Pallas kernels of the program XLA dumped into `dump`, by name."""
    launches: dict[str, tuple[int, tuple[int, ...]]] = {}
    for path in dump.glob("*thunk_sequence.txt"):
        for m in re.finditer(r"kCustomKernel .*? (\w+) grid: \[([^\]]*)\].*?shared_memory: (\d+) bytes",
                             path.read_text()):
            launches[m.group(1)] = (int(m.group(3)), tuple(int(x) for x in m.group(2).replace(" ", "").split(",")))
    compiled: dict[str, tuple[int, int, int]] = {}
    for path in dump.glob("*.ptx"):
        text = path.read_text()
        names = re.findall(r"\.entry (\w+)", text)
        if not any(n in launches and _PALLAS.search(n) for n in names):
            continue
        mma = len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\b", text))
        out = subprocess.run([_ptxas(), f"-arch={arch(target)}", "-v", str(path), "-o", os.devnull],
                             capture_output=True, text=True).stderr
        for m in re.finditer(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores.*?\n.*?Used (\d+) registers",
                             out, re.S):
            compiled[m.group(1)] = (int(m.group(3)), int(m.group(2)), mma)
    return [GpuKernel(_kernel_name(name), launches[name][1], launches[name][0], *compiled.get(name, (-1, -1, -1)))
            for name in sorted(n for n in launches if _PALLAS.search(n))]  # the Pallas kernels, not XLA's


def compile_and_read(lowered: Any, target: str) -> tuple[Any, list[GpuKernel]]:
    """Compile a program lowered for a GPU target and read its kernels."""
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        return compiled, read_dump(Path(dump), target)


class DeclaredCost(NamedTuple):
    """What a Pallas kernel declares it costs (its pl.CostEstimate)."""
    name: str
    flops: int
    bytes_accessed: int


def declared_costs(fn, *args) -> list[DeclaredCost]:
    """The cost estimate of every pallas_call `fn(*args)` makes, in order
    (traced only: runs anywhere). Per phase, FLOPs per byte of HBM traffic
    say whether a kernel can be compute-bound; a change that moves more
    bytes shows here without a GPU."""
    def calls(jaxpr) -> list:
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        found += calls(inner)
        return found

    out = []
    for eqn in calls(jax.make_jaxpr(fn)(*args).jaxpr):
        cost = eqn.params["cost_estimate"]
        name = eqn.params["jaxpr"].debug_info.func_src_info.split()[0].removesuffix("_kernel").lstrip("_")
        out.append(DeclaredCost(name, int(cost.flops), int(cost.bytes_accessed)))
    return out
