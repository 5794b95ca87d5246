"""`gdnx demo`: the gated delta rule op against its float64 oracle, and timings.

Until the training CLI lands this is what `make demo` runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.measure import median_ms, relative_error


def run(b=2, t=512, hk=2, hv=4, dk=64, dv=64, chunk=64, seed=0) -> dict:
    jax.config.update("jax_enable_x64", True)  # for the float64 oracle only
    from gdnx.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule

    rng = np.random.default_rng(seed)
    f32 = np.float32
    q = jnp.asarray(rng.standard_normal((b, t, hk, dk)), f32)
    k = jnp.asarray(rng.standard_normal((b, t, hk, dk)), f32)
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), f32)
    g = jnp.asarray(np.log(rng.uniform(0.7, 1.0, (b, t, hv))), f32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, t, hv)), f32)
    args = (q, k, v, g, beta)
    kw = dict(output_final_state=True, use_qk_l2norm=True)
    print(f"gated delta rule  B={b} T={t} HK={hk} HV={hv} K={dk} V={dv} chunk={chunk}  "
          f"jax {jax.__version__} on {jax.default_backend()}")

    ref_o, ref_f = recurrent_gated_delta_rule(*(x.astype(jnp.float64) for x in args), state_dtype="float64",
                                              decay_dtype="float64", **kw)

    def loss(impl, *xs):
        o, f = chunk_gated_delta_rule(*xs, chunk_size=chunk, implementation=impl, **kw)
        return jnp.sum(o * o) + jnp.sum(f * f)

    results = {}
    for impl in ("xla", "reference"):
        o, f = chunk_gated_delta_rule(*args, chunk_size=chunk, implementation=impl, **kw)
        fwd = jax.jit(lambda *xs, impl=impl: chunk_gated_delta_rule(*xs, chunk_size=chunk, implementation=impl, **kw))
        grad = jax.jit(jax.grad(lambda *xs, impl=impl: loss(impl, *xs), argnums=range(5)))
        row = dict(err_o=relative_error(o, ref_o), err_state=relative_error(f, ref_f),
                   fwd_ms=median_ms(fwd, args), fwd_bwd_ms=median_ms(grad, args))
        results[impl] = row
        print(f"  {impl:10s} rel err o {row['err_o']:.1e}  state {row['err_state']:.1e}   "
              f"forward {row['fwd_ms']:7.1f} ms   forward+backward {row['fwd_bwd_ms']:7.1f} ms")
    print("relative error ||x - ref|| / ||ref|| against the float64 token recurrence; medians of 5 runs")
    return results
