"""How a server's many programs are compiled and kept: JAX's persistent
compilation cache (compiled once, read back on the next start), and
XLA:CPU's flags that compile them sooner and map fewer pages per program.

JAX keys each entry by the program itself (its HLO), the compile options,
the XLA flags, the backend and the JAX version, so an entry is used only
for the very program it was compiled from: a changed model shape, engine
flag or gdnx that changes a program compiles it anew; the weights are not
part of a program, so another checkpoint of the same shapes reuses it,
as it should.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "GDNX_COMPILE_CACHE"  # a directory, or "off"
# XLA:CPU maps every compiled kernel into the process, and a server's many programs can meet the host's limit of
# memory maps (vm.max_map_count): its older elemental emitters map fewer per program.
CPU_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
# LLVM's optimisation level 1 compiles a server's programs a third sooner than the default 2 on XLA:CPU, and they
# run as fast (level 0: 3x sooner and 3x slower; docs/benchmarks.md). XLA's GPU backend reads the same flag for its
# kernels, so it is set only where no GPU plugin is installed.
CPU_ONLY_FLAGS = ("--xla_backend_optimization_level=1",)
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def cpu_flags() -> None:
    """Before JAX starts its backend: XLA:CPU's flags for a server's many
    programs, where XLA_FLAGS does not already choose them."""
    import importlib.util

    wanted: tuple[str, ...] = CPU_FLAGS
    if os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" or not any(
            importlib.util.find_spec(name) for name in GPU_PLUGINS):
        wanted += CPU_ONLY_FLAGS
    given = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in wanted if f.split("=")[0] not in given]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([given, *extra]).strip()


def default_dir() -> Path:
    """$XDG_CACHE_HOME/gdnx/compiled, else ~/.cache/gdnx/compiled."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gdnx" / "compiled"


def use(where: str | None = None) -> Path | None:
    """Turn the cache on at `where` (None: $GDNX_COMPILE_CACHE, else
    default_dir(); "off": leave it off) and return its directory. A cache
    the caller's environment already set (JAX_COMPILATION_CACHE_DIR) is
    kept as it is. Every program is cached, however quick its compile: a
    server's start is many small ones."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    where = where or os.environ.get(ENV) or str(default_dir())
    if where == "off":
        return None
    path = Path(where).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache: cannot use {path} ({e.strerror}); give another directory or off") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--compile-cache: {path} is not writable; give another directory or off")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
