"""Deviceless ahead-of-time compilation for real TPUs and GPUs, from any host.

A target names a device that need not be attached: libtpu compiles for a TPU
topology, the CUDA plugin (Triton -> PTX -> ptxas) for a GPU described by
its target config. The compiled program reports its memory and cost, so a
kernel that overflows VMEM or shared memory, or that a compiler rejects,
fails here, before anyone reaches the hardware.

    from gdnx import aot
    sharding = aot.sharding("h100")
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for ...]
    compiled = jax.jit(f).lower(*args).compile()

Needs the compilers in the environment: `jax[tpu]` (libtpu) for TPU
targets, `jax[cuda12-local]` plus `nvidia-cuda-nvcc-cu12` (ptxas) for GPU
targets; `make test` installs both into `.venv-aot`. Run with
JAX_PLATFORMS=cpu so that neither plugin looks for a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.experimental import topologies
from jax.experimental.compilation_cache import compilation_cache

@contextlib.contextmanager
def targeting(device: jax.Device) -> Iterator[None]:
    """Trace for `device`, a machine that need not be attached: the
    delta-rule kernels' tiles (compile_target) and tokamax's grouped
    matmuls, which check and tile for the default device, are chosen for
    it."""
    from gdnx.ops.delta_rule.tiles import compile_target

    with compile_target(device), jax.default_device(device):
        yield


# The smallest slice of each generation; one chip compiles the same kernels.
TPU_TOPOLOGIES = {"tpu_v4": "v4:2x2x1", "tpu_v5e": "v5e:2x2", "tpu_v5p": "v5p:2x2x1", "tpu_v6e": "v6e:2x2"}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What the GPU compiler needs to know about a device (NVIDIA's
    published figures)."""

    description: str
    compute_capability: tuple[int, int]
    sm_count: int
    shared_memory_per_block_optin: int   # bytes a kernel may ask for
    shared_memory_per_sm: int
    memory_bytes: int
    memory_bandwidth: int                # bytes / s
    l2_cache_bytes: int
    clock_ghz: float


GPU_SPECS = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 232_448, 233_472, 80 * 2**30, 3_350 * 10**9,
                    50 * 2**20, 1.98),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 232_448, 233_472, 141 * 10**9, 4_800 * 10**9, 50 * 2**20, 1.98),
    "a100": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166_912, 167_936, 80 * 2**30, 2_039 * 10**9,
                    40 * 2**20, 1.41),
}
TARGETS = tuple(TPU_TOPOLOGIES) + tuple(GPU_SPECS)


def gpu_target_config(spec: GpuSpec) -> str:
    """A GpuTargetConfigProto in text form, with the fields compilation reads."""
    major, minor = spec.compute_capability
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {spec.sm_count}
  fpus_per_core: {128 if major >= 9 else 64}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {spec.memory_bandwidth}
  l2_cache_size: {spec.l2_cache_bytes}
  clock_rate_ghz: {spec.clock_ghz}
  device_memory_size: {spec.memory_bytes}
  shared_memory_per_block_optin: {spec.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{spec.description}"
"""


def platform(target: str) -> str:
    """"tpu" or "cuda"."""
    _check(target)
    return "tpu" if target in TPU_TOPOLOGIES else "cuda"


def _check(target: str):
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {TARGETS}, got {target!r}")


@functools.cache
def device(target: str) -> jax.Device:
    """An abstract device of the target (first chip of the topology)."""
    _check(target)
    try:
        if target in TPU_TOPOLOGIES:
            topo = topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[target], platform="tpu")
        else:
            topo = topologies.get_topology_desc(platform="cuda", topology_name="", topology="1x1x1",
                                                target_config=gpu_target_config(GPU_SPECS[target]))
    except Exception as e:  # the plugin is missing or refuses: say which
        need = "jax[tpu]" if target in TPU_TOPOLOGIES else "jax[cuda12-local] and nvidia-cuda-nvcc-cu12"
        raise RuntimeError(f"target {target!r}: no compiler for it in this environment (install {need}): {e}") from e
    return topo.devices[0]


def sharding(target: str) -> jax.sharding.Sharding:
    """Place abstract arguments (ShapeDtypeStruct(..., sharding=...)) on the target."""
    return jax.sharding.SingleDeviceSharding(device(target))


# HBM per chip, bytes (Google Cloud's published figures)
HBM_BYTES = {"v4": 32 * 2 ** 30, "v5e": 16 * 2 ** 30, "v5p": 95 * 2 ** 30, "v6e": 32 * 2 ** 30}


def generation(topology: str) -> str:
    """"v5p" from "v5p:4x4x4", with the topology checked."""
    name, _, shape = topology.partition(":")
    if name not in HBM_BYTES or not shape or not all(d.isdigit() and int(d) > 0 for d in shape.split("x")):
        raise ValueError(f"--topology: expected <generation>:<shape> with a generation of "
                         f"{', '.join(HBM_BYTES)} (e.g. v5p:2x2x1, v5e:4x4), got {topology!r}")
    return name


def topology_devices(topology: str) -> list[jax.Device]:
    from jax.experimental import topologies

    generation(topology)
    # one chip (v5e:1x1): libtpu's default host (2x2x1 chips) would not divide it
    single = {"chips_per_host_bounds": (1, 1, 1)} if set(topology.partition(":")[2].split("x")) == {"1"} else {}
    try:
        devices = list(topologies.get_topology_desc(topology_name=topology, platform="tpu", **single).devices)
        # a mesh takes one device per chip (megacore); libtpu lists a v4 chip's two TensorCores apart
        return [d for d in devices if getattr(d, "core_on_chip", 0) == 0]
    except Exception as e:  # no libtpu, a shape libtpu refuses, libtpu held by another process
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        hint = (f"; gdnx plan needs libtpu: pip install 'jax[tpu]=={jax.__version__}'"
                if "not installed" in first else "")
        raise ValueError(f"--topology {topology}: libtpu cannot describe it ({first}){hint}") from None


def abstract(tree: Any, placements: Any) -> Any:
    """Shapes and dtypes of `tree` placed by `placements` (what `lower` takes for a target not attached)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, placements)


def compile_within(lowered: Any, refusal: str, options: dict | None = None) -> Any:
    """The compiled program (options: XLA's compiler options); a compiler's
    refusal of one whose buffers overflow a chip's memory
    (RESOURCE_EXHAUSTED) as a ValueError: `refusal` with the compiler's line
    in it ({} marks where)."""
    try:
        return lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(refusal.format(str(e).splitlines()[0][:300])) from None


def xla_flops(compiled: Any) -> float:
    """XLA's cost analysis of a compiled program: its FLOPs (0 where the target reports none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


def target_devices(topology: str) -> tuple[list[jax.Device], int, str]:
    """The target's devices, memory per device and platform: a TPU slice
    (v5p:2x2x1), or NAME:N for N GPUs of one host (h100:8; gdnx.aot's GPU
    targets)."""
    name, _, count = topology.partition(":")
    if name not in GPU_SPECS and name not in HBM_BYTES:
        raise ValueError(f"--topology: expected a TPU slice <generation>:<shape> ({', '.join(HBM_BYTES)}; e.g. "
                         f"v5p:2x2x1) or N GPUs of one host <gpu>:N ({', '.join(GPU_SPECS)}; e.g. h200:2), "
                         f"got {topology!r}")
    if name not in GPU_SPECS:
        return topology_devices(topology), HBM_BYTES[generation(topology)], "tpu"
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"--topology: a GPU target is NAME:N, N GPUs of one host (e.g. {name}:8), got {topology!r}")
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology_name="", topology=f"1x1x{count}",
                                            target_config=gpu_target_config(GPU_SPECS[name]))
    except Exception as e:  # no CUDA plugin here
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"--topology {topology}: the CUDA plugin cannot describe it ({first}); install "
                         "jax[cuda12-local] and nvidia-cuda-nvcc-cu12") from None
    return list(topo.devices), GPU_SPECS[name].memory_bytes, "cuda"


class Buffer(NamedTuple):
    """A temporary buffer of a compiled program: its bytes, the value that
    holds it (an HLO instruction), that value's shape, and what made it
    (the JAX operation named in its metadata, else the instruction)."""
    bytes: int
    value: str
    shape: str
    made_by: str


_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @[^>]*> \(size=(\d+),offset=\d+\): (\S+?)(\{.*)?$")


def largest_temporaries(dump: Path, top: int = 3) -> list[Buffer]:
    """The `top` largest temporaries of the program XLA dumped into `dump`
    (xla_dump_to, as text): read from its buffer assignment, each named by
    the instruction that holds it."""
    assignments = sorted(dump.glob("*after_optimizations-buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    if not assignments:
        return []
    found: list[tuple[int, str, str]] = []
    temporary = False
    for line in assignments[-1].read_text().splitlines():
        if line.startswith("allocation "):  # arguments, constants and outputs are not temporaries
            temporary = not any(kind in line for kind in ("parameter", "constant", "output shape"))
        elif temporary and (m := _VALUE.match(line)):
            found.append((int(m.group(2)), m.group(1), m.group(3)))
    found = sorted(set(found), reverse=True)[:top]
    hlo = assignments[-1].with_name(assignments[-1].name.replace("-buffer-assignment", ""))
    text = hlo.read_text() if hlo.exists() else ""
    out = []
    for size, name, shape in found:
        held = re.search(rf"^\s*%?{re.escape(name)} = \S+ (.*)$", text, re.M)
        rest = held.group(1) if held else ""
        op = re.search(r'op_name="([^"]+)"', rest)
        call = re.match(r"([\w-]+\([^)]*\))", rest)
        out.append(Buffer(size, name, shape, op.group(1) if op else call.group(1) if call else name))
    return out


def compile_reporting(lowered: Any, refusal: str, top: int = 3) -> tuple[Any, list[Buffer]]:
    """compile_within, and the program's `top` largest temporaries (its
    buffer assignment dumped as text into a directory of its own; the
    persistent compilation cache is left aside for this compile, as a
    program read back from it is not compiled and dumps nothing). JAX
    decides once per process whether the cache is in use, so the decision
    is reset on the way in and out for the toggle to take effect."""
    cached = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            compiled = compile_within(lowered, refusal, options)
        except ValueError as e:  # refused for memory: what held it, where the compiler got that far
            largest = largest_temporaries(Path(dump), top)
            raise ValueError(f"{e}; largest temporaries: {describe_buffers(largest)}" if largest else str(e)) from None
        finally:
            jax.config.update("jax_enable_compilation_cache", cached)
            compilation_cache.reset_cache()
        return compiled, largest_temporaries(Path(dump), top)


def describe_buffers(buffers: list[Buffer]) -> str:
    return "; ".join(f"{b.bytes / 2 ** 30:,.2f} GiB {b.shape} ({b.made_by})" for b in buffers) or "none reported"
