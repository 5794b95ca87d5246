"""JAX's persistent compilation cache for gdnx's long-lived commands: a
server's programs, compiled once, are read back on its next start.

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
