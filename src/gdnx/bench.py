"""`gdnx bench`: op timings for every implementation this platform compiles,
and a train step of the GDN hybrid model against an attention-only model of
the same width and depth (time and compiled peak memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gdnx.config.schema import ModelConfig
from gdnx.measure import compiled_peak_bytes, median_ms
from gdnx.models import CausalLM
from gdnx.ops import chunk_gated_delta_rule

COMPILED_KERNEL = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


def op_rows(b=2, t=2048, hk=4, hv=8, dk=128, dv=128, dtype="bfloat16", repeats=5):
    platform = jax.default_backend()
    impls = ["xla", "reference"] + ([COMPILED_KERNEL[platform]] if platform in COMPILED_KERNEL else [])
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, hk, dk)), dtype)
    k = jnp.asarray(rng.standard_normal((b, t, hk, dk)), dtype)
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), dtype)
    g = jnp.asarray(np.log(rng.uniform(0.7, 1.0, (b, t, hv))), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (b, t, hv)), dtype)
    args = (q, k, v, g, beta)
    rows = []
    for impl in impls:
        def fwd(*xs, impl=impl):
            return chunk_gated_delta_rule(*xs, use_qk_l2norm=True, implementation=impl)[0]

        def loss(*xs, impl=impl):
            return jnp.sum(fwd(*xs, impl=impl).astype(jnp.float32) ** 2)

        rows.append((impl, median_ms(jax.jit(fwd), args, repeats),
                     median_ms(jax.jit(jax.grad(loss, argnums=range(5))), args, repeats)))
    shape = f"B={b} T={t} HK={hk} HV={hv} K={dk} V={dv} {dtype}"
    return shape, rows


def bench_model_config(layer_types, hidden=256, heads=4) -> ModelConfig:
    return ModelConfig(
        vocab_size=4096, hidden_size=hidden, num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=hidden // heads,
        linear_num_key_heads=heads // 2, linear_num_value_heads=heads, linear_key_head_dim=hidden // heads,
        linear_value_head_dim=hidden // heads, intermediate_size=4 * hidden, num_experts=0)


def train_step_row(cfg: ModelConfig, batch: int, seq_len: int, repeats: int):
    model = CausalLM(cfg)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, cfg.vocab_size, jnp.int32)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step)
    args = (params, opt_state, tokens)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return n_params, median_ms(jitted, args, repeats), compiled_peak_bytes(jitted, args)


def run_benchmarks(*, batch: int = 4, seq_len: int = 1024, repeats: int = 5, op_tokens: int = 2048,
                   op_head_dim: int = 128, width: int = 256, print_fn=print) -> dict:
    print_fn(f"gdnx bench  jax {jax.__version__} on {jax.default_backend()}  (medians of {repeats} runs)")
    shape, rows = op_rows(t=op_tokens, dk=op_head_dim, dv=op_head_dim, repeats=repeats)
    print_fn(f"\nchunk_gated_delta_rule  {shape}")
    print_fn(f"  {'implementation':<16}{'forward ms':>12}{'fwd+bwd ms':>12}")
    for impl, f, fb in rows:
        print_fn(f"  {impl:<16}{f:>12.1f}{fb:>12.1f}")
    hybrid = ["linear_attention"] * 3 + ["full_attention"]
    models = {"GDN hybrid (3:1)": hybrid, "attention only": ["full_attention"] * 4}
    print_fn(f"\ntrain step (AdamW)  batch {batch} x {seq_len} tokens, 4 layers, width {width}")
    print_fn(f"  {'model':<20}{'params':>10}{'step ms':>10}{'peak MiB':>10}")
    results = {"ops": rows, "models": {}}
    for name, types in models.items():
        n, ms, peak = train_step_row(bench_model_config(types, hidden=width), batch, seq_len, repeats)
        results["models"][name] = (n, ms, peak)
        print_fn(f"  {name:<20}{n:>10,}{ms:>10.1f}{peak / 2 ** 20:>10.1f}")
    return results
