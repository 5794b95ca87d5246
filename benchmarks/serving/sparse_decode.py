"""Decode cost of the sparse-attention layers against the context length, on CPU.

    python -m benchmarks.serving.sparse_decode [--contexts 1024 2048 4096 8192 16384 32768] [--repeats 20]

One decode step (one token, batch 1, float32) of GLM-5-Next's indexed latent
attention at its published sizes (hidden 4096, 64 heads, latent 512, query
rank 1536, 256-dim heads without RoPE; indexer 32 x 128, 2048 tokens in pools
of 16) and of the same layer on a shared-index layer (the selection given),
beside the dense latent attention over the whole cache; then Qwen4-Exp's
indexed gated attention (hidden 2048, 16 heads, 2 key/value heads of 256;
indexer 16 x 128, budget 2048 in blocks of 16: transformers publishes no
indexer sizes) beside plain gated attention. The cache holds `context`
tokens of random entries; the step is the token after them. Medians of
`repeats` steps, milliseconds, each step's cache donated to it (written in place, as
the engine's are); all rows from one run (compare as ratios).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdnx.layers.attention import GatedAttention, KVCache
from gdnx.layers.latent_attention import LatentAttention, LatentCache
from gdnx.layers.rope import rope_tables
from gdnx.layers.sparse_attention import IndexedGatedAttention, IndexedKVCache, IndexedLatentAttention, \
    IndexedLatentCache
from gdnx.layers.sparse_index import IndexCache

from benchmarks.harness import machine

F32 = jnp.float32
GLM = dict(num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, qk_rope_head_dim=0,
           v_head_dim=256, bias=False, norm_eps=1e-5, absorb=True)
GLM_INDEX = dict(index_heads=32, index_head_dim=128, block=16, budget=2048, tail=True)
QWEN = dict(num_heads=16, num_kv_heads=2, head_dim=256, bias=False, norm_eps=1e-6)
QWEN_INDEX = dict(index_heads=16, index_head_dim=128, block=16, budget=2048, theta=1e7, rotary_dim=64)


def _common() -> dict:
    return dict(init_std=0.02, dtype=F32, param_dtype=F32, rngs=nnx.Rngs(0))


def _step(layer: nnx.Module, call):
    """The layer's step jitted with its cache donated (as the engine's
    programs are: the step writes one token into it in place)."""
    graph, state = nnx.split(layer)

    @functools.partial(jax.jit, donate_argnums=2)
    def run(state, x, cache, *rest):
        return call(nnx.merge(graph, state), x, cache, *rest)
    return lambda *args: run(state, *args)


def _timed(run, x, cache, repeats: int, *rest) -> float:
    """Median ms of `repeats` steps, each writing the same position of the
    cache the last one returned, after one warm-up step."""
    cache = run(x, cache, *rest)[1]
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        cache = jax.block_until_ready(run(x, cache, *rest)[1])
        times.append(time.perf_counter() - begin)
    return 1e3 * float(np.median(times))


def glm_rows(context: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    h = 4096
    x = jnp.asarray(rng.standard_normal((1, 1, h)), F32)
    pos = jnp.full((1,), context, jnp.int32)
    cap = context + 1
    latent = LatentCache(jnp.asarray(rng.standard_normal((1, cap, 512)), F32), jnp.zeros((1, cap, 0), F32))
    index = IndexCache(jnp.asarray(rng.standard_normal((1, cap, 128)), F32),
                       jnp.asarray(rng.standard_normal((1, cap, 128)), F32),
                       jnp.asarray(rng.standard_normal((1, cap, 128)), F32))
    full = IndexedLatentAttention(h, **GLM, **GLM_INDEX, shared=False, **_common())
    shared = IndexedLatentAttention(h, **GLM, **GLM_INDEX, shared=True, **_common())
    dense = LatentAttention(h, **GLM, **_common())
    run_full = _step(full, lambda m, x, c: m(x, None, pos, c, context))
    _, _, sel = run_full(x, IndexedLatentCache.of(*_copies(latent, index)))
    run_shared = _step(shared, lambda m, x, c, s: m(x, None, pos, c, context, selection=s))
    run_dense = _step(dense, lambda m, x, c: m(x, None, pos, c, context))
    return {"GLM-5-Next indexed (full)": _timed(run_full, x, IndexedLatentCache.of(*_copies(latent, index)), repeats),
            "GLM-5-Next indexed (shared)": _timed(run_shared, x, IndexedLatentCache.of(_copies(latent), None),
                                                  repeats, sel),
            "GLM-5-Next dense MLA": _timed(run_dense, x, _copies(latent), repeats)}


def qwen_rows(context: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    h = 2048
    x = jnp.asarray(rng.standard_normal((1, 1, h)), F32)
    pos = jnp.full((1,), context, jnp.int32)
    rope = rope_tables(pos[None], 64, 1e7)
    cap = context + 1
    kv = KVCache(*(jnp.asarray(rng.standard_normal((1, cap, 2, 256)), F32) for _ in range(2)))
    index = IndexCache(jnp.asarray(rng.standard_normal((1, cap, 128)), F32), None,
                       jnp.asarray(rng.standard_normal((1, cap, 128)), F32))
    sparse = IndexedGatedAttention(h, **QWEN, **QWEN_INDEX, **_common())
    dense = GatedAttention(h, **QWEN, **_common())
    run_sparse = _step(sparse, lambda m, x, c: m(x, rope, pos, c, context))
    run_dense = _step(dense, lambda m, x, c: m(x, rope, pos, c, context))
    return {"Qwen4-Exp indexed": _timed(run_sparse, x, IndexedKVCache(*_copies(kv, index)), repeats),
            "Qwen4-Exp dense": _timed(run_dense, x, _copies(kv), repeats)}


def _copies(*caches):
    """Fresh copies (a donated cache is gone after the step)."""
    out = jax.tree.map(jnp.copy, caches)
    return out[0] if len(out) == 1 else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    table: dict[str, dict[int, float]] = {}
    for context in args.contexts:
        for name, ms in {**glm_rows(context, args.repeats, rng), **qwen_rows(context, args.repeats, rng)}.items():
            table.setdefault(name, {})[context] = ms
    print(f"# decode step, batch 1, float32: median ms over {args.repeats} steps; {machine()}")
    first = args.contexts[0]
    print("| layer | " + " | ".join(f"{c:,}" for c in args.contexts) + f" | {args.contexts[-1]:,} / {first:,} |")
    print("|---" * (len(args.contexts) + 2) + "|")
    for name, row in table.items():
        cells = " | ".join(f"{row[c]:.2f}" for c in args.contexts)
        print(f"| {name} | {cells} | {row[args.contexts[-1]] / row[first]:.2f}x |")


if __name__ == "__main__":
    main()
