"""The serving engine on this machine's CPU: decode throughput against the
plain loop, per-token decode cost against context length (GDN hybrid vs
attention only), time to first token on a prefix-cache hit, n-gram
speculation, the batch-invariant mode's cost, and the engine's compiled
programs.

    python -m benchmarks.serving.engine [--plot docs/serving_decode.png]

Model: Qwen3-Next's pattern (3 GDN layers, then attention), width 256, 8
layers, 4,096-token vocabulary, float32, random weights. Everything runs
in one process; each timing is the median of --repeats runs after an
untimed one that compiles, so the ratios are the comparison. Prints
markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gdnx.config import ModelConfig
from gdnx.generate import generate
from gdnx.models import Cache, CausalLM
from gdnx.models.causal_lm import parameter_count
from gdnx.serving import Engine, NgramDrafter, SamplingParams

from benchmarks.harness import machine

MODEL = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, full_attention_interval=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64, intermediate_size=768, num_experts=0,
             max_position_embeddings=65536)


def timed(fn, repeats: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(model, repeats: int) -> list[str]:
    """Decode tokens per second once every request has its first token:
    the engine (slots = requests, 16 tokens per round trip) against
    gdnx.generate on the same batch (one jitted step per token; its first
    two tokens, which include compiling the step, are not counted)."""
    rows = ["| active requests | engine decode tokens/s | plain loop decode tokens/s | engine / loop |",
            "|---|---|---|---|"]
    rng = np.random.default_rng(0)
    new = 64
    for n in (1, 8, 32):
        prompts = rng.integers(0, MODEL["vocab_size"], (n, 64))
        greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        engine = Engine(model, max_slots=n, max_length=192, block_size=64, decode_steps=16)
        engine.generate(prompts.tolist(), greedy)  # compiles

        def engine_rate() -> float:
            t_first, count = None, 0
            for _, toks in engine.stream(prompts.tolist(), greedy):
                if t_first is None:
                    t_first = time.perf_counter()  # the prefill's first tokens
                else:
                    count += len(toks)
            assert t_first is not None
            return count / (time.perf_counter() - t_first)

        def loop_rate() -> float:
            stamps: list[float] = []
            generate(model, jnp.asarray(prompts), new,
                     on_token=lambda tok: (tok.block_until_ready(), stamps.append(time.perf_counter())))
            return n * (len(stamps) - 3) / (stamps[-1] - stamps[2])

        e = statistics.median(engine_rate() for _ in range(repeats))
        lp = statistics.median(loop_rate() for _ in range(repeats))
        rows.append(f"| {n} | {e:,.0f} | {lp:,.0f} | {e / lp:.2f}x |")
    return rows


def decode_cost(repeats: int, plot: str | None) -> list[str]:
    """One decode token at a cache of L tokens (the step's cost does not
    depend on the cached values, so the cache is left at zeros)."""
    hybrid = CausalLM(ModelConfig(**MODEL), seed=0)
    # attention only, equal parameters: a GDN layer of this width holds ~1.5x an attention layer's
    dense = CausalLM(ModelConfig(**{**MODEL, "layer_types": ["full_attention"] * 8, "num_attention_heads": 6,
                                    "num_key_value_heads": 3}), seed=0)
    contexts = (1024, 8192, 32768)
    times: dict[str, list[float]] = {}
    gdn_only = CausalLM(ModelConfig(**{**MODEL, "layer_types": ["linear_attention"] * 8}), seed=0)
    for name, model in (("GDN only (8 layers)", gdn_only), ("GDN hybrid (6 GDN + 2 attention)", hybrid),
                        ("attention only (8 layers)", dense)):
        step = jax.jit(lambda tok, cache, m=model: m.forward(tok, cache).logits)
        times[name] = []
        for ctx in contexts:
            cache = Cache.init(model, 1, ctx + 8)._replace(length=jnp.int32(ctx))
            tok = jnp.zeros((1, 1), jnp.int32)
            times[name].append(timed(lambda: step(tok, cache).block_until_ready(), repeats))
        times[name].append(parameter_count(model.config))
    rows = ["| model | parameters | " + " | ".join(f"{c // 1024}K context" for c in contexts) + " | 32K / 1K |",
            "|---|---|" + "---|" * len(contexts) + "---|"]
    for name, t in times.items():
        rows.append(f"| {name} | {t[-1] / 1e6:.1f} M | " + " | ".join(f"{x * 1e3:.2f} ms" for x in t[:-1])
                    + f" | {t[2] / t[0]:.2f}x |")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name, t in times.items():
            ax.plot([c / 1024 for c in contexts], [x * 1e3 for x in t[:-1]], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("ms per decoded token")
        ax.set_title("decode cost vs context (CPU, batch 1)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
    return rows


def first_token(model, repeats: int) -> list[str]:
    """A 1,280-token prompt whose first 1,152 tokens (90%) an earlier
    request shared: time to its first token with the prefix cached, against
    the same prompt with an empty cache."""
    rng = np.random.default_rng(1)
    shared = rng.integers(0, MODEL["vocab_size"], 1152).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0)
    rows = ["| mode | TTFT, prefix cached | TTFT, not cached | hit / miss |", "|---|---|---|---|"]
    for invariant in (False, True):
        def ttft(cached: bool) -> float:
            def run():
                engine = Engine(model, max_slots=4, max_length=1536, block_size=64,
                                prefix_cache_bytes=1 << 30, batch_invariant=invariant)
                if cached:
                    engine.generate([shared + [1]], one)
                tail = rng.integers(0, MODEL["vocab_size"], 128).tolist()
                t0 = time.perf_counter()
                out = engine.generate([shared + tail], one)[0]
                assert out.cached_tokens == (1152 if cached else 0)
                return time.perf_counter() - t0
            run()
            return statistics.median(run() for _ in range(repeats))
        hit, miss = ttft(True), ttft(False)
        name = "batch-invariant (block by block)" if invariant else "default (length buckets)"
        rows.append(f"| {name} | {hit * 1e3:,.0f} ms | {miss * 1e3:,.0f} ms | {hit / miss:.2f}x |")
    return rows


def repeating_model() -> CausalLM:
    """The benchmark model with its embeddings scaled 100x: the residual
    stream is then the current token's embedding with small additions, so
    the next token depends almost only on the current one and the model
    repeats what it wrote before, as a trained model copies its context.
    (A random model's greedy continuation changes with any change of
    context: n-gram drafts are then never accepted, which measures only the
    cost of refused drafts.)"""
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    model.embed_tokens.embedding[...] = model.embed_tokens.embedding[...] * 100.0
    return model


def speculation(model, repeats: int) -> list[str]:
    """Edit-like requests: the model is asked to write again what it wrote
    before. For each of 8 requests, X is 64 random tokens and Y the model's
    own greedy 128-token continuation of X; the prompt is X + Y + X and 128
    tokens are generated (greedy). The n-gram drafter proposes Y's tokens
    from the prompt; they are accepted as far as the model repeats itself."""
    rng = np.random.default_rng(2)
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    xs = [rng.integers(0, MODEL["vocab_size"], 64).tolist() for _ in range(8)]
    first = Engine(model, max_slots=8, max_length=512, block_size=64).generate(xs, greedy)
    prompts = [x + c.tokens + x for x, c in zip(xs, first)]
    rows = ["| decoding | tokens/s | tokens per pass per request | acceptance | vs plain |", "|---|---|---|---|---|"]
    plain_tokens, plain_t = None, 0.0
    for k in (0, 2, 4, 8):
        engine = Engine(model, max_slots=8, max_length=512, block_size=64, decode_steps=8,
                        speculative=NgramDrafter(k) if k else None)
        out: list = []
        t = timed(lambda: out.append(engine.generate(prompts, greedy)), repeats)
        tokens = [c.tokens for c in out[-1]]
        plain_tokens = plain_tokens or tokens
        plain_t = plain_t or t
        assert tokens == plain_tokens  # speculation never changes greedy output
        s = engine.stats
        rate = len(prompts) * 128 / t
        if k:
            rows.append(f"| n-gram, {k} drafts | {rate:,.0f} | {s.tokens_per_pass:.2f} | {s.acceptance:.0%} | "
                        f"{plain_t / t:.2f}x |")
        else:
            rows.append(f"| plain ({engine.decode_steps} tokens per round trip) | {rate:,.0f} | 1.00 | - | 1.00x |")
    return rows


def programs(model) -> list[str]:
    engine = Engine(model, max_slots=8, max_length=1024, block_size=64, decode_steps=8,
                    prefix_cache_bytes=1 << 28, speculative=NgramDrafter(4))
    rng = np.random.default_rng(3)
    lengths = [50, 100, 200, 400, 700, 60, 120, 250]
    prompts = [rng.integers(0, MODEL["vocab_size"], n).tolist() for n in lengths]
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([p[::-1] for p in prompts], SamplingParams(max_tokens=16, temperature=0.0))
    again = time.perf_counter() - t0
    kinds = sorted(engine.stats.programs)
    return [f"- buckets {engine.buckets}; programs compiled for 8 ragged prompts (50-700 tokens): {len(kinds)} "
            f"({', '.join(f'{n} {s}' for n, s in kinds)})",
            f"- first run (compiling them) {first:.1f} s, the same shapes again {again:.1f} s: "
            f"{first - again:.1f} s of compilation"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plot", default=None, help="write the decode-cost plot (PNG) here")
    ap.add_argument("--only", nargs="*", default=None, help="run the sections whose title starts so")
    args = ap.parse_args()
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    print(f"serving, {machine()}, "
          f"command: python -m benchmarks.serving.engine --repeats {args.repeats}\n")
    sections = [("Decode throughput (64-token prompts, 64 new tokens, greedy)", lambda: throughput(model, args.repeats)),
                ("Per-token decode time against context", lambda: decode_cost(args.repeats, args.plot)),
                ("Time to first token, 90%-shared prefix", lambda: first_token(model, args.repeats)),
                ("n-gram speculation: writing again what it wrote", lambda: speculation(model, args.repeats)),
                ("n-gram speculation, a model that repeats itself", lambda: speculation(repeating_model(),
                                                                                        args.repeats)),
                ("Compiled programs", lambda: programs(model))]
    for title, fn in sections:
        if args.only and not any(title.lower().startswith(o.lower()) for o in args.only):
            continue
        print(f"### {title}\n")
        print("\n".join(fn()), "\n", flush=True)


if __name__ == "__main__":
    main()
