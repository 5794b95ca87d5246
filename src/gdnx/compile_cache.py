"""How a server's many programs are compiled and kept: JAX's persistent
compilation cache (compiled once, read back on the next start), and
XLA:CPU's flags that map fewer pages per program.

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
# memory maps (vm.max_map_count): its older elemental emitters map fewer per program (docs/benchmarks.md)
CPU_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def fewer_maps() -> None:
    """Before JAX starts its backend: XLA:CPU's flags that map fewer pages
    per program, where XLA_FLAGS does not already choose them (they name
    the CPU alone; other backends ignore them)."""
    given = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in CPU_FLAGS if f.split("=")[0] not in given]
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
