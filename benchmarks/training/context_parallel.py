"""The cost of context parallelism for Gated DeltaNet, on a virtual CPU mesh.

    python -m benchmarks.training.context_parallel [--length 4096] [--devices 8]

Times one loss + gradient step of a Gated DeltaNet model (GDN layers only,
so the full-attention K/V gather does not blur the figure) at batch B and
length T: on one device; on a data mesh (the batch split over the devices);
on a context mesh (the sequence split); on data x context. Then the delta
rule op alone (forward + backward, XLA path) under shard_map, batch split
against sequence split. Medians of 5.

All the virtual devices share this machine's cores, so these ratios measure
work, not speed-up: context / data is what splitting the sequence instead
of the batch costs in extra computation (the op at value width V + K, the
state all-gather and fold, the conv halo), and each mesh / one device is
the price of running 8 programs with collectives on the same cores.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.harness import machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")

    import jax  # noqa: PLC0415  (after XLA_FLAGS)
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415

    from gdnx.config.reading import load_config  # noqa: PLC0415
    from gdnx.config.schema import ParallelConfig  # noqa: PLC0415
    from gdnx.measure import median_ms  # noqa: PLC0415
    from gdnx.models import CausalLM  # noqa: PLC0415
    from gdnx.parallel import make_mesh, shard, spec  # noqa: PLC0415

    layers = 2
    cfg = load_config("tiny", [
        "model.hidden_size=256", f"model.num_hidden_layers={layers}",
        f"model.layer_types=[{', '.join(['linear_attention'] * layers)}]",
        "model.linear_num_key_heads=4", "model.linear_num_value_heads=8", "model.linear_key_head_dim=64",
        "model.linear_value_head_dim=64", "model.intermediate_size=512"]).model
    graphdef, params = nnx.split(CausalLM(cfg, seed=0), nnx.Param)
    b, t = args.batch, args.length
    tokens = jax.random.randint(jax.random.key(0), (b, t), 0, cfg.vocab_size, jnp.int32)

    def loss(p, tok):
        logits = nnx.merge(graphdef, p)(tok)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    step = jax.jit(jax.value_and_grad(loss))
    rows = [("one device", median_ms(step, (params, tokens)))]
    n = args.devices
    for name, axes in ((f"data={n}", dict(data=n)), (f"context={n}", dict(data=1, context=n)),
                       (f"data=2 x context={n // 2}", dict(data=2, context=n // 2))):
        mesh = make_mesh(ParallelConfig(**axes))
        with jax.set_mesh(mesh):
            placed = jax.device_put(tokens, NamedSharding(mesh, spec(("batch", "length"), tokens.shape, mesh=mesh)))
            rows.append((name, median_ms(jax.jit(jax.value_and_grad(loss)), (shard(params, cfg, mesh), placed))))
    rows += op_rows(args.batch, args.length, n)
    base = dict(rows)
    print(f"context parallelism, {machine()}")
    print(f"`python -m benchmarks.training.context_parallel --length {t} --batch {b} --devices {n}`: "
          f"{layers} GDN layers, "
          f"hidden 256, HK=4 HV=8 K=V=64, B={b} T={t}, loss + gradients, median of 5")
    print("| what | mesh | ms | / one device | / data mesh |")
    print("|---|---|---:|---:|---:|")
    for name, ms in rows:
        what, ref = ("delta rule op", "op: ") if name.startswith("op: ") else ("model step", "")
        print(f"| {what} | {name.removeprefix('op: ')} | {ms:.0f} | {ms / base[ref + 'one device']:.2f} | "
              f"{ms / base[ref + f'data={n}']:.2f} |")
    sys.stdout.flush()


def op_rows(b, t, n):
    """The op alone at the model's GDN shape (HK=4, HV=8, K=V=64)."""
    import functools  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from gdnx.config.schema import ParallelConfig  # noqa: PLC0415
    from gdnx.measure import median_ms  # noqa: PLC0415
    from gdnx.ops import chunk_gated_delta_rule  # noqa: PLC0415
    from gdnx.parallel import make_mesh  # noqa: PLC0415
    from gdnx.parallel.context import context_delta_rule  # noqa: PLC0415

    ks = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(ks[0], (b, t, 4, 64), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, 4, 64), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, 8, 64), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, 8), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, 8), jnp.float32))
    args = (q, k, v, g, beta)
    op = functools.partial(chunk_gated_delta_rule, use_qk_l2norm=True, implementation="xla")

    def grad_of(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)[0] ** 2), argnums=(0, 1, 2, 3, 4)))

    rows = [("op: one device", median_ms(grad_of(op), args))]
    for name, axes, seq in ((f"data={n}", dict(data=n), False), (f"context={n}", dict(data=1, context=n), True)):
        mesh = make_mesh(ParallelConfig(**axes))
        spec = P(None, "context") if seq else P("data")
        body = functools.partial(context_delta_rule, chunk_gated_delta_rule, axis="context", use_qk_l2norm=True,
                                 implementation="xla") if seq else op
        fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, P()), check_vma=False)
        rows.append((f"op: {name}", median_ms(grad_of(fn), args)))
    return rows


if __name__ == "__main__":
    main()
